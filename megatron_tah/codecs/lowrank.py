"""``lowrank``: the message's top-``rank`` principal directions sent apart, the rest as ``hadint``.

A forward codec beyond scalar quantizers. The hidden states a pipeline stage sends
are far from isotropic: once training is under way a handful of directions of the hidden dimension
carry most of their energy, and those directions are not aligned with channels, so neither
per-channel scales nor a Hadamard on 64-channel tiles sees them. A codec that quantizes every
rotated value with the same step spends its bits on that energy; this one sends the few big
directions apart, once per message, and quantizes what is left.

Encode, for ``X = x`` viewed as ``[rows, h]`` (``h`` the last dim, ``k = min(rank, h)``):

1. A row holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE / (2 (1 + sqrt h))`` (7.7e33 at h 4096) is
   *bad*: it takes no part in steps 2-3 and gets no low-rank part (its residual is the row itself, step 4;
   hadint then codes every finite value up to ``MAX_ABS_VALUE``, and a residual of a good row, at most
   ``(1 + sqrt h)`` times its largest value, never exceeds it).
2. Basis: ``k`` orthonormal directions spanning (approximately) the top-``k`` right singular
   subspace of the good rows, tracked across messages (only the sender computes it; any basis
   decodes correctly, a worse one only leaves more to the residual). The codec keeps, per hidden
   size, ``Q`` ``[h, k + OVERSAMPLING]`` with orthonormal columns: a width's first message starts
   from a fixed seeded Gaussian and takes ``COLD_ITERATIONS`` block power steps
   ``Q <- qr(X^T X Q)`` (columns ordered by energy before the QR: ``track_subspace``), every later
   one ``WARM_ITERATIONS`` from the previous message's ``Q`` (a message of zeros keeps it); the basis
   is ``Q``'s first ``k`` columns. ``Q`` is codec state
   (``state_dict``), so a resumed sender continues the same bytes. Sent as 8-bit codes ``q + 127``
   with one bf16 scale per direction (``max |v| / 127`` rounded up): ``V``, the decoded basis, ``[k, h]``.
3. Coefficients ``C = X V^T`` ``[rows, k]``: symmetric ``coef_bits``-bit integers with one bf16
   scale per row, exactly as ``hadint`` codes a tile (``hadint_encode_reference`` without the
   transform); ``C'`` their decoded values (0 for bad rows).
4. Residual ``R = X - C' V`` (``X`` itself for bad rows), coded by ``hadint`` (``bits``,
   ``tile_size``, its random-sign Hadamard; ``stochastic_rounding``: hadint's, with its noise stream):
   the quantization error of steps 2-3 lands in ``R``, so only the residual's own rounding reaches the
   receiver, and with stochastic rounding the decoded message is unbiased whatever the basis (gradients:
   ``--tah-backward-codec lowrank --tah-backward-stochastic-rounding``; worth it only where their energy sits
   in a few directions, as in the speedrun's toy model and not in SmolLM2: docs/CODECS.md, "Do the toy's errors
   carry over?").

Decode: ``x = C' V + hadint_decode(R)`` in fp32, cast to the output dtype. Error: that of
``hadint`` on ``R`` (``||R|| <= ||X||`` up to the coefficients' rounding), so a tile's error bound is
hadint's for the residual tile; zeros decode exactly; a tile with a bad value decodes to NaN and
its row's other tiles keep hadint's accuracy on the raw row (the codecs' common rule).

Wire (``rows`` = numel / h, ``T`` = rows * ceil(h / tile_size) residual tiles; sizes in ``lowrank_sections``):
header | ``basis_scale``: bf16[k] | ``basis``: uint8[k*h] | ``coef_scale``: bf16[rows] |
``coef``: rows*k codes of ``coef_bits`` bits (``common.pack_bits``, code = q + 2^(coef_bits-1) - 1; zero
codes pad to a multiple of 8) |
``scale``, ``codes``: hadint's sections for ``R``. Bits per element:
``bits + 16/tile_size + (16k + 8kh) / (rows*h) + (16 + k*coef_bits) / h``, e.g. 4.375 for
bits 3, rank 16, coef_bits 6 at h 128 and 512 rows.

Cost: the basis takes ``2 * WARM_ITERATIONS`` products of ``[rows, h]`` by ``[h, k + 8]`` and a
Householder QR of ``[h, k + 8]`` per step (``COLD_ITERATIONS`` on a width's first message); nothing
on the encode path reads the device from the host (no ``eigh``, no ``.item()``), so it can be
captured as a CUDA graph (``graphs.GraphedCodec``); the residual runs hadint's Triton kernels on CUDA.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from .. import geometry, numerics
from ..kernels.hadint import hadint_sections
from .core import common
from .core.base import CHECKSUM_DEFAULT, Codec
from .core.errors import CodecError
from .core.header import register_codec_id
from .hadint import HadIntCodec, hadint_decode_reference, hadint_encode_reference
from .core.options import CodecDeclaration, Option

DECLARATION = CodecDeclaration(
    takes=("bits", "tile_size", "stochastic_rounding"),  # the residual's rounding
    kernel=True,
    options=(
        Option("tah_lowrank_rank", "rank", int, 16, "lowrank codec: principal directions of each message sent apart "
               "from the residual (at most the hidden size).", bounds=(1, 256)),
        Option("tah_lowrank_coef_bits", "coef_bits", int, 6, "lowrank codec: bits of the per-token coefficients of "
               "those directions.", bounds=(3, 8)),
    ),
)

COLD_ITERATIONS = 3  # block power steps from the seeded start (a hidden size's first message)
WARM_ITERATIONS = 1  # block power steps from the previous message's subspace
OVERSAMPLING = 8  # extra columns tracked beside the k sent (they speed up the leading k's convergence)
BASIS_BITS = 8
START_SEED = 0x5EED


def lowrank_rank(h: int, rank: int) -> int:
    """Directions the lowrank codec sends for a last dim of ``h``: ``min(rank, h)``."""
    return min(int(rank), int(h))


def lowrank_sections(shape: Sequence[int], bits: int, tile_size: int, rank: int,
                     coef_bits: int) -> list[tuple[str, int]]:
    """The ``lowrank`` wire sections of ``shape``: basis and coefficients, then hadint's sections of the residual."""
    h, rows = int(shape[-1]), geometry.num_tokens(shape)
    k = lowrank_rank(h, rank)
    coefs = geometry.cdiv(rows * k, 8) * 8  # packed in groups of 8 codes, the last group padded with zero codes
    return [("basis_scale", 2 * k), ("basis", k * h), ("coef_scale", 2 * rows),
            ("coef", geometry.packed_nbytes(coefs, coef_bits))] + hadint_sections(shape, bits, tile_size)


@functools.lru_cache(maxsize=16)
def _start(h: int, width: int, device: str) -> torch.Tensor:
    """The power iteration's fixed orthonormal start ``[h, width]`` (seeded Gaussian, QR), made once per device."""
    start = torch.randn(h, width, generator=torch.Generator().manual_seed(START_SEED))
    return torch.linalg.qr(start)[0].to(device)


def track_subspace(x: torch.Tensor, q: torch.Tensor, iterations: int) -> torch.Tensor:
    """``iterations`` block power steps for fp32 ``x [rows, h]`` from ``q [h, width]`` with orthonormal columns.

    A step: ``y = x^T x q``, its columns ordered by decreasing norm (a greedy stand-in for the
    Rayleigh-Ritz step's ``eigh``: the leading columns of the QR then hold the most energy), then
    ``q = qr(y)``. No host sync: nothing branches on a value (Householder QR, unlike ``eigh``, checks
    nothing on the host); an ``x`` of zeros returns ``q`` unchanged.
    """
    # Scaled so that Gram entries stay within rows (no overflow for any finite input).
    scale = x.abs().amax()
    x = x / scale.clamp_min(torch.finfo(torch.float32).tiny)
    start = q
    for _ in range(iterations):
        y = x.T @ (x @ q)
        q = torch.linalg.qr(y[:, torch.argsort(y.norm(dim=0), descending=True, stable=True)])[0]
    return torch.where(scale > 0, q, start)


def principal_directions(x: torch.Tensor, k: int, iterations: int = COLD_ITERATIONS) -> torch.Tensor:
    """Orthonormal fp32 ``[k, h]`` spanning about the top-``k`` right singular subspace of fp32 ``x [rows, h]``,
    from the seeded start (what a codec sends for a hidden size's first message)."""
    h = x.shape[1]
    q = track_subspace(x, _start(h, min(k + OVERSAMPLING, h), str(x.device)), iterations)
    return q[:, :k].T.contiguous()


class LowRankCodec(Codec):
    name = "lowrank"
    codec_id = 9

    def __init__(self, bits: int = 3, tile_size: int = 64, rank: int = 16, coef_bits: int = 6,
                 hadamard_seed: int = 0, stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 256:
            raise CodecError(f"rank must be an integer in [1, 256], got {rank!r}")
        self.rank = rank
        self.coef_bits = common.check_bits(coef_bits, name="coef_bits", low=3)
        self.residual = HadIntCodec(bits=bits, tile_size=tile_size, hadamard_seed=hadamard_seed,
                                    stochastic_rounding=stochastic_rounding, seed=seed, backend=backend)
        self.bits, self.tile_size, self.hadamard_seed = self.residual.bits, self.residual.tile_size, hadamard_seed
        self._subspaces: dict[int, torch.Tensor] = {}  # hidden size -> Q [h, k + OVERSAMPLING] fp32

    # ----- the tracked subspace (codec state) ---------------------------------------------------
    @property
    def stateful(self) -> bool:
        """The basis starts from the previous message's subspace: a sender's bytes depend on its history."""
        return True

    @property
    def stochastic_rounding(self) -> bool:
        """Whether the residual rounds stochastically."""
        return self.residual.stochastic_rounding

    @property
    def rounding_noise(self) -> common.RoundingNoise:
        """The residual's rounding noise (``Codec.salt_rounding`` and the graphs read it here)."""
        return self.residual.rounding_noise

    @rounding_noise.setter
    def rounding_noise(self, noise: common.RoundingNoise) -> None:
        self.residual.rounding_noise = noise

    def state_dict(self) -> dict:
        """The tracked subspace per hidden size and the residual's rounding-noise counter (a resumed sender
        then writes the same bytes)."""
        state = {"subspaces": {h: q.detach().cpu().clone() for h, q in self._subspaces.items()}}
        return {**state, **self.residual.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s subspaces; one already held is overwritten in place (a captured graph reads it)."""
        self.residual.load_state_dict(state)
        for h, saved in state.get("subspaces", {}).items():
            width = min(lowrank_rank(int(h), self.rank) + OVERSAMPLING, int(h))
            if tuple(saved.shape) != (int(h), width) or saved.dtype != torch.float32:
                raise CodecError(f"lowrank state for hidden size {h} is {tuple(saved.shape)} "
                                 f"{saved.dtype}, this codec tracks ({h}, {width}) float32 (rank {self.rank})")
            held = self._subspaces.get(int(h))
            if held is not None:
                held.copy_(saved)
            else:
                self._subspaces[int(h)] = saved.clone()

    def _basis(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """This message's basis ``[k, h]``; advances the tracked subspace in place (no host sync)."""
        h = x.shape[1]
        q = self._subspaces.get(h)
        if q is not None and q.device != x.device:
            q = self._subspaces[h] = q.to(x.device)
        if q is None:  # a hidden size's first message: from the seeded start (then state, updated in place)
            q = self._subspaces[h] = track_subspace(x, _start(h, min(k + OVERSAMPLING, h), str(x.device)),
                                                    COLD_ITERATIONS).contiguous()
        else:
            q.copy_(track_subspace(x, q, WARM_ITERATIONS))
        return q[:, :k].T.contiguous()

    def code_sections(self) -> dict[str, int]:
        return {"coef": self.coef_bits, "codes": self.bits}

    def config(self) -> dict:
        return {"bits": self.bits, "tile_size": self.tile_size, "rank": self.rank, "coef_bits": self.coef_bits,
                "hadamard_seed": self.hadamard_seed, "stochastic_rounding": self.stochastic_rounding}

    def _sections(self, shape, dtype):
        return lowrank_sections(shape, self.bits, self.tile_size, self.rank, self.coef_bits)

    # ----- the low-rank part ----------------------------------------------------------------
    def _low_rank(self, x: torch.Tensor, buf, layout) -> torch.Tensor:
        """Write basis and coefficients of ``x`` [rows, h] fp32; return the decoded low-rank part (0 on bad rows)."""
        # A row within the bound has a residual within MAX_ABS_VALUE whatever the basis (|r_j| <= (1 + sqrt h) m).
        bound = numerics.MAX_ABS_VALUE / (2 * (1 + x.shape[1] ** 0.5))
        good = (x.abs() <= bound).all(dim=1)  # False for NaN too
        x = torch.where(good[:, None], x, 0.0)
        k = lowrank_rank(x.shape[1], self.rank)
        basis = self._basis(x, k)
        no_bad = torch.zeros(k, dtype=torch.bool, device=x.device)
        scale, codes = hadint_encode_reference(basis, no_bad, BASIS_BITS)
        layout.view(buf, "basis_scale", torch.int16).copy_(scale)
        layout.view(buf, "basis").copy_(codes.reshape(-1))
        basis = hadint_decode_reference(scale.view(torch.bfloat16), codes, BASIS_BITS)
        no_bad = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        scale, codes = hadint_encode_reference(x @ basis.T, no_bad, self.coef_bits)
        layout.view(buf, "coef_scale", torch.int16).copy_(scale)
        padded = codes.new_zeros(layout.offsets["coef"][1] * 8 // self.coef_bits)
        padded[: codes.numel()] = codes.reshape(-1)
        layout.view(buf, "coef").copy_(common.pack_bits(padded, self.coef_bits))
        return hadint_decode_reference(scale.view(torch.bfloat16), codes, self.coef_bits) @ basis

    def _read_low_rank(self, buf, layout, rows: int, h: int) -> torch.Tensor:
        k = lowrank_rank(h, self.rank)
        basis = hadint_decode_reference(layout.view(buf, "basis_scale", torch.bfloat16),
                                        layout.view(buf, "basis").reshape(k, h), BASIS_BITS)
        codes = common.unpack_bits(layout.view(buf, "coef"), self.coef_bits, rows * k).reshape(rows, k)
        return hadint_decode_reference(layout.view(buf, "coef_scale", torch.bfloat16), codes, self.coef_bits) @ basis

    # ----- encode / decode: the residual through hadint's torch or Triton path -----------------------
    def _residual(self, x: torch.Tensor, buf, layout) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        residual = rows - self._low_rank(rows, buf, layout)  # NaN/Inf stay in bad rows (low-rank part 0)
        return residual.reshape(x.shape)

    def _encode_torch(self, x, buf, layout):
        self.residual._encode_torch(self._residual(x, buf, layout), buf, layout)

    def _encode_triton(self, x, buf, layout):
        self.residual._encode_triton(self._residual(x, buf, layout), buf, layout)

    def _decode(self, decode_residual, buf, shape, dtype, layout, out) -> torch.Tensor:
        """hadint's decode of the residual (fp32; straight into an fp32 ``out``) plus the low-rank part."""
        h = shape[-1]
        direct = out if dtype == torch.float32 else None
        residual = decode_residual(buf, shape, torch.float32, layout, out=direct)
        values = residual.view(-1, h).add_(self._read_low_rank(buf, layout, residual.numel() // h, h))
        if direct is not None:
            return direct
        return common.from_tiles(values, shape, dtype, out)  # (clamped to fp16's range)

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        return self._decode(self.residual._decode_torch, buf, shape, dtype, layout, out)

    def _decode_triton(self, buf, shape, dtype, layout, out=None):
        return self._decode(self.residual._decode_triton, buf, shape, dtype, layout, out)


register_codec_id(LowRankCodec.codec_id, LowRankCodec.name)
