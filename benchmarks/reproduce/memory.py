"""Memory: AQ-SGD's per-sample activation buffer vs TAH-Quant's (none), for the fine-tuning run.

Two measurements. The plugin logs ``buffer_bytes`` per iteration (what every stage's
codecs hold, summed), read here from the fine-tuning runs' logs. And, independently, the
buffer is measured by replaying the fine-tuning run's traffic through the codec itself: one ``AqSgdCodec`` link end
(same bits, tile, warm-up) encodes every training sample once, in micro-batches of
the run's ``[s, b, h]`` shape, and ``buffer_nbytes()`` is read (its size depends on
the set of sample ids and the shape, not on the values). Every stage boundary has
two ends (sender and receiver keep identical copies), so a run with ``p`` stages
holds ``2 (p - 1)`` of them. TAH-Quant is checked to be stateless: encoding the same
tensor twice, with other tensors in between, gives identical bytes.

Peak RSS per run (largest stage process, from ``wait4``) is read from the runs' meta
files. Writes ``root/memory/memory.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .convergence import DEFAULT_SEED, EXTRA_SEEDS, SIZES, data_prefixes, seed_name, train_samples
from ..common.runner import ReproduceError, read_log, read_meta

GPT2_XL = {"seq": 1024, "hidden": 1600, "bytes_per_value": 2}
"""The AQ-SGD paper's setting (fp16 buffer), for the extrapolation row."""


def _flag(flags: list[str], name: str) -> int:
    return int(flags[flags.index(name) + 1])


def aqsgd_buffer_bytes(samples: int, seq: int, micro_batch: int, hidden: int, bits: int = 4, tile_size: int = 64) -> int:
    """Bytes of one AQ-SGD link end after every one of ``samples`` ids passed once (measured, not computed)."""
    import torch

    from megatron_tah.codecs import get_codec

    codec = get_codec("aqsgd", bits=bits, tile_size=tile_size, warmup_samples=samples, backend="torch")
    gen = torch.Generator().manual_seed(0)
    for first in range(0, samples, micro_batch):
        ids = torch.arange(first, min(first + micro_batch, samples), dtype=torch.long)
        x = torch.randn(seq, len(ids), hidden, generator=gen)
        codec.encode(x, sample_ids=ids)
    return codec.buffer_nbytes()


def tah_is_stateless(seq: int, micro_batch: int, hidden: int) -> bool:
    import torch

    from megatron_tah.codecs import get_codec

    codec = get_codec("tah", backend="torch")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(seq, micro_batch, hidden, generator=gen)
    first = codec.encode(x).clone()
    for _ in range(3):
        codec.encode(torch.randn(seq, micro_batch, hidden, generator=gen))
    return bool(torch.equal(first, codec.encode(x)))


def run(root: Path, size: str = "full") -> dict:
    cfg = SIZES[size]
    model = cfg["model"]
    seq, mb, hidden = _flag(model, "--seq-length"), _flag(model, "--micro-batch-size"), _flag(model, "--hidden-size")
    p = cfg["pipeline"]
    samples = train_samples(data_prefixes(root, size)["sotu"], seq)
    per_end = aqsgd_buffer_bytes(samples, seq, mb, hidden)
    conv = Path(root) / "convergence"
    rss = {name: (read_meta(conv, f"ft_{name}") or {}).get("max_rss_kb") for name in ("none", "tah", "aqsgd")}
    # The first of the run's seeds whose log has the field (logs older than the field lack it).
    logged = {name: next((v for seed in (DEFAULT_SEED, *EXTRA_SEEDS)
                          if (v := _logged_buffer(conv / f"{seed_name('ft_' + name, seed)}.jsonl"))), None)
              for name in ("none", "tah", "aqsgd")}
    xl_per_sample_rank = 2 * GPT2_XL["seq"] * GPT2_XL["hidden"] * GPT2_XL["bytes_per_value"]
    result = {
        "samples": samples, "seq": seq, "micro_batch": mb, "hidden": hidden, "pipeline": p,
        "aqsgd_buffer_bytes_per_link_end": per_end,
        "aqsgd_buffer_bytes_per_sample_per_end": per_end / samples,
        "aqsgd_buffer_bytes_run": per_end * 2 * (p - 1),
        "tah_buffer_bytes_run": 0, "tah_stateless": tah_is_stateless(seq, mb, hidden),
        "max_rss_kb": rss, "logged_buffer_bytes": logged,
        # Validation batches cross the same links (forward only), so their fixed samples are buffered too.
        "valid_samples": cfg["eval_iters"] * _flag(model, "--global-batch-size"),
        "gpt2_xl_bytes_per_sample_per_middle_rank": xl_per_sample_rank,
    }
    out = Path(root) / "memory"
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(result, indent=1))
    return result


def _logged_buffer(path: Path) -> dict | None:
    """``{"final", "peak"}`` buffer bytes (all stages) from a run's log; None if missing or not logged."""
    try:
        records = read_log(path)
    except ReproduceError:
        return None
    values = [r["buffer_bytes"] for r in records if "buffer_bytes" in r]
    return {"final": values[-1], "peak": max(values)} if values else None
