"""Real slow links: namespaces + tc limit throughput to the requested rate and leave nothing behind.

Tests that build namespaces need root and iproute2 (CI runs as root); they skip otherwise.
Throughput tolerance: the achieved rate must lie within 70%..110% of the requested rate
(measured here: 95-98% from 100 Mbit/s to 1 Gbit/s).
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_tah import netns_link
from megatron_tah.netns_link import SlowLinks, check_rate, list_namespaces

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="needs root and iproute2 (ip, tc) to create network namespaces")
CLI = [sys.executable, "-m", "megatron_tah.netns_link"]


def _owned_by(pid: int) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(f"mtah{pid}_") or n.startswith(f"mtah{pid}n")]


@pytest.mark.parametrize("rate, bps", [("100mbit", 1e8), ("300Mbps", 3e8), ("1gbit", 1e9), ("10gbit", 1e10)])
def test_check_rate_accepts(rate, bps):
    assert check_rate(rate) == bps


@pytest.mark.parametrize("rate", ["0", "-5mbit", "fast", "200gbit", "1bit", "nan"])
def test_check_rate_rejects(rate):
    with pytest.raises(ValueError, match="rate|bandwidth"):
        check_rate(rate)


@pytest.mark.parametrize("args", [["measure", "--rate", "200gbit"], ["--stages", "1", "--rate", "100mbit", "--", "true"]])
def test_cli_bad_input_is_one_line_exit_2(args):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")
    assert len(proc.stderr.strip().splitlines()) == 1


@needs_netns
@pytest.mark.parametrize("rate, mbytes", [("100mbit", 4), ("1gbit", 32)])
def test_tcp_throughput_matches_rate(rate, mbytes):
    # The limit holds on every try; reaching 70% of it needs CPU time, which other jobs on a
    # 2-core machine can take, so the best of three tries counts (contention only lowers it).
    results = []
    for _ in range(3):
        results.append(netns_link.measure(rate, nbytes=mbytes << 20))
        assert results[-1]["ratio"] <= 1.1, results[-1]
        if results[-1]["ratio"] >= 0.7:
            break
    assert max(r["ratio"] for r in results) >= 0.7, results
    assert _owned_by(os.getpid()) == []


@needs_netns
@pytest.mark.distributed
def test_gloo_three_stages_full_mesh_and_rate():
    # all-reduce needs every pair connected; the timed send crosses the switch from stage 0 to stage 2.
    result = netns_link.measure("100mbit", nbytes=6 << 20, transport="gloo", n_stages=3)
    assert result["world_size"] == 3 and result["all_reduce"] == 3.0
    assert 0.7 <= result["ratio"] <= 1.1, result
    assert _owned_by(os.getpid()) == []


@needs_netns
def test_cli_run_sets_stage_env_and_tears_down():
    script = 'echo "$RANK/$WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $GLOO_SOCKET_IFNAME $(ip -4 -o addr show eth0 | wc -l)"'
    proc = subprocess.Popen([*CLI, "--stages", "3", "--rate", "300mbit", "--", "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert sorted(out.split("\n")[:3]) == [f"{r}/3 10.77.0.1:29500 eth0 1" for r in range(3)]
    assert _owned_by(proc.pid) == []


@needs_netns
def test_failing_stage_stops_the_others():
    start = time.monotonic()
    proc = subprocess.run([*CLI, "--stages", "3", "--rate", "100mbit", "--", "sh", "-c",
                           'if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 60'], capture_output=True, timeout=120)
    assert proc.returncode == 3 and time.monotonic() - start < 40


@needs_netns
def test_sigterm_removes_namespaces_and_processes():
    proc = subprocess.Popen([*CLI, "--stages", "2", "--rate", "100mbit", "--", "sleep", "120"])
    deadline = time.monotonic() + 60
    while len(_owned_by(proc.pid)) < 3 or any(
            not subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.strip()
            for n in _owned_by(proc.pid) if not n.endswith("_hub")):
        assert time.monotonic() < deadline and proc.poll() is None, "namespaces never came up"
        time.sleep(0.2)
    pids = [int(p) for n in _owned_by(proc.pid)
            for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert _owned_by(proc.pid) == []
    for pid in pids:  # the stages' `sleep` processes are gone (or reaped zombies of a dead parent)
        assert not os.path.exists(f"/proc/{pid}") or "sleep" not in open(f"/proc/{pid}/cmdline").read()


@needs_netns
def test_exception_inside_with_block_cleans_up():
    with pytest.raises(KeyboardInterrupt):
        with SlowLinks(2, "1gbit") as links:
            names = _owned_by(os.getpid())
            assert sorted(names) == sorted([links.hub, links.namespace(0), links.namespace(1)])
            raise KeyboardInterrupt
    assert _owned_by(os.getpid()) == []


@needs_netns
def test_delay_is_applied_or_refused_clearly():
    # This project's CI kernel has no netem qdisc: then the run must refuse with a message naming it.
    try:
        with SlowLinks(2, "100mbit", delay_ms=20) as links:
            probe = links.popen(0, [sys.executable, "-c", _RTT_PROBE, links.address(1)],
                                stdout=subprocess.PIPE, text=True)
            server = links.popen(1, [sys.executable, "-c", _ECHO_SERVER])
            out, _ = probe.communicate(timeout=60)
            server.wait(timeout=30)
            assert float(out) >= 0.040  # 20 ms each way
    except RuntimeError as exc:
        assert "netem" in str(exc) and "delay_ms = 20" in str(exc)
    assert _owned_by(os.getpid()) == []


_ECHO_SERVER = """
import socket
with socket.create_server(("0.0.0.0", 29401)) as s:
    c, _ = s.accept()
    c.sendall(c.recv(1))
"""
_RTT_PROBE = """
import socket, sys, time
for _ in range(200):
    try:
        c = socket.create_connection((sys.argv[1], 29401)); break
    except OSError:
        time.sleep(0.05)
t = time.perf_counter(); c.sendall(b"x"); c.recv(1); print(time.perf_counter() - t)
"""


@needs_netns
def test_cleanup_removes_only_dead_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    names = [f"mtah{dead.pid}_hub", f"mtah{live.pid}_hub"]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        removed = netns_link.cleanup()
        assert names[0] in removed and names[1] not in removed
        assert names[1] in list_namespaces() and names[0] not in list_namespaces()
    finally:
        live.kill()
        live.wait()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_launch_spec_of_a_gpu_stage_without_root(monkeypatch):
    # Built, not run: the namespace exec, the stage's rendezvous, and the caller's CUDA settings kept.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    links = SlowLinks(4, "1gbit")
    links.tag = "mtah123"
    argv, env = links.launch_spec(2, ["python", "-m", "megatron_tah.pretrain_gpt", "--tah-share-gpus"],
                                  env={"EXTRA": "x"})
    assert argv == ["ip", "netns", "exec", "mtah123_s2", "python", "-m", "megatron_tah.pretrain_gpt",
                    "--tah-share-gpus"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2", "4", "4")
    assert env["MASTER_ADDR"] == "10.77.0.1" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["MTAH_LINK_RATE_BPS"] == "1000000000" and env["EXTRA"] == "x"
    assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == "1"  # NCCL could not bypass eth0
    assert env["OMP_NUM_THREADS"] == "1"  # torchrun's default: 4 stages x 1 thread, not x cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert links.launch_spec(2, ["true"])[1]["OMP_NUM_THREADS"] == "3"  # the caller's setting wins
    with pytest.raises(ValueError, match="stage = 4"):
        links.launch_spec(4, ["true"])
    with pytest.raises(ValueError, match="no command"):
        links.launch_spec(0, [])
