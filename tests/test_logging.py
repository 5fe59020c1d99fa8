"""The statistics in a real ``megatron.training.training.training_log`` call (CPU, gloo world of one)."""

from __future__ import annotations

import types

import megatron.training.arguments as megatron_arguments
import megatron.training.global_vars as global_vars
import megatron.training.training as megatron_training
import pytest
import torch
import torch.distributed as dist
from test_arguments import gpt_argv

from megatron_tah.megatron import arguments as tah_arguments
from megatron_tah.megatron import logging as tah_logging
from megatron_tah.megatron import stats
from megatron_tah.megatron.registry import REGISTRY


class Recorder:
    """Stands in for a TensorBoard SummaryWriter and a wandb run."""

    def __init__(self):
        self.scalars, self.logged = {}, {}

    def add_scalar(self, name, value, step):
        self.scalars[name] = (float(value), step)

    def log(self, values, step):
        self.logged.update({name: (value, step) for name, value in values.items()})


@pytest.fixture
def megatron_state(monkeypatch, tmp_path):
    """Parsed and validated args, Megatron's global variables, a gloo world of one, fake writers."""
    # The two CUDA calls training_log reaches (timers, the max-reduce of the learning rate).
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr("sys.argv", gpt_argv(1, "--tah-forward-codec", "none", "--tah-backward-codec", "none"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    tah_arguments.install_arguments()
    created_group = not dist.is_initialized()
    if created_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        args = megatron_arguments.parse_args()
        megatron_arguments.validate_args(args)
        global_vars.unset_global_variables()
        global_vars.set_global_variables(args, build_tokenizer=False)
        args.padded_vocab_size = 50304  # what building the GPT-2 tokenizer sets (used by the FLOP count)
        writer, wandb = Recorder(), Recorder()
        monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", writer)
        monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", wandb)
        global_vars.get_timers()("interval-time", log_level=0).start(barrier=True)
        REGISTRY.stats.collect(reset=True)
        yield types.SimpleNamespace(args=args, writer=writer, wandb=wandb)
    finally:
        REGISTRY.stats.collect(reset=True)
        tah_logging.uninstall_logging()
        tah_arguments.uninstall_arguments()
        global_vars.unset_global_variables()
        if created_group:
            dist.destroy_process_group()


def call_training_log(iteration: int, is_first_iteration: bool = False):
    """Call training_log the way train() does (positional then keyword arguments)."""
    loss = torch.tensor(2.5)
    return megatron_training.training_log(
        {"lm loss": loss}, {}, 1e-4, iteration, 1.0, False,
        1,  # skipped_iter: the accumulate branch would allocate on "cuda"
        1.25, None, None, None,
        pg_collection=types.SimpleNamespace(mp=dist.group.WORLD, dp=dist.group.WORLD),
        is_first_iteration=is_first_iteration,
    )


def record_traffic():
    REGISTRY.stats.record_send("forward", raw_nbytes=4_000_000, wire_nbytes=1_000_000, peer=0, rel_error=0.02,
                      rotated_fraction=0.25)
    REGISTRY.stats.record_send("forward", raw_nbytes=4_000_000, wire_nbytes=1_000_000, peer=0)
    REGISTRY.stats.record_send("backward", raw_nbytes=4_000_000, wire_nbytes=2_000_000, peer=0)


def test_statistics_are_appended_to_the_real_iteration_line(megatron_state, capsys):
    tah_logging.install_logging()
    record_traffic()
    expected = stats.format_for_log(REGISTRY.stats.collect(reset=False))
    assert "tah fwd ratio: 4.00x" in expected

    assert call_training_log(iteration=2) is False
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "iteration        2/      10 |" in line and "grad norm: 1.250" in line
    assert line.endswith(expected)
    # Counters were reset by the log line; the scalars went to both writers.
    assert REGISTRY.stats.collect(reset=False)["forward"]["messages"] == 0
    writer, wandb = megatron_state.writer, megatron_state.wandb
    assert writer.scalars["tah/forward_ratio"] == (4.0, 2)
    assert writer.scalars["tah/forward_wire_bytes"] == (2_000_000.0, 2)
    assert writer.scalars["tah/backward_ratio"] == (2.0, 2)
    assert writer.scalars["tah/forward_rel_error"] == (pytest.approx(0.02), 2)
    assert "tah/backward_rel_error" not in writer.scalars  # nothing sampled: not written as 0
    assert wandb.logged["tah/forward_rotated_fraction"] == (0.25, 2)
    assert "grad-norm" in writer.scalars  # Megatron's own scalars still written


def test_other_iterations_pass_through_without_collecting(megatron_state, capsys):
    tah_logging.install_logging()
    record_traffic()
    call_training_log(iteration=3)  # log_interval is 2: Megatron prints nothing
    assert " iteration " not in capsys.readouterr().out
    assert REGISTRY.stats.collect(reset=False)["forward"]["messages"] == 2
    assert "learning-rate" in megatron_state.writer.scalars  # Megatron wrote its own (every iteration)
    assert not [name for name in megatron_state.writer.scalars if name.startswith("tah/")]

    call_training_log(iteration=3, is_first_iteration=True)  # Megatron logs its first iteration
    out = capsys.readouterr().out
    assert "iteration        3/" in out and "tah fwd MB: 2.000 |" in out


def test_install_idempotent_and_uninstall_exact(megatron_state, capsys):
    original = megatron_training.training_log
    tah_logging.install_logging()
    wrapped = megatron_training.training_log
    tah_logging.install_logging()
    assert megatron_training.training_log is wrapped and wrapped.__wrapped__ is original
    tah_logging.uninstall_logging()
    assert megatron_training.training_log is original

    record_traffic()
    call_training_log(iteration=2)
    assert "tah " not in capsys.readouterr().out
    assert REGISTRY.stats.collect(reset=False)["forward"]["messages"] == 2


def test_scalars_skip_missing_values():
    values = tah_logging.scalars({
        "forward": {"messages": 3, "raw_bytes": 30, "wire_bytes": 10, "ratio": 3.0, "rel_error": None,
                    "rotated_fraction": float("nan")},
        "backward": {"messages": 0, "raw_bytes": 0, "wire_bytes": 0, "ratio": None, "rel_error": None,
                     "rotated_fraction": None},
        "links": {},
    })
    assert values == {"tah/forward_messages": 3.0, "tah/forward_raw_bytes": 30.0, "tah/forward_wire_bytes": 10.0,
                      "tah/forward_ratio": 3.0, "tah/backward_messages": 0.0, "tah/backward_raw_bytes": 0.0,
                      "tah/backward_wire_bytes": 0.0}
