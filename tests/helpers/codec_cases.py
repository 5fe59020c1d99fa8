"""The codecs the generic tests run on: every codec of the registry (``megatron_tah.codecs.CODECS``).

``cases()`` gives one pytest parameter per registered codec (its name as the id), built at its defaults
or with the options a test names for it, read when the tests are collected: a new codec runs through
every generic test with no edit here or there. A generic test takes the codec as its ``case`` argument;
``run_for`` calls it on another case (a codec a test registers itself) with every value of its other
parameters, as pytest would.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import pytest
import torch

from megatron_tah.codecs import CODECS, Codec, CodecDeclaration, codec_declaration, get_codec


@dataclasses.dataclass(frozen=True)
class Case:
    """A codec under test: its registered ``name`` and the ``options`` it is built with (torch backend)."""

    name: str
    options: dict = dataclasses.field(default_factory=dict)

    def make(self, **extra) -> Codec:
        return get_codec(self.name, **{"backend": "torch", **self.options, **extra})

    @property
    def declaration(self) -> CodecDeclaration:
        return codec_declaration(self.name)


def cases(options: dict[str, dict] | None = None, keep: Callable[[Case], bool] = lambda case: True,
          variants: dict[str, Case] | None = None) -> list:
    """One ``pytest.param(Case)`` per registered codec that ``keep`` accepts, built with ``options[name]`` where
    given (else its defaults), then the named ``variants`` (id -> ``Case``)."""
    registered = [Case(name, dict((options or {}).get(name, {}))) for name in CODECS]
    return ([pytest.param(case, id=case.name) for case in registered if keep(case)]
            + [pytest.param(case, id=key) for key, case in (variants or {}).items()])


def encode(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """``codec.encode(x)``, with the sample ids ``0 .. b-1`` a codec keeping per-sample state takes."""
    if codec.needs_sample_ids:
        return codec.encode(x, sample_ids=torch.arange(x.shape[1], device=x.device))
    return codec.encode(x)


def run_for(test: Callable, case: Case, **fixtures) -> int:
    """Call the generic ``test`` with ``case`` for ``case`` and every combination of its other ``parametrize``
    values (``fixtures``: its other arguments); returns the number of calls."""
    grids = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0] if isinstance(mark.args[0], (list, tuple)) else mark.args[0].split(",")
        names = [name.strip() for name in names]
        if "case" in names:
            continue
        rows = [value.values if hasattr(value, "values") and hasattr(value, "marks") else
                (value,) if len(names) == 1 else value for value in mark.args[1]]
        grids.append([dict(zip(names, row)) for row in rows])
    calls = 0
    for combination in itertools.product(*grids):
        test(case=case, **fixtures, **{k: v for values in combination for k, v in values.items()})
        calls += 1
    return calls
