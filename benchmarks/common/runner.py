"""Launch training runs (``python -m megatron_tah.pretrain_gpt``: Megatron-LM's loop) and collect their JSON logs.

A :class:`Run` is one training run: its Megatron flags, its pipeline size, and its link
(``rate=None``: unthrottled, one process per stage on loopback through ``torchrun``; otherwise
one network namespace per stage behind ``tc`` links at ``rate``, through
``python -m megatron_tah.netns_link``). :func:`execute` writes, under ``out_dir``::

    NAME.jsonl       the plugin's per-iteration records (``--tah-log-json``)
    NAME.meta.json   {"name", "label", "command", "rate", "status", "seconds", "started", "host",
                      "load_before", "load_after", "max_rss_kb", "iterations"}
    NAME.log         the run's stdout and stderr

``max_rss_kb`` is the peak resident set of the largest process of the run (``wait4``'s
``ru_maxrss``: the launcher and every stage process it waited for). A run whose meta
says ``status == 0`` and whose log holds all its iterations is not run again
(``force=True`` reruns it). :func:`execute_all` runs a list with ``jobs`` workers,
honouring :attr:`Run.after` (names that must finish first, e.g. the checkpoint a
fine-tuning run loads).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


class ReproduceError(RuntimeError):
    """A run failed or its log is unusable; the message names the run and its log file."""


@dataclasses.dataclass
class Run:
    name: str
    """File stem, unique within a part (``tah``, ``tput_tah_100mbit``...)."""
    flags: list[str]
    """Megatron and ``--tah-*`` flags (model, data, codec, iterations...), without the CPU flags,
    the pipeline size and ``--tah-log-json`` (``command`` adds them)."""
    pipeline: int
    """Pipeline stages (``--pipeline-model-parallel-size``; one process each)."""
    rate: str | None = None
    """Link rate for real namespaced links (``100mbit``); None: unthrottled loopback."""
    label: str = ""
    """Human-readable description used in tables and plots."""
    after: tuple[str, ...] = ()
    """Names of runs (same list) that must complete first."""
    info: dict = dataclasses.field(default_factory=dict)
    """Free-form facts for the analysis (codec, bits, ablation value...), copied to the meta file."""

    def iterations(self) -> int:
        return int(self.flags[self.flags.index("--train-iters") + 1])

    def complete(self, records: list[dict]) -> bool:
        """Whether a run that exited with status 0 and logged ``records`` did all it was to do."""
        return records[-1]["iteration"] >= self.iterations()

    def command(self, out_dir: Path, python: str = sys.executable) -> list[str]:
        """``python -m megatron_tah.pretrain_gpt`` (Megatron's loop, CPU flags) for this run's stages."""
        from megatron_tah.pretrain_gpt import CPU_FLAGS, command, stage_command

        flags = [*CPU_FLAGS, *self.flags, "--pipeline-model-parallel-size", str(self.pipeline),
                 "--tah-log-json", str(out_dir / f"{self.name}.jsonl")]
        if self.rate is None:
            return command(self.pipeline, flags, python)
        return [python, "-m", "megatron_tah.netns_link", "--stages", str(self.pipeline), "--rate", self.rate,
                "--", *stage_command(flags, python)]


def read_log(path: Path) -> list[dict]:
    """The per-iteration records of a run's ``--tah-log-json`` file (evaluations merged into them,
    see ``megatron_tah.megatron.run_log.read_records``); ``ReproduceError`` when missing or empty."""
    from megatron_tah.megatron.run_log import read_records

    path = Path(path)
    if not path.is_file():
        raise ReproduceError(f"log {path} not found (run the part that writes it first)")
    records = read_records(path)
    if not records:
        raise ReproduceError(f"log {path} holds no records")
    return records


def read_meta(out_dir: Path, name: str) -> dict | None:
    path = Path(out_dir) / f"{name}.meta.json"
    return json.loads(path.read_text()) if path.is_file() else None


def is_complete(run: Run, out_dir: Path) -> bool:
    meta = read_meta(out_dir, run.name)
    if not meta or meta.get("status") != 0:
        return False
    try:
        records = read_log(Path(out_dir) / f"{run.name}.jsonl")
    except (ReproduceError, json.JSONDecodeError):
        return False
    return run.complete(records)


def host_info() -> dict:
    """The machine and the software a run's numbers come from: CPU model, cores, memory, kernel, Python,
    torch and megatron-core versions (runs on different CPUs can differ in the last bits of a float), and whether
    the CPU multiplies bf16 natively (without, a bf16 run's step takes tens of times longer)."""
    import platform
    from importlib import metadata

    import torch

    from megatron_tah.megatron.cpu_shims import bf16_instructions

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gb, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "megatron_core": metadata.version("megatron-core"),
            "bf16_matmul": bf16_instructions()}


def source_commit() -> str | None:
    """The commit of the checkout these benchmarks run from (``+`` when it has uncommitted changes); None outside
    a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def load_average() -> float:
    return os.getloadavg()[0]


def say(text: str) -> None:
    print(f"[reproduce {time.strftime('%H:%M:%S')}] {text}", flush=True)


def execute(run: Run, out_dir: Path, force: bool = False, python: str = sys.executable,
            env: dict[str, str] | None = None) -> dict:
    """Run one training run unless already complete; returns its meta record.

    Raises ``ReproduceError`` (naming the log) when the run exits with a non-zero status.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not force and is_complete(run, out_dir):
        return read_meta(out_dir, run.name)
    log_json = out_dir / f"{run.name}.jsonl"
    log_json.unlink(missing_ok=True)
    cmd = run.command(out_dir, python)
    meta = {"name": run.name, "label": run.label, "command": cmd, "rate": run.rate, "pipeline": run.pipeline,
            "info": run.info, "host": host_info(), "commit": source_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_before": load_average()}
    say(f"start {out_dir.name}/{run.name}" + (f" over {run.rate} links" if run.rate else ""))
    start = time.perf_counter()
    with open(out_dir / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    meta.update(status=proc.returncode, seconds=time.perf_counter() - start, load_after=load_average(),
                max_rss_kb=usage.ru_maxrss)
    if proc.returncode == 0:
        meta["iterations"] = len(read_log(log_json))
    written = out_dir / f"{run.name}.meta.json.tmp"  # whole or absent: a resumed study reads it
    written.write_text(json.dumps(meta, indent=1))
    os.replace(written, out_dir / f"{run.name}.meta.json")
    say(f"done  {out_dir.name}/{run.name}: status {proc.returncode}, {meta['seconds']:.0f} s")
    if proc.returncode != 0:
        raise ReproduceError(f"run {run.name} failed with status {proc.returncode}; see {out_dir / (run.name + '.log')}")
    return meta


def execute_all(runs: list[Run], out_dir: Path, jobs: int = 1, force: bool = False, **kwargs) -> dict[str, dict]:
    """Run ``runs`` with up to ``jobs`` at a time, each after the runs named in its ``after``.

    Returns ``{name: meta}``; raises ``ReproduceError`` listing every failed run at the end
    (runs that depend on a failed run are skipped).
    """
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique, got {names}")
    for r in runs:
        missing = [a for a in r.after if a not in names]
        if missing:
            raise ValueError(f"run {r.name}: after = {missing} names no run of this list")
    if jobs < 1:
        raise ValueError(f"jobs = {jobs}: must be >= 1")
    done: dict[str, dict] = {}
    failed: dict[str, str] = {}
    pending = list(runs)
    cond = threading.Condition()

    def next_run() -> Run | None:
        with cond:
            while pending:
                for r in pending:
                    if any(a in failed for a in r.after):
                        pending.remove(r)
                        failed[r.name] = f"skipped: {[a for a in r.after if a in failed]} failed"
                        cond.notify_all()
                        break
                    if all(a in done for a in r.after):
                        pending.remove(r)
                        return r
                else:
                    cond.wait()
            return None

    def worker() -> None:
        while (r := next_run()) is not None:
            try:
                meta = execute(r, out_dir, force=force, **kwargs)
                with cond:
                    done[r.name] = meta
                    cond.notify_all()
            except (ReproduceError, OSError) as err:
                with cond:
                    failed[r.name] = str(err)
                    cond.notify_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(jobs, len(runs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise ReproduceError("failed runs: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    return done


def steady(records: list[dict], skip: int = 2) -> list[dict]:
    """Records after the first ``skip`` iterations (start-up), or all when there are too few."""
    return records[skip:] if len(records) > skip else records
