"""The depth study's emulated boundaries: a codec round trip after the chosen layers, both directions."""

import torch

from benchmarks.depth.boundaries import Boundaries, _RoundTrip
from megatron_tah.config import TahConfig


def test_a_boundary_sends_activations_and_gradients_through_their_codecs(tmp_path):
    forward = {"tah_forward_codec": "fixedpoint", "tah_forward_bits": 4, "tah_tile_size": 64}
    backward = {"tah_backward_codec": "fixedpoint", "tah_backward_bits": 3, "tah_backward_tile_size": 32}
    boundaries = Boundaries([2], forward, backward, log=tmp_path / "log.jsonl", sample_every=1)
    x = torch.randn(16, 2, 128, requires_grad=True)
    y = _RoundTrip.apply(x, boundaries, 2)
    fwd = TahConfig(**forward).forward_codec()
    assert torch.equal(y, fwd.decode(fwd.encode(x.detach()), x.shape, x.dtype))  # what the next stage receives
    g = torch.randn_like(x)
    y.backward(g)
    bwd = TahConfig(**backward).backward_codec()
    assert torch.equal(x.grad, bwd.decode(bwd.encode(g), g.shape, g.dtype))  # what the previous stage receives
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"direction": "forward"' in lines[0] and '"direction": "backward"' in lines[1]


def test_the_patch_wraps_only_the_chosen_layers_and_restores_exactly():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    original = TransformerLayer.forward
    boundaries = Boundaries([1], {"tah_preset": "paper"}, {})
    boundaries.install()
    assert TransformerLayer.forward is not original
    boundaries.restore()
    assert TransformerLayer.forward is original
