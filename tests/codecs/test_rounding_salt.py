"""Each link end's stochastic rounding draws its own noise (``Codec.salt_rounding``)."""

import pytest
import torch

from megatron_tah.codecs import get_codec
from megatron_tah.config import TahConfig
from megatron_tah.link.transport import PipelineTransport
from megatron_tah.megatron.places import STREAMS
from megatron_tah.megatron.stats import Stats
from tests.helpers.codec_cases import cases

X = torch.randn(64, 2, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _codes(codec):
    return codec.encode(X).clone()


# Every registered codec that rounds stochastically on request (3 bits where it takes a bit width).
@pytest.mark.parametrize("case", cases(keep=lambda case: "stochastic_rounding" in case.declaration.takes))
def test_salted_codecs_draw_different_noise_and_the_same_salt_the_same(case):
    bits = {"bits": 3} if "bits" in case.declaration.takes else {}
    make = lambda: case.make(stochastic_rounding=True, **bits)  # noqa: E731
    a, b, a_again = make().salt_rounding("backward:3->2"), make().salt_rounding("backward:4->3"), \
        make().salt_rounding("backward:3->2")
    first = _codes(a)
    assert not torch.equal(first, _codes(b))  # two link ends' first messages: different noise
    assert not torch.equal(_codes(make()), first)  # and not the unsalted stream
    assert torch.equal(_codes(a_again), first)  # reproducible: the same link end draws the same stream
    state = a.state_dict()
    resumed = make().salt_rounding("backward:3->2")
    resumed.load_state_dict(state)
    assert torch.equal(_codes(resumed), _codes(a))


def test_rounding_to_nearest_is_unaffected():
    codec = get_codec("channel", bits=4)
    assert torch.equal(_codes(codec.salt_rounding("forward:0->1")), _codes(get_codec("channel", bits=4)))


def test_the_transports_link_ends_round_with_their_own_noise():
    """The same codecs at two boundaries (a middle stage sends gradients to rank 1 and rank 3's ends...): the k-th
    messages of different links carry different noise; before, every link drew the same."""
    from megatron_tah.config import candidate_fields

    config = TahConfig(**candidate_fields("channel"))  # per-channel gradients, stochastically rounded
    transport = PipelineTransport(config, Stats(STREAMS))
    to_prev = transport.link("backward", "send", 1).codec
    to_next = transport.link("backward", "send", 3).codec
    codes = [c.encode(X).clone() if hasattr(c, "encode") else None for c in (to_prev, to_next)]
    assert not torch.equal(codes[0], codes[1])
