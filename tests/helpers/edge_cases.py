"""Shared fixtures: a table of named edge-case inputs used by the codec tests."""

import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def edge_case_tensor(kind: str, shape=(6, 2, 96), dtype=torch.float32, seed=0) -> torch.Tensor:
    """Named edge cases: gaussian, zeros, constant, huge (1e6, capped at fp16's range), tiny, one_outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "constant":
        x = torch.full(shape, 3.25)
    elif kind == "huge":
        x = x * (6e4 / x.abs().max() if dtype == torch.float16 else 1e6)
    elif kind == "tiny":
        x = x * 1e-30 if dtype != torch.float16 else x * 1e-4
    elif kind == "one_outlier":
        x[..., 5] = 20 * x.abs().max()
    return x.to(dtype)


EDGE_CASES = ["gaussian", "zeros", "constant", "huge", "tiny", "one_outlier"]


def round_trip(codec, x: torch.Tensor) -> torch.Tensor:
    """``decode(encode(x))`` with x's shape and dtype."""
    return codec.decode(codec.encode(x), x.shape, x.dtype)


def rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||y - x|| / ||x||`` in float64 (tiny inputs must not underflow the norms)."""
    x, y = x.double(), y.double()
    return ((y - x).norm() / x.norm()).item()


def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equal values, NaN where the other has NaN (kernel vs reference, atol=0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(torch.nan_to_num(a.float(), 7.0), torch.nan_to_num(b.float(), 7.0))


def with_bad_values(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with a NaN, a +Inf and a -Inf (second, middle and last element)."""
    x = x.clone()
    flat = x.view(-1)
    flat[1] = float("nan")
    flat[flat.numel() // 2] = float("inf")
    flat[-1] = -float("inf")
    return x


def assert_mismatched_receivers_refused(sender, same_size: list, other_size) -> None:
    """``sender``'s buffer decoded by receivers configured otherwise: of the same wire size (``same_size``:
    refused as another config), of another size (refused by its byte count); decoded for another shape, or
    naming another codec in its header: refused."""
    from megatron_tah.codecs import WireFormatError, get_codec

    x = torch.randn(4, 2, 64)
    for other in same_size:
        assert other.wire_nbytes(x.shape, x.dtype) == sender.wire_nbytes(x.shape, x.dtype)
        with pytest.raises(WireFormatError, match="another config"):
            other.decode(sender.encode(x), x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="bytes"):
        other_size.decode(sender.encode(x), x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="another shape"):
        sender.decode(sender.encode(x), (8, 1, 64), x.dtype)
    buf = sender.encode(x)
    buf[3] = get_codec("fixedpoint").codec_id
    with pytest.raises(WireFormatError, match="'fixedpoint'"):
        sender.decode(buf, x.shape, x.dtype)
