"""Every command line README.md and docs/USAGE.md show runs as written (their ``bash`` and ``python`` blocks).

What would train or convert for long runs the way a user checks it first: ``make`` with ``-n``, the training
scripts with ``DRY_RUN=1`` (then the Megatron command they print goes through Megatron's own argument parsing and
validation, with the ``--tah-*`` flags' checks, as the run would start), ``torchrun ... -m megatron_tah.<entry>``'s
arguments through the same validation, and the other ``python -m megatron_tah.<tool>`` commands through the tool's
own parser. A placeholder a page writes for the reader (``<your Megatron arguments>``, ``/path/to/...``) is filled
with a small CPU model, a checkout holding a ``pretrain_gpt.py`` and a folder, each made here.

Commands shown inline (in single backquotes, on README.md and every page of docs/) are too long to run or name
placeholders; of each the test checks what can go stale: ``make TARGET``: the Makefile has the target;
``python -m MODULE --flag``: the module exists, runs as a program (``__main__``) and its source names each flag;
``scripts/NAME`` (bare, or after ``bash`` / ``python``): the script exists, and is executable when run bare (a shell
script, or one given arguments).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import megatron.training.arguments as megatron_arguments
import pytest

from megatron_tah.megatron import plugin

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/USAGE.md")
CPU_GPT = ("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
           "--micro-batch-size 2 --global-batch-size 16 --train-iters 10 --lr 1e-3 --transformer-impl local "
           "--distributed-backend gloo --no-gradient-accumulation-fusion --no-persist-layer-norm "
           "--tokenizer-type NullTokenizer --vocab-size 50257 --train-data-path data/x_train_text_document "
           "--valid-data-path data/x_valid_text_document")


def documented_commands() -> list[tuple[str, str]]:
    """``(page:line, command)`` of every command in the pages' ``bash`` blocks (continuation lines joined, comments
    dropped, ``name="..."`` assignments expanded into the commands after them) and of their ``python`` blocks
    (``python`` and the block's code)."""
    found = []
    for page in PAGES:
        text = (REPO / page).read_text()
        for block in re.finditer(r"```(bash|python)\n(.*?)```", text, re.S):
            first = text[:block.start()].count("\n") + 2
            if block.group(1) == "python":
                found.append((f"{page}:{first}", "python\n" + "\n".join(
                    line.strip() for line in block.group(2).splitlines())))
                continue
            variables, lines = {}, block.group(2).replace("\\\n", " ").splitlines()
            for number, line in enumerate(lines, first):
                words = shlex.split(line, comments=True)
                if not words:
                    continue
                if len(words) == 1 and re.fullmatch(r"\w+=.*", words[0]):
                    name, _, value = words[0].partition("=")
                    variables[name] = value
                    continue
                command = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)),
                                 line.split(" #")[0].strip())
                found.append((f"{page}:{number}", command))
    return found


COMMANDS = documented_commands()


@pytest.fixture
def placeholders(tmp_path):
    """The pages' placeholders, each with what a reader would put there."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("# a Megatron-LM checkout's entry\n")
    (tmp_path / "SmolLM2-135M").mkdir()
    return {"<your Megatron arguments>": CPU_GPT, "/path/to/Megatron-LM": str(checkout),
            "/path/to/SmolLM2-135M": str(tmp_path / "SmolLM2-135M")}


def _fill(command: str, placeholders: dict) -> str:
    for placeholder, value in placeholders.items():
        command = command.replace(placeholder, value)
    assert "<" not in command and "/path/to" not in command, f"an unknown placeholder in: {command}"
    return command


def megatron_validates(argv: list[str], world_size: int, monkeypatch) -> None:
    """Megatron-LM's parser and validation accept ``argv`` as a run's first rank would see them: with the plugin
    installed (the ``--tah-*`` flags and their checks; on a CPU its shims)."""
    plugin.install_megatron_lm_plugin()
    try:
        monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("RANK", "0")
        megatron_arguments.validate_args(megatron_arguments.parse_args())
    finally:
        plugin.uninstall_megatron_lm_plugin()


def _value(words: list[str], *flags: str) -> str:
    return next(words[i + 1] for i, w in enumerate(words) if w in flags)


def entry_arguments(words: list[str]) -> tuple[list[str], int] | None:
    """The Megatron arguments of a ``torchrun`` / ``torch.distributed.run`` (or ``netns_link``: a stage per
    namespace) command of megatron_tah's entry or launcher, and its process count (None: something else)."""
    for module, skip in (("megatron_tah.pretrain_gpt", 1), ("megatron_tah.launch", 2)):
        if module in words:
            start = words.index(module) + skip
            if module == "megatron_tah.launch":
                assert Path(words[start - 1]).name == "pretrain_gpt.py", words
            return words[start:], int(_value(words, "--nproc-per-node", "--nproc_per_node", "--stages"))
    return None


def test_the_pages_show_commands_of_every_kind():
    kinds = {command.split()[0] if not re.match(r"\w+=", command) else "script" for _, command in COMMANDS}
    assert {"make", "torchrun", "python", "script"} <= kinds | {"script" for _, c in COMMANDS if "scripts/" in c}
    assert any("--tah-preset" in command and "scripts/" in command for _, command in COMMANDS)


@pytest.mark.parametrize("where, command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_runs_as_written(where, command, placeholders, tmp_path, monkeypatch):
    command = _fill(command, placeholders)
    if command.startswith("python\n"):  # a python block: run it, then undo what it installed
        import megatron_tah

        try:
            exec(compile(command.split("\n", 1)[1], where, "exec"), {})
        finally:
            megatron_tah.uninstall()
        return
    words = shlex.split(command)
    env = {}
    while re.fullmatch(r"\w+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "make":  # what make would run, without running it
        done = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "megatron_tah" in done.stdout or "pytest" in done.stdout
    elif words[0].startswith("scripts/"):  # the script's dry run, then Megatron's validation of what it prints
        done = subprocess.run(["bash", *words], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "DRY_RUN": "1", "DEVICE": "cpu", "PYTHON": sys.executable,
                                   "OUT": str(tmp_path / "run"), **env})
        assert done.returncode == 0, done.stdout + done.stderr
        printed = shlex.split(done.stdout.strip().splitlines()[-1])
        megatron, processes = entry_arguments(printed)
        if not any(word.startswith("<the flags of") for word in megatron):  # an imported model not imported yet
            megatron_validates(megatron, processes, monkeypatch)
    elif words[0] == "torchrun":
        megatron, processes = entry_arguments(words)
        megatron_validates(megatron, processes, monkeypatch)
    elif words[:2] == ["python", "-m"]:  # the tool's own parser (running it would convert or tokenize for long)
        import importlib

        tool = importlib.import_module(words[2])
        tool.argument_parser().parse_args(words[3:])
    else:
        pytest.fail(f"{where}: no way to run {command!r}")


def test_the_scripts_take_a_preset_in_place_of_their_codec_defaults(tmp_path):
    """``--tah-preset`` among the flags or ``PRESET``: no ``CODEC`` / ``BWD_CODEC`` default beside it (they would
    conflict with it); codecs given explicitly still go with it; without a preset the defaults stay."""
    def printed(*flags, **env):
        done = subprocess.run(["bash", "scripts/finetune_gpt.sh", "8", *flags], cwd=REPO, capture_output=True,
                              text=True, env=dict(os.environ, DRY_RUN="1", DEVICE="cpu", PYTHON=sys.executable,
                                                  OUT=str(tmp_path), **env))
        assert done.returncode == 0, done.stderr
        return " ".join(shlex.split(done.stdout.strip().splitlines()[-1]))

    assert "--tah-forward-codec" not in printed("--tah-preset", "hadint4")
    assert "--tah-forward-codec" not in printed("--tah-preset=hadint4")
    preset = printed(PRESET="channel_h4")
    assert "--tah-preset channel_h4" in preset and "--tah-forward-codec" not in preset
    both = printed(PRESET="channel_h4", CODEC="channel")
    assert "--tah-preset channel_h4" in both and "--tah-forward-codec channel" in both
    assert "--tah-backward-codec" not in both
    plain = printed()
    assert "--tah-forward-codec tah --tah-backward-codec fixedpoint" in plain and "--tah-preset" not in plain


# ----- commands shown inline -----------------------------------------------------------------------------------
INLINE_PAGES = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
INLINE = re.compile(r"(?:\w+=\S*\s+)*(?:make\s(?!-C)|python3? -m |python3? scripts/|bash scripts/|scripts/)")


def inline_commands() -> list[tuple[str, str]]:
    """``(page:line, command)`` of every inline code span on the pages that starts like a command of this
    repository (``make`` without ``-C``, ``python -m``, ``python`` / ``bash`` of a script, a script)."""
    found = []
    for page in INLINE_PAGES:
        text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), (REPO / page).read_text(), flags=re.S)
        for span in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
            if INLINE.match(span.group(1).strip()):
                found.append((f"{page}:{text[:span.start()].count(chr(10)) + 1}", span.group(1).strip()))
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):(?!=)", (REPO / "Makefile").read_text(), re.M))


def module_source(name: str) -> str | None:
    """The source a ``python -m name`` runs, and its package's when it is one (None: not a program)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin)
    if path.name == "__init__.py":
        if not (path.parent / "__main__.py").exists():
            return None
        return "\n".join(p.read_text() for p in sorted(path.parent.glob("*.py")))
    source = path.read_text()
    return source if re.search(r"__name__ == .__main__.", source) else None


def inline_problem(command: str) -> str | None:
    """What no longer holds of an inline ``command`` (None: nothing found)."""
    words = command.replace("...", "").split()
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        words.pop(0)
    if words[0] == "make":
        missing = [w for w in words[1:] if not w.startswith("-") and "=" not in w and w not in make_targets()]
        return f"no make target {', '.join(missing)}" if missing else None
    if words[1:2] == ["-m"]:
        source = module_source(words[2])
        if source is None:
            return f"python -m {words[2]}: no such program"
        unknown = [w.split("=")[0] for w in words[3:] if w.startswith("--") and f'"{w.split("=")[0]}"' not in source]
        return f"python -m {words[2]} takes no {', '.join(unknown)}" if unknown else None
    bare = words[0].startswith("scripts/")
    script = REPO / (words[0] if bare else words[1])
    if not script.is_file():
        return f"no script {script.relative_to(REPO)}"
    run = bare and (len(words) > 1 or script.suffix == ".sh")  # (a bare python script alone: the file is meant)
    return f"{script.relative_to(REPO)} is not executable" if run and not os.access(script, os.X_OK) else None


INLINE_COMMANDS = inline_commands()


def test_the_pages_show_inline_commands_of_every_kind_and_a_stale_one_is_found():
    kinds = {re.sub(r"^(\w+=\S*\s+)*", "", c).split()[0 if "-m" not in c else 1] for _, c in INLINE_COMMANDS}
    assert {"make", "-m"} <= kinds and any(c.startswith("scripts/") for _, c in INLINE_COMMANDS)
    assert inline_problem("make no-such-target") == "no make target no-such-target"
    assert inline_problem("make reproduce PART=...") is None
    assert inline_problem("python -m benchmarks.no_such_study") == "python -m benchmarks.no_such_study: no such program"
    assert inline_problem("python -m megatron_tah.units") == "python -m megatron_tah.units: no such program"
    assert inline_problem("python -m benchmarks.faults --no-such-flag") == (
        "python -m benchmarks.faults takes no --no-such-flag")
    assert inline_problem("scripts/no_such.sh 2") == "no script scripts/no_such.sh"
    assert inline_problem("scripts/soak.py --runs 2") == "scripts/soak.py is not executable"
    assert inline_problem("scripts/soak.py") is None and inline_problem("python scripts/soak.py --runs 2") is None


@pytest.mark.parametrize("where, command", INLINE_COMMANDS, ids=[where for where, _ in INLINE_COMMANDS])
def test_an_inline_command_names_what_exists(where, command):
    assert inline_problem(command) is None, f"{where}: `{command}`"
