"""Which megatron-core the patch layer supports, decided by the contract it relies on.

The patch replaces the two pipeline transports of
``megatron/core/pipeline_parallel/p2p_communication.py``, ``_batched_p2p_ops`` and ``_p2p_ops``,
which megatron-core looks up by name at call time and calls with seven keyword-only arguments
(``TRANSPORT_KEYWORDS``), and the Megatron-LM plugin wraps functions of
``megatron/training/training.py`` (``HOOKS``). Support is decided by checking exactly that -- in
an installed megatron-core (``check_installed``, at ``install()``) or in a checkout's source
(``check_checkout``, used by ``scripts/apply_patch.sh`` before it changes anything); the version
number only goes into the messages. Checked: megatron-core 0.17.0 - 0.19.2 (wheels, and Megatron-LM
``core_r0.17.0`` - ``core_r0.19.0``) and 0.20.0 (Megatron-LM ``main`` at d98e8a6).

``python -m megatron_tah.megatron.version CHECKOUT`` prints the checkout's version and exits 0
when it is supported, else prints why and exits 1.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

P2P_PATH = "megatron/core/pipeline_parallel/p2p_communication.py"
TRAINING_PATH = "megatron/training/training.py"
PACKAGE_INFO_PATH = "megatron/core/package_info.py"
TRANSPORTS = ("_batched_p2p_ops", "_p2p_ops")
TRANSPORT_KEYWORDS = ("tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next",
                      "group", "prev_pipeline_rank", "next_pipeline_rank")
HOOKS = ("training_log", "evaluate", "evaluate_and_print_results", "build_train_valid_test_data_iterators",
         "initialize_megatron", "save_checkpoint", "load_checkpoint")
"""Names the plugin wraps in ``megatron.training.training`` (defined or imported there)."""
CHECKED = "megatron-core 0.17-0.19 and 0.20.0 (Megatron-LM main)"


class UnsupportedMegatronError(RuntimeError):
    """The megatron-core at hand lacks what the patch relies on; the message says what and which version."""


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric components of a version string: ``"0.19.2rc0+abc"`` -> ``(0, 19, 2)``."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", str(text))
    if not match:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _keyword_only(args: ast.arguments) -> tuple[str, ...]:
    return tuple(a.arg for a in args.kwonlyargs) if not (args.args or args.posonlyargs) else ()


def transport_problems(p2p_source: str) -> list[str]:
    """What ``p2p_communication.py``'s source lacks of the transport contract ([] when it holds)."""
    found = {node.name: node for node in ast.parse(p2p_source).body if isinstance(node, ast.FunctionDef)}
    problems = []
    for name in TRANSPORTS:
        if name not in found:
            problems.append(f"{name} is not defined at module level")
        elif _keyword_only(found[name].args) != TRANSPORT_KEYWORDS:
            problems.append(f"{name} takes ({ast.unparse(found[name].args)}), "
                            f"not the keyword-only ({', '.join(TRANSPORT_KEYWORDS)})")
    return problems


def hook_problems(training_source: str) -> list[str]:
    """Which of ``HOOKS`` ``training.py`` neither defines nor imports ([] when all are there)."""
    names = set()
    for node in ast.walk(ast.parse(training_source)):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return [f"megatron/training/training.py has no {name}" for name in HOOKS if name not in names]


def checkout_version(checkout: str | Path) -> str:
    """``MAJOR.MINOR.PATCH[PRE]`` read from a checkout's package_info.py without importing it."""
    values = {}
    for node in ast.parse((Path(checkout) / PACKAGE_INFO_PATH).read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    return f"{values.get('MAJOR')}.{values.get('MINOR')}.{values.get('PATCH')}{values.get('PRE_RELEASE') or ''}"


def check_checkout(checkout: str | Path) -> str:
    """The checkout's version when the patch's contract holds there; else ``UnsupportedMegatronError``."""
    root = Path(checkout)
    missing = [p for p in (PACKAGE_INFO_PATH, P2P_PATH, TRAINING_PATH) if not (root / p).is_file()]
    if missing:
        raise UnsupportedMegatronError(f"{root} is not a Megatron-LM checkout: {', '.join(missing)} not found")
    version = checkout_version(root)
    problems = (transport_problems((root / P2P_PATH).read_text())
                + hook_problems((root / TRAINING_PATH).read_text()))
    if problems:
        raise UnsupportedMegatronError(
            f"megatron-core {version} in {root} is not supported by megatron_tah: {'; '.join(problems)} "
            f"(checked: {CHECKED})")
    return version


def installed_version() -> str:
    """megatron-core's version string; RuntimeError when it is not installed."""
    try:
        from megatron.core import package_info
    except ImportError as err:
        raise RuntimeError(f"megatron_tah needs megatron-core ({CHECKED}), and it is not installed: {err}") from err
    return str(package_info.__version__)


def check_installed() -> str:
    """The installed megatron-core's version when its transports match the contract, else an error."""
    import importlib

    version = installed_version()
    module = importlib.import_module(P2P_PATH[:-3].replace("/", "."))
    problems = []
    for name in TRANSPORTS:
        function = getattr(module, name, None)
        function = inspect.unwrap(function) if function is not None else None
        if function is None:
            problems.append(f"{name} not found")
            continue
        params = inspect.signature(function).parameters.values()
        keywords = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        if keywords != TRANSPORT_KEYWORDS or any(p.kind is not p.KEYWORD_ONLY for p in params):
            problems.append(f"{name}{inspect.signature(function)} is not ({', '.join(TRANSPORT_KEYWORDS)})")
    if problems:
        raise UnsupportedMegatronError(
            f"megatron-core {version} is not supported by megatron_tah: {'; '.join(problems)} (checked: {CHECKED})")
    return version


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megatron_tah.megatron.version <Megatron-LM checkout>", file=sys.stderr)
        return 2
    try:
        print(check_checkout(argv[0]))
        return 0
    except UnsupportedMegatronError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
