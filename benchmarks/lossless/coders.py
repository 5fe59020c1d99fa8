"""What each lossless coder (``megatron_tah.codecs.core.entropy.CODERS``) costs and saves on real messages, and the link
rate below which it saves time: the numbers ``python -m benchmarks.lossless`` reports per preset and shape.

For every preset, direction and message shape (``[tokens, 1, hidden]``, the first ``tokens`` of the real model's
messages at each cut): the codec buffer's bytes, its order-0 bound (``buffer_entropy_bits``: each section's order-0
entropy, tables excluded), each coder's coded bytes (tables included) and its encode and decode time (the best of
``repeats``, one thread of this machine), and ``break_even_bps``: coding a message saves
``8 * (raw - coded) / rate`` seconds of wire and costs ``encode + decode``, so it pays below
``rate = 8 * (raw - coded) / (encode + decode)``.
"""

from __future__ import annotations

import math
import time

import torch

from megatron_tah.codecs import Codec
from megatron_tah.codecs.core import entropy
from megatron_tah.codecs.core.common import unpack_bits

SHAPES = (1024, 128)  # tokens of the messages measured: [1024, 1, hidden] and [128, 1, hidden]


def entropy_bits(symbols: torch.Tensor) -> float:
    """Order-0 entropy of ``symbols`` (integers) in bits, all of them together: ``n * H(p)``, p their frequencies."""
    counts = torch.bincount(symbols.reshape(-1).to(torch.int64)).double()
    p = counts[counts > 0] / symbols.numel()
    return float(-(p * p.log2()).sum() * symbols.numel())


def buffer_entropy_bits(codec: Codec, buf: torch.Tensor, shape, dtype) -> float:
    """Order-0 entropy of ``buf`` (``codec``'s buffer for ``shape``) section by section; the header and the
    alignment between sections as bytes."""
    layout = codec.layout(shape, dtype)
    packed = codec.code_sections()
    total, covered = 0.0, torch.zeros(layout.nbytes, dtype=torch.bool)
    for name, (start, size) in layout.offsets.items():
        section = buf[start:start + size]
        covered[start:start + size] = True
        if name in packed:
            bits = packed[name]
            total += entropy_bits(unpack_bits(section, bits, size * 8 // bits))
        else:
            total += entropy_bits(section)
    rest = buf[~covered]
    return total + (entropy_bits(rest) if rest.numel() else 0.0)


def break_even_bps(raw_nbytes: float, coded_nbytes: float, seconds: float) -> float:
    """The link rate (bits/s) below which coding a message saves more wire time than ``seconds`` of coder time
    (0: it saves no bytes, so no rate)."""
    saved = raw_nbytes - coded_nbytes
    return 8.0 * saved / seconds if saved > 0 and seconds > 0 else 0.0


def best_of(fn, repeats: int = 3) -> tuple[float, object]:
    """The shortest of ``repeats`` wall times of ``fn()`` (seconds) and its last result."""
    best, out = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def coder_costs(codec: Codec, messages: list[torch.Tensor], repeats: int = 3, coders=tuple(entropy.CODERS)) -> dict:
    """Per coder, over ``messages`` (the same shape): bytes, order-0 bytes, coded bytes, seconds to encode and to
    decode (sums over the messages) and the break-even rate; raises when a coder does not give the buffer back."""
    bufs = [codec.encode(x) for x in messages]
    shape, dtype = tuple(messages[0].shape), messages[0].dtype
    raw = sum(b.numel() for b in bufs)
    order0 = sum(buffer_entropy_bits(codec, b, shape, dtype) for b in bufs) / 8
    out = {"raw": raw, "order0": order0, "coders": {}}
    for coder in coders:
        coded = encode_s = decode_s = 0.0
        for buf in bufs:
            seconds, packed = best_of(lambda: entropy.encode(codec, buf, shape, dtype, coder), repeats)
            encode_s += seconds
            seconds, back = best_of(lambda: entropy.decode(codec, packed, shape, dtype, coder), repeats)
            decode_s += seconds
            if not torch.equal(back, buf):
                raise RuntimeError(f"the {coder} coder did not give back {codec.describe()}'s buffer")
            coded += packed.numel()
        out["coders"][coder] = {"coded": coded, "encode_s": encode_s, "decode_s": decode_s,
                                "mb_s": raw / (encode_s + decode_s) / 1e6,
                                "break_even_bps": break_even_bps(raw, coded, encode_s + decode_s)}
    return out


def rows(found: dict, configs: dict, shapes=SHAPES, repeats: int = 3) -> list[dict]:
    """``coder_costs`` per preset (``configs``: name -> ``TahConfig``), direction and shape, on ``found``
    (``{cut: (hidden state, gradient)}``, ``[tokens, 1, hidden]``), per message."""
    out = []
    for preset, config in configs.items():
        for direction, codec, index in (("forward", config.forward_codec(), 0),
                                        ("backward", config.backward_codec(), 1)):
            for tokens in shapes:
                xs = [pair[index][:tokens].contiguous() for pair in found.values()]
                cost = coder_costs(codec, xs, repeats)
                n = len(xs)
                out.append({"preset": preset, "direction": direction, "shape": list(xs[0].shape),
                            "raw": cost["raw"] / n, "order0": cost["order0"] / n,
                            "coders": {c: {**v, "coded": v["coded"] / n, "encode_ms": 1e3 * v["encode_s"] / n,
                                           "decode_ms": 1e3 * v["decode_s"] / n}
                                       for c, v in cost["coders"].items()}})
    return out


def _rate(bps: float) -> str:
    if bps <= 0:
        return "never"
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.1f} Mbit/s" if bps >= 1e6 else f"{bps / 1e3:.0f} kbit/s"


def table(rows_: list[dict], host: str, command: str) -> str:
    """The coders' block: one row per preset, direction, shape and coder."""
    lines = [f"Measured by `{command}` on {host} (one thread, the best of 3 per message, means over the cuts): "
             "bytes per message; *vs order-0*: coded bytes (tables included) divided by the buffer's order-0 bound "
             "(each section's entropy, tables excluded); *MB/s*: codec-buffer bytes per second of encode + decode; "
             "*pays below*: the link rate below which the wire time it saves exceeds its encode + decode time.", "",
             "| preset | direction | shape | codec bytes | order-0 | coder | coded | vs order-0 | encode ms | "
             "decode ms | MB/s | pays below |", "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows_:
        for coder, c in r["coders"].items():
            lines.append(f"| {r['preset']} | {r['direction']} | `{r['shape']}` | {r['raw']:,.0f} | {r['order0']:,.0f} | "
                         f"{coder} | {c['coded']:,.0f} | {c['coded'] / r['order0']:.4f} | {c['encode_ms']:.2f} | "
                         f"{c['decode_ms']:.2f} | {c['mb_s']:.1f} | {_rate(c['break_even_bps'])} |")
    return "\n".join(lines + ["", summary(rows_)])


def _span(values, digits: int) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if round(low, digits) == round(high, digits) else f"{low:.{digits}f}-{high:.{digits}f}"


def summary(rows_: list[dict]) -> str:
    """The table in one line per coder: its size against the bound per shape, its speed and where it pays."""
    coders = list(rows_[0]["coders"]) if rows_ else []
    shapes = sorted({tuple(r["shape"]) for r in rows_}, reverse=True)
    lines = []
    for coder in coders:
        sizes = "; ".join(f"`{list(shape)}` " + _span([r["coders"][coder]["coded"] / r["order0"] for r in rows_
                                                         if tuple(r["shape"]) == shape], 4) for shape in shapes)
        speed = _span([r["coders"][coder]["mb_s"] for r in rows_], 1)
        pays = [r["coders"][coder]["break_even_bps"] for r in rows_]
        lines.append(f"- `{coder}`: {sizes} of the order-0 bound; {speed} MB/s; pays below "
                     f"{_rate(min(pays))} to {_rate(max(pays))}.")
    return "In sum (every row above):\n\n" + "\n".join(lines)
