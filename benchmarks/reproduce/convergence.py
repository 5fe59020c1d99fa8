"""Convergence, ablation and memory experiments: which runs, and what their logs say.

Pretraining: a GPT (``SIZES[size]``) on the Shakespeare corpus, one run per codec
(:data:`CODECS`), same seed and data order. Fine-tuning: from the uncompressed
pretraining checkpoint, on a small State of the Union subset for several epochs
(so AQ-SGD's per-sample buffer is revisited; its warm-up is the first epoch).
Ablations: TAH-Quant pretraining runs varying one knob of the default
(tau = 2, 80/20 INT4/INT3, tile 64, token allocation, round to nearest), and other
4-bit forward formats in its place (MXFP4, NVFP4).
Seeds (part ``seeds``): the main pretraining and fine-tuning runs again with
:data:`EXTRA_SEEDS` (initialization and data order), so a gap can be compared with the
run-to-run spread. Long runs (part ``long``): :data:`LONG_CODECS` pretrained
``long_iters`` iterations (about one epoch of the capped corpus), to see whether gaps
close or grow with training.

Every codec run uses the same backward codec as TAH-Quant (6-bit fixed point,
tile 32) except ``none`` (uncompressed both ways) and ``fp8`` (fp8 both ways, as TACO),
so the forward codec is the only difference among the quantizing runs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

from ..common import stats
from ..common.runner import ReproduceError, Run, read_log, read_meta

# The 6-bit backward codec (fixedpoint, tile 32) of every "6-bit bwd" run: flags are explicit, nothing is on by default.
BACKWARD_6BIT = ["--tah-backward-codec", "fixedpoint"]


def _candidate(name: str) -> list[str]:
    """``auto``'s candidate ``name`` that is no preset, as the flags that set its fields."""
    from megatron_tah.config import candidate_fields
    from megatron_tah.megatron.arguments import fields_flags

    return fields_flags(candidate_fields(name))

# name -> (label, --tah-* flags)
CODECS = {
    "none": ("uncompressed (fp32)", ["--tah-forward-codec", "none", "--tah-backward-codec", "none"]),
    "tah": ("TAH-Quant (4/3-bit fwd, 6-bit bwd)", ["--tah-forward-codec", "tah", *BACKWARD_6BIT]),
    "fixedpoint4": ("direct 4-bit fwd, 6-bit bwd", ["--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "4", *BACKWARD_6BIT]),
    "fixedpoint3": ("direct 3-bit fwd, 6-bit bwd", ["--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "3", *BACKWARD_6BIT]),
    "fp8": ("fp8 (TACO) both ways", ["--tah-forward-codec", "fp8", "--tah-backward-codec", "fp8"]),
    "tah_bwdnone": ("TAH-Quant fwd, uncompressed bwd (diagnostic)",
                    ["--tah-forward-codec", "tah", "--tah-backward-codec", "none"]),
    "aqsgd": ("AQ-SGD 4-bit deltas, 6-bit bwd", ["--tah-forward-codec", "aqsgd", "--tah-forward-bits", "4", *BACKWARD_6BIT]),
    "mxfp4": ("MXFP4 fwd (4.25 bits), 6-bit bwd", ["--tah-forward-codec", "mxfp4", *BACKWARD_6BIT]),
    # The parity study (part `parity`, module parity.py).
    "bwd6_only": ("uncompressed fwd, 6-bit bwd (diagnostic)", ["--tah-forward-codec", "none", *BACKWARD_6BIT]),
    "hadint4": ("Hadamard INT4 fwd (tile 64, 4.25 bits), 6-bit bwd", ["--tah-forward-codec", "hadint", *BACKWARD_6BIT]),
    "hadint4_bwd4sr": ("Hadamard INT4 fwd, Hadamard INT4 bwd with stochastic rounding (4.25 bits each)",
                       ["--tah-forward-codec", "hadint", "--tah-backward-codec", "hadint", "--tah-backward-bits", "4",
                        "--tah-backward-tile-size", "64", "--tah-backward-stochastic-rounding"]),
    "tah_bwd4sr": ("TAH-Quant fwd, Hadamard INT4 bwd with stochastic rounding (4.25 bits)",
                   ["--tah-forward-codec", "tah", "--tah-backward-codec", "hadint", "--tah-backward-bits", "4",
                    "--tah-backward-tile-size", "64", "--tah-backward-stochastic-rounding"]),
    "lowrank": ("lowrank: 16 principal directions + Hadamard INT3 residual fwd, Hadamard INT4 bwd with "
                "stochastic rounding (4.25 bits): --tah-preset lowrank", ["--tah-preset", "lowrank"]),
    "lowrank_r8": ("lowrank rank 8: 8 principal directions + Hadamard INT3 residual fwd, Hadamard INT4 bwd with "
                   "stochastic rounding (4.25 bits): candidate lowrank8", _candidate("lowrank8")),
    "lowrank_bwdnone": ("lowrank: 16 principal directions + Hadamard INT3 residual fwd, uncompressed bwd "
                        "(diagnostic)", ["--tah-forward-codec", "lowrank", "--tah-forward-bits", "3",
                                         "--tah-backward-codec", "none"]),
    "tah_bwd6sr": ("TAH-Quant fwd, 6-bit bwd with stochastic rounding (diagnostic)",
                   ["--tah-forward-codec", "tah", "--tah-backward-stochastic-rounding", *BACKWARD_6BIT]),
    "hadint4_bwdnone": ("Hadamard INT4 fwd (4.25 bits), uncompressed bwd (diagnostic)",
                        ["--tah-forward-codec", "hadint", "--tah-backward-codec", "none"]),
    "hadint5_bwdnone": ("Hadamard INT5 fwd (5.25 bits), uncompressed bwd (diagnostic)",
                        ["--tah-forward-codec", "hadint", "--tah-forward-bits", "5", "--tah-backward-codec", "none"]),
    "hadint6_bwdnone": ("Hadamard INT6 fwd (6.25 bits), uncompressed bwd (diagnostic)",
                        ["--tah-forward-codec", "hadint", "--tah-forward-bits", "6", "--tah-backward-codec", "none"]),
    "bwd4_only": ("uncompressed fwd, Hadamard INT4 bwd (4.25 bits) (diagnostic)",
                  ["--tah-forward-codec", "none", "--tah-backward-codec", "hadint", "--tah-backward-bits", "4",
                   "--tah-backward-tile-size", "64"]),
    "bwd4sr_only": ("uncompressed fwd, Hadamard INT4 bwd with stochastic rounding (4.25 bits) (diagnostic)",
                    ["--tah-forward-codec", "none", "--tah-backward-codec", "hadint", "--tah-backward-bits", "4",
                     "--tah-backward-tile-size", "64", "--tah-backward-stochastic-rounding"]),
    "bwd4t16_only": ("uncompressed fwd, Hadamard INT4 tile 16 bwd (5 bits) (diagnostic)",
                     ["--tah-forward-codec", "none", "--tah-backward-codec", "hadint", "--tah-backward-bits", "4",
                      "--tah-backward-tile-size", "16"]),
    "bwd5_only": ("uncompressed fwd, Hadamard INT5 bwd (5.25 bits) (diagnostic)",
                  ["--tah-forward-codec", "none", "--tah-backward-codec", "hadint", "--tah-backward-bits", "5",
                   "--tah-backward-tile-size", "64"]),
    "channel": ("channel: per-channel 4-bit fwd, per-channel 3-bit bwd with stochastic rounding: candidate channel",
                _candidate("channel")),
    "channel6": ("channel6: per-channel 4-bit fwd, per-channel 2-bit bwd with stochastic rounding: candidate "
                 "channel6", _candidate("channel6")),
    "channel9": ("channel9: per-channel 6-bit fwd, per-channel 3-bit bwd with stochastic rounding: candidate "
                 "channel9", _candidate("channel9")),
    "channel_h4": ("channel_h4: per-channel 6-bit fwd with each sequence's largest token apart, Hadamard INT4 bwd with "
                   "stochastic rounding: --tah-preset channel_h4", ["--tah-preset", "channel_h4"]),
    "int8_both": ("8-bit blockwise both ways, noise-floor control (diagnostic)",
                  ["--tah-forward-codec", "int8", "--tah-backward-codec", "int8"]),
    "tah_warmup20": ("TAH-Quant, first 20 iterations uncompressed (--tah-warmup-iters 20)",
                     ["--tah-forward-codec", "tah", "--tah-warmup-iters", "20", *BACKWARD_6BIT]),
    "tah_evalboth": ("TAH-Quant, evaluated through the codec and uncompressed (diagnostic)",
                     ["--tah-forward-codec", "tah", "--tah-eval-traffic", "both", *BACKWARD_6BIT]),
    "hadint4_bwd4sr_evalboth": ("Hadamard INT4 both ways, evaluated through the codec and uncompressed (diagnostic)",
                                ["--tah-forward-codec", "hadint", "--tah-backward-codec", "hadint",
                                 "--tah-backward-bits", "4", "--tah-backward-tile-size", "64",
                                 "--tah-backward-stochastic-rounding", "--tah-eval-traffic", "both"]),
}
PRETRAIN_CODECS = ("none", "tah", "fixedpoint4", "fixedpoint3", "fp8", "tah_bwdnone", "mxfp4")
FINETUNE_CODECS = ("none", "tah", "fixedpoint4", "fixedpoint3", "aqsgd", "fp8")
DEFAULT_SEED = 1234  # Megatron's --seed default
EXTRA_SEEDS = (1235, 1236)
SEED_CODECS = ("none", "tah", "fixedpoint4", "fixedpoint3")  # rerun with EXTRA_SEEDS, pretraining and fine-tuning
SEED_PRETRAIN_ONLY = ("mxfp4",)  # rerun with EXTRA_SEEDS, pretraining only (parity: best single seed)
LONG_CODECS = ("none", "tah", "fixedpoint3")


def seed_name(name: str, seed: int) -> str:
    """Run name of ``name`` with another seed (``tah`` -> ``tah_s1235``); the default seed keeps ``name``."""
    return name if seed == DEFAULT_SEED else f"{name}_s{seed}"

# ablation group -> [(run name, value shown, flags)]; the default TAH-Quant run is each group's reference.
ABLATIONS = {
    "outlier threshold tau": [
        ("abl_tau0", "0 (always rotate)", ["--tah-outlier-threshold", "0"]),
        ("tah", "2 (default)", []),
        ("abl_tau4", "4", ["--tah-outlier-threshold", "4"]),
        ("abl_tauinf", "inf (never rotate)", ["--tah-outlier-threshold", "inf"]),
    ],
    "INT4/INT3 mix": [
        ("abl_mix100", "100/0", ["--tah-high-ratio", "1.0"]),
        ("tah", "80/20 (default)", []),
        ("abl_mix50", "50/50", ["--tah-high-ratio", "0.5"]),
        ("abl_mix0", "0/100", ["--tah-high-ratio", "0.0"]),
    ],
    "tile size": [
        ("abl_tile16", "16", ["--tah-tile-size", "16"]),
        ("abl_tile32", "32", ["--tah-tile-size", "32"]),
        ("tah", "64 (default)", []),
        ("abl_tile128", "128", ["--tah-tile-size", "128"]),
    ],
    "bit allocation": [
        ("tah", "token (default)", []),
        ("abl_alloc_tile", "tile", ["--tah-allocation", "tile"]),
        ("abl_low_high_entropy", "token, inverted: low bits to the highest-entropy 20% (diagnostic)",
         ["--tah-low-bits-for", "high_entropy"]),
    ],
    "rounding": [
        ("tah", "to nearest (default)", []),
        ("abl_stochastic", "stochastic", ["--tah-stochastic-rounding"]),
    ],
    # The parity study's candidates: standard 4-bit float formats in TAH-Quant's place (same 6-bit backward codec).
    "forward 4-bit float format": [
        ("tah", "TAH-Quant (default)", []),
        ("cand_mxfp4", "MXFP4: E2M1, E8M0 scale per 32 (4.25 bits)", ["--tah-forward-codec", "mxfp4", *BACKWARD_6BIT]),
        ("cand_mxfp4_had", "MXFP4 + seeded sign-flip Hadamard per block",
         ["--tah-forward-codec", "mxfp4", "--tah-fp4-hadamard", *BACKWARD_6BIT]),
        ("cand_nvfp4", "NVFP4: E2M1, E4M3 scale per 16 + fp32 per tensor (4.5 bits)", ["--tah-forward-codec", "nvfp4", *BACKWARD_6BIT]),
    ],
}

SIZES = {
    # PP 4, one layer per stage; 8 sequences of 128 tokens per iteration (4 micro-batches of 2).
    "full": {"model": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                       "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "8"],
             "pipeline": 4, "pretrain_iters": 200, "finetune_iters": 100, "eval_interval": 25, "eval_iters": 8,
             "long_iters": 800, "long_eval_interval": 50, "shakespeare_tokens": 800_000, "sotu_tokens": 32_768,
             "pretrain_warmup": 20, "finetune_warmup": 10},
    # CI smoke size: seconds per run.
    "tiny": {"model": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
                       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4"],
             "pipeline": 2, "pretrain_iters": 4, "finetune_iters": 4, "eval_interval": 2, "eval_iters": 1,
             "long_iters": 6, "long_eval_interval": 3, "shakespeare_tokens": 4_000, "sotu_tokens": 1_000,
             "pretrain_warmup": 1, "finetune_warmup": 1},
}
PROTOCOLS = {
    # Pretraining as in RESULTS.md sections 2-4: GPT-2's 50257 ids, 8 sequences per iteration.
    "gpt2": {},
    # The parity study's low-noise protocol: a compact vocabulary (``data.py --vocab-limit``), so that the
    # model's compute and parameters sit in the transformer body rather than in a 50257-row embedding
    # and output layer; twice the batch at half the learning rate; 300 iterations; larger evaluations.
    "compact": {"full": {"vocab_limit": 4096, "flags": {"--global-batch-size": "16", "--micro-batch-size": "4",
                                                        "--train-iters": "300", "--lr": "1e-3", "--min-lr": "1e-4",
                                                        "--lr-warmup-iters": "30", "--eval-interval": "50",
                                                        "--eval-iters": "16"}},
                "tiny": {"vocab_limit": 256, "flags": {}}},
}
"""Pretraining protocols: name -> {size: {"vocab_limit": K (data prefix ``..._v<K>``, ``--vocab-size K``),
"flags": Megatron flags replacing the ``gpt2`` protocol's values}}. Runs of a protocol other than
``gpt2`` are named ``<protocol>_<run>``."""
PRETRAIN_LR = ["--lr", "2e-3", "--min-lr", "2e-4", "--hidden-dropout", "0", "--attention-dropout", "0"]
FINETUNE_LR = ["--lr", "5e-4", "--min-lr", "5e-5"]
OPTIM = ["--lr-decay-style", "cosine", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.01",
         "--clip-grad", "1.0", "--untie-embeddings-and-output-weights"]
"""AdamW as the papers' GPT runs use it; separate input and output embeddings (tied, Megatron
all-reduces their gradient between the first and last stage every iteration, on the slow link)."""


def data_flags(prefix: str) -> list[str]:
    """Megatron's flags for a ``python -m megatron_tah.data`` prefix (its train and valid splits)."""
    from megatron_tah.pretrain_gpt import GPT2_DATA_FLAGS

    return ["--train-data-path", f"{prefix}_train_text_document", "--valid-data-path",
            f"{prefix}_valid_text_document", *GPT2_DATA_FLAGS]


def _vocab_limit(size: str, protocol: str) -> int | None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[protocol].get(size, {}).get("vocab_limit")


def data_prefixes(root: Path, size: str, protocol: str = "gpt2") -> dict[str, str]:
    limit = _vocab_limit(size, protocol)
    suffix = f"_v{limit}" if limit else ""
    return {"shakespeare": str(Path(root) / "data" / f"shakespeare_{size}{suffix}"),
            "sotu": str(Path(root) / "data" / f"sotu_{size}{suffix}")}


def prepare_data(root: Path, size: str, protocol: str = "gpt2") -> dict[str, str]:
    """Tokenize both corpora (capped per ``SIZES[size]``, with the protocol's vocabulary) unless present;
    returns the prefixes."""
    from megatron_tah.data import prepare

    prefixes = data_prefixes(root, size, protocol)
    caps = {"shakespeare": SIZES[size]["shakespeare_tokens"], "sotu": SIZES[size]["sotu_tokens"]}
    for corpus, prefix in prefixes.items():
        if not all(Path(f"{prefix}_{s}_text_document.{e}").is_file() for s in ("train", "valid")
                   for e in ("bin", "idx")):
            prepare(corpus, prefix, max_tokens=caps[corpus], vocab_limit=_vocab_limit(size, protocol))
    return prefixes


def protocol_flags(flags: list[str], size: str, protocol: str) -> list[str]:
    """``flags`` with the protocol's values (``--vocab-size`` included) in place of the ``gpt2`` protocol's."""
    limit = _vocab_limit(size, protocol)
    changes = {**({"--vocab-size": str(limit)} if limit else {}), **PROTOCOLS[protocol].get(size, {}).get("flags", {})}
    flags = list(flags)
    for name, value in changes.items():
        if name not in flags:
            raise ValueError(f"protocol {protocol!r} replaces {name}, which the run does not set")
        flags[flags.index(name) + 1] = value
    return flags


def train_samples(prefix: str, seq_length: int) -> int:
    """Samples of ``seq_length`` tokens (plus the next one) in ``prefix``'s train split: one epoch of
    megatron-core's ``GPTDataset``, as ``--fixed-epoch-samples`` revisits it."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(f"{prefix}_train_text_document")
    tokens = sum(len(ds[i]) for i in range(len(ds)))
    return (tokens - 1) // seq_length


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def size_width(size: str) -> int:
    """The hidden size of ``SIZES[size]``'s model."""
    return int(_flag(SIZES[size]["model"], "--hidden-size"))


def pretrain_runs(root: Path, size: str, codecs=PRETRAIN_CODECS, extra: dict[str, list[str]] | None = None,
                  seed: int = DEFAULT_SEED, long: bool = False, hidden: int | None = None,
                  protocol: str = "gpt2") -> list[Run]:
    """Pretraining runs per codec (plus ``extra``: name -> additional TAH-Quant flags, the ablations).

    ``seed``: another initialization and data order (names get ``_s<seed>``); ``long``: the
    ``long_iters`` runs (names ``long_<codec>``); ``hidden``: another hidden size (names get
    ``w<hidden>_``; the size's own hidden size changes nothing); ``protocol``: one of
    :data:`PROTOCOLS` (names get ``<protocol>_`` unless ``gpt2``; no checkpoint is saved).
    """
    cfg, prefixes = SIZES[size], data_prefixes(root, size, protocol)
    model = list(cfg["model"])
    width = size_width(size)
    other_width = hidden not in (None, width)
    prefix = ("" if protocol == "gpt2" else f"{protocol}_") + (f"w{hidden}_" if other_width else "")
    if other_width:
        model[model.index("--hidden-size") + 1] = str(hidden)
    iters, interval = (cfg["long_iters"], cfg["long_eval_interval"]) if long else (cfg["pretrain_iters"],
                                                                                    cfg["eval_interval"])
    common = [*model, *data_flags(prefixes["shakespeare"]), "--train-iters", str(iters),
              "--eval-interval", str(interval), "--eval-iters", str(cfg["eval_iters"]), *PRETRAIN_LR, *OPTIM,
              "--lr-warmup-iters", str(cfg["pretrain_warmup"]),
              *([] if seed == DEFAULT_SEED else ["--seed", str(seed)])]
    common = protocol_flags(common, size, protocol)
    phase = "pretrain_long" if long else "pretrain"
    runs = []
    for name in codecs:
        label, flags = CODECS[name]
        main = name == "none" and seed == DEFAULT_SEED and not long and not prefix
        save = (["--save", str(Path(root) / "convergence" / "ckpt_none"), "--save-interval", str(iters)]
                if main else [])
        runs.append(Run(prefix + seed_name(f"long_{name}" if long else name, seed), [*common, *flags, *save],
                        cfg["pipeline"], label=label,
                        info={"phase": phase, "codec": name, "seed": seed, "hidden": hidden or width,
                              **({} if protocol == "gpt2" else {"protocol": protocol})}))
    for name, flags in (extra or {}).items():
        runs.append(Run(name, [*common, *CODECS["tah"][1], *flags], cfg["pipeline"], label=name,
                        info={"phase": "pretrain", "codec": "tah", "ablation": flags}))
    return runs


def finetune_runs(root: Path, size: str, codecs=FINETUNE_CODECS, seed: int = DEFAULT_SEED) -> list[Run]:
    """Fine-tuning runs from the ``none`` pretraining checkpoint; AQ-SGD warms up for one epoch.

    ``seed`` changes the data order (and dropout); every run starts from the same checkpoint.
    """
    cfg, prefixes = SIZES[size], data_prefixes(root, size)
    samples = train_samples(prefixes["sotu"], int(_flag(cfg["model"], "--seq-length")))
    common = [*cfg["model"], *data_flags(prefixes["sotu"]), "--train-iters", str(cfg["finetune_iters"]),
              "--eval-interval", str(cfg["eval_interval"]), "--eval-iters", str(cfg["eval_iters"]), *FINETUNE_LR,
              *OPTIM, "--lr-warmup-iters", str(cfg["finetune_warmup"]),
              "--load", str(Path(root) / "convergence" / "ckpt_none"), "--finetune", "--fixed-epoch-samples",
              *([] if seed == DEFAULT_SEED else ["--seed", str(seed)])]
    epochs = cfg["finetune_iters"] * int(_flag(cfg["model"], "--global-batch-size")) / samples
    runs = []
    for name in codecs:
        label, flags = CODECS[name]
        if name == "aqsgd":
            flags = [*flags, "--tah-aqsgd-warmup-samples", str(samples)]
        runs.append(Run(seed_name(f"ft_{name}", seed), [*common, *flags], cfg["pipeline"], label=label,
                        after=("none",), info={"phase": "finetune", "codec": name, "seed": seed,
                                               "train_samples": samples, "epochs": epochs}))
    return runs


def seed_runs(root: Path, size: str) -> list[Run]:
    """The main pretraining and fine-tuning runs of :data:`SEED_CODECS` with each of :data:`EXTRA_SEEDS`.

    The fine-tuning runs start from the checkpoint the ``convergence`` part's ``none`` run saves.
    """
    checkpoint = Path(root) / "convergence" / "ckpt_none"
    if not checkpoint.is_dir():
        raise ReproduceError(f"part seeds: fine-tuning starts from {checkpoint}, written by the convergence "
                             "part's `none` run; run `convergence` first")
    runs = []
    for seed in EXTRA_SEEDS:
        runs += pretrain_runs(root, size, codecs=SEED_CODECS + SEED_PRETRAIN_ONLY, seed=seed)
    for seed in EXTRA_SEEDS:
        runs += [dataclasses.replace(r, after=()) for r in finetune_runs(root, size, codecs=SEED_CODECS, seed=seed)]
    return runs


def seed_run_names() -> list[str]:
    return [seed_name(prefix + c, seed) for prefix in ("", "ft_") for seed in EXTRA_SEEDS
            for c in SEED_CODECS + (SEED_PRETRAIN_ONLY if not prefix else ())]


def long_runs(root: Path, size: str) -> list[Run]:
    return pretrain_runs(root, size, codecs=LONG_CODECS, long=True)


def ablation_runs(root: Path, size: str) -> list[Run]:
    extra = {name: flags for group in ABLATIONS.values() for name, _, flags in group if name != "tah"}
    return pretrain_runs(root, size, codecs=(), extra=extra)


# ----------------------------------------------------------------------------- analysis
def summarize(records: list[dict]) -> dict:
    """Final validation loss / perplexity, the validation curve, and the mean wire bytes per iteration."""
    valid = [r for r in records if "valid_loss" in r]
    if not valid:
        raise ValueError("log has no validation records")
    n = len(records)
    wire = sum(r["fwd_wire_bytes"] + r["bwd_wire_bytes"] for r in records) / n
    raw = sum(r["fwd_raw_bytes"] + r["bwd_raw_bytes"] for r in records) / n
    return {"valid_loss": valid[-1]["valid_loss"], "valid_ppl": math.exp(min(valid[-1]["valid_loss"], 700)),
            "best_valid_loss": min(r["valid_loss"] for r in valid),
            "train_loss": sum(r["lm_loss"] for r in records[-10:]) / len(records[-10:]),
            "iterations": records[-1]["iteration"], "wire_bytes_per_iter": wire, "raw_bytes_per_iter": raw,
            "fwd_rel_error": _mean([(r.get("tah") or {}).get("forward", {}).get("rel_error") for r in records]),
            "rotated_fraction": _mean([(r.get("tah") or {}).get("forward", {}).get("rotated_fraction")
                                       for r in records])}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def collect(out_dir: Path, names) -> dict[str, dict]:
    """``{name: summary + meta}`` for the runs of ``names`` that completed (others are left out)."""
    rows = {}
    for name in names:
        path = Path(out_dir) / f"{name}.jsonl"
        meta = read_meta(out_dir, name)
        if not path.is_file() or not meta or meta.get("status") != 0:
            continue
        records = read_log(path)
        rows[name] = {**summarize(records), "records": records, "meta": meta}
    return rows


def seeds_needed(values: list[float], half_width: float, most: int = 1000) -> int | None:
    """Fewest paired seeds whose 95% interval would be ``half_width`` wide on each side if the seeds'
    spread stayed that of ``values`` (None with fewer than 2 values; ``most`` caps the answer)."""
    if len(values) < 2:
        return None
    spread = statistics.stdev(values)
    n = 2
    while n < most and stats.t975(n - 1) * spread / n ** 0.5 > half_width:
        n += 1
    return n


def relative_gap(value: float, reference: float) -> float:
    """``(value - reference) / reference``: positive when ``value`` is worse (higher loss)."""
    if reference == 0:
        raise ValueError("reference loss is 0")
    return (value - reference) / reference
