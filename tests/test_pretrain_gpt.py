"""Megatron-LM's own training loop (``megatron.training.pretrain``) on CPU/gloo with megatron_tah.

Real end-to-end runs, tiny model: the project's entry (``python -m megatron_tah.pretrain_gpt``)
and a Megatron-LM-style script in a checkout with its own ``megatron`` package under
``python -m megatron_tah.launch``. Checked: Megatron's iteration line with the tah statistics,
bytes on the wire per iteration equal the codecs' ``wire_nbytes``, a resumed run continues
with bit-identical losses (codec state included), TensorBoard events carry the tah scalars, and
a ``--tah-*`` mistake is one line before anything is built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import megatron
import pytest
import torch

from megatron_tah import pretrain_gpt
from megatron_tah.config import TahConfig
from megatron_tah.megatron.run_log import read_records

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "2e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "constant", "--log-interval", "1",
         "--eval-interval", "4", "--eval-iters", "1", "--untie-embeddings-and-output-weights"]


PAPER = ["--tah-preset", "paper"]  # TAH-Quant with the 6-bit backward codec (nothing is on without a flag)


def flags(corpus: str, stages: int, log: Path, *extra: str, layers: int | None = None) -> list[str]:
    model = list(MODEL)
    if layers is not None:
        model[1] = str(layers)
    return [*pretrain_gpt.CPU_FLAGS, *pretrain_gpt.GPT2_DATA_FLAGS, *model,
            "--train-data-path", f"{corpus}_train_text_document", "--valid-data-path", f"{corpus}_valid_text_document",
            "--pipeline-model-parallel-size", str(stages), "--tah-log-json", str(log), *extra]


def run(cmd: list[str], cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:  # the first error lines of the ranks, then the tails
        errors = [line for line in result.stderr.splitlines() if "Error" in line or "error:" in line]
        raise AssertionError("\n".join([f"exit {result.returncode}: {' '.join(cmd[-12:])}", *errors[:20],
                                        result.stdout[-2000:], result.stderr[-3000:]]))
    return result


def iteration_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " iteration " in line and "consumed samples" in line]


def expected_bytes(config: TahConfig, stages: int, micro_batches: int, shape, dtype) -> tuple[int, int]:
    """Forward and backward wire bytes of one iteration, summed over the stage boundaries."""
    messages = micro_batches * (stages - 1)
    return (messages * config.forward_codec().wire_nbytes(shape, dtype),
            messages * config.backward_codec().wire_nbytes(shape, dtype))


@pytest.mark.smoke
def test_entry_trains_pp2_logs_wire_bytes_and_resumes_bit_identically(corpus, tmp_path):
    common = ["--train-iters", "6", "--save-interval", "3", "--tah-stochastic-rounding",
              "--tah-forward-codec", "tah", "--tah-backward-codec", "fixedpoint"]
    full = tmp_path / "full.jsonl"
    out = run(pretrain_gpt.command(2, flags(corpus, 2, full, *common, "--tensorboard-dir", str(tmp_path / "tb"))))
    lines = iteration_lines(out.stdout)
    assert len(lines) == 6 and all("tah fwd MB/iter:" in line and "tah bwd ratio:" in line for line in lines), lines
    records = read_records(full)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    fwd, bwd = expected_bytes(TahConfig(tah_preset="paper", tah_stochastic_rounding=True), 2, 4, (32, 2, 64),
                              torch.float32)
    assert {(r["fwd_wire_bytes"], r["bwd_wire_bytes"]) for r in records} == {(fwd, bwd)}
    assert all(r["fwd_raw_bytes"] == 4 * 32 * 2 * 64 * 4 for r in records)
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] and "valid_loss" in records[3]

    # TensorBoard event files written by Megatron's writer carry the tah scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"tah/forward_ratio", "tah/backward_wire_bytes_per_iter"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("tah/forward_wire_bytes_per_iter")] == [1, 2, 3, 4, 5, 6]

    # Interrupted after iteration 3 and resumed: the same losses bit for bit (dropout, data order,
    # optimizer and the stochastic-rounding generators all continue).
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ckpt = ["--save", str(tmp_path / "ckpt")]
    run(pretrain_gpt.command(2, flags(corpus, 2, first, *common, *ckpt, "--exit-interval", "3")))
    assert (tmp_path / "ckpt" / "iter_0000003" / "megatron_tah" / "rank_00000.pt").is_file()
    run(pretrain_gpt.command(2, flags(corpus, 2, second, *common, *ckpt, "--load", str(tmp_path / "ckpt"))))
    resumed = read_records(first) + read_records(second)
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in records]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in records]


def test_log_items_are_one_iteration_of_training_traffic_and_evaluations_have_their_own_line(corpus, tmp_path):
    """--log-interval 2 and an evaluation every 2 iterations, no --tah-log-json (the counters are collected only
    on printed lines): each line's tah items are one iteration's training messages (wire_nbytes x messages per
    iteration), whatever the span and the evaluations; an evaluation's traffic is on its own line; tensor and
    data parallelism are off, so no tp/dp scalars are written."""
    argv = flags(corpus, 2, tmp_path / "unused.jsonl", "--train-iters", "4", "--eval-interval", "2",
                 "--tensorboard-dir", str(tmp_path / "tb"), "--tah-preset", "paper")
    del argv[argv.index("--tah-log-json"):argv.index("--tah-log-json") + 2]
    argv[argv.index("--log-interval") + 1] = "2"
    out = run(pretrain_gpt.command(2, argv))
    fwd, bwd = expected_bytes(TahConfig(tah_preset="paper"), 2, 4, (32, 2, 64), torch.float32)
    lines = iteration_lines(out.stdout)
    assert [int(line.split(" iteration ")[1].split("/")[0]) for line in lines] == [1, 2, 4], lines
    for line in lines:
        assert f" tah fwd MB/iter: {fwd / 1e6:.3f} |" in line and f" tah bwd MB/iter: {bwd / 1e6:.3f} |" in line
        assert " tah tp " not in line and " tah dp " not in line
    # One evaluation: --eval-iters 1 of 4 micro-batches, forward only, over the one stage boundary.
    evaluations = [line for line in out.stdout.splitlines() if " evaluation tah traffic at " in line]
    assert len(evaluations) >= 2 and all(f" tah fwd MB: {fwd / 1e6:.3f} |" in line and " bwd " not in line
                                         for line in evaluations), evaluations
    assert not (tmp_path / "unused.jsonl").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("tah/forward_wire_bytes_per_iter")] == [(1, fwd), (2, fwd), (4, fwd)]
    assert [(e.step, e.value) for e in events.Scalars("tah/backward_wire_bytes_per_iter")] == [(1, bwd), (2, bwd), (4, bwd)]
    assert [e.value for e in events.Scalars("tah/forward_messages_per_iter")] == [4.0] * 3
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith(("tah/tp_", "tah/dp_"))]


def test_warmup_iterations_go_uncompressed_then_the_codecs_take_over(corpus, tmp_path):
    log = tmp_path / "warm.jsonl"
    run(pretrain_gpt.command(2, flags(corpus, 2, log, *PAPER, "--train-iters", "3", "--tah-warmup-iters", "2",
                                      "--eval-interval", "100")))
    records = read_records(log)
    plain = expected_bytes(TahConfig(tah_forward_codec="none", tah_backward_codec="none"), 2, 4, (32, 2, 64),
                           torch.float32)
    compressed = expected_bytes(TahConfig(tah_preset="paper"), 2, 4, (32, 2, 64), torch.float32)
    assert [(r["fwd_wire_bytes"], r["bwd_wire_bytes"]) for r in records] == [plain, plain, compressed]
    assert records[2]["tah"]["forward"]["ratio"] > 6


def test_eval_traffic_both_evaluates_the_same_batches_through_the_codec_and_uncompressed(corpus, tmp_path):
    """--tah-eval-traffic both: each evaluation runs through the codec (the loss Megatron reports, equal
    to a run's without the flag) and again on the same batches uncompressed (valid_loss_uncompressed);
    training traffic and losses are unchanged."""
    common = [*PAPER, "--train-iters", "4", "--eval-interval", "2"]
    logs = {mode: tmp_path / f"{mode}.jsonl" for mode in ("codec", "both")}
    run(pretrain_gpt.command(2, flags(corpus, 2, logs["codec"], *common)))
    out = run(pretrain_gpt.command(2, flags(corpus, 2, logs["both"], *common, "--tah-eval-traffic", "both")))
    assert "evaluations through the codec and uncompressed" not in out.stderr  # (stages agree: no mismatch)
    records = {mode: read_records(path) for mode, path in logs.items()}
    assert [r["lm_loss"] for r in records["both"]] == [r["lm_loss"] for r in records["codec"]]
    compressed = expected_bytes(TahConfig(tah_preset="paper"), 2, 4, (32, 2, 64), torch.float32)
    assert all((r["fwd_wire_bytes"], r["bwd_wire_bytes"]) == compressed for r in records["both"])
    evals = {mode: [r for r in rs if "valid_loss" in r] for mode, rs in records.items()}
    assert [r["iteration"] for r in evals["both"]] == [2, 4] == [r["iteration"] for r in evals["codec"]]
    plain = expected_bytes(TahConfig(tah_forward_codec="none"), 2, 4, (32, 2, 64), torch.float32)[0]
    for both, codec in zip(evals["both"], evals["codec"]):
        assert both["valid_loss"] == codec["valid_loss"] and "valid_loss_uncompressed" not in codec
        assert both["valid_loss_uncompressed"] != both["valid_loss"]
        assert abs(both["valid_loss_uncompressed"] - both["valid_loss"]) < 0.05  # same weights and batches
        assert both["valid_fwd_wire_bytes"] == compressed[0] + plain and codec["valid_fwd_wire_bytes"] == compressed[0]


def test_aqsgd_buffers_survive_a_resume(corpus, tmp_path):
    common = ["--train-iters", "4", "--save-interval", "2", "--tah-forward-codec", "aqsgd",
              "--tah-backward-codec", "fixedpoint", "--eval-interval", "100"]
    full = tmp_path / "full.jsonl"
    run(pretrain_gpt.command(2, flags(corpus, 2, full, *common)))
    records = read_records(full)
    assert records[-1]["buffer_bytes"] > 0
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ckpt = ["--save", str(tmp_path / "ckpt")]
    run(pretrain_gpt.command(2, flags(corpus, 2, first, *common, *ckpt, "--exit-interval", "2")))
    run(pretrain_gpt.command(2, flags(corpus, 2, second, *common, *ckpt, "--load", str(tmp_path / "ckpt"))))
    resumed = read_records(first) + read_records(second)
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in records]
    assert [r["buffer_bytes"] for r in resumed] == [r["buffer_bytes"] for r in records]
    assert [r["fwd_wire_bytes"] for r in resumed] == [r["fwd_wire_bytes"] for r in records]


def test_auto_resumes_with_the_codec_its_checkpoint_announced(corpus, tmp_path):
    """auto (none or fp8) at an emulated 1 Mbit/s starts with none, measures the link and switches to fp8
    (half the bytes); interrupted after iteration 3 and resumed, the run has the same codecs per iteration
    (from the checkpoint, not the start codec), wire bytes and losses as an uninterrupted one."""
    common = ["--train-iters", "5", "--save-interval", "3", "--eval-interval", "100",
              "--tah-forward-codec", "auto", "--tah-backward-codec", "auto", "--tah-auto-candidates", "none,fp8",
              "--tah-auto-max-error", "0.05", "--tah-auto-interval", "1", "--tah-emulate-bandwidth", "1mbit"]
    full = tmp_path / "full.jsonl"
    run(pretrain_gpt.command(2, flags(corpus, 2, full, *common)))
    records = read_records(full)
    codecs = [{link: item["codec"] for link, item in r["auto"].items()} for r in records]
    assert codecs[0] == {"0->1": "none", "1->0": "none"} and codecs[-1] == {"0->1": "fp8", "1->0": "fp8"}, codecs
    assert codecs[3] == codecs[-1]  # switched before the checkpoint: the resumed run must not start afresh
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ckpt = ["--save", str(tmp_path / "ckpt")]
    run(pretrain_gpt.command(2, flags(corpus, 2, first, *common, *ckpt, "--exit-interval", "3")))
    run(pretrain_gpt.command(2, flags(corpus, 2, second, *common, *ckpt, "--load", str(tmp_path / "ckpt"))))
    resumed = read_records(first) + read_records(second)
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [{link: item["codec"] for link, item in r["auto"].items()} for r in resumed] == codecs
    assert [r["fwd_wire_bytes"] for r in resumed] == [r["fwd_wire_bytes"] for r in records]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in records]


def checkout_with_its_own_megatron(root: Path) -> Path:
    """A Megatron-LM-like checkout: a copy of the installed ``megatron`` package, and a pretrain_gpt.py
    that knows nothing of megatron_tah's plugin (it only borrows the project's data and step functions)."""
    checkout = root / "Megatron-LM"
    shutil.copytree(Path(megatron.__path__[0]), checkout / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "pretrain_gpt.py").write_text(textwrap.dedent("""
        import megatron.core
        from megatron.core.enums import ModelType
        from megatron.training import pretrain, print_rank_0
        from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args
        from megatron_tah.pretrain_gpt import forward_step, train_valid_test_datasets_provider

        if __name__ == "__main__":
            args = parse_and_validate_args()
            print_rank_0("MEGATRON_PACKAGE " + megatron.core.__file__)
            config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
            pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    """))
    return checkout


@pytest.mark.parametrize("stages", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_launcher_runs_a_checkouts_script_with_its_own_megatron(corpus, tmp_path, stages):
    checkout = checkout_with_its_own_megatron(tmp_path)
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages),
           "-m", "megatron_tah.launch", str(checkout / "pretrain_gpt.py"),
           *flags(corpus, stages, log, *PAPER, "--train-iters", "3", "--eval-interval", "100", layers=stages)]
    out = run(cmd, cwd=tmp_path)
    package = out.stdout.split("MEGATRON_PACKAGE ", 1)[1].split()[0]
    assert Path(package).resolve().is_relative_to(checkout.resolve())  # the checkout's megatron ran
    assert len(iteration_lines(out.stdout)) == 3
    assert all("tah fwd ratio:" in line for line in iteration_lines(out.stdout))
    records = read_records(log)
    fwd, bwd = expected_bytes(TahConfig(tah_preset="paper"), stages, 4, (32, 2, 64), torch.float32)
    assert [(r["fwd_wire_bytes"], r["bwd_wire_bytes"]) for r in records] == [(fwd, bwd)] * 3


def test_a_tah_flag_mistake_is_one_line_before_anything_is_built(corpus, tmp_path):
    cmd = [sys.executable, "-m", "megatron_tah.pretrain_gpt",
           *flags(corpus, 1, tmp_path / "x.jsonl", "--train-iters", "2", "--tah-forward-codec", "fixedpoint",
                  "--tah-forward-bits", "12")]
    env = dict(os.environ, PYTHONPATH=str(REPO), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29591")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--tah-forward-bits 12" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "building GPT model" not in result.stdout and "initializing torch distributed" not in result.stdout


def _validation_samples(monkeypatch, corpus: str, seed: int, train_iters: int, eval_data_seed: int | None):
    """The validation items the entry's dataset provider gives, one process, no distributed state."""
    import argparse

    import megatron.training
    from megatron.core import mpu

    args = argparse.Namespace(
        seed=seed, eval_data_seed=eval_data_seed, fixed_validation=True, fixed_epoch_samples=False, eval_iters=2,
        global_batch_size=4, seq_length=32, split=None, data_path=None, per_split_data_args_path=None,
        data_args_path=None, pad_vocab_size=None,
        train_data_path=[f"{corpus}_train_text_document"], valid_data_path=[f"{corpus}_valid_text_document"],
        test_data_path=None, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask_in_dataloader=True, data_cache_path=None, mmap_bin_files=True,
        num_dataset_builder_threads=1, tokenizer_type="NullTokenizer", vocab_size=50257, tah_forward_codec="none",
        tensor_model_parallel_size=1, rank=0, make_vocab_size_divisible_by=128)
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_rank", lambda: 0)
    evaluations = train_iters // 5 + 1
    _, valid, _ = pretrain_gpt.train_valid_test_datasets_provider([train_iters * 4, evaluations * 8, 8])
    return [valid[i]["tokens"].tolist() for i in range(8)]


def test_eval_data_seed_validates_on_the_same_samples_whatever_the_seed_and_the_schedule(monkeypatch, corpus):
    """Megatron sizes the validation split by every evaluation of the schedule, and a split of several epochs
    shuffles its samples over all of them: without --eval-data-seed, a longer schedule validates on other samples."""
    reference = _validation_samples(monkeypatch, corpus, 1, 10, 7)
    assert _validation_samples(monkeypatch, corpus, 2, 2000, 7) == reference
    assert _validation_samples(monkeypatch, corpus, 1, 2000, None) != _validation_samples(monkeypatch, corpus, 1, 10,
                                                                                            None)


def test_scripts_run_the_entry_or_a_checkout_through_the_launcher(tmp_path):
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable)
    for pp in (2, 4, 8):
        out = subprocess.run(["bash", "scripts/pretrain_gpt.sh", str(pp)], cwd=REPO, env=env,
                             capture_output=True, text=True, check=True).stdout
        assert "-m megatron_tah.pretrain_gpt" in out and f"--pipeline-model-parallel-size {pp}" in out
        assert "--transformer-impl local --distributed-backend gloo" in out and "--tah-log-json" in out
        assert f"--num-layers {max(pp, 4)}" in out and "--tensorboard-dir" in out
    (tmp_path / "pretrain_gpt.py").write_text("")
    out = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "2"], cwd=REPO, capture_output=True, text=True,
                         check=True, env=dict(env, MEGATRON_LM=str(tmp_path))).stdout
    assert f"-m megatron_tah.launch {tmp_path}/pretrain_gpt.py" in out
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20")
    out = subprocess.run(["bash", "scripts/finetune_gpt.sh", "4"], cwd=REPO, capture_output=True, text=True,
                         check=True, env=dict(env, LOAD=str(ckpt))).stdout
    assert f"--load {ckpt} --finetune" in out and "sotu" in out


def test_scripts_fine_tune_an_imported_model_with_its_flags_tokenizer_and_split(tmp_path):
    """LOAD (or HF=, imported once into HF_CKPT) an imported folder: its model flags replace the default model, the
    pipeline split of its 30 layers over 8 stages is Megatron's uneven one, the corpus is tokenized with its
    tokenizer, and its tied embeddings stay tied on a slow link (EMBEDDINGS=untied is refused)."""
    imported = tmp_path / "smol"
    imported.mkdir()
    (imported / "megatron_flags.txt").write_text("--num-layers 30 --hidden-size 576 --num-attention-heads 9 "
                                                 "--tokenizer-type NullTokenizer --vocab-size 49152\n")
    (imported / "latest_checkpointed_iteration.txt").write_text("release")

    def run(pp, **env):
        done = subprocess.run(["bash", "scripts/finetune_gpt.sh", pp], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, LINK="emulate", **env))
        return done.returncode, done.stdout + done.stderr

    rc, out = run("8", LOAD=str(imported), RATE="20mbit")
    assert rc == 0, out
    assert "--num-layers 30 --hidden-size 576" in out and "--vocab-size 49152" in out and "--vocab-size 50257" not in out
    assert "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 3" in out
    assert f"--load {imported} --finetune" in out and "--seq-length 256" in out
    assert "data/sotu_smol_train_text_document" in out and "--untie-embeddings-and-output-weights" not in out
    rc, out = run("2", HF=str(tmp_path / "somewhere"), HF_CKPT=str(imported), SEQ="128")
    assert rc == 0 and f"--load {imported} --finetune" in out and "--seq-length 128" in out
    assert "--decoder-first-pipeline-num-layers" not in out  # 30 layers split evenly over 2 stages
    rc, out = run("2", LOAD=str(imported), EMBEDDINGS="untied")
    assert rc == 2 and "ties its embeddings" in out


def test_an_imported_model_s_tied_embeddings_behind_a_slow_link_go_through_the_embedding_codec(tmp_path):
    """RATE set and an imported model that ties its embeddings (they stay tied: untying would change the model):
    their gradient exchange goes through --tah-embedding-codec int8 by default, and the script says so;
    EMBEDDINGS=model keeps Megatron's uncompressed all-reduce; without RATE, or at one stage, nothing is added; a
    model that unties them needs nothing."""
    def imported(name, *flags):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "megatron_flags.txt").write_text(" ".join(("--num-layers 8 --hidden-size 64 --num-attention-heads 4 "
                                                             "--tokenizer-type NullTokenizer --vocab-size 49152",
                                                             *flags)) + "\n")
        return folder

    tied, untied = imported("tied"), imported("untied", "--untie-embeddings-and-output-weights")

    def run(pp="2", **env):
        done = subprocess.run(["bash", "scripts/pretrain_gpt.sh", pp], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, DRY_RUN="1", DEVICE="cpu", PYTHON=sys.executable, LINK="emulate",
                                       **env))
        assert done.returncode == 0, done.stderr
        return done.stdout

    codec = "--tah-embedding-codec int8"
    out = run(LOAD=str(tied), RATE="20mbit")
    assert codec in out and "--untie-embeddings-and-output-weights" not in out
    assert "the imported model ties its embeddings: behind RATE=20mbit" in out
    assert codec not in run(LOAD=str(tied), RATE="20mbit", EMBEDDINGS="model")
    assert codec not in run(LOAD=str(tied))
    assert codec not in run("1", LOAD=str(tied), RATE="20mbit")
    out = run(LOAD=str(untied), RATE="20mbit")
    assert codec not in out and "--untie-embeddings-and-output-weights" in out


def test_scripts_untie_embeddings_on_a_slow_link_unless_told_otherwise():
    """RATE set: --untie-embeddings-and-output-weights (the tied gradient's all-reduce would cross the slow link
    uncompressed); EMBEDDINGS=tied keeps Megatron's default, EMBEDDINGS=codec compresses that all-reduce."""
    def flags(pp="2", **env):
        run = subprocess.run(["bash", "scripts/pretrain_gpt.sh", pp], cwd=REPO, capture_output=True, text=True,
                             env=dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, LINK="emulate", **env))
        return run.returncode, run.stdout + run.stderr

    untie, codec = "--untie-embeddings-and-output-weights", "--tah-embedding-codec int8"
    rc, out = flags()
    assert rc == 0 and untie not in out and codec not in out  # no RATE: Megatron's tied default
    rc, out = flags(RATE="20mbit")
    assert rc == 0 and untie in out and codec not in out and "--tah-emulate-bandwidth 20mbit" in out
    rc, out = flags(RATE="20mbit", EMBEDDINGS="tied")
    assert rc == 0 and untie not in out and codec not in out
    rc, out = flags(RATE="20mbit", EMBEDDINGS="codec")
    assert rc == 0 and untie not in out and codec in out
    rc, out = flags("1", EMBEDDINGS="codec")
    assert rc == 0 and codec not in out  # one stage: nothing crosses, no flag (it would be an error)
    rc, out = flags(EMBEDDINGS="shared")
    assert rc == 2 and "EMBEDDINGS=shared: choose untied, tied or codec" in out


def test_the_script_checks_payloads_behind_a_slow_link():
    """CHECKSUM: on by default with RATE (a slow link, where it costs under 0.05% of a step), off without; 0 / 1
    override; anything else is an error."""
    def flags(**env):
        run = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "2"], cwd=REPO, capture_output=True, text=True,
                             env=dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, LINK="emulate", **env))
        return run.returncode, run.stdout + run.stderr

    assert flags(RATE="20mbit") == (0, flags(RATE="20mbit")[1]) and "--tah-wire-checksum" in flags(RATE="20mbit")[1]
    assert "--tah-wire-checksum" not in flags()[1]
    assert "--tah-wire-checksum" not in flags(RATE="20mbit", CHECKSUM="0")[1]
    assert "--tah-wire-checksum" in flags(CHECKSUM="1")[1]
    rc, out = flags(CHECKSUM="yes")
    assert rc == 2 and "CHECKSUM=yes: choose 1 or 0" in out


def test_staged_pipeline_gives_the_plain_paths_losses(corpus, tmp_path):
    """--tah-share-gpus on CPU (what CI can run of that mode): every pipeline message goes through host staging;
    forward tah and backward `none` give bit-identical losses, grad norms and wire bytes to the plain path."""
    common = ["--train-iters", "3", "--eval-interval", "100", "--tah-forward-codec", "tah",
              "--tah-backward-codec", "none"]
    logs = {mode: tmp_path / f"{mode}.jsonl" for mode in ("plain", "staged")}
    run(pretrain_gpt.command(2, flags(corpus, 2, logs["plain"], *common)))
    out = run(pretrain_gpt.command(2, flags(corpus, 2, logs["staged"], *common, "--tah-share-gpus")))
    assert "--tah-share-gpus without a CUDA device" in out.stdout + out.stderr
    plain, staged = read_records(logs["plain"]), read_records(logs["staged"])
    assert [r["iteration"] for r in staged] == [1, 2, 3]
    for key in ("lm_loss", "grad_norm", "fwd_wire_bytes", "bwd_wire_bytes"):
        assert [r[key] for r in staged] == [r[key] for r in plain], key
    fwd, bwd = expected_bytes(TahConfig(tah_forward_codec="tah", tah_backward_codec="none"), 2, 4, (32, 2, 64), torch.float32)
    assert {(r["fwd_wire_bytes"], r["bwd_wire_bytes"]) for r in staged} == {(fwd, bwd)}
