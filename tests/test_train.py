"""The compact trainer (``python -m megatron_tah.train``): learning at PP=2 and PP=4, checkpoint
resume and fine-tuning, data order, and one-line errors for bad input.

Runs use a synthetic learnable corpus (arithmetic token sequences, vocabulary 128,
``--tokenizer-type NullTokenizer``) and a 2-4 layer, hidden-64 GPT, so each run is
dominated by process start-up (~10-20 s on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_tah import train
from megatron_tah.trainer_args import parse_args, split_bounds

VOCAB = 128
PY = sys.executable


def write_corpus(prefix: Path, documents: int = 48, length: int = 400, seed: int = 0) -> str:
    """Documents of the form (a + k*step) mod VOCAB: next-token prediction a small GPT can learn."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        start, step = rng.integers(0, VOCAB), rng.integers(1, 5)
        builder.add_document(((start + step * np.arange(length)) % VOCAB).astype(np.uint16), [length])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "arith")


def model_flags(corpus: str, pp: int, layers: int, iters: int) -> list[str]:
    return ["--data-path", corpus, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--pipeline-model-parallel-size", str(pp), "--eval-interval", "0", "--eval-iters", "2",
            "--quiet"]


def run_trainer(flags: list[str], log: Path, timeout: int = 900) -> list[dict]:
    proc = subprocess.run([PY, "-m", "megatron_tah.train", *flags, "--log-json", str(log)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def assert_learns(records: list[dict], iters: int) -> None:
    assert [r["iteration"] for r in records] == list(range(1, iters + 1))
    first = records[0]["lm_loss"]
    last = np.mean([r["lm_loss"] for r in records[-4:]])
    assert first > np.log(VOCAB) - 0.5  # starts near uniform
    assert last < first - 0.5, [round(r["lm_loss"], 3) for r in records]
    assert records[-1]["valid_loss"] < first - 0.5
    # Compressed traffic flowed both ways: TAH-Quant forward, fixed point backward.
    assert all(r["fwd_wire_bytes"] > 0 and r["bwd_wire_bytes"] > 0 for r in records)
    assert all(r["fwd_wire_bytes"] < r["fwd_raw_bytes"] / 4 for r in records)


@pytest.fixture(scope="module")
def pp2_run(corpus, tmp_path_factory):
    """24 iterations at PP=2, checkpoints at 12 and 24."""
    out = tmp_path_factory.mktemp("pp2")
    flags = model_flags(corpus, 2, 2, 24) + ["--save", str(out / "ckpt"), "--save-interval", "12"]
    return out, run_trainer(flags, out / "log.jsonl")


@pytest.mark.distributed
def test_pp2_learns(pp2_run):
    _, records = pp2_run
    assert_learns(records, 24)
    # The codecs' own time is logged; no per-sample state without AQ-SGD.
    assert all(r["codec_ms"] > 0 and r["buffer_bytes"] == 0 for r in records)
    assert all(r["tah"]["forward"]["encode_seconds"] > 0 and r["tah"]["backward"]["decode_seconds"] > 0
               for r in records)


@pytest.mark.distributed
def test_aqsgd_buffer_bytes_are_logged(corpus, tmp_path):
    """Both ends of the one link hold [seq, hidden] fp32 per sample seen (no sample revisited yet)."""
    flags = model_flags(corpus, 2, 2, 3) + ["--tah-forward-codec", "aqsgd"]
    records = run_trainer(flags, tmp_path / "log.jsonl")
    per_sample = 32 * 64 * 4
    assert [r["buffer_bytes"] for r in records] == [2 * 8 * i * per_sample for i in (1, 2, 3)]


@pytest.mark.distributed
def test_pp4_learns(corpus, tmp_path):
    records = run_trainer(model_flags(corpus, 4, 4, 20), tmp_path / "log.jsonl")
    assert_learns(records, 20)
    # Three stage boundaries: every stage sends forward except the last, every stage but the first backward.
    assert set(records[-1]["tah"]["links"]) == {"0->1", "1->2", "2->3", "3->2", "2->1", "1->0"}


@pytest.mark.distributed
def test_load_resumes_the_same_losses(corpus, pp2_run, tmp_path):
    out, full = pp2_run
    ckpt = out / "ckpt"
    assert (ckpt / "iter_0000012" / "mp_rank_00_001" / "model_optim_rng.pt").is_file()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("12\n")  # resume from the middle
    resumed = run_trainer(model_flags(corpus, 2, 2, 24) + ["--load", str(ckpt)], tmp_path / "log.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(13, 25))
    assert resumed[0]["consumed_samples"] == 13 * 8
    np.testing.assert_allclose([r["lm_loss"] for r in resumed], [r["lm_loss"] for r in full[12:]], rtol=1e-5)

    # --finetune: weights only; iteration count, optimizer and lr schedule start afresh.
    tuned = run_trainer(model_flags(corpus, 2, 2, 2) + ["--load", str(ckpt), "--finetune"],
                        tmp_path / "finetune.jsonl")
    assert [r["iteration"] for r in tuned] == [1, 2]
    assert tuned[0]["lm_loss"] < full[0]["lm_loss"] - 0.5  # starts from the trained weights


def test_batches_resume_in_the_same_order(corpus):
    data = train.TokenSamples(corpus, 32, split_bounds("90,10,0", 0))
    stream = train.batches(data, 2, 0, 7, "cpu")
    seen = [next(stream) for _ in range(len(data))]  # more than one epoch of micro-batches of 2
    resumed = train.batches(data, 2, 10, 7, "cpu")
    for expected in seen[5:8]:
        got = next(resumed)
        assert torch.equal(got["sample_ids"], expected["sample_ids"])
        assert torch.equal(got["tokens"], expected["tokens"])
    # One epoch visits every sample once; labels are the tokens shifted by one.
    first_epoch = torch.cat([b["sample_ids"] for b in seen])[: len(data)]
    assert sorted(first_epoch.tolist()) == list(range(data.first, data.first + len(data)))
    assert torch.equal(seen[0]["tokens"][:, 1:], seen[0]["labels"][:, :-1])
    valid = train.TokenSamples(corpus, 32, split_bounds("90,10,0", 1))
    assert valid.first == data.first + len(data)


def test_learning_rate_schedule(corpus):
    args = parse_args(model_flags(corpus, 2, 2, 100) + ["--lr-warmup-iters", "10", "--min-lr", "1e-4"])
    lrs = [train.learning_rate(args, i) for i in range(1, 101)]
    assert lrs[9] == pytest.approx(3e-3) and lrs[0] == pytest.approx(3e-4)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05)


@pytest.mark.parametrize("change, message", [
    ({"--data-path": "/nonexistent/corpus"}, "--data-path /nonexistent/corpus: found neither"),
    ({"--num-layers": "3"}, "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    ({"--global-batch-size": "7"}, "--global-batch-size 7 is not divisible by --micro-batch-size 2"),
    ({"--hidden-size": "65"}, "--hidden-size 65 is not divisible by --num-attention-heads 2"),
    ({"--tensor-model-parallel-size": "2"}, "supports 1"),
    ({"--tah-tile-size": "48"}, "--tah-tile-size"),
    ({"--split": "100,0,0"}, "validation share must be > 0"),
    ({"--split": "a,b"}, "--split 'a,b': give up to three"),
])
def test_bad_input_is_one_clear_line(corpus, capsys, change, message):
    flags = model_flags(corpus, 2, 2, 4)
    for flag, value in change.items():
        if flag in flags:
            flags[flags.index(flag) + 1] = value
        else:
            flags += [flag, value]
    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_vocab_and_checkpoint_files(corpus, capsys, tmp_path):
    flags = model_flags(corpus, 2, 2, 4)
    flags[flags.index("NullTokenizer")] = "GPT2BPETokenizer"
    with pytest.raises(SystemExit):
        parse_args(flags + ["--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "m.txt")])
    assert f"--vocab-file {tmp_path / 'vocab.json'}: file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(model_flags(corpus, 2, 2, 4) + ["--load", str(tmp_path)])
    assert "no latest_checkpointed_iteration.txt" in capsys.readouterr().err


@pytest.mark.distributed
def test_token_ids_outside_the_vocabulary_are_one_line(corpus, tmp_path):
    flags = model_flags(corpus, 1, 2, 2)
    flags[flags.index("--vocab-size") + 1] = "100"  # the corpus holds ids up to 127
    proc = subprocess.run([PY, "-m", "megatron_tah.train", *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "holds token id 127, outside the vocabulary of 100" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_error_has_no_traceback(tmp_path):
    proc = subprocess.run([PY, "-m", "megatron_tah.train", "--data-path", str(tmp_path / "missing"),
                           "--num-layers", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("python -m megatron_tah.train: error: --num-layers 3")


def _script(name: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    import os

    root = Path(__file__).resolve().parents[1]
    full = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM", "RATE", "LINK", "CODEC", "PP")}
    full.update(DRY_RUN="1", PYTHON=PY, **env)
    return subprocess.run(["bash", str(root / "scripts" / name)], capture_output=True, text=True, env=full,
                          timeout=120)


def test_scripts_build_the_expected_commands(tmp_path):
    megatron = tmp_path / "Megatron-LM"
    megatron.mkdir()
    (megatron / "pretrain_gpt.py").write_text("")
    out = _script("pretrain_gpt_pp8.sh", tmp_path, MEGATRON_LM=str(megatron), RATE="1gbit", NUM_NODES="2",
                  GPUS_PER_NODE="4", NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    assert out.returncode == 0, out.stderr
    for part in ("-m megatron_tah.launch", f"{megatron}/pretrain_gpt.py", "--pipeline-model-parallel-size 8",
                 "--num-layers 48", "--hidden-size 1600", "--nnodes 2", "--node_rank 1", "--master_addr 10.0.0.1",
                 "--nproc_per_node 4", "--tah-forward-codec tah", "--tah-emulate-bandwidth 1gbit"):
        assert part in out.stdout, part
    bad = _script("pretrain_gpt.sh", tmp_path, MEGATRON_LM=str(megatron), PP="5")
    assert bad.returncode == 2 and "must divide 48 layers" in bad.stderr

    compact = _script("pretrain_gpt_pp4.sh", tmp_path, RATE="100mbit", LINK="emulate", CODEC="none")
    assert compact.returncode == 0, compact.stderr
    for part in ("-m megatron_tah.train", "--pipeline-model-parallel-size 4", "--tah-forward-codec none",
                 "--tah-emulate-bandwidth 100mbit", "shakespeare_train_text_document"):
        assert part in compact.stdout, part

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert _script("finetune_gpt_pp2.sh", tmp_path, LOAD=str(ckpt)).returncode == 2  # no tracker file
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10\n")
    tune = _script("finetune_gpt_pp2.sh", tmp_path, LOAD=str(ckpt))
    assert tune.returncode == 0, tune.stderr
    for part in (f"--load {ckpt}", "--finetune", "sotu_train_text_document", "runs/finetune_pp2/ckpt"):
        assert part in tune.stdout, part
