"""The README's measured numbers come from files committed under docs/ (what a script in the repo wrote)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"


def _committed_results() -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted(DOCS.rglob("*"))
                     if path.suffix in (".md", ".txt", ".json"))


def test_every_percentage_and_ratio_in_the_readme_is_in_a_committed_result():
    """A figure such as ``+1.64%`` or ``1.33x`` must appear in some file under docs/ (the same text, a
    leading ``+`` aside). It checks presence, not context: the check finds a number with no source."""
    results = _committed_results()
    figures = set(re.findall(r"[+-]?\d+\.\d+(?:%|x)", README))
    assert len(figures) > 50  # the README's tables and summaries are read
    unbacked = sorted(f for f in figures if f not in results and f.lstrip("+") not in results)
    assert unbacked == [], f"README figures found in no file under docs/: {unbacked}"


def _table_rows(text: str, first_cell: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else line.split()
        if line.startswith("|") and cells and cells[0] != first_cell and not cells[0].startswith("---"):
            rows[cells[0]] = cells[1:]
    return rows


def test_the_codec_table_is_the_committed_codec_report():
    """README's codec table: bits, ratios and relative error of each row as docs/data/codec_report.txt printed them."""
    report = (DOCS / "data" / "codec_report.txt").read_text()
    table = README[README.index("| codec | bits/element |"):]
    table = table[:table.index("\n\n")]
    readme_rows = _table_rows(table, "codec")
    assert len(readme_rows) == 17
    for label, cells in readme_rows.items():
        name = label.rstrip(" ¹²").strip()
        line = next((row for row in report.splitlines() if row.startswith(name + "  ")), None)
        assert line is not None, f"{name} is not in docs/data/codec_report.txt"
        printed = line[len(name):].split()[:4]
        assert cells == printed, (name, cells, printed)


def test_kernel_table_is_the_committed_kernel_report():
    """Registers and instructions per element of README's kernel table are in the committed sm_90 report."""
    import json

    report = json.loads((DOCS / "benchmarks" / "kernel-report-sm90-triton3.8.json").read_text())
    assert report["triton"].startswith("3.8")
    registers = {r["registers"] for r in report["results"] if r["target"] == "sm_90"}
    per_element = {f"{r['per_element']:.1f}" for r in report["results"] if r["target"] == "sm_90"}
    table = README[README.index("| kernel | registers |"):]
    table = table[:table.index("\n\n")]
    rows = _table_rows(table, "kernel")
    assert len(rows) == 7
    for kernel, (regs, spills, instructions) in rows.items():
        assert {int(v) for v in re.findall(r"\d+", regs)} <= registers, kernel
        assert spills == "0"
        assert set(re.findall(r"\d+\.\d", instructions)) <= per_element, kernel


def test_make_reproduce_needs_a_part():
    """README states the behaviour of a bare `make reproduce`; the script does it (usage, exit status 2)."""
    import subprocess

    assert "without one, `make reproduce` prints the parts with their durations and exits (status 2)" in README
    result = subprocess.run(["bash", str(REPO / "scripts" / "reproduce.sh")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "about 10 hours" in result.stderr and "parity-report" in result.stderr and "~10 h" in result.stderr
