#!/usr/bin/env python
"""Compile the codec kernels for H100 (sm_90) and A100 (sm_80) without a GPU; report what ptxas made of them.

The codecs are run on ``meta`` tensors inside ``megatron_tah.kernels.common.recording()``: every launch
the launchers would make (kernel, grid, arguments, constexprs) is recorded instead of run, then
compiled by Triton for each target through ``JITFunction.warmup`` with a stand-in driver, using the
``ptxas`` shipped in the Triton wheel. Meta tensors hold no data, so a host sync anywhere on the
encode/decode path (``.item()``, ``.tolist()``) fails the run.

Per kernel variant it reports registers, spill bytes, local memory, shared memory and the SASS
instructions of the main path (from the entry to the last ``EXIT``; the slow-path subroutines of
IEEE division after it are not counted) per element the program handles. The kernels are loop-free,
so that is what every element costs; a variant with a backward branch is flagged ``loop``. A kernel that
loops over its elements by design (``channel_range``: a channel block's rows) is counted by its loop body
per element of one iteration (prologue and epilogue are spread over all its iterations). The small
per-unit steps between them (tah's bit allocation, the header check) have no per-element count. An H100
issues about 29.6e12 thread-instructions per second, so ``bound`` = 29.6e12 / (instructions per
element) * (bytes moved per element) is the most a kernel could move: a static bound, not a timing.

    python scripts/kernel_report.py                          # default configs, sm_90 and sm_80
    python scripts/kernel_report.py --configs all --json runs/kernel_report.json
    python scripts/kernel_report.py --only tah --targets 90 --sass-dir runs/sass

Exit status 3 (and a message) when ptxas is not available.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

ISSUE_RATE = 29.6e12  # H100 SXM: 132 SMs x 4 schedulers x 32 lanes x ~1.755 GHz
SKIP_EXIT = 3
DEFAULT_SHAPE = (2048, 8, 8192)

# (label, codec name, options): the configurations the CI test asserts on (``default_configs``: with every other
# registered codec that has a kernel module of its own, at its defaults).
DEFAULT_CONFIGS = [
    ("tah G64 4/3 token", "tah", {"tile_size": 64, "high_bits": 4, "low_bits": 3, "allocation": "token"}),
    ("tah G64 4/3 tile", "tah", {"tile_size": 64, "high_bits": 4, "low_bits": 3, "allocation": "tile"}),
    ("tah G128 4/3 token", "tah", {"tile_size": 128, "high_bits": 4, "low_bits": 3, "allocation": "token"}),
    ("fixedpoint G32 6b", "fixedpoint", {"tile_size": 32, "bits": 6}),
    ("fixedpoint G128 4b", "fixedpoint", {"tile_size": 128, "bits": 4}),
    ("fixedpoint G128 6b", "fixedpoint", {"tile_size": 128, "bits": 6}),
    ("fp8 G128", "fp8", {"group_size": 128}),
    ("hadint G64 4b", "hadint", {"tile_size": 64, "bits": 4}),
    ("hadint G64 4b SR", "hadint", {"tile_size": 64, "bits": 4, "stochastic_rounding": True}),
    ("channel 4b", "channel", {"bits": 4}),
    ("channel 4b SR", "channel", {"bits": 4, "stochastic_rounding": True}),
]


# The codecs of docs/PERFORMANCE.md (scripts/performance_model.py).
MODEL_CONFIGS = [
    ("tah G64 4/3 token", "tah", {"tile_size": 64, "high_bits": 4, "low_bits": 3, "allocation": "token"}),
    ("fixedpoint G32 6b", "fixedpoint", {"tile_size": 32, "bits": 6}),
    ("fixedpoint G64 4b", "fixedpoint", {"tile_size": 64, "bits": 4}),
    ("fp8 G128", "fp8", {"group_size": 128}),
]


def with_every_kernel_codec(configs: list[tuple[str, str, dict]]) -> list[tuple[str, str, dict]]:
    """``configs``, then each registered codec with a kernel module of its own (``kernels/<name>.py``) that they
    leave out, at its defaults: a codec's kernels are compiled and checked once it is in the registry."""
    import megatron_tah
    from megatron_tah.codecs import CODECS

    kernels = pathlib.Path(megatron_tah.__file__).parent / "kernels"
    named = {name for _, name, _ in configs}
    return configs + [(name, name, {}) for name in CODECS if name not in named and (kernels / f"{name}.py").is_file()]


def default_configs() -> list[tuple[str, str, dict]]:
    return with_every_kernel_codec(DEFAULT_CONFIGS)


def all_configs() -> list[tuple[str, str, dict]]:
    """Every kernel variant the launchers produce for bf16 pipeline tensors, give or take the dtype."""
    configs = []
    for g in (8, 16, 32, 64, 128):
        for bits in range(2, 9):
            for sr in (False, True):
                configs.append((f"fixedpoint G{g} {bits}b{' SR' if sr else ''}", "fixedpoint",
                                {"tile_size": g, "bits": bits, "stochastic_rounding": sr}))
        configs.append((f"fp8 G{g}", "fp8", {"group_size": g}))
        for bits in range(3, 9):
            for sr in (False, True):
                configs.append((f"hadint G{g} {bits}b{' SR' if sr else ''}", "hadint",
                                {"tile_size": g, "bits": bits, "stochastic_rounding": sr}))
        for hb, lb in ((4, 3), (8, 6), (5, 2)):
            for alloc in ("token", "tile"):
                for sr in (False, True):
                    for tau in (2.0, 0.0, float("inf")):
                        configs.append((f"tah G{g} {hb}/{lb} {alloc}{' SR' if sr else ''} tau={tau}", "tah",
                                        {"tile_size": g, "high_bits": hb, "low_bits": lb, "allocation": alloc,
                                         "stochastic_rounding": sr, "outlier_threshold": tau}))
    for bits in range(2, 9):
        for sr in (False, True):
            configs.append((f"channel {bits}b{' SR' if sr else ''}", "channel",
                            {"bits": bits, "stochastic_rounding": sr}))
    return with_every_kernel_codec(configs)


def ptxas_path() -> str | None:
    """The ptxas Triton compiles with, or None."""
    try:
        import triton
    except ImportError:
        return None
    try:
        from triton import knobs

        return knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - older Triton, or no ptxas: look in the wheel
        path = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        return str(path) if path.exists() else None


def cuobjdump_path() -> str:
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


class StandInDriver:
    """What ``JITFunction.warmup`` asks of a driver, for a GPU that is not there."""

    def __init__(self):
        self.capability = 90

    def get_current_device(self):
        return self.capability  # one "device" per target keeps Triton's per-device caches apart

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.capability, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def capture(configs, capability: int, shape, dtype) -> list[tuple[str, float, object]]:
    """(config label, bytes per element, launch) for every launch an encode and a decode make."""
    from megatron_tah.codecs import get_codec
    from megatron_tah.kernels import common

    rows = []
    x = torch.empty(shape, dtype=dtype, device="meta")
    for label, name, options in configs:
        codec = get_codec(name, backend="triton", **options).defer_checks("deferred")
        moved = (dtype.itemsize * x.numel() + codec.wire_nbytes(shape, dtype)) / x.numel()
        with common.recording(capability) as launches:
            buf = codec.encode(x)
            codec.decode(buf, shape, dtype)
        rows += [(label, moved, launch) for launch in launches]
    return rows


OPCODE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)\s*([^;]*);")


def sass_instructions(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump_path(), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    out = []
    for line in text.splitlines():
        m = OPCODE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2), m.group(4)))
    return out


def main_path(instructions) -> tuple[list[str], bool, list[str]]:
    """Opcodes from the entry to the last EXIT before the first subroutine return (NOPs dropped), whether
    a backward branch (a loop) lies on that path, and the opcodes of the widest loop's body (from the
    branch's target to the branch; empty without a loop)."""
    end = len(instructions)
    for i, (_, op, _) in enumerate(instructions):
        if op == "RET":
            end = i
            break
    last_exit = max((i for i in range(end) if instructions[i][1] == "EXIT"), default=end - 1)
    path = instructions[: last_exit + 1]
    body: list[str] = []
    for address, op, operands in path:
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            loop_ops = [o for a, o, _ in path if start <= a <= address and o != "NOP"]
            body = max(body, loop_ops, key=len)
    return [op for _, op, _ in path if op != "NOP"], bool(body), body


def resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    keys = ("registers", "stack", "static_shared", "local")
    return dict(zip(keys, map(int, m.groups()))) if m else {}


@dataclasses.dataclass
class Result:
    config: str
    kernel: str
    target: str
    compiles: bool
    error: str = ""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    local: int = 0
    shared: int = 0
    main_instructions: int = 0
    per_element: float = 0.0
    bytes_per_element: float = 0.0
    bound_tbps: float = 0.0
    loop: bool = False
    loops_by_design: bool = False  # the launcher says the kernel loops over its elements (counted by its loop body)
    loop_instructions: int = 0
    top: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def compile_one(config: str, moved: float, launch, driver, capability: int, sass_dir=None) -> Result:
    from triton import knobs

    result = Result(config, launch.label, f"sm_{capability}", False, bytes_per_element=round(moved, 3))
    driver.capability = capability
    started = time.time()
    log = io.StringIO()
    try:
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    except Exception as err:  # noqa: BLE001 - reported, not raised: one bad variant should not hide the others
        result.error = f"{type(err).__name__}: {err}"[-2000:]
        result.seconds = round(time.time() - started, 1)
        return result
    result.compiles = True
    text = log.getvalue()
    for field, pattern in (("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads")):
        found = re.findall(pattern, text)
        setattr(result, field, int(found[-1]) if found else 0)
    cubin = compiled.asm["cubin"]
    usage = resource_usage(cubin)
    result.registers = usage.get("registers", 0)
    result.local = usage.get("local", 0)
    result.shared = int(getattr(compiled.metadata, "shared", 0))
    ops, result.loop, body = main_path(sass_instructions(cubin))
    threads = 32 * launch.kwargs.get("num_warps", 4)
    result.main_instructions = len(ops)
    result.loop_instructions = len(body)
    result.loops_by_design = bool(getattr(launch, "loops", False))
    if launch.elements:  # an elementwise kernel (the others: small per-unit steps, e.g. tah's bit allocation)
        counted = body if result.loops_by_design and body else ops  # a looping kernel: one iteration's elements
        result.per_element = round(len(counted) * threads / launch.elements, 2)
        result.bound_tbps = round(ISSUE_RATE / result.per_element * moved / 1e12, 2)
    result.top = dict(collections.Counter(ops).most_common(10))
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{launch.label}_sm{capability}")
        (sass_dir / f"{name}.ptx").write_text(compiled.asm["ptx"])
        (sass_dir / f"{name}.ttgir").write_text(compiled.asm["ttgir"])
    result.seconds = round(time.time() - started, 1)
    return result


def format_table(results: list[Result]) -> str:
    header = (f"{'kernel':44} {'target':6} {'regs':>4} {'spill B':>8} {'local':>5} {'smem':>6} "
              f"{'instr':>6} {'instr/el':>8} {'B/el':>5} {'bound TB/s':>10}  notes")
    lines = [header, "-" * len(header)]
    for r in results:
        if not r.compiles:
            lines.append(f"{r.kernel:44} {r.target:6} FAILED: {r.error.splitlines()[0][:120]}")
            continue
        notes = " ".join(n for n, on in (("loop", r.loop and not r.loops_by_design),
                                         (f"loop body {r.loop_instructions}", r.loops_by_design),
                                         ("per-unit step", not r.per_element)) if on)
        per_element = f"{r.per_element:8.1f}" if r.per_element else f"{'-':>8}"
        bound = f"{r.bound_tbps:10.2f}" if r.per_element else f"{'-':>10}"
        lines.append(f"{r.kernel:44} {r.target:6} {r.registers:4d} {r.spill_stores + r.spill_loads:8d} {r.local:5d} "
                     f"{r.shared:6d} {r.main_instructions:6d} {per_element} {r.bytes_per_element:5.2f} "
                     f"{bound}  {notes}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="90,80", help="compute capabilities, comma separated (default 90,80)")
    parser.add_argument("--configs", choices=["default", "model", "all"], default="default",
                        help="default: what the CI test checks; model: docs/PERFORMANCE.md's; all: every variant")
    parser.add_argument("--only", default="", help="keep configurations whose label contains this text")
    parser.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)), help="s,b,h of the bf16 tensor")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--json", type=pathlib.Path, help="write every result as JSON here")
    parser.add_argument("--sass-dir", type=pathlib.Path, help="write each variant's PTX and TTGIR here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("kernel_report: triton was imported with TRITON_INTERPRET=1; run the script on its own")
    os.environ.pop("TRITON_INTERPRET", None)  # compile for real: before triton is imported
    os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")  # a cached kernel prints no ptxas log
    args = parse_args(argv)
    ptxas = ptxas_path()
    if ptxas is None or not os.path.exists(ptxas):
        print("kernel_report: skipped, no ptxas (install triton with its bundled CUDA tools)", file=sys.stderr)
        return SKIP_EXIT
    import triton
    from triton.runtime.driver import driver as triton_driver

    configs = {"default": default_configs, "model": lambda: MODEL_CONFIGS}.get(args.configs, all_configs)()
    configs = [c for c in configs if args.only in c[0]]
    shape = tuple(int(d) for d in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    stand_in = StandInDriver()
    triton_driver.set_active(stand_in)
    results = []
    try:
        for capability in (int(t) for t in args.targets.split(",")):
            seen = set()
            for config, moved, launch in capture(configs, capability, shape, dtype):
                key = (launch.label, repr(sorted(launch.kwargs.items())))
                if key in seen:
                    continue
                seen.add(key)
                results.append(compile_one(config, moved, launch, stand_in, capability, args.sass_dir))
                print(format_table(results[-1:]).splitlines()[-1], flush=True)
    finally:
        with contextlib.suppress(RuntimeError):  # no GPU driver here: nothing to go back to
            triton_driver.reset_active()
    print(f"\ntriton {triton.__version__}, ptxas {ptxas}, shape {list(shape)} {args.dtype}")
    print(format_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"triton": triton.__version__, "shape": list(shape), "dtype": args.dtype,
                                         "issue_rate": ISSUE_RATE,
                                         "results": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n")
    return 0 if all(r.compiles for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
