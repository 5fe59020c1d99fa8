"""A Megatron-LM checkout's dataset helpers compile with only the project's install (pybind11 included).

The checkout: megatron-core's installed package with its compiled ``helpers_cpp`` left out and a
Makefile beside ``helpers.cpp`` -- the one of the Megatron-LM checkout at ``$MEGATRON_LM`` (default
``/tmp/mlm``) when there is one, else one that builds the same way (``python3 -m pybind11
--includes``, ``python3-config --extension-suffix``, as ``megatron/core/datasets/Makefile`` of
core_r0.19.0 does). The launcher runs Megatron's own ``_compile_dependencies`` in it with ``PATH``
holding only the system's tools and no user site or extra ``PYTHONPATH``: pybind11 can only come
from the interpreter's own environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import megatron
import pytest

from megatron_tah.megatron import dataset_helpers

REPO = Path(__file__).resolve().parents[2]
INSTALLED = Path(megatron.__path__[0])
REAL_CHECKOUT = Path(os.environ.get("MEGATRON_LM", "/tmp/mlm"))
DATASETS = Path("megatron", "core", "datasets")
SYSTEM_PATH = "/usr/bin:/bin"

# Stands in for a checkout's megatron/core/datasets/Makefile when no checkout is at hand.
MAKEFILE = textwrap.dedent("""\
    CXXFLAGS += -O3 -Wall -shared -std=c++17 -fPIC
    CPPFLAGS += $(shell python3 -m pybind11 --includes)
    OUT = helpers_cpp$(shell python3-config --extension-suffix)

    $(OUT): helpers.cpp
    \t$(CXX) $(CXXFLAGS) $(CPPFLAGS) $< -o $@
""")

# Megatron's start-up step that compiles the helpers, then the module it built.
SCRIPT = textwrap.dedent("""
    import json, sys, types
    import torch.distributed as dist
    from megatron.training import global_vars
    from megatron.training.initialize import _compile_dependencies

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    global_vars.set_args(types.SimpleNamespace())
    _compile_dependencies()
    from megatron.core.datasets import helpers_cpp
    import pybind11
    print("REPORT " + json.dumps({"helpers": helpers_cpp.__file__, "pybind11": pybind11.__file__}))
""")


def make_checkout(root: Path) -> Path:
    """``root/Megatron-LM`` with the installed ``megatron`` package (linked), helpers uncompiled, a Makefile."""
    checkout = root / "Megatron-LM"
    shutil.copytree(INSTALLED, checkout / "megatron", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__", "helpers_cpp*"))
    real = REAL_CHECKOUT / DATASETS / "Makefile"
    (checkout / DATASETS / "Makefile").write_text(real.read_text() if real.is_file() else MAKEFILE)
    return checkout


def test_pybind11_is_a_dependency_of_the_project():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("pybind11") for d in dependencies), dependencies


def test_launcher_compiles_a_checkouts_helpers_with_this_interpreter(tmp_path):
    checkout = make_checkout(tmp_path)
    assert not list((checkout / DATASETS).glob("helpers_cpp*"))
    (checkout / "compile_helpers.py").write_text(SCRIPT)
    env = {"PATH": SYSTEM_PATH, "HOME": str(tmp_path), "PYTHONNOUSERSITE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "megatron_tah.launch", str(checkout / "compile_helpers.py"),
                             str(tmp_path / "store")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1].splitlines()[0])
    built = checkout / DATASETS / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    assert Path(report["helpers"]) == built and built.is_file()
    # pybind11 came from this interpreter's own environment (the project's install), nothing else.
    assert Path(report["pybind11"]).is_relative_to(sysconfig.get_paths()["purelib"])


def test_build_path_puts_this_interpreter_first():
    path = dataset_helpers.build_path(SYSTEM_PATH)
    assert path.endswith(SYSTEM_PATH) and path.split(os.pathsep)[0] == os.path.dirname(sys.executable)
    python3 = shutil.which("python3", path=path)
    out = subprocess.run([python3, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == sys.prefix
    config = shutil.which("python3-config", path=path)
    if config is not None:  # the Makefile's module suffix
        suffix = subprocess.run([config, "--extension-suffix"], capture_output=True, text=True).stdout.strip()
        assert suffix == sysconfig.get_config_var("EXT_SUFFIX")


def test_path_is_restored_exactly(monkeypatch):
    monkeypatch.setenv("PATH", SYSTEM_PATH)
    with dataset_helpers.this_python_on_path():
        assert os.environ["PATH"] == dataset_helpers.build_path(SYSTEM_PATH) != SYSTEM_PATH
    assert os.environ["PATH"] == SYSTEM_PATH
    monkeypatch.delenv("PATH")
    with pytest.raises(RuntimeError):
        with dataset_helpers.this_python_on_path():
            raise RuntimeError
    assert "PATH" not in os.environ


def _never_called():
    raise AssertionError("make must not run")


_never_called.__module__ = "megatron.core.datasets.utils"


def test_compiled_helpers_are_not_rebuilt(monkeypatch):
    monkeypatch.setattr(dataset_helpers, "helpers_importable", lambda: True)
    assert dataset_helpers.compiling_with_this_python(_never_called)() is None


def test_missing_pybind11_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(dataset_helpers, "helpers_importable", lambda: False)
    monkeypatch.setattr(dataset_helpers, "pybind11_available", lambda: False)
    with pytest.raises(dataset_helpers.HelpersBuildError, match=r"core/datasets need compiling.*pip install pybind11"):
        dataset_helpers.compiling_with_this_python(_never_called)()


def test_a_build_that_leaves_no_importable_module_is_an_error(monkeypatch):
    monkeypatch.setattr(dataset_helpers, "helpers_importable", lambda: False)
    calls = []

    def compile_helpers():
        calls.append(os.environ["PATH"].split(os.pathsep)[0])

    compile_helpers.__module__ = "megatron.core.datasets.utils"
    with pytest.raises(dataset_helpers.HelpersBuildError, match="does not import"):
        dataset_helpers.compiling_with_this_python(compile_helpers)()
    assert calls == [os.path.dirname(sys.executable)]  # Megatron's make ran with this interpreter first
