"""The energy share of a message's top-k principal directions: what ``lowrank`` sends apart (the spectrum study, the
codec reports and the transfer study measure it).

``energy_share(x, ks)``: for a message ``x`` of shape ``[..., hidden]`` seen as a matrix ``M`` of
``rows x hidden`` (every token of every sample one row), the share of ``||M||_F^2`` that its top-k
right singular directions carry, ``sum(s[:k]^2) / sum(s^2)`` (uncentred, as the ``lowrank`` codec
projects: what the codec sends apart is exactly that share, what it leaves to the residual the rest).
"""

from __future__ import annotations

from typing import Sequence

import torch

KS = (1, 2, 4, 8, 16, 32, 64)
"""The numbers of directions whose share is recorded (``lowrank`` sends 16, ``lowrank8`` 8)."""


def energy_share(x: torch.Tensor, ks: Sequence[int] = KS) -> dict[int, float]:
    """``{k: share of the energy in the top-k principal directions}`` of ``x`` seen as ``[-1, hidden]``.

    Computed in fp64 from the singular values; ``k`` past the matrix rank gives 1.0. An all-zero
    message has no directions: ``ValueError``, as for non-finite values or a ``k < 1``.
    """
    if x.dim() < 2:
        raise ValueError(f"energy_share takes a [..., hidden] message, got shape {list(x.shape)}")
    if any(int(k) < 1 for k in ks):
        raise ValueError(f"k must be >= 1, got {list(ks)}")
    m = x.detach().reshape(-1, x.shape[-1]).double()
    if not torch.isfinite(m).all():
        raise ValueError("energy_share: the message holds NaN or Inf")
    energy = torch.linalg.svdvals(m).square()
    total = energy.sum()
    if total == 0:
        raise ValueError("energy_share: an all-zero message has no principal directions")
    cumulative = energy.cumsum(0) / total
    return {int(k): min(1.0, cumulative[min(int(k), cumulative.numel()) - 1].item()) for k in ks}
