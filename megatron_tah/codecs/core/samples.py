"""Activation-like test data: what pipeline tensors of a transformer look like.

Hidden states are roughly Gaussian per channel, with a few "massive" channels
that are much larger than the rest in every token (the outliers Hadamard
rotation is for) and heavier tails than a Gaussian. Deterministic in ``seed``.
"""

from __future__ import annotations

import torch


def activation_like(shape, dtype=torch.bfloat16, seed: int = 0, outlier_channels: int = 4,
                    outlier_scale: float = 20.0, device="cpu") -> torch.Tensor:
    """``[s, b, h]`` activations: Student-t-ish values, per-channel scales, ``outlier_channels`` big channels."""
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    base = torch.randn(shape, generator=gen)
    # Heavier tails: scale each element by an independent |N(0,1)|-ish factor.
    base = base * (0.5 + torch.rand(shape, generator=gen))
    channel_scale = torch.exp(0.5 * torch.randn(h, generator=gen))
    x = base * channel_scale
    if outlier_channels:
        idx = torch.randperm(h, generator=gen)[:outlier_channels]
        x[..., idx] = x[..., idx] * outlier_scale + outlier_scale
    return x.to(dtype=dtype, device=device)
