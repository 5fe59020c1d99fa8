"""megatron-core's C++ dataset helpers, compiled by the interpreter that trains.

Megatron's ``initialize.py:_compile_dependencies`` calls ``megatron.core.datasets.utils.compile_helpers``,
which runs ``make`` in that package's folder. A Megatron-LM checkout's Makefile asks ``python3 -m
pybind11 --includes`` and ``python3-config --extension-suffix``, i.e. whatever ``python3`` is first on
``PATH`` -- not necessarily the interpreter that runs (a virtual environment that is not activated,
torchrun from ``.venv/bin``), so the build misses the environment's pybind11 or names the module for
another Python version. :func:`compiling_with_this_python` (installed by the plugin) wraps
``compile_helpers``:

- the compiled ``helpers_cpp`` imports (megatron-core's wheel ships it without the Makefile): the
  build is skipped;
- else, without pybind11 in this interpreter: :class:`HelpersBuildError` saying what to install
  (``make setup`` installs it: a dependency in ``pyproject.toml``);
- else Megatron's own ``compile_helpers`` runs with ``PATH`` led by this interpreter's directory and
  the directory of its ``python3-config`` (:func:`build_path`), restored afterwards; when the module
  still does not import, :class:`HelpersBuildError` names the folder.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


class HelpersBuildError(RuntimeError):
    """The dataset helpers cannot be compiled or imported; the message says what to install or run."""


def helpers_importable() -> bool:
    """Whether ``megatron.core.datasets.helpers_cpp`` imports (compiled for this interpreter)."""
    importlib.invalidate_caches()  # a build in this process adds the file after the first look
    try:
        importlib.import_module(HELPERS_MODULE)
        return True
    except ImportError:
        return False


def pybind11_available() -> bool:
    return importlib.util.find_spec("pybind11") is not None


def build_path(old_path: str | None = None) -> str:
    """``PATH`` on which ``python3`` is this interpreter and ``python3-config`` this version's, then ``old_path``.

    This interpreter's directory comes first (a virtual environment's ``bin`` has ``python3`` but no
    ``python3-config``), then the base installation's ``bin`` (``sysconfig``'s ``BINDIR``) when it holds
    ``python3-config``: ``python3`` still resolves to this interpreter, and its packages (pybind11) are found.
    """
    old_path = os.environ.get("PATH", "") if old_path is None else old_path
    first = [os.path.dirname(sys.executable)]
    bindir = sysconfig.get_config_var("BINDIR")
    if bindir and os.access(os.path.join(bindir, "python3-config"), os.X_OK) and bindir not in first:
        first.append(bindir)
    return os.pathsep.join([*first, *(p for p in old_path.split(os.pathsep) if p and p not in first)])


@contextlib.contextmanager
def this_python_on_path():
    """``os.environ["PATH"]`` is :func:`build_path` inside the block, and exactly as before after it."""
    old = os.environ.get("PATH")
    os.environ["PATH"] = build_path(old)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def compiling_with_this_python(original):
    """Wrapper of ``megatron.core.datasets.utils.compile_helpers`` (module docstring)."""

    def compile_helpers():
        if helpers_importable():
            return None
        folder = Path(importlib.import_module(original.__module__).__file__).parent  # megatron/core/datasets
        if not pybind11_available():
            raise HelpersBuildError(
                f"megatron-core's dataset helpers in {folder} need compiling, which needs pybind11, and "
                f"{sys.executable} has none: `pip install pybind11` (`make setup` installs it)")
        with this_python_on_path():
            result = original()
        if not helpers_importable():
            raise HelpersBuildError(
                f"`make -C {folder}` ran but {HELPERS_MODULE} does not import in {sys.executable} "
                f"(expected helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')} there)")
        return result

    return compile_helpers
