"""The speedrun's numbers per codec (``build``: the setup, one row per codec, the curves and the projection), and a
page JSON's curves read back as ``build`` takes them (``losses_from_page``)."""

from __future__ import annotations

import datetime

from ..common import score
from ..common.codecs import CODECS
from . import projection, runs
from .frontier import PROJECTION_NAMES

SPLITS = (16, 32, 64, 128)  # micro-batch counts the projection compares at the setup's global batch (64: its own)


MEASURED = "measured at CPU scale"  # the projection's label of the steps this page measured


def _steps_by_seed(losses: dict, codec: str, target: float, key: str = "validations"
                   ) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """{seed: steps to target} (the shortest schedule that reached it), {seed: longest schedule run} and
    {seed: the schedule that reached it} of ``codec``'s loss runs, on the validations under ``key`` (through the
    codecs; ``validations_uncompressed``: the model on its own, the runs that validated so)."""
    reached, longest, reached_on = {}, {}, {}
    for run in sorted((r for r in losses.values() if r["codec"] == codec and key in r), key=lambda r: r["iters"]):
        seed = run["seed"]
        longest[seed] = run["iters"]
        steps = score.steps_to_target(run[key], target)
        if steps is not None and seed not in reached:
            reached[seed], reached_on[seed] = steps, run["iters"]
    return reached, longest, reached_on


def _bf16_on(losses: dict, target: float, seed: int, iters: int) -> int | None:
    """bf16's steps to target with ``seed`` on the schedule of ``iters`` steps (None: not run there, or missed)."""
    run = next((r for r in losses.values() if r["codec"] == "bf16" and r["seed"] == seed and r["iters"] == iters), None)
    return score.steps_to_target(run["validations"], target) if run else None


def _bits(losses: dict, codec: str, size: runs.Size) -> dict:
    """Bits per value each way and bytes per token (both directions, one boundary) from the base schedule's
    wire bytes (every link and micro-batch of an iteration summed)."""
    run = min((r for r in losses.values() if r["codec"] == codec), key=lambda r: (r["iters"], r["seed"]))
    fwd, bwd = run["bytes"]
    messages = (size.stages - 1) * size.micro_batches
    seq, mb, hidden = size.message_shape
    values, tokens = seq * mb * hidden, seq * mb
    return {"forward_bits": 8 * fwd / (messages * values), "backward_bits": 8 * bwd / (messages * values),
            "bytes_per_token": (fwd + bwd) / (messages * tokens)}


def _on_its_own(losses: dict, codec: str, target: float, bf16: dict[int, int | None]) -> dict | None:
    """``codec``'s steps to target evaluated uncompressed (the model on its own) against bf16's paired ones
    (``bf16``: {seed: steps}): {"steps_by_seed", "multiplier"...}; None where its runs did not validate so."""
    reached, longest, _ = _steps_by_seed(losses, codec, target, "validations_uncompressed")
    if not longest:
        return None
    seeds = sorted(longest)
    found = {"steps_by_seed": {str(s): reached.get(s) for s in seeds}, "multiplier": None,
             "missed_within": {str(s): longest[s] for s in seeds if s not in reached}}
    if len(reached) == len(seeds) and all(bf16.get(s) for s in seeds):
        ratio = score.paired_ratio(reached, {s: bf16[s] for s in seeds})
        found.update(multiplier=ratio.mean, multiplier_low=ratio.low, multiplier_high=ratio.high)
    return found


def build(size: runs.Size, target: float, compute_s: float, link: runs.Link, losses: dict, steady: dict,
          host: dict, modes: dict | None = None, date: str | None = None, compute_measured: dict | None = None) -> dict:
    """Everything the page shows: the setup, one row per codec, the curves and the projection. A codec's steps
    are paired with bf16's runs of its own kind (emulated boundaries or the real pipeline:
    ``runs.emulated_for``); bf16's row and T's bf16 steps are the page's kind's. Each curve carries where it was
    measured (``measured``: date and CPU; a run without one: ``date`` or today, on ``host``), and so does the compute
    step (``compute_measured``)."""
    date = date or datetime.date.today().isoformat()
    here = {"date": date, "cpu": host["cpu"]}
    modes = modes or {"loss_runs": "pipeline", "timing": "measured"}
    emulated = modes["loss_runs"] == "emulated"
    of_kind = {kind: {n: r for n, r in losses.items() if r.get("emulated", emulated) == kind} for kind in (False, True)}
    bf16_steps = {kind: _steps_by_seed(runs_of_kind, "bf16", target)[0] for kind, runs_of_kind in of_kind.items()}
    base_steps = bf16_steps[emulated]
    base_mean = score.mean_interval(list(base_steps.values())).mean if base_steps else None
    rows = []
    for codec in [c for c in CODECS if c in steady]:
        kind = runs.emulated_for(codec, emulated)
        same_kind = of_kind[kind]
        reached, longest, reached_on = _steps_by_seed(same_kind, codec, target)
        seeds = sorted(longest)
        chose = next((r["choices"] for r in sorted(losses.values(), key=lambda r: (r["iters"], r["seed"]))
                      if r["codec"] == codec and r.get("choices")), None)
        row = {"codec": codec, "seeds": seeds, **_bits(losses, codec, size), **({"choices": chose} if chose else {}),
               "s_per_step": steady[codec]["seconds"], "steady": steady[codec]["steady"],
               "steps_by_seed": {str(s): reached.get(s) for s in seeds},
               "schedule_by_seed": {str(s): longest[s] for s in seeds}}
        # each seed against bf16 on the schedule it reached the target on, or (missed) the longest it ran, where bf16
        # ran it (the cosine follows the schedule: a longer one alone reaches a loss in fewer steps), else on its own
        schedule = {s: reached_on.get(s, longest[s]) for s in seeds}
        same = {s: _bf16_on(same_kind, target, s, schedule[s]) for s in seeds}
        paired = {s: same[s] or bf16_steps[kind].get(s) for s in seeds}
        row["bf16_steps_by_seed"] = {str(s): paired[s] for s in seeds}
        if len(reached) == len(seeds):
            steps = score.mean_interval([reached[s] for s in seeds])
            ratio = score.paired_ratio(reached, {s: v for s, v in paired.items() if v})
            row.update(steps=steps.mean, steps_low=steps.low, steps_high=steps.high,
                       multiplier=ratio.mean, multiplier_low=ratio.low, multiplier_high=ratio.high,
                       multiplier_by_seed={str(s): reached[s] / paired[s] for s in seeds if paired[s]},
                       bf16_schedule_by_seed={str(s): schedule[s] if same[s] else size.iters for s in seeds},
                       T=ratio.mean * base_mean * row["s_per_step"] if base_mean else None)
        else:  # no multiplier: within which schedule each seed that missed missed (score.missed_bound: a lower bound)
            row.update(steps=None, multiplier=None, T=None,
                       missed_within={str(s): longest[s] for s in seeds if s not in reached})
        row["uncompressed"] = _on_its_own(same_kind, codec, target, paired)
        rows.append(row)
    base_T = next((r["T"] for r in rows if r["codec"] == "bf16"), None)
    for row in rows:
        row["T_vs_bf16"] = row["T"] / base_T if row["T"] and base_T else None
    name = lambda r: PROJECTION_NAMES.get(r["codec"], r["codec"])  # noqa: E731
    measured = {name(r): r["multiplier"] for r in rows if r["multiplier"] is not None and name(r) in projection.CODECS}
    missed = {name(r): f"{score.missed_text(r['missed_within'])} at CPU scale: not projected" for r in rows
              if r["multiplier"] is None and name(r) in projection.CODECS}
    from megatron_tah.config.auto import STEPS_AT_LEAST, STEPS_MULTIPLIER

    elsewhere = {codec: m for codec, m in STEPS_MULTIPLIER.get(size.stages, {}).items()
                 if codec in projection.CODECS and codec not in {name(r) for r in rows}}
    project = lambda m: projection.project(  # noqa: E731
        {**elsewhere, **measured}, multiplier_label=MEASURED, micro_batches=m, not_projected=missed,
        labels={n: ("at least: " if n in STEPS_AT_LEAST.get(size.stages, ()) else "") + "auto's measured.json"
                for n in elsewhere})
    own = project(projection.SETUP.micro_batches)
    curves = {name: {"codec": r["codec"], "seed": r["seed"], "iters": r["iters"], "validations": r["validations"],
                     **({"validations_uncompressed": r["validations_uncompressed"]}
                        if "validations_uncompressed" in r else {}),
                     **({"pipeline": True} if r.get("emulated") is False and emulated else {}),
                     **({"bytes": r["bytes"]} if r.get("emulated") is False else {}),  # a pipeline run's, measured
                     **({"choices": r["choices"]} if r.get("choices") else {}),
                     "measured": r.get("measured") or here}
              for name, r in losses.items()}
    return {"date": date, "host": host, "size": size.name, "modes": modes, "setup": size.setup(),
            "target": target, "compute_s_per_step": compute_s, "compute_measured": compute_measured or here,
            "link": {"rate_bps": link.rate_bps, "latency_s": link.latency_s},
            "table": rows, "curves": curves,
            "projection": own,
            "projection_splits": {str(m): [{k: r[k] for k in ("codec", "micro_batch", "s_per_step", "steps", "T")}
                                           for r in (own if m == projection.SETUP.micro_batches else project(m))]
                                  for m in SPLITS},
            "records": projection.record_rows()}


def losses_from_page(data: dict) -> dict:
    """A page JSON's curves as ``build`` takes them (``__main__.loss_results``' form): a run named ``emulated_*`` had
    emulated boundaries, whose bytes are the codec's exact message bytes; a pipeline run's bytes are its curve's."""
    size = runs.SIZES[data["size"]]
    messages = (size.stages - 1) * size.micro_batches
    losses = {}
    for name, curve in data["curves"].items():
        emulated = name.startswith("emulated_")
        nbytes = (tuple(messages * n for n in runs.message_nbytes(curve["codec"], size)) if emulated
                  else tuple(curve["bytes"]))
        losses[name] = {"codec": curve["codec"], "seed": curve["seed"], "iters": curve["iters"], "kind": "loss",
                        "emulated": emulated, "validations": [tuple(v) for v in curve["validations"]],
                        **({"validations_uncompressed": [tuple(v) for v in curve["validations_uncompressed"]]}
                           if "validations_uncompressed" in curve else {}),
                        "bytes": nbytes, **({"choices": curve["choices"]} if curve.get("choices") else {}),
                        **({"measured": curve["measured"]} if curve.get("measured") else {})}
    return losses
