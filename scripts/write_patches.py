#!/usr/bin/env python3
"""Write docs/PATCHES.md: every function or attribute of megatron-core, Megatron-LM (and torch) megatron_tah replaces.

    python scripts/write_patches.py            # rewrite docs/PATCHES.md
    python scripts/write_patches.py --check    # exit 1 (and say so) when docs/PATCHES.md is not what it would write

What is replaced comes from the installers themselves (``installed_entries``): in this process the CPU shims, the
Megatron-LM plugin (flags, log, its hooks) and ``megatron_tah.install`` with every place on are installed, each
``Patches`` lists what it replaced with the line its call gave (``why=``), and everything is restored afterwards.
What is replaced only while a run goes on -- during one call, or in a mode such as several ranks per GPU -- is read
from the source (``patch_calls``): each ``wrap`` / ``replace`` call of ``megatron_tah/megatron/`` whose line the
installers did not show. ``tests/megatron/test_patching.py`` checks that the committed page is this output and that
every such call gives its line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import re
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "PATCHES.md"
PATCH_LAYER = REPO / "megatron_tah" / "megatron"
RECEIVER = re.compile(r"(^|\.)patches$|^during$")  # the Patches objects the patch layer calls
ALL_PLACES = {"tah_preset": "paper", "tah_tp_codec": "fp8", "tah_dp_codec": "int8", "tah_embedding_codec": "int8",
              "tah_activation_memory": "laaq"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One ``wrap`` / ``replace`` call in the patch layer's source: where, what it names, how and why."""

    path: str
    line: int
    target: str
    how: str
    why: str | None


def _text(node: ast.expr, constants: dict[str, str]) -> str | None:
    """A string literal or a module constant's value; None for anything else (a variable)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    return None


def patch_calls() -> list[Call]:
    """Every ``<patches>.wrap(owner, attribute, ...)`` / ``.replace(...)`` call of the patch layer: ``why`` its
    line, empty when the call gives none, None when a variable gives it (a loop over a table: the installers show
    those)."""
    calls = []
    for path in sorted(PATCH_LAYER.glob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                     for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):  # a local ``module = resolve(CONSTANT)`` names the constant's module
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and ast.unparse(node.value.func)
                    == "resolve" and node.value.args and isinstance(node.value.args[0], ast.Name)):
                constants.update({t.id: constants.get(node.value.args[0].id, t.id) for t in node.targets
                                  if isinstance(t, ast.Name)})
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("wrap", "replace") and RECEIVER.search(ast.unparse(node.func.value))):
                continue
            why = next((_text(k.value, constants) for k in node.keywords if k.arg == "why"), "")
            owner, attribute = (_text(arg, constants) or ast.unparse(arg) for arg in node.args[:2])
            calls.append(Call(str(path.relative_to(REPO)), node.lineno, f"{owner.replace(':', '.')}.{attribute}",
                              "wraps" if node.func.attr == "wrap" else "replaces", why))
    return calls


def installed_entries() -> dict[str, list]:
    """``{when: [Entry, ...]}`` of everything the installers replace, installed here and restored before returning."""
    import megatron_tah
    from megatron_tah.config import TahConfig
    from megatron_tah.megatron import cpu_shims, plugin
    from megatron_tah.megatron.arguments import flag_name
    from megatron_tah.megatron.places import PLACES
    from megatron_tah.megatron.registry import REGISTRY

    shims = cpu_shims.apply_cpu_shims(force=True, bf16_products=True)  # listed whatever this CPU has
    try:
        plugin.install_megatron_lm_plugin()
        megatron_tah.install(TahConfig(**ALL_PLACES))
        found = {"With the plugin (every run through Megatron-LM's loop)":
                 REGISTRY.arguments.entries() + REGISTRY.logging.entries() + REGISTRY.plugin.entries(),
                 "On a CPU (no CUDA device): the CPU shims": REGISTRY.cpu_shims.entries()}
        for name, place in REGISTRY.places.items():
            option = PLACES[name].option
            when = f"With `{flag_name(option)}` on" if option else "With `megatron_tah.install` (always)"
            found.setdefault(f"{when}: the {name} place", []).extend(place.patches.entries())
        return found
    finally:
        plugin.uninstall_megatron_lm_plugin()
        megatron_tah.uninstall()
        if shims:
            cpu_shims.remove_cpu_shims()


def _file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _targets(targets: list[str]) -> str:
    """``a.b.f`` cells: one target as it is; several of one attribute as ``attr`` in each owner."""
    attributes = {t.rpartition(".")[2] for t in targets}
    if len(targets) > 2 and len(attributes) == 1:
        return f"`{attributes.pop()}` of " + ", ".join(f"`{t.rpartition('.')[0]}`" for t in targets)
    return ", ".join(f"`{t}`" for t in targets)


def _rows(entries) -> list[str]:
    """One row per (how, why, module), its targets together, in the order first seen."""
    grouped: dict[tuple, list[str]] = {}
    for entry in entries:
        grouped.setdefault((entry.how, entry.why, entry.by), []).append(entry.target)
    return [f"| {_targets(targets)} | {how} | {why} | `{_file(by)}` |" for (how, why, by), targets in grouped.items()]


HEADER = "| what | how | why | in |\n|---|---|---|---|"


def page() -> str:
    """The whole of docs/PATCHES.md."""
    from megatron_tah.megatron.version import CHECKED, HOOKS, TRANSPORTS

    found = installed_entries()
    megatron = {when: [e for e in entries if e.target.startswith("megatron.")] for when, entries in found.items()}
    outside = [e for entries in found.values() for e in entries if not e.target.startswith("megatron.")]
    seen = {e.why for entries in found.values() for e in entries}
    later = [c for c in patch_calls() if c.why is not None and c.why not in seen]
    intro = ("Every replacement is an attribute set on a megatron-core or Megatron-LM module or class, where it is "
             "looked up at call time; each installer restores exactly what it replaced (`Patches.restore`), and "
             "nothing is replaced before the plugin or `megatron_tah.install` runs. Checked against "
             f"{CHECKED}; `install()` first checks the contract it relies on in the megatron-core at hand "
             "(`megatron_tah/megatron/version.py`: the keyword signatures of "
             f"{' and '.join(f'`{n}`' for n in TRANSPORTS)}, "
             f"the plugin's hooks {', '.join(f'`{n}`' for n in HOOKS)}).")
    out = ["# What megatron_tah changes in Megatron", "",
           "Generated by `python scripts/write_patches.py` from the installers themselves (each `Patches` of",
           "`megatron_tah/megatron/patching.py` lists what it replaced and why); do not edit by hand.", "",
           *textwrap.wrap(intro, 116, break_on_hyphens=False), ""]
    for when, entries in megatron.items():
        out += [f"## {when}", "", HEADER, *_rows(entries), ""]
    out += ["## While a run goes on", "",
            "Replaced during one call, or when a mode turns on, and restored after it (as the source names the "
            "target):", "", HEADER]
    out += [f"| `{c.target}` | {c.how} | {c.why} | `{c.path}` |" for c in later]
    out += ["", "## Outside Megatron", "", "The same installers replace these attributes and kernels of torch itself:", "",
            HEADER, *_rows(outside), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/PATCHES.md instead of writing it")
    check, text = parser.parse_args(argv).check, page()
    stale = not PAGE.is_file() or PAGE.read_text() != text
    if check and stale:
        print(f"{PAGE.relative_to(REPO)} differs from the installers: run python scripts/write_patches.py",
              file=sys.stderr)
    elif not check:
        PAGE.write_text(text)
        print(PAGE.relative_to(REPO))
    return int(check and stale)


if __name__ == "__main__":
    raise SystemExit(main())
