"""What a codec declares about itself: its options and its capabilities.

Every codec file starts with one ``DECLARATION = CodecDeclaration(...)`` block. From those blocks
``megatron_tah.config`` takes ``TahConfig``'s codec fields (one line each, ``codec_option(name)``:
default, help and range come from here), their ``--tah-*`` flags and flag-table rows, checks their
values, and builds codecs (``build_kwargs``). Adding a codec therefore touches its own file (its
declaration and an unused ``codec_id``: a taken one is an error at import), one line of the registry
(``codecs/__init__.py``), the regenerated flag page and, per new option, one ``codec_option`` line in
``TahConfig`` (docs/DESIGN.md, "Adding a codec").

A codec takes two kinds of options:

- *direction parameters* (``DIRECTION_PARAMETERS``): the same knob for whichever codec a pipeline
  direction uses, set per direction by ``TahConfig`` (``tah_forward_bits`` / ``tah_backward_bits``,
  ``tah_tile_size`` / ``tah_backward_tile_size``, the two stochastic-rounding flags). A codec lists
  the ones it takes in ``takes``;
- its own ``Option``\\ s: one ``TahConfig`` field each (``tah_<...>``), passed as ``kwarg``.
  Two codecs may share an ``Option`` object (mxfp4 and nvfp4 share ``tah_fp4_hadamard``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

DIRECTION_PARAMETERS = ("bits", "tile_size", "stochastic_rounding")


@dataclasses.dataclass(frozen=True)
class Option:
    """One codec option: the ``TahConfig`` field ``name`` (flag ``--tah-...``) passed to the codec as ``kwarg``.

    ``choices`` (a tuple) or ``bounds`` (``(low, high)``, inclusive, ``math.inf`` for none) is the valid
    range; ``check`` raises ``ValueError`` naming the field and the value outside it.
    """

    name: str
    kwarg: str
    type: type
    default: Any
    help: str
    choices: tuple = ()
    bounds: tuple[float, float] | None = None

    def __post_init__(self):
        if not self.name.startswith("tah_"):
            raise ValueError(f"codec option {self.name!r}: TahConfig fields start with 'tah_'")
        if not isinstance(self.default, self.type):
            raise ValueError(f"codec option {self.name!r}: default {self.default!r} is not a {self.type.__name__}")
        self.check(self.default)

    def check(self, value: Any) -> None:
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name} = {value!r}: choose one of {', '.join(map(str, self.choices))}")
        if self.bounds is not None:
            low, high = self.bounds
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                where = f"must be >= {low:g}" if high == math.inf else f"must lie in [{low:g}, {high:g}]"
                raise ValueError(f"{self.name} = {value!r}: {where}")

    def values(self) -> str:
        """The valid range as the README shows it (``token, tile``; ``[0, 1]``; ``>= 0``; empty: any)."""
        if self.choices:
            return ", ".join(map(str, self.choices))
        if self.bounds is None:
            return ""
        low, high = self.bounds
        return f">= {low:g}" if high == math.inf else f"{low:g} to {high:g}"


@dataclasses.dataclass(frozen=True)
class CodecDeclaration:
    """A codec's options and capabilities.

    ``takes``: the direction parameters its constructor accepts (a subset of ``DIRECTION_PARAMETERS``);
    ``forward_only``: it cannot carry activation gradients; ``needs_sample_ids``: ``encode`` takes the
    micro-batch's sample ids (per-sample state); ``kernel``: it has a Triton path (``backend="triton"``).
    """

    options: tuple[Option, ...] = ()
    takes: tuple[str, ...] = ()
    forward_only: bool = False
    needs_sample_ids: bool = False
    kernel: bool = False

    def __post_init__(self):
        unknown = set(self.takes) - set(DIRECTION_PARAMETERS)
        if unknown:
            raise ValueError(f"takes {sorted(unknown)}: direction parameters are {DIRECTION_PARAMETERS}")

    def build_kwargs(self, config: Any, direction: dict[str, Any]) -> dict[str, Any]:
        """The codec's constructor keywords: the direction parameters it takes, then its options read from ``config``."""
        kwargs = {name: direction[name] for name in self.takes}
        kwargs.update({option.kwarg: getattr(config, option.name) for option in self.options})
        return kwargs
