"""The default codec kernels, compiled for H100 (sm_90) and A100 (sm_80) without a GPU (scripts/kernel_report.py).

Every kernel the launchers make for the default configurations (tah G=64 4/3 with token and tile
allocation, tah G=128, fixedpoint G=32 6-bit and G=128, fp8 G=128, hadint G=64 4-bit with and without
stochastic rounding, channel 4-bit with and without, and any other registered codec with a kernel module
of its own at its defaults; bf16 [2048, 8, 8192]) must compile
with zero spill bytes, no local memory and fewer than 255 registers, and stay at or under 50 SASS
instructions per element on sm_90 (the bound for running at half of H100's copy bandwidth).
The report runs in a subprocess: it compiles for real, which the interpreter-mode test process cannot.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # kernel_report imports without side effects (main() sets the env)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Both targets' reports, compiled by two processes at once (each target is its own ptxas work)."""
    out = tmp_path_factory.mktemp("kernel_report")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs = {target: subprocess.Popen([sys.executable, str(ROOT / "scripts" / "kernel_report.py"), "--targets", target,
                                       "--json", str(out / f"sm{target}.json")], cwd=ROOT,
                                      env={**env, "TRITON_CACHE_DIR": str(out / f"cache{target}")},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for target in ("90", "80")}
    results = []
    for target, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1500)
        if proc.returncode == 3:
            pytest.skip(f"kernel report skipped: {stderr.strip()}")
        assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
        results += json.loads((out / f"sm{target}.json").read_text())["results"]
    return {"results": results}


def test_every_default_kernel_compiles_for_both_targets(report):
    import kernel_report

    results = report["results"]
    assert all(r["compiles"] for r in results), [r["error"] for r in results if not r["compiles"]]
    for target in ("sm_90", "sm_80"):
        configs = {r["config"] for r in results if r["target"] == target}
        assert configs == {label for label, _, _ in kernel_report.default_configs()}
        kernels = {r["kernel"].split()[0] for r in results if r["target"] == target}
        assert kernels >= {"tah_partials", "tah_encode", "tah_decode", "fixedpoint_encode", "fixedpoint_decode",
                           "fp8_encode", "fp8_decode", "tah_token_entropy", "tah_rank", "tah_token_tables",
                           "tah_tile_tables", "header_check", "hadint_encode", "hadint_decode", "channel_range",
                           "channel_merge", "channel_encode", "channel_decode"}
        # Each codec's kernels are named by its stem (its encode and decode among them), plus the header check.
        stems = {name for _, name, _ in kernel_report.default_configs()}
        assert {kernel for kernel in kernels if kernel.split("_")[0] not in stems} == {"header_check"}
        assert all({f"{stem}_encode", f"{stem}_decode"} <= kernels for stem in stems)


def test_no_spills_and_fewer_than_255_registers(report):
    for r in report["results"]:
        where = f"{r['kernel']} on {r['target']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, where
        assert r["local"] == 0, where
        assert 0 < r["registers"] < 255, where
        if r["per_element"]:  # elementwise kernels: straight-line code, or counted by the loop body of one iteration
            assert r["loop"] == r["loops_by_design"], where


def test_at_most_50_instructions_per_element_on_sm90(report):
    elementwise = [r for r in report["results"] if r["target"] == "sm_90" and r["per_element"]]
    assert len(elementwise) >= 20
    for r in elementwise:
        assert r["per_element"] <= 50, (r["kernel"], r["per_element"])


def test_main_path_stops_before_the_slow_path_subroutines():
    import kernel_report

    code = [(0x0, "S2R", "R0, SR_TID.X"), (0x10, "BRA", "0x40"), (0x20, "EXIT", ""), (0x30, "BRA", "0x30"),
            (0x40, "FFMA", "R1, R2, R3, R4"), (0x50, "RET", "R20 0x0")]
    ops, loop, body = kernel_report.main_path(code)
    assert ops == ["S2R", "BRA", "EXIT"] and not loop and body == []
    looping = [(0x0, "S2R", ""), (0x10, "IADD3", ""), (0x20, "NOP", ""), (0x30, "BRA", "0x10"), (0x40, "EXIT", "")]
    ops, loop, body = kernel_report.main_path(looping)
    assert loop and body == ["IADD3", "BRA"] and len(ops) == 4
