"""Real slow links: one network namespace per pipeline stage, rate-limited with ``tc``.

Topology (all of it created and removed by one run; needs root and iproute2)::

    mtah<pid>_s0 [eth0 10.77.0.1]--veth--[p0]                     egress of every stage's eth0: tbf (+ netem)
    mtah<pid>_s1 [eth0 10.77.0.2]--veth--[p1]  br0 in mtah<pid>_hub  egress of every hub port p<i>: tbf
    ...

Every stage reaches every other stage (gloo needs a full mesh and rank 0's store), and each
stage-to-stage path crosses two token buckets at ``rate`` (the sender's eth0, the receiver's hub
port), so a pair sees ``rate`` each way. ``delay_ms`` (netem on the stages' eth0 only) is the
one-way stage-to-stage latency; kernels without netem (CONFIG_NET_SCH_NETEM, e.g. this project's
CI machines) refuse a delay with a clear error. Addresses live only inside the run's own namespaces.
Measured on a 2-core CI machine: 95-98% of the requested rate from 100 Mbit/s to 1 Gbit/s; at
10 Gbit/s the veth path itself (CPU) stays below the limit (about 4-6 Gbit/s).

API: ``with SlowLinks(n_stages, "100mbit", delay_ms=0) as links: links.popen(i, cmd)``. Teardown
(processes in the namespaces, then the namespaces, which removes the veths and qdiscs) runs in
``__exit__``, on SIGTERM/SIGHUP (turned into ``SystemExit``), on Ctrl-C and at interpreter exit.

CLI::

    python -m megatron_tah.netns_link --stages N --rate 100mbit [--delay-ms D] -- COMMAND...
    python -m megatron_tah.netns_link measure --rate 100mbit [--delay-ms D] [--mbytes 8] [--transport tcp|gloo]
    python -m megatron_tah.netns_link cleanup [--all]

``run`` starts COMMAND once per stage inside its namespace with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR (stage 0), MASTER_PORT, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0
and MTAH_LINK_RATE_BPS set, and ``OMP_NUM_THREADS=1`` unless the caller sets it (what
``torch.distributed.run`` does for more than one process per node, so that a run through these links
computes like the unthrottled torchrun run it is compared with; measured on a 2-core machine, four
stages of the throughput reproduction at 10 Gbit/s, uncompressed: 2001 ms per iteration with torch's
default of one intra-op thread per core, 429 ms with one thread, against 394 ms under torchrun); when one stage fails the others are stopped; the exit status is the
first failing stage's.

GPU stages run the same way: a network namespace separates only the network, so ``/dev/nvidia*``
and the driver stay visible, and the caller's environment (``CUDA_VISIBLE_DEVICES``,
``CUDA_DEVICE_MAX_CONNECTIONS``...) passes through unchanged. ``LOCAL_RANK`` is the stage, so with
fewer GPUs than stages the ranks share them (``megatron/share_gpus.py``: ``local_rank %
device_count``, automatic). Pipeline traffic must cross ``eth0`` to be limited: the stages use gloo
(CUDA wire buffers staged through pinned host memory, ``link/message.py``); for a run that uses
NCCL anyway, ``NCCL_P2P_DISABLE=1`` and ``NCCL_SHM_DISABLE=1`` keep it off CUDA IPC and shared memory,
which would bypass the link.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

PREFIX = "mtah"
IFNAME = "eth0"
MAX_RATE_BPS = 100e9
MIN_RATE_BPS = 8e3
MAX_STAGES = 250
MASTER_PORT = 29500
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)(?:n\d+)?_(?:s\d+|hub)$")
_active_tags: set[str] = set()


def check_rate(rate: str | float | int) -> float:
    """Link rate in bits/s; ``ValueError`` for nonsense, <= 0, below 8 kbit/s or above 100 gbit/s."""
    from .units import parse_bandwidth

    bps = parse_bandwidth(rate)
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ValueError(f"link rate {rate!r} = {bps:.3g} bit/s is outside what tc can emulate here "
                         f"({MIN_RATE_BPS:.0f} bit/s .. {MAX_RATE_BPS:.0e} bit/s)")
    return bps


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def tbf_args(bps: float) -> list[str]:
    """``tbf`` parameters: burst of 4 ms (at least 32 KiB, so GSO packets pass), queue of 50 ms."""
    burst = max(32 * 1024, int(bps / 8 * 0.004))
    return ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "50ms"]


def require_netns() -> None:
    """``RuntimeError`` naming what is missing when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise RuntimeError("slow links need root (network namespaces and tc); run as root or use "
                           "--tah-emulate-bandwidth for the in-process emulation")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)")


class SlowLinks:
    """``n_stages`` namespaces behind a rate-limited switch; see the module docstring."""

    def __init__(self, n_stages: int, rate: str | float, delay_ms: float = 0.0):
        if not isinstance(n_stages, int) or not 2 <= n_stages <= MAX_STAGES:
            raise ValueError(f"n_stages = {n_stages!r}: must be an integer in [2, {MAX_STAGES}]")
        if not 0 <= delay_ms <= 10_000:
            raise ValueError(f"delay_ms = {delay_ms!r}: must lie in [0, 10000]")
        self.n_stages, self.rate_bps, self.delay_ms = n_stages, check_rate(rate), float(delay_ms)
        self.tag = ""
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}

    # ----- names -------------------------------------------------------------------------
    def namespace(self, stage: int) -> str:
        return f"{self.tag}_s{stage}"

    @property
    def hub(self) -> str:
        return f"{self.tag}_hub"

    def address(self, stage: int) -> str:
        return f"10.77.0.{stage + 1}"

    def env(self, stage: int, master_port: int = MASTER_PORT) -> dict[str, str]:
        """Environment of a stage's process: torch.distributed env:// rendezvous and interface names."""
        return {"RANK": str(stage), "WORLD_SIZE": str(self.n_stages), "LOCAL_RANK": str(stage),
                "LOCAL_WORLD_SIZE": str(self.n_stages), "MASTER_ADDR": self.address(0),
                "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": IFNAME, "NCCL_SOCKET_IFNAME": IFNAME,
                "MTAH_LINK_RATE_BPS": str(int(self.rate_bps)), "MTAH_LINK_DELAY_MS": str(self.delay_ms),
                "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}  # NCCL, if used, through eth0 too

    def launch_spec(self, stage: int, cmd: list[str], env: dict[str, str] | None = None) -> tuple[list[str], dict]:
        """The argv and environment that run ``cmd`` as stage ``stage`` inside its namespace: the
        caller's environment (CUDA_VISIBLE_DEVICES included), then the stage's, then ``env``."""
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage = {stage}: must lie in [0, {self.n_stages - 1}]")
        if not cmd:
            raise ValueError("no command to run in the stage's namespace")
        threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}  # torchrun's default (below)
        return (["ip", "netns", "exec", self.namespace(stage), *cmd],
                {**threads, **os.environ, **self.env(stage), **(env or {})})

    # ----- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> "SlowLinks":
        require_netns()
        base, k = f"{PREFIX}{os.getpid()}", 0
        while (tag := base if k == 0 else f"{base}n{k}") in _active_tags:
            k += 1
        self.tag = tag
        _active_tags.add(tag)
        atexit.register(self.close)
        self._trap_signals()
        try:
            for stale in list_namespaces():  # left by an earlier, killed process with our pid
                if stale.startswith(f"{tag}_"):
                    delete_namespace(stale)
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._namespaces.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.hub)
        _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.n_stages):
            ns, port = self.namespace(i), f"p{i}"
            self._add_ns(ns)
            _sh("ip", "link", "add", "name", IFNAME, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.hub)
            _sh("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            if self.delay_ms > 0:
                netem = _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "netem",
                            "delay", f"{self.delay_ms}ms", "limit", "100000", check=False)
                if netem.returncode != 0:
                    raise RuntimeError(f"delay_ms = {self.delay_ms} needs tc's netem qdisc, which this kernel lacks "
                                       f"(tc: {netem.stderr.strip()}); use delay 0 here, or the in-process "
                                       "emulation (--tah-emulate-latency-ms)")
                _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "parent", "1:1", "handle", "10:",
                    *tbf_args(self.rate_bps))
            else:
                _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *tbf_args(self.rate_bps))
            _sh("tc", "-n", self.hub, "qdisc", "add", "dev", port, "root", *tbf_args(self.rate_bps))

    def popen(self, stage: int, cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside stage ``stage``'s namespace (own session, so it can be stopped as a group)."""
        if not self._namespaces:
            raise RuntimeError("SlowLinks.popen called outside the `with` block")
        argv, full_env = self.launch_spec(stage, cmd, env)
        proc = subprocess.Popen(argv, env=full_env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Stop the run's processes, delete its namespaces; idempotent."""
        in_main = threading.current_thread() is threading.main_thread()
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
        try:
            for proc in self._procs:
                stop_process(proc)
            self._procs.clear()
            for ns in reversed(self._namespaces):
                delete_namespace(ns)
            self._namespaces.clear()
        finally:
            if in_main:
                signal.signal(signal.SIGINT, old_int)
                for signum, handler in self._old_handlers.items():
                    signal.signal(signum, handler)
            self._old_handlers.clear()
            _active_tags.discard(self.tag)
            atexit.unregister(self.close)

    def _trap_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def _raise(signum, _frame):
            raise SystemExit(128 + signum)

        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[signum] = signal.signal(signum, _raise)


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group ``proc`` leads (its own session), SIGKILL it after ``grace_s``; when ``proc``
    itself has ended, whatever of its group still runs (a launcher's worker left behind) is stopped alike."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # nothing of the group is left
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.05)
        if not _group_alive(proc):
            break
    proc.poll()


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether a process of the group ``proc`` leads still runs (``proc`` itself reaped when it has ended)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return proc.returncode is None or _members_running(proc.pid)


def _members_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs (not a zombie awaiting its reaper), read from /proc."""
    return bool(processes(group=pgid))


def processes(group: int | None = None, session: int | None = None) -> list[int]:
    """The live processes (zombies apart) of process group ``group`` or session ``session``, read from /proc."""
    column, wanted = (2, group) if group is not None else (3, session)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[column]) == wanted and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def delete_namespace(name: str) -> None:
    """Kill what still runs in namespace ``name`` (all started by the run that owns it), then delete it."""
    pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _sh("ip", "netns", "del", name, check=False)


def list_namespaces() -> list[str]:
    """Names of all namespaces made by this tool (any run)."""
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip() and _NAME_RE.match(line.split()[0])]


def cleanup(all_runs: bool = False) -> list[str]:
    """Delete leftover namespaces of runs whose process is gone (every run's with ``all_runs``)."""
    removed = []
    for name in list_namespaces():
        pid = int(_NAME_RE.match(name).group(1))
        tag = name.rsplit("_", 1)[0]
        if tag in _active_tags or (not all_runs and _alive(pid)):
            continue
        delete_namespace(name)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_stages(links: SlowLinks, command: list[str], poll_s: float = 0.05, **popen_kwargs) -> int:
    """Run ``command`` once per stage; stop the rest when one fails; return the first failing status."""
    procs = [links.popen(i, command, **popen_kwargs) for i in range(links.n_stages)]
    while None in (codes := [p.poll() for p in procs]):
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for p in procs:
                stop_process(p)
            return failed[0]
        time.sleep(poll_s)
    return next((c for c in codes if c), 0)


# ----- throughput probes (each runs as its own process inside a namespace) ----------------
_PROBE_PORT = 29400


def _tcp_sink(nbytes: int) -> None:
    """Accept one connection, read ``nbytes``, answer one byte."""
    import socket

    with socket.create_server(("0.0.0.0", _PROBE_PORT)) as server:
        conn, _ = server.accept()
        with conn:
            left = nbytes
            while left > 0:
                chunk = conn.recv(min(left, 1 << 20))
                if not chunk:
                    raise RuntimeError(f"sender closed with {left} bytes missing")
                left -= len(chunk)
            conn.sendall(b"k")


def _tcp_source(host: str, nbytes: int) -> None:
    """Send ``nbytes`` to the sink, time until its answer; print ``{"bytes", "seconds"}``."""
    import socket

    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((host, _PROBE_PORT), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = bytes(nbytes)
    with conn:
        start = time.perf_counter()
        conn.sendall(payload)
        if conn.recv(1) != b"k":
            raise RuntimeError("sink did not confirm the transfer")
        seconds = time.perf_counter() - start
    print(json.dumps({"bytes": nbytes, "seconds": seconds}), flush=True)


def _gloo_probe(nbytes: int) -> None:
    """torch.distributed gloo over the env:// rendezvous: an all-reduce over every stage (full
    mesh), then a timed send of ``nbytes`` from rank 0 to the last rank; rank 0 prints the result."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.ones(1)
    dist.all_reduce(total)
    last, ack = world - 1, torch.zeros(1)
    if rank == 0:
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        dist.send(payload[:1024], last)  # warm the pair up
        dist.recv(ack, last)
        start = time.perf_counter()
        dist.send(payload, last)
        dist.recv(ack, last)
        seconds = time.perf_counter() - start
        print(json.dumps({"bytes": nbytes, "seconds": seconds, "world_size": world,
                          "all_reduce": total.item()}), flush=True)
    elif rank == last:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(buf[:1024], 0)
        dist.send(ack, 0)
        dist.recv(buf, 0)
        dist.send(ack, 0)
    dist.barrier()
    dist.destroy_process_group()


def measure(rate: str | float, delay_ms: float = 0.0, nbytes: int = 8 << 20, transport: str = "tcp",
            n_stages: int = 2) -> dict:
    """Send ``nbytes`` from stage 0 to the last stage over fresh slow links; the achieved rate.

    Returns ``{"bytes", "seconds", "rate_bps" (requested), "achieved_bps", "ratio", "transport", ...}``.
    """
    if transport not in ("tcp", "gloo"):
        raise ValueError(f"transport = {transport!r}: choose tcp or gloo")
    if nbytes < 1024:
        raise ValueError(f"nbytes = {nbytes}: send at least 1024 bytes")
    me = [sys.executable, "-m", __spec__.name if __spec__ else "megatron_tah.netns_link"]
    with SlowLinks(n_stages, rate, delay_ms) as links:
        timeout = 60 + 4 * nbytes * 8 / links.rate_bps + n_stages * 30
        if transport == "tcp":
            sink = links.popen(n_stages - 1, [*me, "_tcp-sink", "--nbytes", str(nbytes)])
            source = links.popen(0, [*me, "_tcp-source", "--host", links.address(n_stages - 1),
                                     "--nbytes", str(nbytes)], stdout=subprocess.PIPE, text=True)
            procs = [source, sink]
        else:
            procs = [links.popen(i, [*me, "_gloo-probe", "--nbytes", str(nbytes)],
                                 stdout=subprocess.PIPE if i == 0 else None, text=True)
                     for i in range(n_stages)]
        try:
            out, _ = procs[0].communicate(timeout=timeout)
            codes = [p.wait(timeout=timeout) for p in procs[1:]]
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{transport} probe did not finish within {timeout:.0f} s") from None
        if procs[0].returncode or any(codes):
            raise RuntimeError(f"{transport} probe failed: exit statuses {[procs[0].returncode, *codes]}")
        result = json.loads(out.strip().splitlines()[-1])
        rate_bps = links.rate_bps
    achieved = result["bytes"] * 8 / result["seconds"]
    return {**result, "transport": transport, "rate_bps": rate_bps, "delay_ms": float(delay_ms),
            "achieved_bps": achieved, "ratio": achieved / rate_bps}


# ----- command line --------------------------------------------------------------------------
_SUBCOMMANDS = ("run", "measure", "cleanup", "_tcp-sink", "_tcp-source", "_gloo-probe")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_tah.netns_link",
                                     description="Pipeline stages in network namespaces joined by tc-limited links.",
                                     epilog="run form: --stages N --rate 100mbit [--delay-ms D] -- COMMAND...")
    sub = parser.add_subparsers(dest="action", required=True, metavar="{run,measure,cleanup}")
    run = sub.add_parser("run", help="run COMMAND once per stage, each in its namespace (default action)")
    run.add_argument("--stages", type=int, required=True)
    for p in (run, meas := sub.add_parser("measure", help="measure the achieved rate between two stages")):
        p.add_argument("--rate", required=True, help="link rate, e.g. 100mbit, 300mbit, 1gbit, 10gbit")
        p.add_argument("--delay-ms", type=float, default=0.0, help="one-way stage-to-stage latency (ms)")
    meas.add_argument("--mbytes", type=float, default=8.0, help="payload size in MiB (default 8)")
    meas.add_argument("--transport", choices=("tcp", "gloo"), default="tcp")
    meas.add_argument("--stages", type=int, default=2, help="namespaces; the transfer goes first to last")
    meas.add_argument("--json", action="store_true", help="print the result as one JSON line")
    clean = sub.add_parser("cleanup", help="delete namespaces left by runs that are gone")
    clean.add_argument("--all", action="store_true", help="also those of runs still alive")
    for name in ("_tcp-sink", "_tcp-source", "_gloo-probe"):
        probe = sub.add_parser(name)
        probe.add_argument("--nbytes", type=int, required=True)
        probe.add_argument("--host")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    if argv and argv[0] not in _SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")
    args = _parser().parse_args(argv)
    try:
        if args.action == "run":
            if not command:
                raise ValueError("no command given: put it after `--`")
            with SlowLinks(args.stages, args.rate, args.delay_ms) as links:
                return run_stages(links, command)
        if args.action == "measure":
            r = measure(args.rate, args.delay_ms, int(args.mbytes * (1 << 20)), args.transport, args.stages)
            print(json.dumps(r) if args.json else
                  f"{r['transport']}: {r['bytes']} bytes in {r['seconds']:.3f} s = {r['achieved_bps'] / 1e6:.1f} "
                  f"Mbit/s, requested {r['rate_bps'] / 1e6:.1f} Mbit/s ({100 * r['ratio']:.0f}%)")
            return 0
        if args.action == "cleanup":
            removed = cleanup(args.all)
            print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
            return 0
        {"_tcp-sink": lambda: _tcp_sink(args.nbytes), "_tcp-source": lambda: _tcp_source(args.host, args.nbytes),
         "_gloo-probe": lambda: _gloo_probe(args.nbytes)}[args.action]()
        return 0
    except KeyboardInterrupt:
        print("interrupted; slow links removed", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
