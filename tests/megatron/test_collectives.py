"""Compressed collectives on gloo ranks: exact with the none codec, error within each codec's bound,
every rank gets the same result, bytes handed to the network == wire_nbytes, rank disagreement raises."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist_utils import run_distributed
from tests.helpers.tiny_gpt import WireSpy

pytestmark = pytest.mark.distributed

FP8_FACTOR = 2**-4 + 2**-10 * math.sqrt(128) / 448 + 1e-5  # the fp8 codec's relative bound per group (G=128)


def _inputs(rank: int, shape, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(shape, generator=g) * scale * (1 + rank)).to(dtype)


def _norm(x):
    return float(x.double().norm())


def _body(rank, world_size):
    from megatron_tah.codecs import get_codec
    from megatron_tah.megatron import collectives

    dist = torch.distributed
    n = world_size
    out = {}
    none, fp8, int8 = get_codec("none"), get_codec("fp8"), get_codec("int8", block_size=128)

    # ----- all-gather of [s, b, h] activations --------------------------------------------------
    shape = (8, 2, 192)
    xs = [_inputs(r, shape) for r in range(n)]
    exact = torch.cat(xs)
    for name, codec in (("none", none), ("fp8", fp8)):
        result = torch.empty(n * shape[0], *shape[1:])
        with WireSpy() as spy:
            traffic = collectives.all_gather(codec, result, xs[rank], None)
        expected = (n - 1) * codec.wire_nbytes(shape, torch.float32)
        out[f"ag_{name}"] = {
            "result": result, "spied": spy.nbytes, "wire": traffic.wire_nbytes, "expected": expected,
            "uint8_only": spy.uint8_only,
            "rel": [_norm(a - b) / _norm(b) for a, b in zip(result.chunk(n), xs)]}
    reference = torch.empty_like(exact)
    dist.all_gather_into_tensor(reference, xs[rank])
    out["ag_reference"] = reference

    # ----- reduce-scatter (sequence-parallel gradients: [n*s, b, h]; gradient buckets: 1-D) ----------
    for label, shape in (("rs3d", (4 * n, 2, 256)), ("rs1d", (n * 4096,))):
        xs = [_inputs(r, shape) for r in range(n)]
        chunks = [x.chunk(n)[rank] for x in xs]
        exact = sum(c.double() for c in chunks)
        for name, codec in (("none", none), ("fp8", fp8), ("int8", int8)):
            result = torch.empty_like(chunks[0])
            with WireSpy() as spy:
                traffic = collectives.reduce_scatter(codec, result, xs[rank], None)
            expected = (n - 1) * codec.wire_nbytes(chunks[0].shape, torch.float32)
            entry = {"spied": spy.nbytes, "wire": traffic.wire_nbytes, "expected": expected,
                     "err": _norm(result - exact), "sum_norms": sum(_norm(c) for c in chunks),
                     "exact_norm": _norm(exact)}
            if name == "int8":  # per element: at most half a step of every rank's block
                blocks = torch.stack([c.reshape(-1, 128).abs().amax(-1) for c in chunks]).sum(0) / 254
                err = (result.double() - exact).abs().reshape(-1, 128)
                entry["int8_ok"] = bool((err <= blocks[:, None].double() * (1 + 1e-5) + 1e-12).all())
            out[f"{label}_{name}"] = entry
        reference = torch.empty_like(chunks[0])
        dist.reduce_scatter_tensor(reference, xs[rank])
        none_result = torch.empty_like(chunks[0])
        collectives.reduce_scatter(none, none_result, xs[rank], None)
        out[f"{label}_none"]["same_as_torch"] = torch.equal(reference, none_result)

    # ----- all-reduce: activations [s, b, h] (rows padded to n), a 1-D bucket, bf16, AVG ------------
    cases = (("ar3d", (5, 2, 128), torch.float32, torch.distributed.ReduceOp.SUM),
             ("ar1d", (3000,), torch.float32, torch.distributed.ReduceOp.SUM),
             ("arbf16", (6, 2, 128), torch.bfloat16, torch.distributed.ReduceOp.SUM),
             ("aravg", (5000,), torch.float32, torch.distributed.ReduceOp.AVG))
    for label, shape, dtype, op in cases:
        xs = [_inputs(r, shape, dtype) for r in range(n)]
        exact = sum(x.double() for x in xs)
        if op == torch.distributed.ReduceOp.AVG:
            exact = exact / n
        for name, codec in (("none", none), ("fp8", fp8), ("int8", int8)):
            tensor = xs[rank].clone()
            with WireSpy() as spy:
                traffic = collectives.all_reduce(codec, tensor, None, op)
            padded = collectives._chunked(xs[rank], n)[0]
            expected = 2 * (n - 1) * codec.wire_nbytes(padded.shape, torch.float32)
            out[f"{label}_{name}"] = {
                "result": tensor, "dtype": tensor.dtype, "spied": spy.nbytes, "wire": traffic.wire_nbytes,
                "expected": expected, "err": _norm(tensor - exact), "exact_norm": _norm(exact),
                "sum_norms": sum(_norm(x) for x in xs) / (n if op == torch.distributed.ReduceOp.AVG else 1)}
        if op == torch.distributed.ReduceOp.SUM and dtype == torch.float32:
            reference = xs[rank].clone()
            dist.all_reduce(reference)
            out[f"{label}_none"]["same_as_torch"] = torch.equal(reference, out[f"{label}_none"]["result"])

    # ----- non-contiguous input, and tensors the compressed path leaves alone ------------------------
    x = _inputs(rank, (64, 6)).t()
    collectives.all_reduce(fp8, x, None)
    out["noncontiguous_err"] = _norm(x - sum(_inputs(r, (64, 6)).double() for r in range(n)).t())
    out["compressible"] = [collectives.compressible(torch.zeros(3, dtype=torch.int64)),
                           collectives.compressible(torch.zeros(3), torch.distributed.ReduceOp.MAX),
                           collectives.compressible(torch.zeros(3), torch.distributed.ReduceOp.AVG)]
    return _plain(out)


def _plain(value):
    """Tensors as (dtype, raw bytes): results cross the process boundary as plain data."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), bytes(value.detach().contiguous().view(torch.uint8).numpy())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def _check(results, n):
    r0 = results[0]
    for rank, r in enumerate(results):
        for key, entry in r.items():
            if isinstance(entry, dict) and "wire" in entry:
                # Bytes handed to the network == wire_nbytes of the buffers, and the Traffic record says so.
                assert entry["spied"] == entry["wire"] == entry["expected"], (rank, key, entry)
        # The none codec moves the exact bytes: same results as gloo's own collectives.
        assert r["ag_none"]["result"] == r["ag_reference"]
        # (With two ranks a + b is the only sum; with more, gloo may add in another order.)
        for key in ("rs3d_none", "rs1d_none", "ar3d_none", "ar1d_none"):
            assert r[key]["same_as_torch"] or (n > 2 and r[key]["err"] < 1e-6 * r[key]["exact_norm"]), (rank, key)
        assert r["ag_none"]["uint8_only"] and r["ag_fp8"]["uint8_only"]
        # fp8: every gathered slice within the per-group bound (normwise), ~2-3 % in practice.
        assert all(e <= FP8_FACTOR for e in r["ag_fp8"]["rel"]) and max(r["ag_fp8"]["rel"]) < 0.04
        for label in ("rs3d", "rs1d"):
            e = r[f"{label}_fp8"]
            assert e["err"] <= FP8_FACTOR * e["sum_norms"] and e["err"] < 0.04 * e["exact_norm"], (label, e)
            assert r[f"{label}_int8"]["int8_ok"], label
            assert r[f"{label}_int8"]["err"] < 0.01 * r[f"{label}_int8"]["exact_norm"]
        for label in ("ar3d", "ar1d", "arbf16", "aravg"):
            e = r[f"{label}_fp8"]
            bound = FP8_FACTOR * e["sum_norms"] + FP8_FACTOR * (e["exact_norm"] + FP8_FACTOR * e["sum_norms"])
            assert e["err"] <= bound and e["err"] < 0.05 * e["exact_norm"], (label, e)
            q = r[f"{label}_int8"]
            assert q["err"] < 0.01 * q["exact_norm"], (label, q)
            n_err = r[f"{label}_none"]["err"] / r[f"{label}_none"]["exact_norm"]
            assert n_err < (4e-3 if label == "arbf16" else 1e-6)  # bf16 output rounding only
            assert r[f"{label}_fp8"]["dtype"] == ("torch.bfloat16" if label == "arbf16" else "torch.float32")
            # Every rank ends with the same bits (sums in rank order, own slices decoded too).
            for name in ("none", "fp8", "int8"):
                assert r[f"{label}_{name}"]["result"] == r0[f"{label}_{name}"]["result"], (rank, label)
        assert r["ag_fp8"]["result"] == r0["ag_fp8"]["result"]
        assert r["noncontiguous_err"] < 0.05 * math.sqrt(64 * 6) * n
        assert r["compressible"] == [False, False, True]


def _body_and_mismatch(rank, world_size):
    return {"collectives": _body(rank, world_size), "mismatch": _mismatch(rank, world_size)}


def test_collectives_two_ranks_and_ranks_that_disagree():
    results = run_distributed(_body_and_mismatch, 2, timeout=300)
    _check([r["collectives"] for r in results], 2)
    for message in (r["mismatch"] for r in results):  # every rank raises, naming each rank's setting
        assert "different settings for tp" in message, message
        assert "rank 0: tp=fp8(group_size=128)" in message and "rank 1: tp=none" in message
        assert "dp" not in message.split("(")[0] and "same --tah-* flags" in message


def test_collectives_three_ranks_padding_and_sum_order():
    _check(run_distributed(_body, 3, timeout=300), 3)


def _mismatch(rank, world_size):
    from megatron_tah.config import TahConfig
    from megatron_tah.megatron import places

    places.check_ranks_agree(TahConfig(tah_dp_codec="int8"))  # every rank agrees: nothing raised
    config = TahConfig(tah_tp_codec="fp8" if rank == 0 else "none", tah_dp_codec="int8")
    try:
        places.check_ranks_agree(config)
    except places.PlaceMismatchError as err:
        return str(err)
    return "no error"
