"""The layers import one way: codecs -> kernels -> geometry (read from the source with ``ast``, nothing imported).

``megatron_tah/geometry.py`` (shapes and constants) imports nothing of the package and no torch; the
kernels import only each other and geometry, and take plain ints and tensors (no codec objects, no
wire layouts); the codecs import only codecs, kernels and geometry.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_tah"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every ``a.b.c`` the source imports, relative imports resolved, function-level imports included;
    ``from m import x`` gives ``m.x`` (x may be a module or a name in it)."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def imports_of(path: pathlib.Path) -> set[str]:
    return imported_names(path.read_text(), module_name(path), path.name == "__init__.py")


def outside(names: set[str], allowed: tuple[str, ...]) -> set[str]:
    """The package's names not under one of ``allowed`` (dotted prefixes)."""
    return {n for n in names if n.split(".")[0] == "megatron_tah"
            and not any(n == a or n.startswith(a + ".") for a in allowed)}


KERNELS = sorted((PACKAGE / "kernels").glob("*.py"))
CODECS = sorted((PACKAGE / "codecs").glob("*.py"))


def test_the_checker_resolves_relative_imports_and_catches_a_reverse_import():
    source = "from ..codecs import geometry\nfrom .. import get_codec\nfrom .common import launch\n" \
             "def f():\n    from ..codecs.tah import TahCodec\n"
    names = imported_names(source, "megatron_tah.kernels.tah")
    assert names == {"megatron_tah.codecs.geometry", "megatron_tah.get_codec", "megatron_tah.kernels.common.launch",
                     "megatron_tah.codecs.tah.TahCodec"}
    assert outside(names, ("megatron_tah.kernels", "megatron_tah.geometry")) == {
        "megatron_tah.codecs.geometry", "megatron_tah.get_codec", "megatron_tah.codecs.tah.TahCodec"}
    assert imported_names("from . import common", "megatron_tah.kernels", is_package=True) == {
        "megatron_tah.kernels.common"}


def test_geometry_imports_nothing_of_the_package_and_no_torch():
    names = imports_of(PACKAGE / "geometry.py")
    assert not outside(names, ())
    assert not {n for n in names if n.split(".")[0] in ("torch", "triton")}
    assert not (PACKAGE / "codecs" / "geometry.py").exists()  # one place


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernels_import_only_kernels_and_geometry(path):
    assert not outside(imports_of(path), ("megatron_tah.kernels", "megatron_tah.geometry"))


@pytest.mark.parametrize("path", CODECS, ids=lambda p: p.name)
def test_codecs_import_only_codecs_kernels_and_geometry(path):
    assert not outside(imports_of(path), ("megatron_tah.codecs", "megatron_tah.kernels", "megatron_tah.geometry"))


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernel_launchers_take_plain_values_not_codecs_or_layouts(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            args = node.args
            params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
            assert not params & {"codec", "layout"}, f"{path.name}: {node.name}({', '.join(sorted(params))})"


def test_no_global_statement_in_megatron_and_no_issue_history_in_the_product():
    """One registry object holds what is installed (``global`` nowhere); docstrings state contracts."""
    import re

    for path in sorted((PACKAGE / "megatron").glob("*.py")):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f"{path.name} uses global"
    cited = [f"{p.relative_to(PACKAGE)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\b[Ii]ssue \d+", line)]
    assert not cited, cited
