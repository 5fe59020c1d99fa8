"""The statistics in a real ``megatron.training.training.training_log`` call (CPU, gloo world of one)."""

from __future__ import annotations

import json
import types

import megatron.training.arguments as megatron_arguments
import megatron.training.global_vars as global_vars
import megatron.training.training as megatron_training
import pytest
import torch
import torch.distributed as dist
from tests.megatron.test_arguments import gpt_argv, refused_by_validation

from megatron_tah.megatron import arguments as tah_arguments
from megatron_tah.megatron import run_log as tah_logging
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
    expected = REGISTRY.stats.format_for_log(REGISTRY.stats.collect(reset=False), 1)
    assert "tah fwd MB/iter: 2.000 | tah fwd ratio: 4.00x" in expected

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
    assert writer.scalars["tah/forward_wire_bytes_per_iter"] == (2_000_000.0, 2)
    assert writer.scalars["tah/backward_ratio"] == (2.0, 2)
    assert writer.scalars["tah/forward_rel_error"] == (pytest.approx(0.02), 2)
    assert "tah/backward_rel_error" not in writer.scalars  # nothing sampled: not written as 0
    assert wandb.logged["tah/forward_rotated_fraction"] == (0.25, 2)
    assert "grad-norm" in writer.scalars  # Megatron's own scalars still written
    # Tensor and data parallelism are off: no tp_*/dp_* scalars (not zeros).
    assert not [name for name in writer.scalars if name.startswith(("tah/tp_", "tah/dp_"))]
    assert not [name for name in wandb.logged if name.startswith(("tah/tp_", "tah/dp_"))]


def test_the_wan_ledger_leads_the_line_and_goes_to_the_writers_and_the_json_log(megatron_state, capsys, monkeypatch,
                                                                                  tmp_path):
    """What crossed a stage boundary (the WAN ledger) starts the items, with the share that went through a codec;
    TensorBoard gets the total, the codec bytes and each category; the JSON record the same per iteration."""
    tah_logging.install_logging()
    log = tmp_path / "log.jsonl"
    monkeypatch.setattr(megatron_state.args, "tah_log_json", str(log))
    REGISTRY.stats.record_wan("embedding", 25_000_000)
    REGISTRY.stats.record_wan("pipeline", 1_000_000, codec=True)
    call_training_log(iteration=2)
    line = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line][0]
    assert line.endswith(" iterations:   0 | wan MB/iter: 26.000 | wan compressed: 3.8% |")
    scalars = megatron_state.writer.scalars
    assert scalars["tah/wan_bytes_per_iter"] == (26e6, 2) and scalars["tah/wan_codec_bytes_per_iter"] == (1e6, 2)
    assert scalars["tah/wan_embedding_bytes_per_iter"] == (25e6, 2) and scalars["tah/wan_dp_bytes_per_iter"] == (0, 2)
    record = json.loads(log.read_text().splitlines()[-1])
    assert (record["wan_bytes"], record["wan_codec_bytes"]) == (26_000_000, 1_000_000)
    assert record["wan"]["embedding"] == {"ops": 1, "bytes": 25_000_000, "codec_bytes": 0}


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
    # Two training_log calls (iterations) since the last line: 2 MB sent, 1 MB per iteration.
    assert "iteration        3/" in out and "tah fwd MB/iter: 1.000 |" in out


def test_items_and_scalars_are_per_iteration_since_the_last_line(megatron_state, capsys):
    """log_interval 2: the line of iteration 4 covers iterations 3 and 4 and shows one iteration's traffic."""
    tah_logging.install_logging()
    record_traffic()
    call_training_log(iteration=3)  # not printed (collected only when printing: no --tah-log-json)
    record_traffic()
    call_training_log(iteration=4)
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 1 and "iteration        4/" in lines[0]
    assert " tah fwd MB/iter: 2.000 | tah fwd ratio: 4.00x |" in lines[0]
    assert " tah bwd MB/iter: 2.000 | tah bwd ratio: 2.00x |" in lines[0]
    writer = megatron_state.writer
    assert writer.scalars["tah/forward_wire_bytes_per_iter"] == (2_000_000.0, 4)
    assert writer.scalars["tah/forward_raw_bytes_per_iter"] == (8_000_000.0, 4)
    assert writer.scalars["tah/forward_messages_per_iter"] == (2.0, 4)
    assert writer.scalars["tah/forward_ratio"] == (4.0, 4)  # means are not divided
    assert not [name for name in writer.scalars if name.startswith("tah/") and "bytes" in name
                and not name.endswith("_per_iter")]

    # The next line starts a new span: one iteration of half the traffic.
    REGISTRY.stats.record_send("forward", raw_nbytes=4_000_000, wire_nbytes=1_000_000, peer=0)
    call_training_log(iteration=6)
    assert " tah fwd MB/iter: 1.000 |" in capsys.readouterr().out


def test_the_first_line_does_not_start_a_new_span_as_megatron_s(megatron_state, capsys):
    tah_logging.install_logging()
    record_traffic()
    call_training_log(iteration=1, is_first_iteration=True)
    assert " tah fwd MB/iter: 2.000 |" in capsys.readouterr().out
    REGISTRY.stats.record_send("forward", raw_nbytes=4_000_000, wire_nbytes=4_000_000, peer=0)
    call_training_log(iteration=2)  # Megatron's line averages iterations 1 and 2: so does ours
    assert " tah fwd MB/iter: 3.000 |" in capsys.readouterr().out


def test_tensor_parallel_scalars_appear_only_while_that_place_is_installed(megatron_state, monkeypatch):
    tah_logging.install_logging()
    monkeypatch.setitem(REGISTRY.places, "tp", None)
    assert tah_logging.streams_on() == ("forward", "backward", "tp_forward", "tp_backward")
    record_traffic()
    call_training_log(iteration=2)
    scalars = megatron_state.writer.scalars
    assert scalars["tah/tp_forward_messages_per_iter"] == (0.0, 2)  # on, nothing sent: 0
    assert "tah/tp_forward_ratio" not in scalars and not [n for n in scalars if n.startswith("tah/dp_")]


def test_evaluation_traffic_is_reported_apart_from_the_training_items(megatron_state, monkeypatch, capsys, tmp_path):
    """Training traffic recorded before an evaluation (not collected yet: no line printed) stays the
    training's; the evaluation's goes to its own line and JSON record, not to the next training line."""
    def evaluate(*args, **kwargs):  # Megatron's evaluate, standing in: one evaluation's forward traffic
        REGISTRY.stats.record_send("forward", raw_nbytes=9_000_000, wire_nbytes=3_000_000, peer=0)
        return {"lm loss": torch.tensor(2.0)}, None, False

    monkeypatch.setattr(megatron_training, "evaluate", evaluate)
    log = tmp_path / "log.jsonl"
    monkeypatch.setattr(megatron_state.args, "tah_log_json", None)
    tah_logging.install_logging()
    record_traffic()
    call_training_log(iteration=1)  # not printed: its traffic is still pending
    monkeypatch.setattr(megatron_state.args, "tah_log_json", str(log))
    megatron_training.evaluate_and_print_results("iteration 1", None, None, None, 1, None, None)
    out = capsys.readouterr().out
    assert " evaluation tah traffic at iteration 1 | tah fwd MB: 3.000 | tah fwd ratio: 3.00x |" in out
    assert "bwd" not in out.split("evaluation tah traffic", 1)[1]
    assert [json.loads(line)["valid_fwd_wire_bytes"] for line in log.read_text().splitlines()] == [3_000_000]

    monkeypatch.setattr(megatron_state.args, "tah_log_json", None)
    record_traffic()
    call_training_log(iteration=2)
    line = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line][0]
    assert " tah fwd MB/iter: 2.000 | tah fwd ratio: 4.00x |" in line  # iterations 1 and 2, no evaluation
    assert megatron_state.writer.scalars["tah/forward_messages_per_iter"] == (2.0, 2)


@pytest.mark.parametrize("where", ["under a file", "a folder"])
def test_an_unwritable_log_json_fails_argument_validation_in_one_line(monkeypatch, tmp_path, capsys, where):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    path = blocker / "log.jsonl" if where == "under a file" else tmp_path
    err = refused_by_validation(monkeypatch, capsys, gpt_argv(1, "--tah-log-json", str(path)), world_size=1)
    assert len(err) == 1 and err[0].startswith(f"error: --tah-log-json {path}") and "Traceback" not in err[0]
    assert not path.exists() or path.is_dir()  # nothing created


def test_check_log_json_accepts_new_files_in_new_folders_and_creates_nothing(tmp_path):
    tah_logging.check_log_json(None)
    tah_logging.check_log_json(str(tmp_path / "new" / "deeper" / "log.jsonl"))
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "log.jsonl"
    existing.write_text("{}\n")
    tah_logging.check_log_json(str(existing))
    with pytest.raises(ValueError, match="--tah-log-json"):
        tah_logging.check_log_json("")


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
    }, iterations=2, streams=("forward", "backward"))
    assert values == {"tah/forward_messages_per_iter": 1.5, "tah/forward_raw_bytes_per_iter": 15.0,
                      "tah/forward_wire_bytes_per_iter": 5.0, "tah/forward_ratio": 3.0,
                      "tah/backward_messages_per_iter": 0.0, "tah/backward_raw_bytes_per_iter": 0.0,
                      "tah/backward_wire_bytes_per_iter": 0.0}
    with pytest.raises(ValueError, match="iterations"):
        tah_logging.scalars({}, iterations=0)
