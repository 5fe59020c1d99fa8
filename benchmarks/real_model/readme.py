"""The README's study sections (``write_readme``): each between ``<!-- real_model:NAME -->`` and
``<!-- /real_model:NAME -->``, written from the study's result dict alone (``report.build``'s, or the page's JSON):
the summary table, the rule with the choice per depth and use, what the study found, and where the whole-run study
stands (from its page's JSON)."""

from __future__ import annotations

import json
from pathlib import Path

from .report import _wrap, damage_text, multiplier_text, presets_by_depth, presets_text, t_text

from .scoring import MORE_DAMAGE, seeds_all_in, serving_bits

from .verdicts import GOALS, candidates, fewest_bits, meets, qualifies, rule_text, serves


WHOLE_RUN_DATA = Path("docs") / "data" / "whole_run.json"
"""The whole-run study's JSON (beside the README): its real pipeline runs' WAN-ledger bits (``wire_bits``)."""


def read_whole_run(data: Path) -> dict:
    """The whole-run page's JSON (``data``); {} without the file."""
    path = Path(data)
    return json.loads(path.read_text()) if path.is_file() else {}


def wire_bits(data: Path | dict) -> dict[str, dict[int, dict]]:
    """{codec: {depth: {"forward", "backward", "both", "shape"}}}: the bits per value the WAN ledger counted in the
    real pipeline runs with the lossless coder of a whole-run page's JSON (``data``: its path, or it read); {}
    without the file. A later stage's run of the same codec and depth replaces an earlier's."""
    found: dict[str, dict[int, dict]] = {}
    for check in (data if isinstance(data, dict) else read_whole_run(data)).get("pipeline", []):
        if check.get("ledger_bits") and "--tah-entropy-coding" in check.get("flags", []):
            found.setdefault(check["codec"], {})[int(check["depth"])] = {**check["ledger_bits"], "shape": check["shape"]}
    return found


def readme_table(result: dict, page: str = "docs/REAL_MODEL.md", wire: dict | None = None) -> str:
    """The README's summary of ``result`` at its main depth: bf16 and every ``--tah-preset`` the study measured, with
    its bits on the wire where a real pipeline run with the coder measured them at that depth (``wire``:
    ``wire_bits``; the whole-run study's page) and at the reference shape from the codec, steps vs bf16 on both
    evaluations, damage at equal steps and projected T, each linked to the page that measured it (the page has the
    other candidates; ``test_readme_claims`` compares the two)."""
    from megatron_tah.config.presets import PRESETS

    wire, depth = wire or {}, int(result["depth"])
    shapes = sorted({tuple(w[depth]["shape"]) for w in wire.values() if depth in w})
    shape = f"[{shapes[0][0]}, {shapes[0][1]}, hidden]" if len(shapes) == 1 else "the run's shape"
    lines = [f"| preset | bits fwd + bwd on the wire: WAN ledger, real {depth}-stage pipeline with the coder, {shape} "
             "| bits fwd + bwd at [1024, 8, 1024] | steps vs bf16, model served on its own | steps vs bf16, "
             "served through the pipeline | damage vs bf16 at equal steps, served on its own | projected T (s) |",
             "|---|---:|---:|---|---|---|---:|"]
    for r in (r for r in result["table"] if r["codec"] == "bf16" or r["codec"] in PRESETS):
        name = "bf16 (uncompressed)" if r["codec"] == "bf16" else f"`{r['codec']}`"
        unc, cod = ("1", "1") if r["codec"] == "bf16" else (multiplier_text(r["uncompressed"]),
                                                            multiplier_text(r["compressed"]))
        measured = wire.get(r["codec"], {}).get(depth)
        on_wire = f"[{measured['forward']:.2f} + {measured['backward']:.2f}](docs/WHOLE_RUN.md)" if measured else "–"
        lines.append(f"| [{name}]({page}) | {on_wire} | {r['forward_bits']:.2f} + {r['backward_bits']:.2f} | {unc} | "
                     f"{cod} | {damage_text(r['uncompressed'], r['codec'])} | {t_text(r['uncompressed'])} |")
    return "\n".join(lines)


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _at_depths(depths: list[str]) -> str:
    return ("depth " if len(depths) == 1 else "depths ") + _listed(depths)


def _choice_text(picks: dict[str, str | None], replaced: list[str] | None) -> str:
    """The short study's choice per depth, but at the depths ``replaced`` by the whole run's verdict, said so."""
    replaced = [d for d in picks if d in (replaced or ())]
    kept = {d: c for d, c in picks.items() if d not in replaced}
    if not replaced:
        return _by_codec(kept)
    whole = f"the whole run's at {_at_depths(sorted(replaced, key=lambda d: -int(d)))} (the table above)"
    return f"{_by_codec(kept)}, {whole}" if kept else whole


def _by_codec(picks: dict[str, str | None]) -> str:
    """``{depth: codec}`` as "`a` at depths 8 and 4, `b` at depth 2"."""
    depths: dict[str, list[str]] = {}
    for depth, codec in sorted(picks.items(), key=lambda x: -int(x[0])):
        depths.setdefault(codec or "none", []).append(depth)
    return _listed([f"`{c}` at {_at_depths(d)}" for c, d in depths.items()])


def _through_text(rows: list[dict], iters: str, detail: bool) -> str:
    """One depth's candidates on the evaluation through the pipeline: with ``detail``, which missed the target, which
    reached it with more damage than bf16's, which ran one seed; always, which reached it without."""
    rows = candidates(rows, "compressed")
    parts = []
    missed = [r for r in rows if r["compressed"]["multiplier"] is None and len(r["seeds"]) >= 2]
    if missed and detail:
        counts: dict[str, list[str]] = {}
        for r in missed:
            by_seed = r["compressed"]["steps_by_seed"]
            n = sum(v is None for v in by_seed.values())
            counts.setdefault("in every seed" if n == len(by_seed) else f"in {n} of {len(by_seed)} seeds", []).append(
                f"`{r['codec']}`")
        parts.append(_listed([f"{_listed(c)} {k}" for k, c in counts.items()]) + f" missed the target within {iters} "
                     "steps")
    worse = [r for r in rows if r["compressed"]["multiplier"] is not None and len(r["seeds"]) >= 2
             and not qualifies(r, "compressed")]
    if worse and detail:
        parts.append(_listed([f"`{r['codec']}` {r['compressed']['multiplier']:.2f}x" for r in worse])
                     + " reached it with more damage than bf16's")
    fits = [r for r in rows if qualifies(r, "compressed")]
    parts.append((_listed([f"`{r['codec']}` {multiplier_text(r['compressed'])}" for r in fits]) if fits else "none")
                 + (" without" if detail else ""))
    alone = [r for r in rows if len(r["seeds"]) < 2]
    if alone and detail:
        parts.append(_listed([f"`{r['codec']}` {multiplier_text(r['compressed'])}" for r in alone]))
    return "; ".join(parts)


def found_text(result: dict, wire: dict | None = None, replaced: list[str] | None = None) -> str:
    """The README's "What the study found", from ``result`` alone: per use, the presets' steps and damage at every
    depth (the candidates that missed or did more damage through the pipeline at the main depth only), the choice
    per depth (``presets_by_depth``, as the table above it, but at the depths ``replaced`` by the whole run's
    verdict, said so), and the page's goals at its main depth (``GOALS``)."""
    from megatron_tah.config.presets import PRESETS

    tables = {str(result["depth"]): result["table"], **result["depths"]}
    depths, main = sorted(tables, key=int, reverse=True), str(result["depth"])
    picks, iters = presets_by_depth(result), str(result["setup"]["iters"])
    presets = {d: [r for r in tables[d] if r["codec"] in PRESETS and r["codec"] != "bf16"] for d in depths}
    seeds = sorted({len(r["seeds"]) for rows in presets.values() for r in rows})
    ranges = []
    for d in depths:
        means = [r["uncompressed"]["multiplier"] for r in presets[d] if r["uncompressed"]["multiplier"] is not None]
        ranges.append((f"{min(means):.2f}x to {max(means):.2f}x" if means else "none") +
                      (" bf16's steps" if not ranges else "") + f" at depth {d}")
    missed = [f"`{r['codec']}` at depth {d}" for d in depths for r in presets[d]
              if r["uncompressed"]["multiplier"] is None]
    worse: dict[str, list[str]] = {}
    for d in depths:
        for r in presets[d]:
            if r["uncompressed"]["damage_verdict"] == MORE_DAMAGE:
                worse.setdefault(r["codec"], []).append(d)
    damage = ("none did more damage than bf16's at equal steps" + (
        " but " + _listed([f"`{c}` at {_at_depths(d)}" for c, d in worse.items()]) if worse else ""))
    own = {d: p["uncompressed"] for d, p in picks.items()}
    chosen = next((r for r in tables[main] if r["codec"] == own.get(main)), None)
    text = [f"What the study found, on this model and this short fine-tune ({seeds[0]} to {seeds[-1]} paired seeds "
            "per preset; the page has every interval): **served on its own**, the presets needed "
            + _listed(ranges) + " (means" + ("; " + _listed(missed) + " missed the target" if missed else "")
            + f"), and {damage}. The choice is {_choice_text(own, replaced)}"
            + (f"; at depth {main} `{chosen['codec']}` ({PRESETS[chosen['codec']].description}) needed "
               f"{multiplier_text(chosen['uncompressed'])} ({len(chosen['seeds'])} seeds), damage "
               f"{damage_text(chosen['uncompressed'], chosen['codec'])}" if chosen else "") + ".", ""]
    through = {d: p["compressed"] for d, p in picks.items()}
    others = [f"at depth {d} {_through_text(tables[d], iters, False)}" for d in depths if d != main]
    text.append("**Served through the pipeline** a forward codec's error is paid at every evaluation. "
                f"At depth {main}, {_through_text(tables[main], iters, True)}."
                + (" Without more damage, " + _listed(others) + "." if others else "")
                + f" The choice is {_choice_text(through, replaced)}. " + goals_summary(result, wire))
    return _wrap("\n".join(text))


def goals_summary(result: dict, wire: dict | None = None) -> str:
    """The page's goals (``GOALS``) at its main depth, a clause each: met by which candidates, or not met; a
    candidate's bits on the wire beside its computed ones where a real pipeline run measured them (``wire``)."""
    rows = [r for r in result["table"] if r["codec"] != "bf16"]
    depth, wire = int(result["depth"]), wire or {}
    parts = []

    def bits(r: dict, limit: float) -> str:
        measured = wire.get(r["codec"], {}).get(depth)
        if not measured:
            return f"{fewest_bits(r):.2f} bits"
        return (f"{fewest_bits(r):.2f} bits computed, {measured['both']:.3f} on the WAN ledger"
                + (": above it" if measured["both"] > limit else ""))

    for g in GOALS:
        goal = f"at most {g.bits:g} bits, {g.steps:.2f}x and {100 * g.damage:.1f}% damage"
        met = [r for r in rows if meets(r, g.bits, g.steps, g.damage, g.steps_high)]
        coded = " with `--tah-entropy-coding`" if any(fewest_bits(r) < r["forward_bits"] + r["backward_bits"]
                                                     for r in met) else ""
        parts.append(f"{goal}: " + ("met by " + _listed([f"`{r['codec']}` ({bits(r, g.bits)})" for r in met])
                                    + coded if met else "not met"))
        if g.serving is not None:
            serving = [r for r in met if serving_bits(r["codec"]) is not None]
            served = [r for r in serving if serves(r, g.serving)]
            parts.append(f"the same served through the pipeline in {g.serving:.2f}x: " + (
                "met by " + _listed([f"`{r['codec']}` {multiplier_text(r['compressed'])}" for r in served]) if served
                else "not met" + (" (" + _listed([f"`{r['codec']}` {multiplier_text(r['compressed'])}"
                                                  for r in serving]) + ")" if serving else "")))
    return f"The page's goals at depth {result['depth']} (served on its own): " + "; ".join(parts) + "."


def so_far_text(result: dict, whole: dict) -> str:
    """The README's word on the whole-run study (``whole``: its page's JSON) while it goes on: at its main depth,
    served on its own, each preset's end-of-run steps ratio so far, the toy's from-scratch runs, whether the
    choice above (``result``'s, from the short study) is above the plan's goal there, and the plan's rule's choice
    so far where it differs."""
    from megatron_tah.config.presets import PRESETS

    if not whole.get("tables"):
        return "The whole-run study ([docs/WHOLE_RUN.md](docs/WHOLE_RUN.md)) has no finished run yet."
    depth = str(max(int(d) for d in whole["tables"]))
    end, goal = str(max(int(p) for p in whole["points"])), whole["rule"]["goal_ratio"]
    ends = {}
    for row in whole["tables"][depth]:
        point = (row.get("uncompressed") or {}).get("points", {}).get(end)
        if row["codec"] in PRESETS and point and point.get("ratio") is not None:
            ends[row["codec"]] = (point["ratio"], len(point["by_seed"]))
    parts = [f"`{c}` {r:.2f}x ({n})" for c, (r, n) in sorted(ends.items(), key=lambda x: x[1][0])]
    toy = [f"the toy's from-scratch `{row['codec']}` missed bf16's target in {missed} of {len(row['seeds'])} seeds"
           for stage in whole.get("toy", []) for row in stage["rows"]
           if (missed := sum(v["steps"] is None for v in row["uncompressed"]["to_target"].values()))]
    chosen = presets_by_depth(result).get(depth, {}).get("uncompressed")
    verdict = ""
    if chosen in ends and ends[chosen][0] > goal:
        row = next(r for r in whole["tables"][depth] if r["codec"] == chosen)
        if seeds_all_in(row):
            damage = row["uncompressed"].get("damage_vs_bf16")
            verdict = (f" Over every planned seed the 40-step choice at depth {depth}, `{chosen}`, ends above the plan's "
                       f"goal ({goal:.2f}x)" + (f", damage {100 * damage:+.2f}%" if damage is not None else "") + ".")
        else:
            verdict = f" So far the 40-step choice at depth {depth}, `{chosen}`, ends above the plan's goal ({goal:.2f}x)."
    picked = whole.get("chosen", {}).get(depth, {}).get("uncompressed")
    if picked and picked != chosen and picked in ends and whole.get("final", {}).get(depth):
        fails = next(r for r in whole["tables"][depth] if r["codec"] == picked)["uncompressed"].get("goal_fails")
        verdict += (f" The plan's verdict there, over every planned seed: `{picked}` ({ends[picked][0]:.2f}x; "
                    + (f"short of the plan's goal: {'; '.join(fails)}" if fails else "it meets the plan's goal") + ").")
    elif picked and picked != chosen and picked in ends:
        verdict += (f" The plan's rule, over the seeds in so far, chooses `{picked}` there ({ends[picked][0]:.2f}x, "
                    f"{ends[picked][1]} seed{'s' * (ends[picked][1] != 1)}; its verdict waits for every seed).")
    return _wrap(f"**Over a whole run** ([docs/WHOLE_RUN.md](docs/WHOLE_RUN.md), {end} steps, "
                 f"{whole.get('planned_finished', 0)} of {whole.get('planned', 0)} planned runs in), served on its own "
                 f"at depth {depth}, steps vs bf16 at the end (seeds): " + ", ".join(parts)
                 + ("; " + "; ".join(toy) if toy else "") + "." + verdict)


def whole_run_verdicts(whole: dict) -> dict[str, dict[str, str | None]]:
    """{depth: {use: the whole run's choice}} at the depths where its plan's verdict is in (``whole``: its page's
    JSON; ``final``)."""
    return {d: whole["chosen"][d] for d, final in sorted(whole.get("final", {}).items(), key=lambda x: -int(x[0]))
            if final}


def presets_section(result: dict, whole: dict) -> str:
    """The README's rule and choice per depth: the short study's (``result``), but where the whole run's verdict is
    in (``whole_run_verdicts``), the whole run's choice by its own rule, said so."""
    final = whole_run_verdicts(whole)
    text = _wrap(rule_text())
    if final:
        end = max(int(p) for p in whole["points"])
        text += "\n\n" + _wrap(f"At {_at_depths(list(final))} the whole run's verdict ({end} steps, every planned "
                                "seed, by its own rule: [docs/WHOLE_RUN.md](docs/WHOLE_RUN.md)) replaces it.")
    return text + "\n\n" + presets_text(result, (2, 4, 8), flag=True, override=final)


README_SECTIONS = {"table": lambda result, whole: readme_table(result, wire=wire_bits(whole)),
                   "presets": presets_section,
                   "found": lambda result, whole: found_text(result, wire_bits(whole), list(whole_run_verdicts(whole))),
                   "whole_run": so_far_text}
"""The README's parts a study writes: each between ``<!-- real_model:NAME -->`` and ``<!-- /real_model:NAME -->``."""


def write_readme(result: dict, readme: Path, whole_run: Path | None = None) -> bool:
    """Rewrite ``readme``'s study sections (``README_SECTIONS``) from ``result`` and the whole-run study's JSON
    (``whole_run``, default ``WHOLE_RUN_DATA`` beside ``readme``: its ledger bits and where it stands); False (nothing
    written) when the file or a section's markers are missing."""
    readme = Path(readme)
    if not readme.is_file():
        return False
    text = readme.read_text()
    whole = read_whole_run(readme.parent / WHOLE_RUN_DATA if whole_run is None else whole_run)
    for name, make in README_SECTIONS.items():
        begin, end = f"<!-- real_model:{name} -->", f"<!-- /real_model:{name} -->"
        if begin not in text or end not in text:
            return False
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + make(result, whole) + "\n" + end + rest.split(end, 1)[1]
    readme.write_text(text)
    return True
