"""Imports run one way, and no module imports itself back (read from the source with ``ast``, nothing imported).

The layers, lowest first (``LAYERS``): ``geometry`` / ``numerics`` / ``units`` <- ``kernels`` <- ``codecs`` <- ``config``
<- ``link`` <- ``megatron`` (the Megatron patches) <- the entry points (``pretrain_gpt``, ``launch``,
``demo``, ``data``, ``netns_link``, ``restart``, the package's ``__init__``) <- ``benchmarks`` / ``scripts``. A module
may import its own layer and the ones below. Every import counts: module-level, inside functions,
under ``TYPE_CHECKING``, and the names given to ``importlib.import_module`` / ``__import__`` (a string,
a module-level string constant, or ``f"{__name__}.{...}"``: every module of that package).
Within one layer there is no circle either.

Further: ``geometry`` and ``numerics`` import no torch; the kernels import only each other, geometry and numerics and
take plain values; the codecs import only codecs, kernels, geometry and numerics; the link reads nothing of Megatron.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_tah"

LAYERS = (
    ("geometry", "numerics", "units"),
    ("kernels",),
    ("codecs",),
    ("config",),
    ("link",),
    ("megatron",),
    ("pretrain_gpt", "launch", "demo", "data", "netns_link", "restart", "hf_checkpoint", "__init__"),  # "__init__": the package itself
    ("benchmarks", "scripts"),
)
LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


# ----- reading the imports -----------------------------------------------------------------------
def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (a name handed to ``import_module``)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return found


def _dynamic_name(arg: ast.expr, module: str, package: str, constants: dict[str, str]) -> str | None:
    """The module an ``import_module`` argument names: a string, a module constant, or ``f"{__name__}.{...}"``
    (returned as ``"<package>.*"``: any module of it); None when it cannot be read."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Name):
        return constants.get(arg.id)
    if isinstance(arg, ast.JoinedStr) and len(arg.values) >= 2:
        head, dot = arg.values[0], arg.values[1]
        if (isinstance(head, ast.FormattedValue) and isinstance(head.value, ast.Name)
                and head.value.id in ("__name__", "__package__") and isinstance(dot, ast.Constant)
                and str(dot.value).startswith(".")):
            return (module if head.value.id == "__name__" else package) + ".*"
    return None


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every ``a.b.c`` the source imports, relative imports resolved, function-level imports and
    ``importlib.import_module`` / ``__import__`` names included; ``from m import x`` gives ``m.x`` (x may be
    a module or a name in it); ``p.*``: any module of package ``p``."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    constants = _string_constants(tree)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                name = _dynamic_name(node.args[0], module, package, constants)
                if name is not None and name.startswith("."):  # import_module(".x", __package__)
                    name = package + name
                if name is not None:
                    names.add(name)
    return names


def imports_of(path: pathlib.Path) -> set[str]:
    return imported_names(path.read_text(), module_name(path), path.name == "__init__.py")


def _sources() -> list[pathlib.Path]:
    paths = list(PACKAGE.rglob("*.py")) + list((REPO / "benchmarks").rglob("*.py")) + list((REPO / "scripts").glob("*.py"))
    return sorted(p for p in paths if "__pycache__" not in p.parts)


SOURCES = _sources()
MODULES = {module_name(p): p for p in SOURCES}


def resolve(name: str, modules) -> set[str]:
    """The modules an imported name stands for: the longest module prefix of ``name`` (``p.*``: every module of
    ``p``); nothing for names outside the repository's packages."""
    if name.endswith(".*"):
        prefix = name[:-2]
        return {m for m in modules if m.startswith(prefix + ".")}
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return {candidate}
    return set()


def graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{module: the modules it imports}`` from ``{module: imported names}`` (itself left out)."""
    return {m: {t for name in names for t in resolve(name, modules)} - {m} for m, names in modules.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``edges``: strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(root):
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] in ("benchmarks", "scripts"):
        return LAYER_OF[parts[0]]
    room = parts[1] if len(parts) > 1 else "__init__"
    return LAYER_OF.get(room)


EDGES = graph({m: imports_of(p) for m, p in MODULES.items()})


# ----- the checker itself ---------------------------------------------------------------------------
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


def test_the_checker_reads_importlib_names_and_finds_circles():
    source = ("import importlib\nTARGET = 'megatron_tah.config'\n"
              "def f(name):\n    importlib.import_module('megatron_tah.link.wire')\n"
              "    importlib.import_module(TARGET)\n    importlib.import_module(f'{__name__}.{name}')\n"
              "    importlib.import_module('.staging', __package__)\n    __import__('megatron_tah.units')\n")
    names = imported_names(source, "megatron_tah.link", is_package=True)
    assert names == {"importlib", "megatron_tah.link.wire", "megatron_tah.config", "megatron_tah.link.*", "megatron_tah.link.staging",
                     "megatron_tah.units"}
    known = {"megatron_tah.link", "megatron_tah.link.wire", "megatron_tah.link.auto", "megatron_tah.config"}
    assert resolve("megatron_tah.link.*", known) == {"megatron_tah.link.wire", "megatron_tah.link.auto"}
    assert resolve("megatron_tah.config.TahConfig", known) == {"megatron_tah.config"}
    assert resolve("torch.nn", known) == set()
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert layer("megatron_tah.link.transport") < layer("megatron_tah.megatron.places") < layer("megatron_tah")
    assert layer("megatron_tah.kernels.tah") < layer("megatron_tah.codecs") < layer("benchmarks.codec_report")


# ----- the house -------------------------------------------------------------------------------------
def test_every_module_has_a_layer():
    assert len(MODULES) > 80
    assert [m for m in MODULES if layer(m) is None] == []
    for room in ("config", "link", "megatron", "benchmarks", "scripts"):
        assert any(layer(m) == LAYER_OF[room] for m in MODULES), room


def test_no_import_runs_up_a_layer():
    up = sorted(f"{m} -> {t}" for m, targets in EDGES.items() for t in targets if layer(t) > layer(m))
    assert up == []


def test_no_import_circle():
    assert circles(EDGES) == []


def test_the_link_reads_nothing_of_megatron():
    """Neither megatron-core (``megatron.*``, imported or named as a string) nor the patches (``megatron_tah.megatron``)."""
    for path in sorted((PACKAGE / "link").glob("*.py")):
        names = imports_of(path)
        assert not {n for n in names if n == "megatron" or n.startswith(("megatron.", "megatron_tah.megatron"))}, path
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        named = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and id(node) not in docstrings
                 and isinstance(node.value, str) and node.value.startswith("megatron.")]
        assert named == [], (path.name, named)


# ----- what each low layer may import ---------------------------------------------------------------
def outside(names: set[str], allowed: tuple[str, ...]) -> set[str]:
    """The package's names not under one of ``allowed`` (dotted prefixes)."""
    return {n for n in names if n.split(".")[0] == "megatron_tah"
            and not any(n == a or n.startswith(a + ".") for a in allowed)}


KERNELS = sorted((PACKAGE / "kernels").glob("*.py"))
CODECS = sorted((PACKAGE / "codecs").rglob("*.py"))
CORE = sorted((PACKAGE / "codecs" / "core").glob("*.py"))


@pytest.mark.parametrize("name", ["geometry", "numerics"])
def test_geometry_and_numerics_import_nothing_of_the_package_and_no_torch(name):
    names = imports_of(PACKAGE / f"{name}.py")
    assert not outside(names, ())
    assert not {n for n in names if n.split(".")[0] in ("torch", "triton")}
    assert not (PACKAGE / "codecs" / f"{name}.py").exists()  # one place


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernels_import_only_kernels_geometry_and_numerics(path):
    assert not outside(imports_of(path), ("megatron_tah.kernels", "megatron_tah.geometry", "megatron_tah.numerics"))


@pytest.mark.parametrize("path", CODECS, ids=lambda p: str(p.relative_to(PACKAGE / "codecs")))
def test_codecs_import_only_codecs_kernels_geometry_and_numerics(path):
    assert not outside(imports_of(path), ("megatron_tah.codecs", "megatron_tah.kernels", "megatron_tah.geometry",
                                          "megatron_tah.numerics"))


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_codecs_wire_core_imports_no_format_and_not_the_registry(path):
    """Every format builds on ``codecs/core``; the core names none of them (nor ``codecs/__init__``'s registry)."""
    names = {n for n in imports_of(path) if n == "megatron_tah.codecs" or n.startswith("megatron_tah.codecs.")}
    assert not outside(names, ("megatron_tah.codecs.core",))


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernel_launchers_take_plain_values_not_codecs_or_layouts(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            args = node.args
            params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
            assert not params & {"codec", "layout"}, f"{path.name}: {node.name}({', '.join(sorted(params))})"


def test_no_global_statement_in_megatron_or_the_link_and_no_issue_history_in_the_product():
    """One registry object holds what is installed (``global`` nowhere); docstrings state contracts."""
    import re

    for path in sorted((PACKAGE / "megatron").glob("*.py")) + sorted((PACKAGE / "link").glob("*.py")):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f"{path.name} uses global"
    cited = [f"{p.relative_to(PACKAGE)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\b[Ii]ssue \d+", line)]
    assert not cited, cited
