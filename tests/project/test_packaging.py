"""What the wheel ships: the product (``megatron_tah``), not the experiments (``benchmarks/``)."""

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from importlib.machinery import PathFinder
from pathlib import Path

import megatron_tah

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_megatron_tah_and_no_benchmarks(tmp_path):
    """Build the wheel from a copy of the sources (setuptools, as pip would) and list its top-level folders."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    for folder in ("megatron_tah", "benchmarks", "tests"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = ("from setuptools import build_meta; import sys; "
             "print(build_meta.build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = tmp_path / "dist" / result.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"megatron_tah", "megatron_tah-0.1.0.dist-info"}
    assert "megatron_tah/codecs/tah.py" in names and "megatron_tah/demo.py" in names
    assert "megatron_tah/config/measured.json" in names  # package data: the studies' numbers auto reads
    assert not [n for n in names if "reproduce" in n or "benchmarks" in n or n.endswith("/report.py")]


def test_the_product_has_no_experiment_modules():
    """Looked up in the imported package's own folders (a path finder: an editable install's finder may map
    submodule names to another checkout)."""
    import megatron_tah.codecs

    assert importlib.util.find_spec("benchmarks.reproduce") is not None  # the experiments, from the repo root
    for package, gone in ((megatron_tah, "reproduce"), (megatron_tah.codecs, "report")):
        assert PathFinder.find_spec(gone, package.__path__) is None, f"{package.__name__}.{gone}"
    assert PathFinder.find_spec("tah", megatron_tah.codecs.__path__) is not None  # the lookup does find modules


def test_the_product_never_imports_the_benchmarks():
    """benchmarks -> megatron_tah, never the reverse: the installed package must work without this folder."""
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "megatron_tah").rglob("*.py")
                 if "benchmarks" in "".join(line for line in path.read_text().splitlines()
                                            if line.lstrip().startswith(("import ", "from ")))]
    assert offenders == []
