"""How a ``TahConfig`` field declares its valid values, whatever the field: the schema's vocabulary.

A field's ``metadata`` may hold

- ``"choices"``: its valid values, a tuple or a :class:`CodecChoices` (a codec field's, read from the codec
  registry at each use);
- ``"option"``: a codec's declared ``Option`` (``codec_option(name)``: default, help and range from the codec's
  ``DECLARATION``);
- ``"parse"``: a callable turning the field's text into the value its readers use (:class:`IntList`,
  ``units.parse_bandwidth``), raising ``ValueError`` on text it cannot read.

``check_field`` checks one value against that declaration, raising ``ValueError`` naming the field and the value;
``TahConfig.__post_init__`` runs it on every field and ``parsed`` returns what ``"parse"`` makes of a field's text.
The flags (``megatron/arguments.py``) read the same metadata. Nothing here knows a particular field.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from typing import Any

from ..codecs import CODECS, Option, codec_declaration


def forward_codecs() -> tuple[str, ...]:
    """The registered codecs, read from the registry at each call: each carries activations."""
    return tuple(CODECS)


def backward_codecs() -> tuple[str, ...]:
    """The registered codecs that carry activation gradients."""
    return tuple(name for name in CODECS if not codec_declaration(name).forward_only)


def rounding_codecs() -> tuple[str, ...]:
    """The registered codecs that round stochastically on request."""
    return tuple(name for name in CODECS if "stochastic_rounding" in codec_declaration(name).takes)


def takers(parameter: str, backward: bool = False) -> tuple[str, ...]:
    """The registered codecs of a direction (``backward``: gradients) that take direction parameter ``parameter``."""
    return tuple(name for name in (backward_codecs() if backward else forward_codecs())
                 if parameter in codec_declaration(name).takes)


class CodecChoices:
    """A codec field's valid values, ``codecs()`` then ``extra``, read from the codec registry at each use: the
    field's check, its flag's choices and its flag-table row follow the registry (a codec registered after this
    module was imported included)."""

    def __init__(self, codecs, *extra: str):
        self.codecs, self.extra = codecs, extra

    def values(self) -> tuple[str, ...]:
        return (*self.codecs(), *self.extra)

    def __iter__(self):
        return iter(self.values())

    def __len__(self) -> int:
        return len(self.values())

    def __contains__(self, value) -> bool:
        return value in self.values()

    def __repr__(self) -> str:
        return repr(self.values())


@dataclasses.dataclass(frozen=True)
class IntList:
    """A comma list of integers (``"4,5,6,8"`` -> ``(4, 5, 6, 8)``), each within ``bounds`` when given; ``what``
    says what an entry stands for and ``example`` is a valid list, both for the error message."""

    example: str
    what: str = ""
    bounds: tuple[int, int] | None = None

    def __call__(self, text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in str(text).split(","))
        except ValueError:
            values = ()
        if not values:
            raise ValueError(f"give comma-separated integers{', ' + self.what if self.what else ''}, "
                             f"e.g. {self.example}")
        if self.bounds is not None and any(not self.bounds[0] <= v <= self.bounds[1] for v in values):
            raise ValueError(f"every entry must lie in [{self.bounds[0]}, {self.bounds[1]}]")
        return values


def check_field(field: dataclasses.Field, value: Any) -> None:
    """``ValueError`` naming ``field`` and ``value`` when the value is not one its metadata declares valid."""
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{field.name} = {value!r}: choose one of {', '.join(map(str, choices))}")
    if "option" in field.metadata:
        field.metadata["option"].check(value)
    if "parse" in field.metadata and value is not None:
        try:
            field.metadata["parse"](value)
        except ValueError as err:
            raise ValueError(f"{field.name} = {value!r}: {err}") from None


def parsed(config: Any, name: str) -> Any:
    """Field ``name`` of ``config`` as its readers use it: what its declared ``parse`` makes of its text (None stays
    None; a field without ``parse``: its value)."""
    value = getattr(config, name)
    parse = next(f for f in dataclasses.fields(config) if f.name == name).metadata.get("parse")
    return value if parse is None or value is None else parse(value)


def _codec_options() -> dict[str, Option]:
    """Every codec's declared options by field name, in registry order (an ``Option`` shared by codecs once)."""
    options: dict[str, Option] = {}
    for name in CODECS:
        for option in codec_declaration(name).options:
            if options.setdefault(option.name, option) != option:
                raise ValueError(f"codec {name!r} declares {option.name} unlike another codec; share one Option")
    return options


CODEC_OPTIONS = _codec_options()


def codec_option(name: str) -> Any:
    """The ``TahConfig`` field of the codec option ``name``: its declared default, with the ``Option``
    (help, range) in the field's metadata."""
    if name not in CODEC_OPTIONS:
        raise ValueError(f"codec_option({name!r}): no codec declares it (declared: {', '.join(CODEC_OPTIONS)})")
    option = CODEC_OPTIONS[name]
    return dataclasses.field(default=option.default, metadata={"option": option})


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence: a full stop followed by a capital letter or the end ("e.g. 6"
    and "0.8" do not end one)."""
    return re.split(r"(?<=\.)\s+(?=[A-Z])", text.strip(), maxsplit=1)[0]


def field_docs(cls) -> dict[str, str]:
    """Docstrings written under the fields of dataclass ``cls`` and of its dataclass bases, read from the source as
    megatron's ArgumentGroupFactory reads them (not imported from there: this module, like the codecs, imports
    without megatron)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs
