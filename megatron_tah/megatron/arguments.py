"""The ``--tah-*`` command-line flags, generated from :class:`megatron_tah.config.TahConfig`.

``add_tah_arguments(parser)`` adds one flag per ``TahConfig`` field: ``tah_tile_size`` becomes
``--tah-tile-size``, the type comes from the field's default (or its annotation when the default
is ``None``), the help text from the docstring under the field, and bools become on/off flags.
Codec names and the allocation unit are argparse ``choices``, so a typo is an argparse error.
Cross-field checks (bit widths, tile sizes) are ``TahConfig``'s: ``tah_config_from_args(args)``
runs them and names the offending flag.

``install_arguments()`` wraps ``megatron.training.arguments.add_megatron_arguments`` (looked up by
name inside ``parse_args``) so that every Megatron-LM parser also has the tah flags, and wraps
``validate_args`` so bad tah values (and a ``--tah-log-json`` that cannot be written) fail while
arguments are validated. ``uninstall_arguments()`` puts both originals back.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
from typing import Any

from ..codecs import CODECS
from ..codecs.base import BACKENDS
from ..codecs.tah import ALLOCATIONS, LOW_BITS_FOR
from ..config import TahConfig
from .logging import check_log_json
from .patching import is_ours
from .registry import REGISTRY

GROUP_TITLE = "megatron_tah (compressed pipeline communication)"
_CHOICES = {
    "tah_forward_codec": tuple(CODECS),
    "tah_backward_codec": tuple(name for name in CODECS if name != "aqsgd"),
    "tah_allocation": ALLOCATIONS,
    "tah_low_bits_for": LOW_BITS_FOR,
    "tah_backend": tuple(BACKENDS),
}
_TYPES = {"int": int, "float": float, "str": str}


def flag_name(field_name: str) -> str:
    """``tah_tile_size`` -> ``--tah-tile-size``."""
    return "--" + field_name.replace("_", "-")


def _field_type(field: dataclasses.Field) -> type:
    """The argparse type of a field: from its default, else the first of int/float/str in its annotation."""
    if field.default is not None and not isinstance(field.default, bool):
        return type(field.default)
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    for name in re.findall(r"[A-Za-z_]+", annotation):
        if name in _TYPES:
            return _TYPES[name]
    raise RuntimeError(f"TahConfig field {field.name}: cannot derive a flag type from annotation {annotation!r}")


def flags_markdown() -> str:
    """The README's flag table (``| flag | default | meaning |``), generated from ``TahConfig``."""
    docs = TahConfig.field_docs()
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(TahConfig):
        default = field.default
        shown = ("on" if default else "off") if isinstance(default, bool) else "off" if default is None else default
        rows.append(f"| `{flag_name(field.name)}` | {shown} | {docs.get(field.name, '')} |")
    return "\n".join(rows)


def has_tah_arguments(parser: argparse.ArgumentParser) -> bool:
    return flag_name(dataclasses.fields(TahConfig)[0].name) in parser._option_string_actions


def add_tah_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``--tah-*`` flag to ``parser`` (once: a parser that has them is returned unchanged)."""
    if has_tah_arguments(parser):
        return parser
    docs = TahConfig.field_docs()
    group = parser.add_argument_group(title=GROUP_TITLE)
    for field in dataclasses.fields(TahConfig):
        flag, help_text = flag_name(field.name), docs.get(field.name, "").replace("%", "%%")
        if isinstance(field.default, bool):
            if field.default:
                group.add_argument("--no-" + flag[2:], dest=field.name, action="store_false", help=help_text)
            else:
                group.add_argument(flag, dest=field.name, action="store_true", help=help_text)
            continue
        kwargs = {"dest": field.name, "type": _field_type(field), "default": field.default, "help": help_text}
        choices = field.metadata.get("choices") or _CHOICES.get(field.name)
        if choices:
            kwargs["choices"] = choices
        elif field.default is not None:
            kwargs["help"] = f"{help_text} Default: {field.default}."
        group.add_argument(flag, **kwargs)
    return parser


def _flags_in_message(message: str) -> str:
    """Name flags instead of fields in TahConfig's messages (``tah_high_bits`` -> ``--tah-high-bits``)."""
    fields = sorted((f.name for f in dataclasses.fields(TahConfig)), key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(fields) + r")\b", lambda m: flag_name(m.group(1)), message)


def tah_config_from_args(args: Any) -> TahConfig:
    """``TahConfig.from_args(args)``; a bad value raises ``ValueError`` naming its ``--tah-*`` flag."""
    try:
        return TahConfig.from_args(args)
    except ValueError as err:
        given = " ".join(
            f"{flag_name(f.name)} {getattr(args, f.name)}"
            for f in dataclasses.fields(TahConfig)
            if hasattr(args, f.name) and getattr(args, f.name) != f.default
        )
        raise ValueError(f"invalid megatron_tah flags ({given or 'defaults'}): {_flags_in_message(str(err))}") from err


# --- wrapping megatron.training.arguments ---------------------------------------------------------


def _megatron_arguments_module():
    try:
        return importlib.import_module("megatron.training.arguments")
    except ImportError as err:
        raise RuntimeError(
            "megatron_tah's Megatron-LM plugin needs megatron.training.arguments "
            f"(megatron-core >= 0.17 ships it): {err}"
        ) from err


def _adding_tah_arguments(original):
    def add_megatron_arguments(parser):
        return add_tah_arguments(original(parser))

    return add_megatron_arguments


def _validating_tah_arguments(original):
    def validate_args(args, *rest, **kwargs):
        if hasattr(args, dataclasses.fields(TahConfig)[0].name):
            try:  # before Megatron's own checks: nothing is built yet, and the message is one line
                tah_config_from_args(args)
                check_log_json(getattr(args, "tah_log_json", None))
            except ValueError as err:
                print(f"error: {err}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
        return original(args, *rest, **kwargs)

    return validate_args



def install_arguments() -> None:
    """Make Megatron-LM's parser carry the ``--tah-*`` flags and validate them (idempotent)."""
    patches = REGISTRY.arguments
    if patches:
        return
    module = _megatron_arguments_module()
    patches.wrap(module, "add_megatron_arguments", _adding_tah_arguments)
    patches.wrap(module, "validate_args", _validating_tah_arguments)


def uninstall_arguments() -> None:
    """Restore ``add_megatron_arguments`` and ``validate_args`` exactly (no-op when not installed)."""
    REGISTRY.arguments.restore()


def arguments_installed() -> bool:
    return is_ours(_megatron_arguments_module().add_megatron_arguments)
