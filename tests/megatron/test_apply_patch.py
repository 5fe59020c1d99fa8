"""``scripts/apply_patch.sh`` and ``patches/megatron-lm-core_r0.19.0.patch``.

No Megatron-LM source is kept in this repository: the checkout under test is synthesized from
the patch's own hunks (pre-image lines at their line numbers). When a real core_r0.19.0
checkout is at ``$MEGATRON_LM`` (default ``/tmp/mlm``), its ``pretrain_gpt.py`` is tested as well.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import megatron
import pytest

from megatron_tah.megatron import version as mversion

INSTALLED = Path(megatron.__path__[0]).parent  # site-packages: megatron/core/... as in a checkout
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "apply_patch.sh"
PATCH = REPO / "patches" / "megatron-lm-core_r0.19.0.patch"
HOOK = "install_megatron_lm_plugin()"
REAL_CHECKOUT = Path(os.environ.get("MEGATRON_LM", "/tmp/mlm"))
SOURCES = ["synthetic"] + (["real"] if (REAL_CHECKOUT / "pretrain_gpt.py").is_file() else [])


def synthesized_pretrain_gpt() -> str:
    """A file the patch applies to: each hunk's pre-image at its line, behind a ``__main__`` guard."""
    lines: list[str] = []
    hunk = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
    in_hunk = False
    for line in PATCH.read_text().splitlines():
        match = hunk.match(line)
        if match:
            start = int(match.group(1))
            lines += [f"# line {n}" for n in range(len(lines) + 1, start - 1)]
            lines.append('if __name__ == "__main__":')
            in_hunk = True
        elif line.startswith("diff --git"):
            in_hunk = False
        elif in_hunk and line[:1] in (" ", "-", ""):
            lines.append(line[1:])
    return "\n".join(lines) + "\n"


def make_checkout(root: Path, source: str, git: bool = True, version: str = "0.19.1") -> Path:
    """pretrain_gpt.py, plus the three megatron-core files the version check reads (from the installed wheel)."""
    checkout = root / "Megatron-LM"
    checkout.mkdir(parents=True)
    text = (REAL_CHECKOUT / "pretrain_gpt.py").read_text() if source == "real" else synthesized_pretrain_gpt()
    (checkout / "pretrain_gpt.py").write_text(text)
    major, minor, patch = version.split(".")
    for path in (mversion.P2P_PATH, mversion.TRAINING_PATH, mversion.PACKAGE_INFO_PATH):
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        content = (INSTALLED / path).read_text() if path != mversion.PACKAGE_INFO_PATH else (
            f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
        (checkout / path).write_text(content)
    if git:
        env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                   GIT_COMMITTER_EMAIL="t@t")
        for cmd in (["init", "-q", "-b", "core_r0.19.0"], ["add", "."], ["commit", "-q", "-m", "base"]):
            subprocess.run(["git", "-C", str(checkout), *cmd], check=True, env=env, capture_output=True)
    return checkout


def apply(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def hook_position(source: str) -> tuple[int, list[int]]:
    """Line of the hook call inside ``if __name__ == "__main__":`` and the lines of the calls after it."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            calls = [n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
            names = [(ast.unparse(c.func), c.lineno) for c in calls]
            hook = [line for name, line in names if name == "install_megatron_lm_plugin"]
            assert len(hook) == 1, names
            return hook[0], names
    raise AssertionError("no __main__ block")


@pytest.mark.parametrize("source", SOURCES)
def test_patch_applies_and_adds_the_hook(tmp_path, source):
    checkout = make_checkout(tmp_path, source)
    before = (checkout / "pretrain_gpt.py").read_text()
    result = apply(str(checkout))
    assert result.returncode == 0, result.stderr
    assert "applied megatron-lm-core_r0.19.0.patch" in result.stdout and "core_r0.19.0" in result.stdout
    after = (checkout / "pretrain_gpt.py").read_text()
    # Small: the hook and nothing else; everything that was there is still there, in order.
    added = [line for line in after.splitlines() if line not in before.splitlines()]
    assert len(added) <= 4 and any(HOOK in line for line in added), added
    compile(after, "pretrain_gpt.py", "exec")
    line, calls = hook_position(after)
    later = {name: lineno for name, lineno in calls if lineno > line}
    assert "inprocess_restart.maybe_wrap_for_inprocess_restart" in later
    if source == "real":  # the hook runs before the arguments are parsed
        assert "parse_and_validate_args" in later and "pretrain" in later

    again = apply(str(checkout))
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (checkout / "pretrain_gpt.py").read_text() == after


def test_patch_applies_to_a_plain_directory_nested_in_another_repository(tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    subprocess.run(["git", "-C", str(outer), "init", "-q"], check=True)
    checkout = make_checkout(outer / "third_party", "synthetic", git=False)
    result = apply(str(checkout))
    assert result.returncode == 0, result.stderr
    assert "not a git checkout" in result.stdout
    assert HOOK in (checkout / "pretrain_gpt.py").read_text()


def test_clear_failure_when_the_patch_does_not_apply(tmp_path):
    checkout = make_checkout(tmp_path, "synthetic")
    path = checkout / "pretrain_gpt.py"
    changed = path.read_text().replace("inprocess_restart", "restart_in_process")
    path.write_text(changed)
    result = apply(str(checkout))
    assert result.returncode == 1
    assert "does NOT apply" in result.stderr and "core_r0.19.0" in result.stderr and "nothing was changed" in result.stderr
    assert "patch does not apply" in result.stderr  # git apply --check's own words are shown
    assert "python -m megatron_tah.launch" in result.stderr
    assert path.read_text() == changed


def test_unsupported_megatron_core_is_refused_before_anything_changes(tmp_path):
    checkout = make_checkout(tmp_path, "synthetic", version="0.21.0")
    p2p = checkout / mversion.P2P_PATH
    p2p.write_text(p2p.read_text().replace("next_pipeline_rank: int,", "next_rank: int,"))
    before = (checkout / "pretrain_gpt.py").read_text()
    result = apply(str(checkout))
    assert result.returncode == 1, result.stdout
    assert "megatron-core 0.21.0" in result.stderr and "_batched_p2p_ops takes" in result.stderr
    assert "Nothing was changed" in result.stderr and "Traceback" not in result.stderr
    assert (checkout / "pretrain_gpt.py").read_text() == before


def test_a_new_version_with_the_same_contract_is_accepted(tmp_path):
    checkout = make_checkout(tmp_path, "synthetic", version="0.20.0")
    result = apply(str(checkout))
    assert result.returncode == 0, result.stderr
    assert "megatron-core 0.20.0" in result.stdout


@pytest.mark.parametrize("args, message", [
    ([], "usage:"),
    (["/nonexistent/Megatron-LM"], "is not a directory"),
])
def test_bad_usage(args, message):
    result = apply(*args)
    assert result.returncode == 2 and message in result.stderr


def test_directory_without_pretrain_gpt(tmp_path):
    result = apply(str(tmp_path))
    assert result.returncode == 2 and "pretrain_gpt.py not found" in result.stderr


@pytest.mark.skipif("real" not in SOURCES, reason="needs a Megatron-LM core_r0.19.0 checkout at $MEGATRON_LM")
@pytest.mark.parametrize("how", ["patched", "launcher"])
def test_real_script_validates_tah_flags(tmp_path, how):
    """The real pretrain_gpt.py, patched or unchanged under the launcher, parses and validates --tah-* flags."""
    checkout = make_checkout(tmp_path, "real", git=False)
    for name in ("model_provider.py", "gpt_builders.py"):
        (checkout / name).write_text((REAL_CHECKOUT / name).read_text())
    if how == "patched":
        assert apply(str(checkout)).returncode == 0
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "1e-4", "--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--mock-data", "--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "12"]
    command = [sys.executable, *(["-m", "megatron_tah.launch"] if how == "launcher" else []), "pretrain_gpt.py"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([*command, *argv], cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "invalid megatron_tah flags (--tah-forward-codec fixedpoint --tah-forward-bits 12)" in result.stderr
