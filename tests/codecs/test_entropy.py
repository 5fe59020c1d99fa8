"""``megatron_tah.codecs.entropy``: the lossless coder after a codec gives back its buffer bit for bit, in fewer
bytes where the codes are skewed, never more than the capacity, and rejects what it did not write."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tah.codecs import WireFormatError, entropy, get_codec
from megatron_tah.codecs.samples import activation_like
from megatron_tah.config import TahConfig
from megatron_tah.config.presets import PRESETS
from tests.helpers.codec_cases import Case, cases, encode
from tests.helpers.edge_cases import EDGE_CASES, edge_case_tensor, with_bad_values


def _kraft(lengths) -> float:
    return sum(2.0 ** -n for n in lengths if n)


def test_code_lengths_are_huffmans_for_a_known_distribution():
    # counts 8, 4, 2, 1, 1: lengths 1, 2, 3, 4, 4 (a complete code: Kraft sum 1)
    assert entropy.code_lengths([8, 4, 2, 1, 1, 0]) == [1, 2, 3, 4, 4, 0]
    assert entropy.code_lengths([0, 5, 0]) == [0, 1, 0]  # one symbol: one bit each
    assert entropy.code_lengths([3, 3, 3, 3]) == [2, 2, 2, 2]


def test_code_lengths_are_capped_and_stay_a_prefix_code():
    counts = [2**i for i in range(20)]  # Fibonacci-like skew: unlimited Huffman lengths reach 19
    lengths = entropy.code_lengths(counts, limit=12)
    assert max(lengths) == 12 and min(lengths) >= 1 and _kraft(lengths) <= 1.0
    # the most frequent symbols keep the shortest codes
    assert lengths[-1] == min(lengths) and lengths[0] == 12


def test_canonical_codes_are_prefix_free():
    lengths = entropy.code_lengths([50, 20, 20, 5, 3, 1, 1])
    codes = entropy._canonical_codes(lengths)
    words = [format(c, f"0{n}b") for c, n in zip(codes, lengths)]
    for a in words:
        for b in words:
            assert a == b or not b.startswith(a)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("n", [1, 7, entropy.CHUNK, entropy.CHUNK + 1, 3 * entropy.CHUNK - 5])
def test_symbols_round_trip_exactly(bits, n):
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    skewed = (torch.randn(n, generator=gen).abs() * 2 ** (bits - 2)).clamp(max=2**bits - 1).to(torch.int64)
    coded = entropy.encode_symbols(skewed, bits)
    symbols, used = entropy.decode_symbols(torch.cat([coded, torch.full((5,), 0xAB, dtype=torch.uint8)]), n, bits)
    assert used == coded.numel()  # what follows the section is not read
    assert torch.equal(symbols, skewed)


def test_a_skewed_section_costs_about_its_entropy():
    gen = torch.Generator().manual_seed(0)
    symbols = torch.multinomial(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]), 64 * 1024, True, generator=gen)
    coded = entropy.encode_symbols(symbols, 3)
    # a dyadic distribution: Huffman meets its entropy (1.875 bits), plus the table and 2 bytes per chunk
    chunks = math.ceil(symbols.numel() / entropy.CHUNK)
    assert 8 * coded.numel() == pytest.approx(1.875 * symbols.numel() + 16 * chunks + 8 * (2 + 4), abs=8 * chunks)


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "none"])
def test_every_presets_buffers_round_trip_bit_for_bit_and_shrink(preset):
    config = TahConfig(tah_preset=preset, tah_backend="torch")
    x = activation_like((64, 2, 128), seed=5)
    for codec in (config.forward_codec(), config.backward_codec()):
        shape = tuple(x.shape)
        buf = codec.encode(x)
        coded = entropy.encode(codec, buf, shape, x.dtype)
        assert coded.numel() < buf.numel() <= entropy.capacity_nbytes(codec, shape, x.dtype)
        back = entropy.decode(codec, coded, shape, x.dtype)
        assert torch.equal(back, buf)
        assert torch.equal(codec.decode(back, shape, x.dtype), codec.decode(buf, shape, x.dtype))


@pytest.mark.parametrize("kind", EDGE_CASES + ["bad_values"])
@pytest.mark.parametrize("case", cases(variants={"channel_6bit": Case("channel", {"bits": 6})}))
def test_edge_case_buffers_round_trip_and_never_exceed_the_capacity(kind, case):
    codec = case.make()
    x = edge_case_tensor("gaussian" if kind == "bad_values" else kind, shape=(6, 2, 96), dtype=torch.bfloat16)
    if kind == "bad_values":
        x = with_bad_values(x)
    shape = tuple(x.shape)
    buf = encode(codec, x)
    coded = entropy.encode(codec, buf, shape, x.dtype)
    assert coded.numel() <= entropy.capacity_nbytes(codec, shape, x.dtype)
    assert torch.equal(entropy.decode(codec, coded, shape, x.dtype), buf)


def test_a_uniform_section_is_carried_as_it_is():
    """Uniform codes gain nothing: the section goes raw, one mode byte more than the codec's buffer."""
    codec = get_codec("channel", bits=4)
    x = (torch.rand(4096, 1, 8) * torch.arange(1, 9)).to(torch.bfloat16)
    buf = codec.encode(x)
    layout = codec.layout(tuple(x.shape), x.dtype)
    start, size = layout.offsets["codes"]
    coded = entropy.encode(codec, buf, tuple(x.shape), x.dtype)
    assert coded[start + 2] == entropy.RAW  # after the scale and zero sections' mode bytes
    assert torch.equal(coded[start + 3 : start + 3 + size], buf[start : start + size])
    assert torch.equal(entropy.decode(codec, coded, tuple(x.shape), x.dtype), buf)


def test_a_corrupted_or_truncated_buffer_is_an_error_never_garbage():
    codec = get_codec("hadint", bits=4)
    x = activation_like((64, 2, 128), seed=1)
    shape = tuple(x.shape)
    coded = entropy.encode(codec, codec.encode(x), shape, x.dtype)
    with pytest.raises(WireFormatError, match="ends at|need"):
        entropy.decode(codec, coded[:-10], shape, x.dtype)
    with pytest.raises(WireFormatError, match="sections end at"):
        entropy.decode(codec, torch.cat([coded, coded[:3]]), shape, x.dtype)
    first = codec.layout(shape, x.dtype).offsets["scale"][0]  # the first section's mode byte: after the header
    assert first == 16 and coded[first] == entropy.HUFFMAN  # bf16 scales: their exponent bytes repeat
    bad_mode = coded.clone()
    bad_mode[first] = 7
    with pytest.raises(WireFormatError, match="mode 7"):
        entropy.decode(codec, bad_mode, shape, x.dtype)
    bad_table = coded.clone()
    bad_table[first + 1] = 15  # longest code 15 > 12
    with pytest.raises(WireFormatError, match="invalid code table"):
        entropy.decode(codec, bad_table, shape, x.dtype)
    with pytest.raises(WireFormatError, match="1-D uint8"):
        entropy.decode(codec, coded.to(torch.int32), shape, x.dtype)
    with pytest.raises(WireFormatError, match="takes hadint's"):
        entropy.encode(codec, coded, shape, x.dtype)


def test_a_chunk_whose_codes_do_not_fill_it_is_an_error():
    symbols = torch.arange(2 * entropy.CHUNK) % 5
    coded = entropy.encode_symbols(symbols, 3)
    table = 2 + 4
    bad = coded.clone()
    bad[table] += 1  # the first chunk claims one byte more than its codes fill
    with pytest.raises(WireFormatError, match="not valid codes|need"):
        entropy.decode_symbols(bad, symbols.numel(), 3)
    # a window that is no code: an incomplete code (one symbol of 3 bits: only prefix 0 is a code)
    one = entropy.encode_symbols(torch.zeros(16, dtype=torch.int64), 3)
    assert one[1] == 1  # longest code: 1 bit
    bad = one.clone()
    bad[-1] = 0xFF
    with pytest.raises(WireFormatError, match="not valid codes"):
        entropy.decode_symbols(bad, 16, 3)


@pytest.mark.parametrize("flip", [40, 300, 1000, -3])
def test_a_flipped_payload_bit_is_caught_by_the_entropy_checks_or_the_codecs_checksum(flip):
    """Huffman codes resynchronise, so a flipped bit may still decode to symbols; the codec's payload checksum
    over the rebuilt buffer (``--tah-wire-checksum``) catches what the chunk checks do not."""
    from megatron_tah.codecs import PayloadChecksumError

    codec = get_codec("hadint", bits=4, checksum=True)
    x = activation_like((64, 2, 128), seed=2)
    shape = tuple(x.shape)
    coded = entropy.encode(codec, codec.encode(x), shape, x.dtype)
    bad = coded.clone()
    bad[flip] ^= 0x10
    with pytest.raises((WireFormatError, PayloadChecksumError)):
        codec.decode(entropy.decode(codec, bad, shape, x.dtype), shape, x.dtype)


def test_decoding_takes_the_same_few_tensor_operations_whatever_the_sections_size():
    """No loop over codes: a section of 40 chunks decodes in as many tensor operations as one of 2 (on a GPU,
    as many kernel launches), fewer than 150."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (2 * entropy.CHUNK, 40 * entropy.CHUNK):
        symbols = (torch.randn(n, generator=torch.Generator().manual_seed(n)).abs() * 3).clamp(max=15).long()
        coded = entropy.encode_symbols(symbols, 4)
        with Count() as count:
            decoded, _ = entropy.decode_symbols(coded, n, 4)
        assert torch.equal(decoded, symbols)
        counts.append(count.ops)
    assert counts[0] == counts[1] < 150, counts


def test_a_section_too_large_for_int32_bit_positions_decodes_with_int64_ones(monkeypatch):
    symbols = (torch.randn(3 * entropy.CHUNK, generator=torch.Generator().manual_seed(9)).abs() * 4).clamp(max=15)
    coded = entropy.encode_symbols(symbols.long(), 4)
    monkeypatch.setattr(entropy, "INT32_BITS", 64)  # every section here is "large"
    decoded, used = entropy.decode_symbols(coded, symbols.numel(), 4)
    assert used == coded.numel() and torch.equal(decoded, symbols.long())
