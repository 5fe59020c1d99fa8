"""The tied-embedding place (``--tah-embedding-codec``): the first stage's rows bit for bit, the same sum on both
ends, both copies of the weight identical after training through megatron-core's own step, the loss against
megatron-core's uncompressed all-reduce, the flag's errors and the start-up line of a tied run without it."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_tah.codecs import CodecError
from megatron_tah.config import TahConfig
from megatron_tah.megatron import arguments, embedding, places
from tests.helpers import tiny_gpt
from tests.helpers.dist_utils import run_distributed

ENV = {"TRITON_INTERPRET": "1"}


def _sparse_gradient(dtype=torch.float32, vocab=50, hidden=16, seed=0):
    """A word-embedding gradient: zero rows but a few, with the edge cases a row may hold."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.zeros(vocab, hidden, dtype=dtype)
    present = [1, 7, 8, 30, 49]
    grad[present] = torch.randn(len(present), hidden, generator=g).to(dtype)
    grad[12, 3] = -0.0  # only a negative zero: its bits are not zero, it is sent
    grad[20, 0] = float("nan")
    grad[21, 5] = torch.finfo(torch.float32).tiny / 8 if dtype == torch.float32 else 1e-40  # subnormal
    return grad, sorted(present + [12, 20, 21])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_round_trip_bit_for_bit(dtype):
    grad, rows = _sparse_gradient(dtype)
    assert embedding.nonzero_rows(grad).tolist() == rows
    header, buf = embedding.encode_rows(grad)
    assert header.tolist() == [embedding.ROWS_MAGIC, len(rows), 50, 16]
    assert buf.numel() == embedding.rows_nbytes(len(rows), 16, dtype) == 4 * 8 + len(rows) * 16 * dtype.itemsize
    k = embedding.rows_expected(header, (50, 16))
    index, values = embedding.decode_rows(buf, k, 16, dtype)
    rebuilt = torch.zeros_like(grad)
    rebuilt[index] = values
    assert torch.equal(_bits(rebuilt), _bits(grad))  # every bit, -0.0 and NaN included


def test_rows_of_a_zero_gradient_and_of_a_dense_one():
    header, buf = embedding.encode_rows(torch.zeros(8, 4))
    assert header[1] == 0 and buf.numel() == 0
    dense = torch.randn(8, 4)
    header, buf = embedding.encode_rows(dense)
    index, values = embedding.decode_rows(buf, int(header[1]), 4, torch.float32)
    assert index.tolist() == list(range(8)) and torch.equal(values, dense)


def test_rows_header_and_length_are_checked():
    header, buf = embedding.encode_rows(_sparse_gradient()[0])
    with pytest.raises(CodecError, match="50 x 16 gradient, this stage's is 50 x 32"):
        embedding.rows_expected(header, (50, 32))
    wrong = header.clone()
    wrong[0] = 7
    with pytest.raises(CodecError, match="not a rows header"):
        embedding.rows_expected(wrong, (50, 16))
    with pytest.raises(CodecError, match="expected"):
        embedding.decode_rows(buf[:-4], int(header[1]), 16, torch.float32)
    with pytest.raises(ValueError, match="2-D"):
        embedding.encode_rows(torch.ones(3))


def _exchange_body(rank, world_size):
    """Both ends of ``exchange`` on a 2-rank gloo world: rank 0 the first stage (sparse), rank 1 the last (dense)."""
    codec = embedding.codec(TahConfig(tah_embedding_codec="int8"))
    sparse, _ = _sparse_gradient(vocab=64, hidden=128, seed=1)
    sparse[20, 0] = 1.0  # (a NaN would make the comparison below meaningless)
    dense = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    grad = sparse if rank == 0 else dense
    total, traffic = embedding.exchange(codec, grad, torch.distributed.group.WORLD, 1 - rank, first=rank == 0,
                                        wait=lambda work, receiving, what: work.wait())
    # What both must hold: the dense gradient through the codec plus the exact rows, in fp32.
    expected = codec.decode(codec.encode(dense), (64, 128), torch.float32) + sparse
    return tiny_gpt.plain((total, expected, traffic.wire_nbytes, traffic.raw_nbytes))  # tensors as lists


@pytest.mark.distributed
@pytest.mark.smoke
def test_exchange_gives_both_ends_the_same_bits():
    (t0, expected, sent0, raw), (t1, _, sent1, _) = run_distributed(_exchange_body, 2, timeout=300)
    t0, t1, expected = (torch.tensor(t, dtype=torch.float32) for t in (t0, t1, expected))  # (exact: fp32 in floats)
    assert torch.equal(_bits(t0), _bits(t1)) and torch.equal(t0, expected)
    codec = embedding.codec(TahConfig(tah_embedding_codec="int8"))
    assert sent0 == 32 + embedding.rows_nbytes(8, 128, torch.float32)  # header + the 8 non-zero rows
    assert sent1 == codec.wire_nbytes((64, 128), torch.float32) and raw == 64 * 128 * 4


def _train_body(rank, world_size, codec, iterations):
    from megatron.core import parallel_state

    import megatron_tah
    from megatron_tah.megatron.registry import REGISTRY

    model = tiny_gpt.build(pp=2, tied=True)
    ddp, optimizer = tiny_gpt.wrap_ddp(model, False, 3e-3)
    megatron_tah.install(TahConfig(tah_embedding_codec=codec))
    losses, _ = tiny_gpt.train(ddp, iterations, ddp_optimizer=optimizer)
    wan = REGISTRY.stats.collect()["wan"]["embedding"]  # the WAN ledger's embedding bytes, all iterations
    megatron_tah.uninstall()
    weight = model.shared_embedding_or_output_weight().detach().clone()
    last = parallel_state.is_pipeline_last_stage()
    return tiny_gpt.plain({"weight": weight, "losses": [sum(x) / len(x) for x in losses] if last else None,
                           "wan": wan})


@pytest.mark.distributed
def test_both_copies_of_the_tied_weight_stay_identical_and_the_loss_follows_the_uncompressed_all_reduce():
    """Six Adam steps of megatron-core's schedule, DDP and finalize_model_grads on a tied GPT at PP=2: the first
    stage's word embedding and the last stage's output weight are equal bit for bit, with megatron-core's
    all-reduce and through the codec; the codec's loss stays by the uncompressed one."""
    iterations = 6

    def run(codec):
        first, last = run_distributed(_train_body, 2, codec, iterations, env=ENV, timeout=900)
        return (torch.tensor(first["weight"], dtype=torch.float32), torch.tensor(last["weight"], dtype=torch.float32),
                last["losses"], (first["wan"], last["wan"]))

    base_first, base_last, base_losses, base_wan = run("none")
    first, last, losses, wan = run("int8")
    # The WAN ledger: megatron-core's all-reduce bills vocabulary x hidden x 4 bytes to each end per iteration;
    # through the codec the last stage sends the int8 buffer, the first its header and the rows of the batch's
    # tokens (at most every row), all of it codec traffic.
    full = tiny_gpt.VOCAB * tiny_gpt.HIDDEN * 4
    assert base_wan[0] == base_wan[1] == {"ops": iterations, "bytes": iterations * full, "codec_bytes": 0}
    dense = embedding.codec(TahConfig(tah_embedding_codec="int8")).wire_nbytes((tiny_gpt.VOCAB, tiny_gpt.HIDDEN),
                                                                               torch.float32)
    assert wan[1] == {"ops": iterations, "bytes": iterations * dense, "codec_bytes": iterations * dense}
    assert dense < full / 3.8
    rows_at_most = 32 + embedding.rows_nbytes(tiny_gpt.VOCAB, tiny_gpt.HIDDEN, torch.float32)
    assert wan[0]["ops"] == 2 * iterations and wan[0]["codec_bytes"] == wan[0]["bytes"] <= iterations * rows_at_most
    assert torch.equal(_bits(base_first), _bits(base_last))
    assert torch.equal(_bits(first), _bits(last))
    assert not torch.equal(first, base_first)  # the codec did change the output layer's contribution
    assert losses[-1] < losses[0] - 1.0 and base_losses[-1] < base_losses[0] - 1.0, (losses, base_losses)
    # The loss falls ~4.9 -> ~2.9 in 6 steps; 8-bit output-layer gradients moved it by < 0.01 in our runs.
    assert max(abs(a - b) for a, b in zip(losses, base_losses)) < 0.05, (losses, base_losses)


# ----- the flag's rules and the start-up line ----------------------------------------------------------
def _args(**values):
    defaults = {"pipeline_model_parallel_size": 2, "untie_embeddings_and_output_weights": False,
                "padded_vocab_size": 50304, "vocab_size": 50257, "hidden_size": 128, "bf16": False,
                "fp16": False, "accumulate_allreduce_grads_in_fp32": False}
    return argparse.Namespace(**{**defaults, **values})


def test_flag_choices_and_the_cases_with_nothing_to_compress():
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    assert parser._option_string_actions["--tah-embedding-codec"].choices == ("none", "int8")
    with pytest.raises(ValueError, match="tah_embedding_codec = 'fp8': choose one of none, int8"):
        TahConfig(tah_embedding_codec="fp8")
    assert embedding.codec(TahConfig()) is None
    assert embedding.codec(TahConfig(tah_embedding_codec="int8")).describe() == "int8(block_size=128)"
    config = TahConfig(tah_embedding_codec="int8")
    embedding.check_embedding_codec(config, _args())
    embedding.check_embedding_codec(TahConfig(), _args(pipeline_model_parallel_size=1))
    with pytest.raises(ValueError, match="with one stage nothing crosses"):
        embedding.check_embedding_codec(config, _args(pipeline_model_parallel_size=1))
    with pytest.raises(ValueError, match="--untie-embeddings-and-output-weights: untied embeddings have no"):
        embedding.check_embedding_codec(config, _args(untie_embeddings_and_output_weights=True))
    with pytest.raises(ValueError, match="with one stage nothing crosses"):  # the place's check of Megatron's args
        places.check_args(config, _args(pipeline_model_parallel_size=1))


def test_validation_stops_an_embedding_codec_without_tied_stages_in_one_line(monkeypatch, capsys):
    from tests.megatron.test_arguments import gpt_argv, refused_by_validation

    err = refused_by_validation(monkeypatch, capsys, gpt_argv(1, "--tah-embedding-codec", "int8"), world_size=1)
    assert len(err) == 1 and err[0].startswith("error: megatron_tah: --tah-embedding-codec int8 compresses")


def test_the_start_up_line_of_a_tied_run_names_its_bytes_and_the_two_remedies():
    paper = TahConfig(tah_preset="paper")
    line = embedding.tied_embedding_warning(paper, _args())
    assert line == ("> megatron_tah: warning: tied embeddings: every iteration all-reduces the 50304 x 128 "
                    "word-embedding gradient between the first and the last stage uncompressed, 51.5 MB per "
                    "iteration (25.8 MB each way) beside the compressed pipeline; compress it with "
                    "--tah-embedding-codec int8 or untie with --untie-embeddings-and-output-weights")
    gpt2_xl = embedding.tied_embedding_warning(paper, _args(hidden_size=1600, bf16=True,
                                                            accumulate_allreduce_grads_in_fp32=True))
    assert "50304 x 1600" in gpt2_xl and "643.9 MB per iteration (321.9 MB each way)" in gpt2_xl
    assert "(161.0 MB each way)" in embedding.tied_embedding_warning(paper, _args(hidden_size=1600, bf16=True))
    # A vocabulary the tokenizer sets later (no --vocab-size yet): the line without the sizes.
    unsized = embedding.tied_embedding_warning(paper, _args(vocab_size=None, padded_vocab_size=None))
    assert "all-reduces the word-embedding gradient" in unsized and "MB" not in unsized
    # No line: untied, one stage, the embedding codec on, or no pipeline codec at all.
    assert embedding.tied_embedding_warning(paper, _args(untie_embeddings_and_output_weights=True)) is None
    assert embedding.tied_embedding_warning(paper, _args(pipeline_model_parallel_size=1)) is None
    assert embedding.tied_embedding_warning(TahConfig(tah_preset="paper", tah_embedding_codec="int8"), _args()) is None
    assert embedding.tied_embedding_warning(TahConfig(tah_dp_codec="int8"), _args()) is None
    assert places.startup_lines(paper, _args())[-1] == line  # the place's start-up line, after the pipeline's
