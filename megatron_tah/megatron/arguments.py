"""The ``--tah-*`` command-line flags, generated from :class:`megatron_tah.config.TahConfig`.

``add_tah_arguments(parser)`` adds one flag per ``TahConfig`` field through megatron-core's own
dataclass-to-argparse machinery (``megatron.training.argument_utils.ArgumentGroupFactory``, as
Megatron-LM builds its ``TransformerConfig`` flags): ``tah_tile_size`` becomes ``--tah-tile-size``,
the type comes from the annotation, bools become ``store_true`` flags (every tah bool defaults to
off). What the factory cannot know comes from the field's metadata: ``choices`` (a field's
``metadata["choices"]`` or a codec option's declared choices) and the help text (``TahConfig``'s
docs, see ``TahFlagFactory``). Cross-field checks are ``TahConfig``'s and the places' (``places.check``):
``tah_config_from_args(args)`` runs them and names the offending flag.

``install_arguments()`` wraps ``megatron.training.arguments.add_megatron_arguments`` (looked up by
name inside ``parse_args``) so that every Megatron-LM parser also has the tah flags, and wraps
``validate_args`` so bad tah values fail while arguments are validated: the config's and the places' checks,
each place's checks against Megatron's arguments (``places.check_args``) and a ``--tah-log-json`` that
cannot be written. ``uninstall_arguments()`` puts both originals back. The
``add_megatron_arguments`` wrapper also repairs an upstream help string that makes ``--help`` crash
(``escape_percent_in_upstream_help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
from typing import Any

from ..config import TahConfig
from . import places
from .run_log import check_log_json
from .patching import is_ours
from .registry import REGISTRY

GROUP_TITLE = "megatron_tah (compressed pipeline communication)"


def flag_name(field_name: str) -> str:
    """``tah_tile_size`` -> ``--tah-tile-size``."""
    return "--" + field_name.replace("_", "-")


def fields_flags(fields: dict) -> list[str]:
    """``TahConfig`` fields as the flags that set them: ``{"tah_tile_size": 32}`` -> ``["--tah-tile-size", "32"]``; a
    true bool is its bare flag, a false one nothing."""
    flags = []
    for field, value in fields.items():
        if isinstance(value, bool):
            flags += [flag_name(field)] if value else []
        else:
            flags += [flag_name(field), str(value)]
    return flags


def _choices(field: dataclasses.Field) -> tuple:
    option = field.metadata.get("option")
    return tuple(field.metadata.get("choices") or (option.choices if option else ()))


def _values(field: dataclasses.Field) -> str:
    """A field's valid values for the flag table: its choices, a codec option's declared range, or nothing."""
    option = field.metadata.get("option")
    if option is not None:
        return option.values()
    return ", ".join(map(str, _choices(field)))


def flags_markdown() -> str:
    """The flag table of docs/FLAGS.md (``| flag | default | values | meaning |``), generated from ``TahConfig``."""
    docs = TahConfig.field_docs()
    rows = ["| flag | default | values | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(TahConfig):
        default = field.default
        shown = ("on" if default else "off") if isinstance(default, bool) else "off" if default is None else default
        meaning = docs.get(field.name, "").replace("|", "\\|")  # a table cell: '|' would end it
        rows.append(f"| `{flag_name(field.name)}` | {shown} | {_values(field)} | {meaning} |")
    return "\n".join(rows)


def _tah_flag_factory():
    """``ArgumentGroupFactory`` for ``TahConfig`` (imported here: it pulls in megatron.training)."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    class TahFlagFactory(ArgumentGroupFactory):
        """Megatron's factory with two additions it cannot derive itself.

        * Help: the factory reads docstrings from the class source; the codec options of ``TahConfig`` are
          generated from the codecs' declarations and have no source, so ``TahConfig.field_help()`` is the
          help (each field's first sentence, ``%`` escaped for argparse, the default appended; the whole
          docs are docs/FLAGS.md's).
        * Choices: the factory turns only ``Literal``/``Enum`` annotations into choices; the valid values of a
          codec name depend on the codec registry, so they are given per field as ``argparse_meta``.
        """

        def _get_field_docstrings(self, src_cfg_class: type) -> dict[str, str]:
            docs = TahConfig.field_help()
            help_texts = {}
            for field in dataclasses.fields(TahConfig):
                text = docs.get(field.name, "").replace("%", "%%")
                if not _choices(field) and field.default is not None and not isinstance(field.default, bool):
                    text = f"{text} Default: {field.default}."
                help_texts[field.name] = text
            return help_texts

        def _build_argparse_kwargs_from_field(self, attribute: dataclasses.Field) -> dict[str, Any]:
            kwargs = super()._build_argparse_kwargs_from_field(attribute)
            if _choices(attribute):
                kwargs["choices"] = _choices(attribute)
            return kwargs

    return TahFlagFactory(TahConfig)


def has_tah_arguments(parser: argparse.ArgumentParser) -> bool:
    return flag_name(dataclasses.fields(TahConfig)[0].name) in parser._option_string_actions


def add_tah_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``--tah-*`` flag to ``parser`` (once: a parser that has them is returned unchanged)."""
    if not has_tah_arguments(parser):
        _tah_flag_factory().build_group(parser, title=GROUP_TITLE)
    return parser


# megatron-core 0.19.x, megatron/core/transformer/transformer_config.py, the docstring of
# ``moe_paged_stash_buffer_size_factor_cuda`` ("... (e.g. 1.10 = 10%)."), becomes the help of
# --moe-paged-stash-buffer-size-factor-cuda through ArgumentGroupFactory unescaped: argparse's
# ``help % params`` then raises "unsupported format character ')'" and every ``--help`` crashes.
# Fixed on Megatron-LM main; repaired here only where a help string cannot be formatted.
UPSTREAM_HELP_WITH_BARE_PERCENT = ("--moe-paged-stash-buffer-size-factor-cuda",)


def escape_percent_in_upstream_help(parser: argparse.ArgumentParser) -> list[str]:
    """Escape ``%`` in the help of ``UPSTREAM_HELP_WITH_BARE_PERCENT`` flags whose help argparse cannot
    format (``help % {}`` fails); other flags and formattable help are left alone. Returns the flags repaired."""
    repaired = []
    for flag in UPSTREAM_HELP_WITH_BARE_PERCENT:
        action = parser._option_string_actions.get(flag)
        if action is None or not action.help:
            continue
        try:
            action.help % {}
        except (ValueError, TypeError):
            action.help = action.help.replace("%", "%%")
            repaired.append(flag)
        except KeyError:
            pass  # a %(name)s placeholder: formattable by argparse
    return repaired


def _flags_in_message(message: str) -> str:
    """Name flags instead of fields in TahConfig's messages (``tah_high_bits`` -> ``--tah-high-bits``)."""
    fields = sorted((f.name for f in dataclasses.fields(TahConfig)), key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(fields) + r")\b", lambda m: flag_name(m.group(1)), message)


def tah_config_from_args(args: Any) -> TahConfig:
    """``TahConfig.from_args(args)``, checked by every place (``places.check``); a bad value raises ``ValueError``
    naming its ``--tah-*`` flag."""
    try:
        config = TahConfig.from_args(args)
        places.check(config)
        return config
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
        parser = original(parser)
        escape_percent_in_upstream_help(parser)
        return add_tah_arguments(parser)

    return add_megatron_arguments


def _validating_tah_arguments(original):
    def validate_args(args, *rest, **kwargs):
        if hasattr(args, dataclasses.fields(TahConfig)[0].name):
            try:  # before Megatron's own checks: nothing is built yet, and the message is one line
                places.check_args(tah_config_from_args(args), args)
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
    patches.wrap(module, "add_megatron_arguments", _adding_tah_arguments, why="add the --tah-* flags to every parser")
    patches.wrap(module, "validate_args", _validating_tah_arguments,
                 why="check the --tah-* flags, ending a bad run with one error line")


def uninstall_arguments() -> None:
    """Restore ``add_megatron_arguments`` and ``validate_args`` exactly (no-op when not installed)."""
    REGISTRY.arguments.restore()


def arguments_installed() -> bool:
    return is_ours(_megatron_arguments_module().add_megatron_arguments)
