"""A study is three files (``benchmarks/README.md``, "Adding a study"): a throwaway study, written here by the recipe
into a temporary folder that joins the ``benchmarks`` package for the length of the test, runs as ``python -m
benchmarks.throwaway`` would, on the floor alone (``benchmarks.common``), and writes its page and its JSON."""

from __future__ import annotations

import ast
import json
import runpy
import sys

import pytest

import benchmarks
from benchmarks.common import runner

STUDY = '''"""``python -m benchmarks.throwaway [--out DIR] [--write PAGE]``: steps to a loss per codec against bf16's, paired
by seed (a throwaway study: tests/studies/test_new_study.py)."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from ..common import pages, score
from ..common.codecs import codec_flags
from ..common.runner import Run, execute_all, read_log

CODECS = ("bf16", "paper")
SEEDS = (1234, 1235)
TARGET = 2.0


def runs() -> list[Run]:
    return [Run(f"{codec}_s{seed}", ["--train-iters", "8", "--seed", str(seed), *codec_flags(codec)], pipeline=2,
                info={"codec": codec, "seed": seed}) for codec in CODECS for seed in SEEDS]


def build(out: Path) -> dict:
    steps: dict[str, dict[int, int | None]] = {}
    for run in runs():
        curve = [(r["iteration"], r["lm_loss"]) for r in read_log(out / f"{run.name}.jsonl")]
        steps.setdefault(run.info["codec"], {})[run.info["seed"]] = score.steps_to_target(curve, TARGET)
    ratio = {c: score.paired_ratio(steps[c], steps["bf16"]).text() for c in CODECS if c != "bf16"}
    return {"date": datetime.date.today().isoformat(), "target": TARGET, "steps": steps, "ratio": ratio}


def write_page(result: dict, page: Path) -> None:
    _, stem = pages.save_data(result, page, lambda result, png: None)
    rows = "\\n".join(f"| {c} | {', '.join(map(str, result['steps'][c].values()))} | {result['ratio'].get(c, '1')} |"
                     for c in CODECS)
    page.write_text(pages.template(__file__).format(date=result["date"], target=TARGET, stem=stem, rows=rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throwaway", description=__doc__.split("\\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/throwaway"))
    parser.add_argument("--write", type=Path)
    args = parser.parse_args(argv)
    execute_all(runs(), args.out, jobs=2)
    result = build(args.out)
    if args.write:
        write_page(result, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
'''

PAGE = """# Throwaway

Written by `python -m benchmarks.throwaway` on {date} (JSON: [data/{stem}.json](data/{stem}.json)).

| codec | steps to {target} by seed | steps vs bf16 |
|---|---|---|
{rows}
"""


def _fake_command(self, out_dir, python=sys.executable):
    """A 'training run' that logs a falling loss, slower through ``paper``: the study, not Megatron, is under test."""
    rate = 0.2 if "paper" in self.flags else 0.25
    code = ("import json\n"
            f"f = open({str(out_dir / (self.name + '.jsonl'))!r}, 'w')\n"
            f"[f.write(json.dumps({{'iteration': i, 'lm_loss': 3.0 - {rate} * i}}) + '\\n') "
            f"for i in range(1, {self.iterations() + 1})]")
    return [python, "-c", code]


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """The recipe's files for a study ``throwaway``: its entry and its page template (the third file is this test)."""
    folder = tmp_path / "studies" / "throwaway"
    folder.mkdir(parents=True)
    (folder / "__main__.py").write_text(STUDY)
    (folder / "page.md").write_text(PAGE)
    monkeypatch.setattr(benchmarks, "__path__", [*benchmarks.__path__, str(tmp_path / "studies")])
    monkeypatch.setattr(runner.Run, "command", _fake_command)
    yield folder
    for name in [m for m in sys.modules if m.startswith("benchmarks.throwaway")]:
        del sys.modules[name]


def test_a_study_in_three_files_runs_and_writes_its_page(throwaway, tmp_path, monkeypatch):
    assert sorted(p.name for p in throwaway.iterdir()) == ["__main__.py", "page.md"]
    page = tmp_path / "docs" / "THROWAWAY.md"
    monkeypatch.setattr(sys, "argv", ["throwaway", "--out", str(tmp_path / "runs"), "--write", str(page)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("benchmarks.throwaway", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0
    result = json.loads((tmp_path / "docs" / "data" / "throwaway.json").read_text())
    assert result["steps"] == {"bf16": {"1234": 4, "1235": 4}, "paper": {"1234": 5, "1235": 5}}
    assert result["ratio"] == {"paper": "1.25 [1.25, 1.25]"}
    text = page.read_text()
    assert "| paper | 5, 5 | 1.25 [1.25, 1.25] |" in text and "[data/throwaway.json](data/throwaway.json)" in text
    assert all((tmp_path / "runs" / f"{c}_s{s}.meta.json").is_file() for c in ("bf16", "paper") for s in (1234, 1235))


def test_the_study_stands_on_the_floor_alone(throwaway):
    imported = {node.module for node in ast.walk(ast.parse((throwaway / "__main__.py").read_text()))
                if isinstance(node, ast.ImportFrom) and node.level}
    assert imported and all(module.split(".")[0] == "common" for module in imported)
