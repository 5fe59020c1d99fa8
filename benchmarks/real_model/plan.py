"""A study's plan, registered before its runs: ``whole_run.toml`` beside this file is the whole-run study's.

The file (TOML) fixes the size (``runs.SIZES``), the seeds, the target and the points along the run where the
equivalent-steps ratio is read, the rule that picks presets, the budget, and the stages that run in order:

* ``kind = "emulated"``: :func:`runs.train_run` of each codec at each of ``depth`` / ``depths`` (bf16 once);
* ``kind = "pipeline"``: :func:`runs.pipeline_run`, the real pipeline, with ``flags`` and an ``exit`` step;
* ``kind = "toy"``: the toy speedrun's loss runs (``benchmarks.speedrun.runs.loss_run``, emulated boundaries) of
  ``steps`` steps, on the toy's corpus and model (``toy_size``: the full toy, or its tiny size for a tiny plan).

A stage may name its own ``seeds`` (a check run with fewer); otherwise the plan's. :func:`load` refuses a plan
whose names or numbers do not fit (an unknown size, codec or kind, a point outside the run).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from ..common.codecs import CODECS
from . import runs

KINDS = ("emulated", "pipeline", "toy")
RULE_NUMBERS = ("tie", "ratio_high", "goal_ratio", "goal_damage", "goal_bits")
"""The numbers a plan's ``[rule]`` gives (``whole_run.choose`` and ``whole_run.goal`` read them)."""
PLAN = Path(__file__).with_name("whole_run.toml")
"""The whole-run study's plan."""


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    what: str
    kind: str
    codecs: tuple[str, ...]
    seeds: tuple[int, ...]
    depths: tuple[int, ...] = ()
    exit: int | None = None
    """The pipeline check's last step (Megatron's ``--exit-interval``) on the plan's schedule."""
    flags: tuple[str, ...] = ()
    steps: int | None = None
    """The toy's run length."""
    after: str = ""
    """What must land first (text, for the page)."""
    added: str = ""
    """For a stage added after the plan's first results: when and after what (the page marks it)."""
    tag: str = ""
    """A pipeline stage's run-name suffix (``runs.pipeline_name``): the same codec, seed and depth as an earlier
    stage's, run again (under another coder)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    path: Path
    name: str
    registered: str
    size: runs.Size
    seeds: tuple[int, ...]
    target_step: int
    points: tuple[int, ...]
    rule: dict
    budget: dict
    stages: tuple[Stage, ...]
    schedule: str = ""
    machine: str = ""

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"{self.path}: no stage {name!r} (stages: {', '.join(s.name for s in self.stages)})")

    @staticmethod
    def run_names(stage: Stage) -> list[str]:
        """The names of an emulated or pipeline stage's runs, seed-major (bf16 once per seed, whatever the depth)."""
        names = []
        for seed in stage.seeds:
            for depth in stage.depths:
                for codec in stage.codecs:
                    name = runs.pipeline_name(codec, seed, depth, stage.tag) if stage.kind == "pipeline" else \
                        runs.run_name(codec, seed, depth)
                    if name not in names:
                        names.append(name)
        return names

    def toy_size(self):
        """The toy's size (``benchmarks.speedrun.runs.SIZES``) for this plan: its tiny one for a plan on the tiny
        model (the machinery's test), else the full toy."""
        from ..speedrun import runs as toy

        return toy.SIZES["tiny" if self.size.model == "tiny" else "full"]

    def toy_run_names(self, stage: Stage) -> list[str]:
        """The names of a toy stage's loss runs, seed-major."""
        from ..speedrun import runs as toy

        return [toy.loss_run_name(codec, seed, stage.steps, self.toy_size(), emulated=True)
                for seed in stage.seeds for codec in stage.codecs]

    def depth_codecs(self, kinds=("emulated",)) -> dict[int, list[str]]:
        """{depth: codecs} over the stages of ``kinds``, bf16 first at every depth (the report's plan)."""
        found: dict[int, list[str]] = {}
        for stage in self.stages:
            if stage.kind in kinds:
                for depth in stage.depths:
                    listed = found.setdefault(depth, ["bf16"])
                    listed += [c for c in stage.codecs if c not in listed]
        return found


def _fail(path: Path, text: str) -> ValueError:
    return ValueError(f"{path}: {text}")


def load(path: Path = PLAN) -> Plan:
    """The plan in ``path``; ``ValueError`` naming the file and the field that does not fit."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise _fail(path, f"not TOML: {err}") from None
    for key in ("name", "registered", "size", "seeds", "target", "rule", "stages"):
        if key not in raw:
            raise _fail(path, f"lacks {key!r}")
    if raw["size"] not in runs.SIZES:
        raise _fail(path, f"size {raw['size']!r} is none of {sorted(runs.SIZES)}")
    size = runs.SIZES[raw["size"]]
    seeds = tuple(int(s) for s in raw["seeds"])
    if not seeds or len(set(seeds)) != len(seeds):
        raise _fail(path, f"seeds {list(seeds)}: give each seed once")
    missing = sorted(set(RULE_NUMBERS) - set(raw["rule"]))
    if missing:
        raise _fail(path, f"[rule] lacks {missing}")
    target_step, points = int(raw["target"]["step"]), tuple(int(p) for p in raw["target"].get("points", ()))
    for step in (target_step, *points):
        if not size.eval_from <= step <= size.iters:
            raise _fail(path, f"step {step} lies outside the run's validations ({size.eval_from}..{size.iters})")
    if target_step != size.target_step:
        raise _fail(path, f"target step {target_step} is not size {size.name!r}'s ({size.target_step})")
    stages = []
    for entry in raw["stages"]:
        name = entry.get("name", "?")
        kind = entry.get("kind")
        if kind not in KINDS:
            raise _fail(path, f"stage {name}: kind {kind!r} is none of {KINDS}")
        codecs = tuple(entry.get("codecs", ()))
        unknown = sorted(set(codecs) - set(CODECS))
        if not codecs or unknown:
            raise _fail(path, f"stage {name}: codecs {list(codecs)} (unknown: {unknown})")
        depths = tuple(int(d) for d in entry.get("depths", [entry["depth"]] if "depth" in entry else []))
        if kind != "toy" and (not depths or any(d < 2 for d in depths)):
            raise _fail(path, f"stage {name}: give its pipeline depth(s) (>= 2)")
        if kind == "toy" and not (isinstance(entry.get("steps"), int) and entry["steps"] > 0):
            raise _fail(path, f"stage {name}: a toy stage needs its run length `steps` (a positive integer)")
        exit_step = entry.get("exit")
        if kind == "pipeline" and (exit_step is None or not size.eval_from <= int(exit_step) <= size.iters):
            raise _fail(path, f"stage {name}: a pipeline check needs `exit` within {size.eval_from}..{size.iters}")
        stages.append(Stage(name, entry.get("what", ""), kind, codecs, tuple(int(s) for s in entry.get("seeds", seeds)),
                            depths, None if exit_step is None else int(exit_step), tuple(entry.get("flags", ())),
                            entry.get("steps"), entry.get("after", ""), entry.get("added", ""), entry.get("tag", "")))
    if len({s.name for s in stages}) != len(stages):
        raise _fail(path, "two stages share a name")
    named = [n for s in stages if s.kind == "pipeline" for n in Plan.run_names(s)]
    if len(set(named)) != len(named):
        raise _fail(path, "two pipeline stages run the same codec, seed and depth under one name: give the later a "
                    "`tag`")
    return Plan(path, raw["name"], str(raw["registered"]), size, seeds, target_step, points, dict(raw["rule"]),
                dict(raw.get("budget", {})), tuple(stages), raw.get("schedule", ""), raw.get("machine", ""))


def stage_runs(plan: Plan, stage: Stage, model_dir: Path, data: dict[str, str], out: Path) -> list:
    """The runs of a stage, seed-major (every codec of a seed before the next seed); bf16 once per seed, whatever
    the depths; a toy stage's loss runs on the toy's corpus (tokenized under ``out`` once)."""
    if stage.kind == "toy":
        from ..speedrun import runs as toy

        size = plan.toy_size()
        prefix, vocab = toy.prepare_data(Path(out) / "toy_data", size)
        return [toy.loss_run(codec, seed, size, toy.data_flags(prefix, vocab), iters=stage.steps, emulated=True)
                for seed in stage.seeds for codec in stage.codecs]
    todo = []
    for seed in stage.seeds:
        for depth in stage.depths:
            for codec in stage.codecs:
                if stage.kind == "pipeline":
                    todo.append(runs.pipeline_run(codec, seed, plan.size, model_dir, data, depth, flags=stage.flags,
                                                  exit=stage.exit, tag=stage.tag))
                else:
                    todo.append(runs.train_run(codec, seed, plan.size, model_dir, data, out, depth))
    seen, unique = set(), []
    for run in todo:  # bf16 is the same run at every depth
        if run.name not in seen:
            seen.add(run.name)
            unique.append(run)
    return unique
