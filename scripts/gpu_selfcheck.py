"""The GPU self-check: the paths no CPU test can see, one PASS/FAIL per step, run by ``scripts/gpu_check.sh``.

    python scripts/gpu_selfcheck.py                  # every step, in order, within --budget-s (1500 s)
    python scripts/gpu_selfcheck.py --steps sync,laaq
    python scripts/gpu_selfcheck.py --list           # the steps, their estimates and time limits

Each step runs in its own process under its time limit (a hang is a FAIL, not a stuck check); the
runner prints ``PASS`` / ``FAIL`` per step and writes ``<out>/<gpu>-selfcheck.json`` and ``.md`` (the
verdicts, seconds, details), and a step's own files under ``<out>/<gpu>-selfcheck/``; training runs
keep their logs under ``runs/gpu_selfcheck/``. The exit status is 0 only when every step passed.

Steps, in order (the estimates are H100 seconds, sized from DESIGN.md's "Facts measured on an H100":
the compiled kernel tests took 145 s; a codec call is 0.3-4.6 ms; Megatron's first iteration ~5 s
and ~40 s of start-up per run; 4 layers of hidden 256..1600 take 0.2-0.3 s per 8 micro-batches):

``kernels``   the Triton kernels compiled for this GPU, byte-exact against the torch references.
``graphs``    the codecs replayed from real CUDA graphs, a capture that syncs failing cleanly; after every
              test the thread is on the default stream and nothing is capturing (``tests/codecs/core/test_graphs.py``).
``sync``      each codec's encode and decode, eager and replayed, under ``torch.cuda.set_sync_debug_mode("error")``.
``staging``   host-staging loopback: 2 processes on 1 GPU over gloo, ``torch.cuda._sleep`` queued before each
              encode and each copy back, 1000 messages of mixed sizes: bytes equal, buffers and memory constant.
``sanitizer`` the same loopback (200 messages, torch backend) under ``TORCH_CUDA_SANITIZER=1``.
``share``     ``--tah-share-gpus`` on one GPU, uncompressed (``none``): PP 2 x DP 2's loss at each iteration
              equal to PP 2 x DP 1's (same stages, same global batch) within ``LOSS_ATOL``; PP 4 trains.
``interleaved`` the interleaved schedule (2 virtual stages per rank) with overlapped p2p and CUDA graphs on,
              PP 2 on one GPU, under the step's time limit: every iteration finishes with a finite loss.
``auto``      ``auto`` on both directions over an emulated link of ``AUTO_RATE``: the rates it measured
              within [0.5, 1.1] x that rate; ``handshake.link_latency`` on the loopback below 5 ms.
``laaq``      one megatron-core layer (local spec, rotary, 4096 tokens): every saved tensor's type, dtype,
              shape and fate logged; only activations packed; input and weight gradients against LAAQ off.
``entropy``   each lossless coder (``codecs/core/entropy.py``: huffman on the device, zstd and ans through a host copy) on
              ``lowrank``'s and ``channel_h4``'s buffers of the ProtocolNanoGPT message ``[1024, 8, 1024]``: decoded bit for bit; encode and decode timed (the
              median of ``ENTROPY_REPEATS``) with their peak memory: what docs/CODECS.md has not measured.

The sum of the estimates is about 20 minutes; the runner stops starting steps when the budget (25 minutes
by default) could not hold the next one's estimate, and cuts each step's limit to what is left, so the
whole check never takes more than the budget. ``--device cpu`` runs the steps that can run without a GPU
(``staging``, ``laaq``, ``entropy``) at small sizes: what the CPU test (``tests/project/test_gpu_selfcheck.py``) does.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUDGET_S = 25 * 60
LOSS_ATOL = 0.02  # PP 2 x DP 2 against PP 2 x DP 1: bf16, same data, no dropout (reductions differ in order)
AUTO_RATE = "200mbit"
AUTO_RATE_BPS = 200e6
SMALL_MODEL = ["--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
               "--max-position-embeddings", "256", "--attention-dropout", "0", "--hidden-dropout", "0"]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    title: str
    estimate_s: int  # H100 seconds (module docstring)
    limit_s: int  # the step's own time limit
    cpu: bool = False  # runs with --device cpu (small sizes)
    env: tuple[tuple[str, str], ...] = ()


STEPS = (
    Step("kernels", "Triton kernels compiled, byte-exact against the torch references", 150, 300),
    Step("graphs", "codecs from real CUDA graphs; stream state after every graph test", 120, 240),
    Step("sync", "each codec's encode/decode under set_sync_debug_mode('error')", 90, 180),
    Step("staging", "host-staging loopback, 2 processes, 1 GPU, gloo, _sleep before each encode", 60, 150, cpu=True),
    Step("sanitizer", "the loopback under TORCH_CUDA_SANITIZER=1", 150, 240, env=(("TORCH_CUDA_SANITIZER", "1"),)),
    Step("share", "--tah-share-gpus on one GPU: PP 2 x DP 2 loss equal to PP 2 x DP 1; PP 4 trains", 240, 420),
    Step("interleaved", "interleaved schedule, overlapped p2p, CUDA graphs on, under a time limit", 120, 240),
    Step("auto", f"auto's rates against an emulated {AUTO_RATE} link; loopback latency", 150, 300),
    Step("laaq", "LAAQ on one layer: every saved tensor logged, gradients against LAAQ off", 60, 180, cpu=True),
    Step("entropy", "the lossless coder (--tah-entropy-coding) bit-exact, timed at the speedrun's message", 60, 180,
         cpu=True),
)


def step(name: str) -> Step:
    for s in STEPS:
        if s.name == name:
            return s
    raise ValueError(f"unknown step {name!r}; choose from {', '.join(s.name for s in STEPS)}")


def gpu_slug(name: str) -> str:
    """File-name form of a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# ----- the report ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    name: str
    passed: bool
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} {self.name} ({self.seconds:.0f} s): {self.detail}"


def write_report(results: list[Result], out_dir: Path, gpu: str, meta: dict) -> tuple[Path, Path]:
    """``<out_dir>/<gpu slug>-selfcheck.json`` and ``.md``: every step's verdict, seconds and detail."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug(gpu)
    estimates = {s.name: s.estimate_s for s in STEPS}
    record = {"gpu": gpu, **meta, "passed": all(r.passed for r in results) and bool(results),
              "steps": [dataclasses.asdict(r) | {"estimate_s": estimates.get(r.name)} for r in results]}
    json_path, md_path = out_dir / f"{slug}-selfcheck.json", out_dir / f"{slug}-selfcheck.md"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# GPU self-check on {gpu} ({meta.get('date', '?')})", "",
             ", ".join(f"{k} {v}" for k, v in meta.items() if k != "date"), "",
             "| step | verdict | seconds | estimate | detail |", "|---|---|---:|---:|---|"]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.name} | {'PASS' if r.passed else 'FAIL'} | {r.seconds:.0f} | {estimates.get(r.name, '')} "
                     f"| {detail} |")
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


# ----- the runner --------------------------------------------------------------------------------------
def launch_step(command: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``command`` in its own session; (exit status, output), or (None, output) when it ran past
    ``timeout``: then its whole process group gets SIGTERM (torchrun stops its workers), SIGKILL 15 s later."""
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = child.communicate(timeout=timeout)
        return child.returncode, output
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            try:
                output, _ = child.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                output = ""
        return None, output or ""


def run_steps(names: list[str], out_dir: Path, device: str, budget_s: float, files: Path | None = None,
              clock: Callable[[], float] = time.monotonic, launch=launch_step) -> list[Result]:
    """Each step in a child process (``--run-step``) under min(its limit, what is left of ``budget_s``);
    a step whose estimate no longer fits is not started (FAIL, "not run: budget"). A step's output goes to
    ``files/<step>.log`` when ``files`` is given."""
    start = clock()
    results = []
    for name in names:
        s = step(name)
        left = budget_s - (clock() - start)
        if left < s.estimate_s:
            results.append(Result(name, False, f"not run: {left:.0f} s of the {budget_s:.0f} s budget left, "
                                               f"estimate {s.estimate_s} s"))
            print(results[-1].line(), flush=True)
            continue
        limit = min(s.limit_s, left)
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "result.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--run-step", name, "--result", str(result_file),
                       "--out", str(out_dir), "--device", device]
            began = clock()
            status, output = launch(command, {**os.environ, **dict(s.env)}, limit)
            if status is None:
                result = Result(name, False, f"timed out after {limit:.0f} s (a hang, or slower than the limit)")
            elif result_file.exists():
                result = Result(**json.loads(result_file.read_text()))
            else:
                tail = " | ".join(output.strip().splitlines()[-3:])
                result = Result(name, False, f"exit {status} without a verdict: {tail}")
            result.seconds = clock() - began
        if files is not None:
            files.mkdir(parents=True, exist_ok=True)
            (files / f"{name}.log").write_text(output)
        results.append(result)
        print(result.line(), flush=True)
    return results


def run_one(name: str, out_dir: Path, device: str, result_file: Path) -> None:
    """Run step ``name`` in this process and write its verdict (what ``--run-step`` does)."""
    began = time.monotonic()
    try:
        passed, detail = STEP_FUNCTIONS[name](Context(out_dir, device))
    except Exception as err:  # noqa: BLE001 - any error is this step's FAIL, with its first line
        traceback.print_exc()  # the whole story in the step's log
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        passed, detail = False, f"{type(err).__name__}: {first[:300]}"
    result = Result(name, bool(passed), detail, time.monotonic() - began)
    result_file.write_text(json.dumps(dataclasses.asdict(result)))


@dataclasses.dataclass
class Context:
    out_dir: Path
    device: str  # "cuda" or "cpu"

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def files(self, step_name: str) -> Path:
        """This step's directory under ``<out>/<gpu>-selfcheck/``."""
        path = self.out_dir / f"{gpu_slug(device_name(self.device))}-selfcheck" / step_name
        path.mkdir(parents=True, exist_ok=True)
        return path


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return "cpu"


# ----- kernels, graphs: the test files on this GPU ---------------------------------------------------------
KERNEL_TESTS = ["tests/kernels/test_fixedpoint.py", "tests/kernels/test_fp8.py", "tests/kernels/test_tah.py",
                "tests/kernels/test_hadint.py", "tests/kernels/test_channel.py", "tests/kernels/test_laaq.py",
                "tests/codecs/test_lowrank.py"]


def _pytest(args: list[str], log: Path) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return done.returncode == 0, f"{summary} (log: {log.name})"


def step_kernels(ctx: Context):
    return _pytest([*KERNEL_TESTS, "-k", "not lowrank or triton or sync"], ctx.files("kernels") / "pytest.log")


def step_graphs(ctx: Context):
    return _pytest(["tests/codecs/core/test_graphs.py", "-k", "gpu"], ctx.files("graphs") / "pytest.log")


# ----- sync: no host sync in any codec call ----------------------------------------------------------------
SYNC_SHAPE = (1024, 1, 1600)  # GPT-2 XL's [s, b, h] (DESIGN.md's measurements)


def step_sync(ctx: Context):
    import torch

    from megatron_tah.codecs import CODECS, codec_class, get_codec
    from megatron_tah.codecs.core.graphs import place_codec
    from megatron_tah.codecs.core.samples import activation_like

    x = activation_like(SYNC_SHAPE, dtype=torch.bfloat16, seed=0).cuda()
    failures, checked, skipped = [], [], []
    for name in CODECS:
        if not codec_class(name).graph_capturable:
            skipped.append(f"{name} ({codec_class(name).graph_blocker})")
            continue
        for path in ("eager", "graph"):
            codec = place_codec(get_codec(name), eager=path == "eager")
            buf = codec.encode(x)  # first calls: caches, compilation, the captures (syncs allowed)
            codec.decode(buf, x.shape, x.dtype)
            torch.cuda.synchronize()
            try:
                torch.cuda.set_sync_debug_mode("error")
                for _ in range(3):
                    buf = codec.encode(x)
                    codec.decode(buf, x.shape, x.dtype)
            except RuntimeError as err:
                failures.append(f"{name} {path}: {(str(err).splitlines() or [''])[0][:160]}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            codec.raise_deferred_errors(wait=True)
            checked.append(f"{name} {path}")
    detail = f"{len(checked) - len(failures)}/{len(checked)} calls without a sync; skipped: {', '.join(skipped)}"
    return not failures, detail + ("; " + "; ".join(failures) if failures else "")


# ----- staging: the loopback through pinned host memory ------------------------------------------------------
STAGING_ROWS = (1, 5, 64, 300, 2048, 8192)  # messages of [rows, 1, 128] bf16: 256 B .. 2 MB on the wire
SLEEP_CYCLES = 200_000  # ~0.1 ms of GPU time queued before each encode and each copy back


def _staging_rank(rank: int, store_path: str, device_name_: str, messages: int, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_tah.codecs import get_codec
    from megatron_tah.codecs.core.samples import activation_like

    staging_module = importlib.import_module("megatron_tah.link.message")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    device = torch.device(device_name_)
    cuda = device.type == "cuda"
    staging = staging_module.HostStaging(device)
    codec = get_codec("fixedpoint", backend=backend).defer_checks()
    bad = torch.zeros((), dtype=torch.int64, device=device)
    warm = len(STAGING_ROWS) * 2
    counts = {}
    for i in range(messages):
        x = activation_like((STAGING_ROWS[i % len(STAGING_ROWS)], 1, 128), dtype=torch.bfloat16, seed=i).to(device)
        if rank == 0:
            if cuda:
                torch.cuda._sleep(SLEEP_CYCLES)  # the encode runs late: the copy to the host must wait for it
            staged = staging.stage_send(codec.encode(x))
            dist.send(staged.host(), 1)
            staged.release()
        else:
            expected = codec.encode(x)
            staged = staging.stage_recv(expected.numel())
            dist.recv(staged.host, 0)
            if cuda:
                torch.cuda._sleep(SLEEP_CYCLES)  # the copy back runs late: its host buffer must not be reused
            bad += (staged.to_device() != expected).sum()
            staged.release()
            del expected
        del x
        if i + 1 in (warm, messages):
            memory = 0
            if cuda:  # blocks freed with a pending stream use are returned at the next allocation
                torch.cuda.synchronize(device)
                torch.empty(1, device=device)
                memory = torch.cuda.memory_allocated(device)
            counts[i + 1] = (staging.allocations, memory)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(device)
    Path(out).write_text(json.dumps({"bad": int(bad), "counts": {str(k): v for k, v in counts.items()}}))
    dist.destroy_process_group()


def staging_loopback(device: str, messages: int, backend: str) -> tuple[bool, str]:
    """Both ranks' verdicts: bytes equal, staging buffers and device memory constant after two rounds of sizes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank{r}.json") for r in range(2)]
        mp.start_processes(_staging_main, args=(str(Path(tmp) / "store"), device, messages, backend, outs),
                           nprocs=2, join=True, start_method="spawn")
        results = [json.loads(Path(o).read_text()) for o in outs]
    warm = str(len(STAGING_ROWS) * 2)
    problems = []
    if results[1]["bad"]:
        problems.append(f"{results[1]['bad']} bytes differ")
    for rank, r in enumerate(results):
        (alloc0, mem0), (alloc1, mem1) = r["counts"][warm], r["counts"][str(messages)]
        if alloc1 != alloc0:
            problems.append(f"rank {rank}: staging buffers {alloc0} -> {alloc1}")
        if abs(mem1 - mem0) > 1 << 20:
            problems.append(f"rank {rank}: device memory {mem0} -> {mem1} bytes")
    sent = f"{messages} messages of {len(STAGING_ROWS)} sizes ({backend} codec)"
    return not problems, (", ".join(problems) or f"{sent}: bytes equal, buffers and memory constant")


def _staging_main(rank, store_path, device, messages, backend, outs):
    _staging_rank(rank, store_path, device, messages, backend, outs[rank])


def step_staging(ctx: Context):
    if ctx.cuda:
        return staging_loopback("cuda", 1000, "triton")
    return staging_loopback("cpu", 24, "torch")


def step_sanitizer(ctx: Context):
    if os.environ.get("TORCH_CUDA_SANITIZER") != "1":
        return False, "TORCH_CUDA_SANITIZER=1 is not set in this process"
    passed, detail = staging_loopback("cuda", 200, "torch")  # torch ops: the sanitizer sees the encode
    return passed, detail + " (under TORCH_CUDA_SANITIZER=1)"


# ----- training runs: share, interleaved, auto ----------------------------------------------------------------
RUNS_DIR = ROOT / "runs" / "gpu_selfcheck"


def training_command(pp: int, processes: int, *flags: str) -> list[str]:
    """``scripts/pretrain_gpt.sh PP`` (GPU path) on a small model with these flags (the environment says the rest)."""
    return ["bash", str(ROOT / "scripts" / "pretrain_gpt.sh"), str(pp), *SMALL_MODEL, *flags]


def training_env(processes: int, out: Path, port: int, iterations: int, codec: str, bwd_codec: str, **extra) -> dict:
    return {**os.environ, "DEVICE": "gpu", "PYTHON": sys.executable, "GPUS_PER_NODE": str(processes),
            "LAYERS": "4", "MICRO_BATCH": "1", "GLOBAL_BATCH": "8", "TRAIN_ITERS": str(iterations),
            "EVAL_INTERVAL": "1000000", "EVAL_ITERS": "0", "SAVE": "none", "OUT": str(out),
            "MASTER_PORT": str(port), "CODEC": codec, "BWD_CODEC": bwd_codec, **extra}


def run_training(name: str, pp: int, processes: int, flags: list[str], iterations: int, port: int,
                 codec: str = "none", bwd_codec: str = "none", timeout: float | None = None, **env) -> list[dict]:
    """One run's JSON records (``--tah-log-json``); raises with the log's last lines when it fails."""
    out = RUNS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.jsonl"
    log.unlink(missing_ok=True)
    done = subprocess.run(training_command(pp, processes, *flags), cwd=ROOT,
                          env=training_env(processes, out, port, iterations, codec, bwd_codec, **env),
                          capture_output=True, text=True, timeout=timeout)
    (out / "stdout.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not log.exists():
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        raise RuntimeError(f"{name} exited {done.returncode}: {tail}")
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def losses(records: list[dict]) -> list[float]:
    return [r["lm_loss"] for r in records if "lm_loss" in r and "iteration" in r]


def compare_losses(reference: list[float], runs: dict[str, list[float]], atol: float = LOSS_ATOL) -> tuple[bool, str]:
    problems, worst = [], 0.0
    for name, values in runs.items():
        if len(values) != len(reference):
            problems.append(f"{name}: {len(values)} iterations logged, reference {len(reference)}")
            continue
        gap = max((abs(a - b) for a, b in zip(values, reference)), default=math.inf)
        worst = max(worst, gap)
        if not gap <= atol:
            problems.append(f"{name}: loss differs from the reference by up to {gap:.4g} (> {atol})")
    detail = f"{len(reference)} iterations, largest gap {worst:.3g} (tolerance {atol})"
    return not problems, "; ".join(problems) or detail


SHARED = ["--tah-share-gpus", "--distributed-backend", "gloo"]


def judge_pp4(values: list[float], iterations: int) -> tuple[bool, str]:
    """PP 4 on one GPU: every iteration logged, finite, and the loss lower at the end than at the start."""
    finite = len(values) == iterations and all(math.isfinite(v) for v in values)
    ok = finite and values[-1] < values[0]
    shown = ", ".join(f"{v:.4g}" for v in values)
    return ok, f"pp4: {len(values)}/{iterations} iterations{'' if ok else ' (want finite and falling)'}: {shown}"


def step_share(ctx: Context):
    """PP 2 x DP 2 against PP 2 x DP 1 at the same global batch: the same stages, so the same weights
    (Megatron seeds stage p with seed + 100 p; PP 1 is no reference: on an H100 its first loss was 10.85,
    PP 4's 10.95, before any update), the same 8 samples per iteration, the DP all-reduce through gloo on
    CUDA tensors as the only difference; PP 4 must train (finite, falling)."""
    iterations = 6
    reference = losses(run_training("share-pp2", 2, 2, SHARED, iterations, 29611))
    runs = {"pp2xdp2": losses(run_training("share-pp2xdp2", 2, 4, SHARED, iterations, 29613))}
    pp4 = losses(run_training("share-pp4", 4, 4, SHARED, iterations, 29612))
    (ctx.files("share") / "losses.json").write_text(json.dumps({"pp2": reference, **runs, "pp4": pp4}, indent=1))
    dp_ok, dp_detail = compare_losses(reference, runs)
    pp4_ok, pp4_detail = judge_pp4(pp4, iterations)
    return dp_ok and pp4_ok, f"pp2xdp2 vs pp2: {dp_detail}; {pp4_detail}"


def step_interleaved(ctx: Context):
    iterations = 4
    records = run_training("interleaved", 2, 2, [*SHARED, "--num-layers-per-virtual-pipeline-stage", "1"],
                           iterations, 29621, codec="tah", bwd_codec="fixedpoint")
    values = losses(records)
    (ctx.files("interleaved") / "losses.json").write_text(json.dumps(values))
    finite = len(values) == iterations and all(math.isfinite(v) for v in values)
    return finite, f"{len(values)}/{iterations} iterations, losses {', '.join(f'{v:.4g}' for v in values)}"


def check_auto_rates(record: dict, rate_bps: float) -> tuple[bool, str]:
    """Every link's measured rate in the last record within [0.5, 1.1] x the emulated rate."""
    links = record.get("auto") or {}
    if not links:
        return False, "no auto record in the log"
    problems, seen = [], []
    for link, item in sorted(links.items()):
        rate = item.get("rate_bps")
        seen.append(f"{link} {item.get('codec')} {rate / 1e6 if rate else float('nan'):.4g} Mbit/s")
        if rate is None or not 0.5 * rate_bps <= rate <= 1.1 * rate_bps:
            problems.append(f"{link}: {rate} bit/s outside [{0.5 * rate_bps:.3g}, {1.1 * rate_bps:.3g}]")
    return not problems, "; ".join(problems + seen)


def _latency_rank(rank: int, store_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    handshake = importlib.import_module("megatron_tah.link.handshake")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    latency = handshake.link_latency(dist.group.WORLD, torch.device("cuda", 0))
    Path(out).write_text(json.dumps({str(k): v for k, v in latency.items()}))
    dist.destroy_process_group()


def _latency_main(rank, store_path, outs):
    _latency_rank(rank, store_path, outs[rank])


def loopback_latency() -> list[float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank{r}.json") for r in range(2)]
        mp.start_processes(_latency_main, args=(str(Path(tmp) / "store"), outs), nprocs=2, join=True,
                           start_method="spawn")
        return [v for o in outs for v in json.loads(Path(o).read_text()).values()]


def step_auto(ctx: Context):
    latencies = loopback_latency()
    latency_ok = bool(latencies) and all(0 < s < 5e-3 for s in latencies)
    records = run_training("auto", 2, 2, [*SHARED, "--tah-auto-interval", "2"], 10, 29631, codec="auto",
                           bwd_codec="auto", RATE=AUTO_RATE, LINK="emulate")
    (ctx.files("auto") / "auto.json").write_text(json.dumps([r.get("auto") for r in records], indent=1))
    rates_ok, detail = check_auto_rates(records[-1], AUTO_RATE_BPS)
    lat = ", ".join(f"{s * 1e6:.0f} us" for s in latencies)
    return latency_ok and rates_ok, f"rates: {detail}; loopback latency {lat} ({'ok' if latency_ok else '> 5 ms'})"


# ----- laaq: one layer, every saved tensor ---------------------------------------------------------------------
def _laaq_sizes(cuda: bool) -> dict:
    if cuda:  # 4096 tokens: per-token statistics have MIN_NUMEL elements
        return {"seq": 2048, "batch": 2, "hidden": 1024, "heads": 16}
    return {"seq": 64, "batch": 2, "hidden": 64, "heads": 4}


def laaq_layer_check(cuda: bool) -> tuple[bool, str, list[dict]]:
    """Forward and backward of one layer with LAAQ measuring only, then packing; (verdict, detail, tensor log)."""
    import types

    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config_module = importlib.import_module("megatron_tah.config")
    from megatron_tah.megatron import activation_memory
    from megatron_tah.megatron.patching import Patches

    if not cuda:
        from megatron_tah.megatron.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    sizes = _laaq_sizes(cuda)
    s, b, h, heads = sizes["seq"], sizes["batch"], sizes["hidden"], sizes["heads"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=heads, use_cpu_initialization=True, params_dtype=dtype,
        pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    # bf16 parameters on the GPU, as Megatron's Float16Module makes them (CUDA's layer norm takes one dtype)
    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1).to(device=device, dtype=dtype)
    rope = RotaryEmbedding(kv_channels=h // heads, rotary_percent=1.0, use_cpu_initialization=True)
    rope.inv_freq = rope.inv_freq.to(device)
    half = rope.get_freqs_non_repeated(s)
    freqs = torch.cat((half, half), dim=-1)[:, None, None, :]  # RotaryEmbedding.get_emb's [s, 1, 1, d]
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1)
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)

    tah_config = config_module.TahConfig(tah_activation_memory="laaq")
    place = types.SimpleNamespace(name="activation_memory", config=tah_config, state={"quantize": False},
                                  patches=Patches(), stats=types.SimpleNamespace())
    log: list[dict] = []
    original_hooks = activation_memory._hooks

    def recording_hooks(place_, quantize):
        pack, unpack = original_hooks(place_, quantize)

        def pack_and_log(t):
            packed = pack(t)
            if packed is not t and place.state["quantize"]:  # (parameters come back as they are)
                quantized = type(packed).__name__ == "_Quantized"
                why = ("attention's own" if not quantize else activation_memory.keep_reason(t)) if not quantized else ""
                log.append({"type": type(t).__name__, "dtype": str(t.dtype).replace("torch.", ""),
                            "shape": list(t.shape), "packed": quantized, "kept_because": why})
            return packed

        return pack_and_log, unpack

    def grads(quantize: bool) -> list[torch.Tensor]:
        place.state["quantize"] = quantize
        layer.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)
        out, _ = layer(hidden_states=inp, attention_mask=mask, rotary_pos_emb=freqs)
        out.float().square().mean().backward()
        return [inp.grad.float()] + [p.grad.float().clone() for p in layer.parameters() if p.grad is not None]

    activation_memory._hooks = recording_hooks
    try:
        activation_memory.install(place)
        want = grads(False)
        got = grads(True)
    finally:
        activation_memory._hooks = original_hooks
        activation_memory.uninstall(place)
        place.patches.restore()
        parallel_state.destroy_model_parallel()
    return (*judge_laaq(log, want, got, sizes), log)


def judge_laaq(log: list[dict], want: list, got: list, sizes: dict) -> tuple[bool, str]:
    """Only activations packed (plain tensors, >= 2-D, last dim > 1, no [s, 1, 1, d] table); something packed;
    every gradient's relative error against LAAQ off below 0.35 (4-bit activations) and the input's above 0."""
    packed = [e for e in log if e["packed"]]
    wrong = [e for e in packed if e["type"] != "Tensor" or len(e["shape"]) < 2 or e["shape"][-1] == 1
             or (len(e["shape"]) == 4 and e["shape"][1:3] == [1, 1])]
    errors = [float((g - w).norm() / w.norm().clamp_min(1e-30)) for w, g in zip(want, got)]
    problems = []
    if not packed:
        problems.append("nothing packed")
    if wrong:
        problems.append(f"packed what must be kept: {wrong[:3]}")
    if len(got) != len(want) or max(errors, default=1.0) >= 0.35 or not errors or errors[0] <= 0:
        problems.append(f"gradient errors {', '.join(f'{e:.3g}' for e in errors)} (input first; want 0 < e < 0.35)")
    tokens = sizes["seq"] * sizes["batch"]
    detail = (f"{tokens} tokens: {len(packed)} packed, {len(log) - len(packed)} kept; gradient errors input "
              f"{errors[0] if errors else float('nan'):.3g}, weights max {max(errors[1:], default=float('nan')):.3g}")
    return not problems, "; ".join(problems) or detail


def step_laaq(ctx: Context):
    passed, detail, log = laaq_layer_check(ctx.cuda)
    (ctx.files("laaq") / "saved-tensors.json").write_text(json.dumps(log, indent=1))
    return passed, detail


# ----- entropy: the lossless coder on this device ----------------------------------------------------------------
ENTROPY_SHAPE = (1024, 8, 1024)  # the ProtocolNanoGPT message (docs/SPEEDRUN.md's projection)
ENTROPY_CPU_SHAPE = (64, 2, 128)
ENTROPY_PRESETS = ("lowrank", "channel_h4")
ENTROPY_REPEATS = 5


def step_entropy(ctx: Context):
    import statistics

    import torch

    from megatron_tah.codecs.core import entropy
    from megatron_tah.codecs.core.samples import activation_like
    from megatron_tah.config import TahConfig

    shape = ENTROPY_SHAPE if ctx.cuda else ENTROPY_CPU_SHAPE
    x = activation_like(shape, dtype=torch.bfloat16, seed=0).to(ctx.device)
    sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)
    rows = []
    for preset in ENTROPY_PRESETS:
        config = TahConfig(tah_preset=preset)
        for direction, codec, message in (("forward", config.forward_codec(), x),
                                          ("backward", config.backward_codec(), x * 1e-3)):
            buf = codec.encode(message)
            for coder in entropy.CODERS:  # huffman on the device; zstd and ans through a host copy
                times: dict[str, list[float]] = {"encode": [], "decode": []}
                if ctx.cuda:
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(ENTROPY_REPEATS):
                    sync()
                    start = time.perf_counter()
                    coded = entropy.encode(codec, buf, shape, message.dtype, coder)
                    sync()
                    middle = time.perf_counter()
                    back = entropy.decode(codec, coded, shape, message.dtype, coder)
                    sync()
                    times["encode"].append(middle - start)
                    times["decode"].append(time.perf_counter() - middle)
                rows.append({"preset": preset, "direction": direction, "coder": coder, "codec": codec.describe(),
                             "shape": list(shape), "wire_nbytes": buf.numel(), "coded_nbytes": coded.numel(),
                             "exact": torch.equal(back, buf) and back.device == buf.device,
                             **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
                             "peak_memory_mb": torch.cuda.max_memory_allocated() / 1e6 if ctx.cuda else None})
    (ctx.files("entropy") / "entropy.json").write_text(json.dumps(rows, indent=1))
    detail = "; ".join(f"{r['preset']} {r['direction']} {r['coder']}: {1 - r['coded_nbytes'] / r['wire_nbytes']:.0%} "
                       f"fewer bytes, "
                       f"encode {r['encode_ms']:.1f} ms, decode {r['decode_ms']:.1f} ms"
                       + ("" if r["exact"] else ", NOT bit-exact") for r in rows)
    return all(r["exact"] for r in rows), f"{'x'.join(map(str, shape))}: {detail}"


STEP_FUNCTIONS = {"kernels": step_kernels, "graphs": step_graphs, "sync": step_sync, "staging": step_staging,
                  "sanitizer": step_sanitizer, "share": step_share, "interleaved": step_interleaved,
                  "auto": step_auto, "laaq": step_laaq, "entropy": step_entropy}


# ----- command line --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=",".join(s.name for s in STEPS),
                        help="comma list, run in the order given (default: every step)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="where the report goes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: only the steps that run without a GPU, at small sizes")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check's time limit")
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    parser.add_argument("--run-step", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = [name.strip() for name in args.steps.split(",") if name.strip()]
    for name in args.steps:
        step(name)  # (raises ValueError naming the known steps)
    if args.device == "cpu":
        refused = [name for name in args.steps if not step(name).cpu]
        if refused and args.steps != [s.name for s in STEPS]:
            cpu_steps = ", ".join(s.name for s in STEPS if s.cpu)
            parser.error(f"--device cpu runs only {cpu_steps}; not {', '.join(refused)}")
        args.steps = [name for name in args.steps if step(name).cpu]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        total = sum(step(name).estimate_s for name in args.steps)
        for name in args.steps:
            s = step(name)
            print(f"{s.name:12s} ~{s.estimate_s:4d} s (limit {s.limit_s} s)  {s.title}")
        print(f"total ~{total / 60:.1f} min estimated, budget {args.budget_s / 60:.0f} min")
        return 0
    if args.run_step:
        run_one(args.run_step, args.out, args.device, args.result)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_selfcheck: no CUDA device here (--device cpu runs the CPU-capable steps)", file=sys.stderr)
        return 2
    gpu = device_name(args.device)
    print(f"gpu_selfcheck: {gpu}, torch {torch.__version__}; steps {', '.join(args.steps)}", flush=True)
    results = run_steps(args.steps, args.out, args.device, args.budget_s,
                        files=args.out / f"{gpu_slug(gpu)}-selfcheck")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "cuda": getattr(torch.version, "cuda", None), "budget_s": args.budget_s}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    json_path, md_path = write_report(results, args.out, gpu, meta)
    passed = sum(r.passed for r in results)
    print(f"gpu_selfcheck: {passed}/{len(results)} steps passed; {json_path} and {md_path}", flush=True)
    return 0 if passed == len(results) and results else 1


if __name__ == "__main__":
    sys.exit(main())
