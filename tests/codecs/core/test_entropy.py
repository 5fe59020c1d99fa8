"""``megatron_tah.codecs.core.entropy``: the lossless coders after a codec (``ans`` on the host, ``huffman`` on the
device) give back its buffer bit for bit, in fewer bytes where the codes are skewed, never more than the capacity,
and reject what they did not write (another coder's sections included). Real messages: ``test_entropy_real.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zstandard

from megatron_tah.codecs import WireFormatError, get_codec
from megatron_tah.codecs.core import ans, entropy, huffman, zstd
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.config import TahConfig
from megatron_tah.config.presets import PRESETS
from tests.helpers.codec_cases import Case, cases, encode
from tests.helpers.edge_cases import EDGE_CASES, edge_case_tensor, with_bad_values


def _kraft(lengths) -> float:
    return sum(2.0 ** -n for n in lengths if n)


def test_code_lengths_are_huffmans_for_a_known_distribution():
    # counts 8, 4, 2, 1, 1: lengths 1, 2, 3, 4, 4 (a complete code: Kraft sum 1)
    assert huffman.code_lengths([8, 4, 2, 1, 1, 0]) == [1, 2, 3, 4, 4, 0]
    assert huffman.code_lengths([0, 5, 0]) == [0, 1, 0]  # one symbol: one bit each
    assert huffman.code_lengths([3, 3, 3, 3]) == [2, 2, 2, 2]


def test_code_lengths_are_capped_and_stay_a_prefix_code():
    counts = [2**i for i in range(20)]  # Fibonacci-like skew: unlimited Huffman lengths reach 19
    lengths = huffman.code_lengths(counts, limit=12)
    assert max(lengths) == 12 and min(lengths) >= 1 and _kraft(lengths) <= 1.0
    # the most frequent symbols keep the shortest codes
    assert lengths[-1] == min(lengths) and lengths[0] == 12


def test_canonical_codes_are_prefix_free():
    lengths = huffman.code_lengths([50, 20, 20, 5, 3, 1, 1])
    codes = huffman._canonical_codes(lengths)
    words = [format(c, f"0{n}b") for c, n in zip(codes, lengths)]
    for a in words:
        for b in words:
            assert a == b or not b.startswith(a)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("n", [1, 7, huffman.CHUNK, huffman.CHUNK + 1, 3 * huffman.CHUNK - 5])
def test_symbols_round_trip_exactly(bits, n):
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    skewed = (torch.randn(n, generator=gen).abs() * 2 ** (bits - 2)).clamp(max=2**bits - 1).to(torch.int64)
    coded = huffman.encode_symbols(skewed, bits)
    symbols, used = huffman.decode_symbols(torch.cat([coded, torch.full((5,), 0xAB, dtype=torch.uint8)]), n, bits)
    assert used == coded.numel()  # what follows the section is not read
    assert torch.equal(symbols, skewed)


def test_a_skewed_section_costs_about_its_entropy():
    gen = torch.Generator().manual_seed(0)
    symbols = torch.multinomial(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]), 64 * 1024, True, generator=gen)
    coded = huffman.encode_symbols(symbols, 3)
    # a dyadic distribution: Huffman meets its entropy (1.875 bits), plus the table and 2 bytes per chunk
    chunks = math.ceil(symbols.numel() / huffman.CHUNK)
    assert 8 * coded.numel() == pytest.approx(1.875 * symbols.numel() + 16 * chunks + 8 * (2 + 4), abs=8 * chunks)


@pytest.mark.parametrize("coder", list(entropy.CODERS))
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "none"])
def test_every_presets_buffers_round_trip_bit_for_bit_and_shrink(preset, coder):
    config = TahConfig(tah_preset=preset, tah_backend="torch")
    x = activation_like((64, 2, 128), seed=5)
    for codec in (config.forward_codec(), config.backward_codec()):
        shape = tuple(x.shape)
        buf = codec.encode(x)
        coded = entropy.encode(codec, buf, shape, x.dtype, coder)
        assert coded.numel() < buf.numel() <= entropy.capacity_nbytes(codec, shape, x.dtype)
        back = entropy.decode(codec, coded, shape, x.dtype, coder)
        assert torch.equal(back, buf)
        assert torch.equal(codec.decode(back, shape, x.dtype), codec.decode(buf, shape, x.dtype))


@pytest.mark.parametrize("coder", list(entropy.CODERS))
@pytest.mark.parametrize("kind", EDGE_CASES + ["bad_values"])
@pytest.mark.parametrize("case", cases(variants={"channel_6bit": Case("channel", {"bits": 6})}))
def test_edge_case_buffers_round_trip_and_never_exceed_the_capacity(kind, case, coder):
    codec = case.make()
    x = edge_case_tensor("gaussian" if kind == "bad_values" else kind, shape=(6, 2, 96), dtype=torch.bfloat16)
    if kind == "bad_values":
        x = with_bad_values(x)
    shape = tuple(x.shape)
    buf = encode(codec, x)
    coded = entropy.encode(codec, buf, shape, x.dtype, coder)
    assert coded.numel() <= entropy.capacity_nbytes(codec, shape, x.dtype)
    assert torch.equal(entropy.decode(codec, coded, shape, x.dtype, coder), buf)


@pytest.mark.parametrize("coder", list(entropy.CODERS))
def test_a_uniform_section_is_carried_as_it_is(coder):
    """Uniform codes gain nothing: the section goes raw, one mode byte more than its bytes. (The codes of a
    codec's buffer are replaced by random bytes: the coder reads only the layout.)"""
    codec = get_codec("channel", bits=4)
    x = (torch.rand(4096, 1, 8) * torch.arange(1, 9)).to(torch.bfloat16)
    buf = codec.encode(x)
    layout = codec.layout(tuple(x.shape), x.dtype)
    start, size = layout.offsets["codes"]
    buf[start : start + size] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    coded = entropy.encode(codec, buf, tuple(x.shape), x.dtype, coder)
    assert coded[-size - 1] == entropy.RAW  # the last section: its mode byte, then its bytes as they are
    assert torch.equal(coded[-size:], buf[start : start + size])
    assert torch.equal(entropy.decode(codec, coded, tuple(x.shape), x.dtype, coder), buf)


def test_a_corrupted_or_truncated_huffman_buffer_is_an_error_never_garbage():
    codec = get_codec("hadint", bits=4)
    x = activation_like((64, 2, 128), seed=1)
    shape = tuple(x.shape)
    coded = entropy.encode(codec, codec.encode(x), shape, x.dtype, "huffman")
    with pytest.raises(WireFormatError, match="ends at|need"):
        entropy.decode(codec, coded[:-10], shape, x.dtype, "huffman")
    with pytest.raises(WireFormatError, match="sections end at"):
        entropy.decode(codec, torch.cat([coded, coded[:3]]), shape, x.dtype, "huffman")
    first = codec.layout(shape, x.dtype).offsets["scale"][0]  # the first section's mode byte: after the header
    assert first == 16 and coded[first] == huffman.MODE  # bf16 scales: their exponent bytes repeat
    bad_mode = coded.clone()
    bad_mode[first] = 7
    with pytest.raises(WireFormatError, match="mode 7"):
        entropy.decode(codec, bad_mode, shape, x.dtype, "huffman")
    bad_table = coded.clone()
    bad_table[first + 1] = 15  # longest code 15 > 12
    with pytest.raises(WireFormatError, match="invalid code table"):
        entropy.decode(codec, bad_table, shape, x.dtype, "huffman")
    with pytest.raises(WireFormatError, match="1-D uint8"):
        entropy.decode(codec, coded.to(torch.int32), shape, x.dtype, "huffman")
    with pytest.raises(WireFormatError, match="takes hadint's"):
        entropy.encode(codec, coded, shape, x.dtype)


def _ans_coded(seed: int = 1, checksum: bool = False):
    codec = get_codec("hadint", bits=4, checksum=checksum)
    x = activation_like((64, 2, 128), seed=seed)
    shape = tuple(x.shape)
    return codec, shape, x.dtype, entropy.encode(codec, codec.encode(x), shape, x.dtype, "ans")


def test_a_truncated_or_padded_ans_buffer_is_an_error():
    codec, shape, dtype, coded = _ans_coded()
    for cut in (1, 10, coded.numel() // 2):
        with pytest.raises(WireFormatError, match="ends at|need|past the buffer"):
            entropy.decode(codec, coded[:-cut], shape, dtype, "ans")
    with pytest.raises(WireFormatError, match="sections end at"):
        entropy.decode(codec, torch.cat([coded, coded[:3]]), shape, dtype, "ans")


def test_a_corrupted_ans_table_or_stream_is_an_error_never_garbage():
    codec, shape, dtype, coded = _ans_coded()
    first, codes_nbytes = codec.layout(shape, dtype).offsets["codes"]
    first += 1  # the scale section went raw: one mode byte
    assert coded[16] == entropy.RAW and coded[first] == ans.MODE  # the codes: skewed 4-bit symbols
    bad_mode = coded.clone()
    bad_mode[first] = 7
    with pytest.raises(WireFormatError, match="mode 7"):
        entropy.decode(codec, bad_mode, shape, dtype, "ans")
    no_symbols = coded.clone()
    no_symbols[first + 5 : first + 5 + 2 ** ans.symbol_bits(4, codes_nbytes)] = 0
    with pytest.raises(WireFormatError, match="without symbols"):
        entropy.decode(codec, no_symbols, shape, dtype, "ans")
    longer = coded.clone()
    longer[first + 1] += 1  # the stream claims one word more than it has: the next section's bytes are read
    with pytest.raises(WireFormatError):
        entropy.decode(codec, longer, shape, dtype, "ans")
    codes = codec.layout(shape, dtype).offsets["codes"]
    caught = 0
    for at in range(coded.numel() - 400, coded.numel(), 20):  # inside the codes section's ANS stream
        bad = coded.clone()
        bad[at] ^= 0x5A
        try:
            back = entropy.decode(codec, bad, shape, dtype, "ans")
        except WireFormatError:
            caught += 1
            continue
        assert not torch.equal(back[codes[0]:], codec.encode(activation_like((64, 2, 128), seed=1))[codes[0]:])
    assert caught >= 18, caught  # an ANS stream rarely survives a flip in its state: 18 or more of 20


def test_a_section_coded_by_another_coder_is_refused_naming_both():
    codec, shape, dtype, coded = _ans_coded()
    with pytest.raises(WireFormatError, match="coded by ans, this end decodes huffman"):
        entropy.decode(codec, coded, shape, dtype, "huffman")
    by_huffman = entropy.encode(codec, codec.encode(activation_like((64, 2, 128), seed=1)), shape, dtype, "huffman")
    with pytest.raises(WireFormatError, match="coded by huffman, this end decodes ans"):
        entropy.decode(codec, by_huffman, shape, dtype, "ans")
    with pytest.raises(WireFormatError, match="coded by ans, this end decodes zstd"):
        entropy.decode(codec, coded, shape, dtype, "zstd")
    by_zstd = entropy.encode(codec, codec.encode(activation_like((64, 2, 128), seed=1)), shape, dtype, "zstd")
    with pytest.raises(WireFormatError, match="coded by zstd, this end decodes ans"):
        entropy.decode(codec, by_zstd, shape, dtype, "ans")
    with pytest.raises(ValueError, match="choose one of zstd, ans, huffman"):
        entropy.decode(codec, coded, shape, dtype, "lz4")


@pytest.mark.parametrize("coder", list(entropy.CODERS))
def test_a_raw_message_decodes_with_either_coder(coder):
    """``coder="raw"``: every section as it is (the sender's choice where coding does not pay); any end reads it."""
    codec = get_codec("hadint", bits=4)
    x = activation_like((64, 2, 128), seed=4)
    shape, buf = tuple(x.shape), codec.encode(x)
    raw = entropy.encode(codec, buf, shape, x.dtype, "raw")
    assert raw.numel() == entropy.capacity_nbytes(codec, shape, x.dtype)
    assert torch.equal(entropy.decode(codec, raw, shape, x.dtype, coder), buf)


@pytest.mark.parametrize("groups", [37, 8192])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_the_host_unpacking_is_the_codecs_packing(bits, groups):
    """The host coder's symbols are the codec's codes, several to a symbol where the section is large."""
    from megatron_tah.codecs.core.common import pack_bits

    codes = torch.randint(0, 2**bits, (8 * groups,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    width = ans.symbol_bits(bits, packed.numel())
    assert width % bits == 0 and width <= 8 and (2**width * ans.TABLE_SHARE <= packed.numel() or width == bits)
    symbols = ans.unpack(packed.numpy(), bits)
    per = width // bits
    assert symbols.size * per == codes.numel() and symbols.max() < 2**width
    mine = (symbols[:, None] >> (np.arange(per) * bits)) & (2**bits - 1)  # a symbol's codes, the first lowest
    assert np.array_equal(mine.reshape(-1), codes.numpy())
    assert np.array_equal(ans.pack(symbols, bits, packed.numel()), packed.numpy())
    if bits in (3, 4) and groups == 8192:
        assert per == 2  # large 3- and 4-bit sections: pairs


@pytest.mark.parametrize("groups", [1, 37, 8192])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_the_zstd_coders_symbols_are_the_codecs_codes_one_symbol_to_a_byte(bits, groups):
    from megatron_tah.codecs.core.common import pack_bits

    codes = torch.randint(0, 2**bits, (8 * groups,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    width = zstd.symbol_bits(bits)
    symbols = zstd.unpack(packed.numpy(), bits)
    assert symbols.dtype == np.uint8 and width <= 8 and width % bits == 0 and symbols.max() < 2**width
    per = width // bits
    assert width == (8 if bits in (1, 2, 4, 8) else 6 if bits == 3 else bits)
    mine = (symbols[:, None].astype(np.int64) >> (np.arange(per) * bits)) & (2**bits - 1)  # the first lowest
    assert np.array_equal(mine.reshape(-1), codes.numpy())
    assert np.array_equal(zstd.pack(symbols, bits, packed.numel()), packed.numpy())
    coded = zstd.encode_section(packed.numpy(), bits)
    back, used = zstd.decode_section(np.concatenate([coded, np.zeros(3, np.uint8)]), 0, packed.numel(), bits)
    assert used == coded.size and np.array_equal(back, packed.numpy())


def test_a_truncated_lengthened_or_corrupted_zstd_section_is_an_error_never_garbage():
    codec = get_codec("hadint", bits=3)
    x = activation_like((64, 2, 128), seed=1)
    shape = tuple(x.shape)
    coded = entropy.encode(codec, codec.encode(x), shape, x.dtype, "zstd")
    codes_at = codec.layout(shape, x.dtype).offsets["codes"][0]
    first = 0  # where the codes section's mode byte lies in the coded buffer: walk the sections before it
    for start, size, _, section in entropy._regions(codec, shape, x.dtype):
        if start == codes_at:
            break
        if not section or coded[first] == entropy.RAW:
            first += size + section
        else:
            first += 6 + int.from_bytes(bytes(coded[first + 2 : first + 6].tolist()), "little")
    assert coded[first] == zstd.MODE
    for cut in (1, 10, coded.numel() // 2):
        with pytest.raises(WireFormatError, match="ends at|need|past the buffer|not a valid frame"):
            entropy.decode(codec, coded[:-cut], shape, x.dtype, "zstd")
    longer = coded.clone()
    longer[first + 2] += 1  # the frame claims one byte more: the checks or the frame refuse it
    with pytest.raises(WireFormatError):
        entropy.decode(codec, longer, shape, x.dtype, "zstd")
    caught = 0
    for at in range(first + 12, coded.numel(), max(1, (coded.numel() - first - 12) // 20)):
        bad = coded.clone()
        bad[at] ^= 0x5A
        with pytest.raises(WireFormatError):  # zstd's frame checksum: every flip inside the frame
            entropy.decode(codec, bad, shape, x.dtype, "zstd")
        caught += 1
    assert caught >= 18
    wide = np.frombuffer(zstandard.ZstdCompressor(write_checksum=True).compress(
        bytes([200]) * 4), dtype=np.uint8)  # 4 symbols, one above 6 bits: a valid frame, not this section's codes
    section = np.concatenate([np.array([zstd.MODE, 1, *len(wide).to_bytes(4, "little")], np.uint8), wide])
    with pytest.raises(WireFormatError, match="above 6 bits"):
        zstd.decode_section(section, 0, 3, 3)


def test_a_zstd_byte_section_of_16_bit_scales_goes_as_two_planes_and_comes_back():
    scales = (torch.rand(1152, generator=torch.Generator().manual_seed(0)) * 0.03 + 1e-3).to(torch.bfloat16)
    raw = scales.view(torch.uint8).numpy()
    coded = zstd.encode_section(raw, 8)
    assert coded[0] == zstd.MODE and coded[1] == 2  # sign-and-exponent bytes apart from mantissa bytes: smaller
    back, used = zstd.decode_section(coded, 0, raw.size, 8)
    assert used == coded.size and np.array_equal(back, raw)
    in_order = zstandard.ZstdCompressor(level=zstd.LEVEL, write_checksum=True, write_content_size=True).compress(
        raw.tobytes())
    assert coded.size - 6 < len(in_order)
    wide = np.random.default_rng(0).integers(0, 256, 768, dtype=np.uint8)  # 8-bit codes: odd bytes span ~256
    codes = zstd.encode_section(wide, 8)
    assert codes[1] == 1 and np.array_equal(zstd.decode_section(codes, 0, wide.size, 8)[0], wide)
    for planes, size, bits in ((3, raw.size, 8), (0, raw.size, 8), (2, raw.size - 1, 8)):
        bad = coded.copy()
        bad[1] = planes
        with pytest.raises(WireFormatError, match="planes byte"):
            zstd.decode_section(bad, 0, size, bits)
    frame = np.frombuffer(zstandard.ZstdCompressor(write_checksum=True).compress(bytes(6)), dtype=np.uint8)
    three_bit = np.concatenate([np.array([zstd.MODE, 2, *len(frame).to_bytes(4, "little")], np.uint8), frame])
    with pytest.raises(WireFormatError, match="planes byte 2"):  # planes only for a byte section
        zstd.decode_section(three_bit, 0, 6, 3)


def test_a_chunk_whose_codes_do_not_fill_it_is_an_error():
    symbols = torch.arange(2 * huffman.CHUNK) % 5
    coded = huffman.encode_symbols(symbols, 3)
    table = 2 + 4
    bad = coded.clone()
    bad[table] += 1  # the first chunk claims one byte more than its codes fill
    with pytest.raises(WireFormatError, match="not valid codes|need"):
        huffman.decode_symbols(bad, symbols.numel(), 3)
    # a window that is no code: an incomplete code (one symbol of 3 bits: only prefix 0 is a code)
    one = huffman.encode_symbols(torch.zeros(16, dtype=torch.int64), 3)
    assert one[1] == 1  # longest code: 1 bit
    bad = one.clone()
    bad[-1] = 0xFF
    with pytest.raises(WireFormatError, match="not valid codes"):
        huffman.decode_symbols(bad, 16, 3)


@pytest.mark.parametrize("coder", list(entropy.CODERS))
@pytest.mark.parametrize("flip", [40, 300, 1000, -3])
def test_a_flipped_payload_bit_is_caught_by_the_entropy_checks_or_the_codecs_checksum(flip, coder):
    """Huffman codes resynchronise, so a flipped bit may still decode to symbols; the codec's payload checksum
    over the rebuilt buffer (``--tah-wire-checksum``) catches what the coder's own checks do not."""
    from megatron_tah.codecs import PayloadChecksumError

    codec = get_codec("hadint", bits=4, checksum=True)
    x = activation_like((64, 2, 128), seed=2)
    shape = tuple(x.shape)
    coded = entropy.encode(codec, codec.encode(x), shape, x.dtype, coder)
    bad = coded.clone()
    bad[flip] ^= 0x10
    with pytest.raises((WireFormatError, PayloadChecksumError)):
        codec.decode(entropy.decode(codec, bad, shape, x.dtype, coder), shape, x.dtype)


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
    for n in (2 * huffman.CHUNK, 40 * huffman.CHUNK):
        symbols = (torch.randn(n, generator=torch.Generator().manual_seed(n)).abs() * 3).clamp(max=15).long()
        coded = huffman.encode_symbols(symbols, 4)
        with Count() as count:
            decoded, _ = huffman.decode_symbols(coded, n, 4)
        assert torch.equal(decoded, symbols)
        counts.append(count.ops)
    assert counts[0] == counts[1] < 150, counts


def test_a_section_too_large_for_int32_bit_positions_decodes_with_int64_ones(monkeypatch):
    symbols = (torch.randn(3 * huffman.CHUNK, generator=torch.Generator().manual_seed(9)).abs() * 4).clamp(max=15)
    coded = huffman.encode_symbols(symbols.long(), 4)
    monkeypatch.setattr(huffman, "INT32_BITS", 64)  # every section here is "large"
    decoded, used = huffman.decode_symbols(coded, symbols.numel(), 4)
    assert used == coded.numel() and torch.equal(decoded, symbols.long())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here): a CUDA message through each "
                    "coder, huffman on the device, ans through a host copy")
@pytest.mark.parametrize("coder", list(entropy.CODERS))
def test_a_cuda_message_round_trips_and_stays_on_its_device(coder):
    codec = get_codec("hadint", bits=4)
    x = activation_like((256, 2, 128), seed=6).cuda()
    shape, buf = tuple(x.shape), codec.encode(x)
    coded = entropy.encode(codec, buf, shape, x.dtype, coder)
    assert coded.is_cuda and coded.numel() < buf.numel()
    back = entropy.decode(codec, coded, shape, x.dtype, coder)
    assert back.is_cuda and torch.equal(back, buf)
    assert torch.equal(entropy.decode(codec, coded.cpu(), shape, x.dtype, coder), buf.cpu())  # either end's device
