"""Hugging Face decoder checkpoints into Megatron checkpoints, and trained Megatron checkpoints back.

    python -m megatron_tah.hf_checkpoint import SOURCE OUT [--gguf-file FILE]
    python -m megatron_tah.hf_checkpoint export CKPT OUT [--reference IMPORTED]
    python -m megatron_tah.hf_checkpoint flags OUT [--pipeline PP]  # the model's Megatron flags, one line
    python -m megatron_tah.hf_checkpoint verify OUT SOURCE  # Megatron's logits against transformers' (JSON)

**import**: ``transformers`` loads SOURCE (a folder of safetensors, or with ``--gguf-file`` a GGUF file in
it, dequantized to fp32), :class:`Architecture` checks that megatron-core's ``GPTModel`` can be that model,
the weights are renamed and stacked onto it (:func:`to_megatron`), and Megatron's own ``save_checkpoint``
writes OUT as a *release* checkpoint in ``torch_dist`` format (fp32 weights, no optimizer): any pipeline or
tensor-parallel split loads it with ``--load OUT --finetune``. OUT also holds ``megatron_flags.txt`` (the
model flags a run needs: ``--num-layers 30 --hidden-size 576 ...``), ``hf_config.json`` (the model's
``transformers`` config) and ``tokenizer/`` (its tokenizer, for ``python -m megatron_tah.data --tokenizer``).

**export**: Megatron's ``load_checkpoint`` reads CKPT (its latest iteration, saved at any split) into the
same model in one process, the weights are mapped back (:func:`to_hf`), and ``transformers`` writes OUT with
``save_pretrained`` (safetensors). Model flags, config and tokenizer come from ``--reference``, the imported
folder the run started from (default: CKPT itself, when it is one); a checkpoint of another shape does not
load (Megatron's strict load names the tensor).

Both run megatron.training in this process (one rank, gloo; the CPU shims without CUDA) and use the local
layer spec, whose checkpoint names are Transformer Engine's (``get_gpt_layer_local_spec``'s key map), so a
GPU run with ``--transformer-impl transformer_engine`` loads the same checkpoint.

Covered: Llama-shaped decoders (``model_type`` llama, mistral without a sliding window, qwen2 with its
query/key/value biases): RMSNorm, SwiGLU, rotary embeddings without scaling, grouped-query attention, tied or
untied output layer. Anything else is an :class:`UnsupportedModel` error naming the config field.

Weight layout (megatron-core 0.19, local spec): ``linear_qkv`` holds, for each query group g, its
``heads / groups`` query heads, then key head g, then value head g (``kv_channels`` rows each);
``linear_fc1`` is ``[gate; up]``; the norms are ``input_layernorm``, ``pre_mlp_layernorm`` and
``decoder.final_layernorm``.

Why a mapping of our own: NVIDIA's ``megatron-bridge`` 0.6.2 does not install on a CPU machine (its
dependencies build ``fast-hadamard-transform`` against CUDA torch) nor import without Transformer Engine,
and ``mbridge`` 0.15.1 gives transformers' logits only after six run-time patches for megatron-core 0.19 and
transformers 5 (tried 2026-11-28). Where a bridge runs (a GPU image with
Transformer Engine), its checkpoints and these are both megatron-core ``torch_dist`` checkpoints of the same
model: either loads where the other was written, as long as the layer names agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import torch

FLAGS_FILE = "megatron_flags.txt"
CONFIG_FILE = "hf_config.json"
TOKENIZER_DIR = "tokenizer"
MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModel(ValueError):
    """A checkpoint this mapping does not cover; the message names the config field and its value."""


# ----- the architecture ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Architecture:
    """What megatron-core needs to build the model, read from a ``transformers`` config."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    rotary_base: float
    vocab_size: int
    max_position_embeddings: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, config) -> "Architecture":
        """From a ``transformers`` config (object or dict); :class:`UnsupportedModel` names what does not fit."""
        c = config if isinstance(config, dict) else config.to_dict()

        def field(name, default=None):
            return c.get(name, default)

        def refuse(name, why):
            raise UnsupportedModel(f"{name} = {field(name)!r}: {why}")

        if field("model_type") not in MODEL_TYPES:
            refuse("model_type", f"only Llama-shaped decoders are mapped ({', '.join(MODEL_TYPES)})")
        if field("hidden_act", "silu") != "silu":
            refuse("hidden_act", "Megatron's --swiglu is silu-gated")
        rope = field("rope_parameters") or field("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            refuse("rope_parameters" if field("rope_parameters") else "rope_scaling",
                   "only unscaled rotary embeddings are mapped")
        theta = rope.get("rope_theta", field("rope_theta"))
        if theta is None:
            refuse("rope_theta", "the rotary base is missing")
        if field("mlp_bias", False):
            refuse("mlp_bias", "Megatron's --disable-bias-linear layers have no MLP biases")
        qkv_bias = field("model_type") == "qwen2" or bool(field("attention_bias", False))
        if field("model_type") != "qwen2" and field("attention_bias", False):
            refuse("attention_bias", "the output projection's bias is not mapped (only Qwen2's query/key/value biases)")
        if field("use_sliding_window", False) or (field("model_type") == "mistral" and field("sliding_window")):
            refuse("sliding_window" if field("model_type") == "mistral" else "use_sliding_window",
                   "sliding-window attention is not mapped")
        heads, hidden = int(field("num_attention_heads")), int(field("hidden_size"))
        groups = int(field("num_key_value_heads") or heads)
        if heads % groups:
            refuse("num_key_value_heads", f"must divide num_attention_heads = {heads}")
        head_dim = int(field("head_dim") or hidden // heads)
        return cls(model_type=field("model_type"), num_layers=int(field("num_hidden_layers")), hidden_size=hidden,
                   ffn_hidden_size=int(field("intermediate_size")), num_attention_heads=heads,
                   num_query_groups=groups, kv_channels=head_dim, norm_epsilon=float(field("rms_norm_eps")),
                   rotary_base=float(theta), vocab_size=int(field("vocab_size")),
                   max_position_embeddings=int(field("max_position_embeddings")),
                   tied=bool(field("tie_word_embeddings", False)), qkv_bias=qkv_bias)

    def megatron_flags(self) -> list[str]:
        """The Megatron flags that build this model (architecture, vocabulary and no dropout, as the HF model)."""
        flags = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                 "--ffn-hidden-size", str(self.ffn_hidden_size), "--num-attention-heads", str(self.num_attention_heads),
                 "--kv-channels", str(self.kv_channels), "--swiglu", "--normalization", "RMSNorm",
                 "--norm-epsilon", repr(self.norm_epsilon), "--position-embedding-type", "rope",
                 "--rotary-base", f"{self.rotary_base:g}", "--no-rope-fusion", "--disable-bias-linear",
                 "--max-position-embeddings", str(self.max_position_embeddings),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", str(self.vocab_size),
                 "--make-vocab-size-divisible-by", "1", "--attention-dropout", "0", "--hidden-dropout", "0"]
        if self.num_query_groups != self.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.qkv_bias:
            flags += ["--add-qkv-bias"]
        if not self.tied:
            flags += ["--untie-embeddings-and-output-weights"]
        return flags


# ----- the weights -------------------------------------------------------------------------------
def _layer_names(i: int) -> dict[str, str]:
    """HF name -> Megatron name of layer ``i``'s tensors that map one to one."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    return {hf + "self_attn.o_proj.weight": mc + "self_attention.linear_proj.weight",
            hf + "mlp.down_proj.weight": mc + "mlp.linear_fc2.weight",
            hf + "input_layernorm.weight": mc + "input_layernorm.weight",
            hf + "post_attention_layernorm.weight": mc + "pre_mlp_layernorm.weight"}


def _qkv(arch: Architecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Query, key and value rows (or biases) interleaved per query group, as ``linear_qkv`` holds them."""
    g, d = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // g
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1) \
        .reshape(-1, *rest)


def _split_qkv(arch: Architecture, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron(arch: Architecture, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``transformers`` state dict as megatron-core ``GPTModel``'s (local spec, one pipeline stage).

    Every tensor of ``hf`` is used (a tied ``lm_head.weight`` must equal the embedding); a missing or
    left-over tensor, or one of the wrong shape, is an :class:`UnsupportedModel` error naming it."""
    hf = dict(hf)
    out: dict[str, torch.Tensor] = {}

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in hf:
            raise UnsupportedModel(f"tensor {name} is missing from the checkpoint")
        t = hf.pop(name)
        if tuple(t.shape) != shape:
            raise UnsupportedModel(f"tensor {name} has shape {tuple(t.shape)}, the config gives {shape}")
        return t

    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    q_rows, kv_rows = arch.num_attention_heads * d, arch.num_query_groups * d
    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight", (arch.vocab_size, h))
    for i in range(arch.num_layers):
        a, mc = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        out[mc + "self_attention.linear_qkv.weight"] = _qkv(
            arch, take(a + "q_proj.weight", (q_rows, h)), take(a + "k_proj.weight", (kv_rows, h)),
            take(a + "v_proj.weight", (kv_rows, h)))
        if arch.qkv_bias:
            out[mc + "self_attention.linear_qkv.bias"] = _qkv(
                arch, take(a + "q_proj.bias", (q_rows,)), take(a + "k_proj.bias", (kv_rows,)),
                take(a + "v_proj.bias", (kv_rows,)))
        m = f"model.layers.{i}.mlp."
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([take(m + "gate_proj.weight", (f, h)),
                                                      take(m + "up_proj.weight", (f, h))])
        shapes = {"o_proj": (h, q_rows), "down_proj": (h, f), "input_layernorm": (h,), "post_attention_layernorm": (h,)}
        for hf_name, mc_name in _layer_names(i).items():
            out[mc_name] = take(hf_name, next(s for key, s in shapes.items() if f".{key}." in hf_name))
    out["decoder.final_layernorm.weight"] = take("model.norm.weight", (h,))
    head = hf.pop("lm_head.weight", None)
    if arch.tied:
        if head is not None and not torch.equal(head, out["embedding.word_embeddings.weight"]):
            raise UnsupportedModel("tie_word_embeddings = True but lm_head.weight differs from model.embed_tokens.weight")
    else:
        if head is None:
            raise UnsupportedModel("tensor lm_head.weight is missing from the checkpoint (tie_word_embeddings = False)")
        hf["lm_head.weight"] = head
        out["output_layer.weight"] = take("lm_head.weight", (arch.vocab_size, h))
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed from the base
    if hf:
        raise UnsupportedModel(f"tensors the mapping does not cover: {', '.join(sorted(hf)[:5])}")
    return out


def to_hf(arch: Architecture, mc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core ``GPTModel``'s state dict (local spec, one stage) as a ``transformers`` one: the inverse
    of :func:`to_megatron` (``lm_head.weight`` only when untied). Megatron's ``_extra_state`` entries are left out."""
    mc = {k: v for k, v in mc.items() if not k.endswith("_extra_state")}
    out = {"model.embed_tokens.weight": mc.pop("embedding.word_embeddings.weight")}
    for i in range(arch.num_layers):
        a, m, pre = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"decoder.layers.{i}."
        q, k, v = _split_qkv(arch, mc.pop(pre + "self_attention.linear_qkv.weight"))
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if arch.qkv_bias:
            q, k, v = _split_qkv(arch, mc.pop(pre + "self_attention.linear_qkv.bias"))
            out.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
        gate, up = mc.pop(pre + "mlp.linear_fc1.weight").chunk(2)
        out.update({m + "gate_proj.weight": gate, m + "up_proj.weight": up})
        out.update({hf_name: mc.pop(mc_name) for hf_name, mc_name in _layer_names(i).items()})
    out["model.norm.weight"] = mc.pop("decoder.final_layernorm.weight")
    if not arch.tied:
        out["lm_head.weight"] = mc.pop("output_layer.weight")
    if mc:
        raise UnsupportedModel(f"Megatron tensors the mapping does not cover: {', '.join(sorted(mc)[:5])}")
    return {k: v.contiguous() for k, v in out.items()}


# ----- transformers ---------------------------------------------------------------------------------
def _transformers():
    try:
        import transformers
    except ImportError:
        raise SystemExit("hf_checkpoint: error: transformers is not installed (pip install 'megatron_tah[real]')") \
            from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.set_verbosity_error()
    return transformers


def _gguf(gguf_file: str | None) -> dict:
    """``transformers``' keyword for a GGUF file in SOURCE (none without one)."""
    return {"gguf_file": gguf_file} if gguf_file else {}


def load_hf(source: str | Path, gguf_file: str | None = None, *, config=None, tokenizer: bool = True):
    """(tokenizer, model) of a local checkpoint as ``transformers`` loads it, in fp32; the tokenizer is None when
    ``tokenizer`` is false. ``config``: SOURCE's config when already loaded (each load of a GGUF file parses it
    whole: its vocabulary is most of that time)."""
    transformers = _transformers()
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a folder (a Hugging Face checkpoint, or the folder of --gguf-file)")
    kwargs = _gguf(gguf_file)
    loaded_tokenizer = transformers.AutoTokenizer.from_pretrained(source, **kwargs) if tokenizer else None
    if config is not None:
        kwargs["config"] = config
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
    return loaded_tokenizer, model


# ----- Megatron in this process -----------------------------------------------------------------------
def _start_megatron(flags: list[str]):
    """Megatron's arguments and distributed state for one rank (this process), and the GPT model it builds
    (local layers, unwrapped, fp32)."""
    from megatron_tah.launch import default_rendezvous

    default_rendezvous()
    from megatron_tah.megatron.plugin import install_megatron_lm_plugin
    from megatron_tah.pretrain_gpt import CPU_FLAGS

    install_megatron_lm_plugin()  # CPU shims without CUDA; no --tah-* flag: nothing else is installed
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.initialize import initialize_megatron

    cpu = [] if torch.cuda.is_available() else [*CPU_FLAGS]
    sys.argv = ["megatron_tah.hf_checkpoint", *cpu, "--transformer-impl", "local", "--micro-batch-size", "1",
                "--global-batch-size", "1", "--train-iters", "1", "--seq-length", "16", "--lr", "0", *flags]
    args = parse_and_validate_args()
    initialize_megatron()
    model_config = gpt_config_from_args(args)
    builder = model_config.get_builder_cls()(model_config)
    model = builder.build_distributed_models(pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                                             wrap_with_ddp=False)
    return args, model


def _checkpoint_flags(load: str | None = None, save: str | None = None) -> list[str]:
    flags = ["--ckpt-format", "torch_dist", "--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng"]
    if load:
        flags += ["--load", str(load), "--finetune"]
    if save:
        flags += ["--save", str(save), "--save-interval", "1"]
    return flags


def import_checkpoint(source: str | Path, out: str | Path, gguf_file: str | None = None) -> Architecture:
    """SOURCE (``transformers``' local checkpoint) as a Megatron release checkpoint in OUT (module docstring)."""
    out = Path(out)
    config = _transformers().AutoConfig.from_pretrained(source, **_gguf(gguf_file))
    hf_config = _config_dict(config)  # before the model's loading sets fields of it
    tokenizer, hf_model = load_hf(source, gguf_file, config=config)
    arch = Architecture.from_hf_config(hf_model.config)
    state = to_megatron(arch, hf_model.state_dict())
    del hf_model
    args, model = _start_megatron([*arch.megatron_flags(), *_checkpoint_flags(save=out)])
    missing, unexpected = model[0].load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise UnsupportedModel(f"Megatron's model does not take the mapped weights: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    from megatron.training.checkpointing import save_checkpoint

    save_checkpoint(0, model, None, None, 0, release=True)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=1, sort_keys=True) + "\n")
    (out / FLAGS_FILE).write_text(" ".join(arch.megatron_flags()) + "\n")
    tokenizer.save_pretrained(out / TOKENIZER_DIR)
    return arch


def _config_dict(config) -> dict:
    """SOURCE's config as the import writes it: fp32, without GGUF's quantization (the weights written are
    dequantized) or the source's path."""
    config = config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    return config


def export_checkpoint(ckpt: str | Path, out: str | Path, reference: str | Path | None = None) -> Architecture:
    """CKPT (a Megatron checkpoint of a model :func:`import_checkpoint` covers) as a ``transformers`` folder."""
    ckpt, out = Path(ckpt), Path(out)
    reference = Path(reference) if reference else ckpt
    if not (reference / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{reference / CONFIG_FILE} not found: pass --reference, the folder "
                                f"`python -m megatron_tah.hf_checkpoint import` wrote")
    config = json.loads((reference / CONFIG_FILE).read_text())
    args, model = _start_megatron([*read_flags(reference), *_checkpoint_flags(load=ckpt)])
    from megatron.training.checkpointing import load_checkpoint

    load_checkpoint(model, None, None, strict=True)
    arch = Architecture.from_hf_config(config)
    state = to_hf(arch, {k: v.detach().float() for k, v in model[0].state_dict().items() if isinstance(v, torch.Tensor)})
    transformers = _transformers()
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf_model.load_state_dict(state, strict=not arch.tied, assign=True)
    if arch.tied:
        hf_model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(out)
    if (reference / TOKENIZER_DIR).is_dir():
        for f in (reference / TOKENIZER_DIR).iterdir():
            shutil.copy(f, out / f.name)
    return arch


def verify(ckpt: str | Path, source: str | Path, gguf_file: str | None = None, tokens: int = 32,
           seed: int = 0) -> dict:
    """The logits of Megatron's model loaded from CKPT against ``transformers``' of SOURCE, fp32, on ``tokens``
    random token ids: ``{"max_abs_diff", "max_abs_logit", "tokens"}``."""
    _, hf_model = load_hf(source, gguf_file, tokenizer=False)
    hf_model.eval()
    ids = torch.randint(0, hf_model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = hf_model(ids).logits.float()
    del hf_model
    args, model = _start_megatron([*read_flags(ckpt), *_checkpoint_flags(load=ckpt)])
    from megatron.training.checkpointing import load_checkpoint

    load_checkpoint(model, None, None, strict=True)
    net = model[0].eval()
    with torch.no_grad():
        logits = net(ids, torch.arange(tokens)[None], None).float()
    return {"max_abs_diff": float((logits - expected).abs().max()), "max_abs_logit": float(expected.abs().max()),
            "tokens": tokens}


def stage_layers(num_layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage: evenly when ``stages`` divides ``num_layers``, else the first and the last stage
    take what the others leave at ``ceil(num_layers / stages)`` each (they also hold the embedding and the output
    layer); :class:`UnsupportedModel` when that does not split evenly."""
    if stages < 1:
        raise UnsupportedModel(f"pipeline size {stages}: must be >= 1")
    if num_layers % stages == 0:
        return [num_layers // stages] * stages
    per = -(-num_layers // stages)
    rest = num_layers - per * (stages - 2)
    if stages < 3 or rest < 2 or rest % 2:
        raise UnsupportedModel(f"{num_layers} layers do not split over {stages} pipeline stages (evenly, or with "
                               f"{per} per stage and the rest shared by the first and the last)")
    return [rest // 2] + [per] * (stages - 2) + [rest // 2]


def split_flags(num_layers: int, stages: int) -> list[str]:
    """Megatron's flags for :func:`stage_layers`' split (none when even)."""
    layers = stage_layers(num_layers, stages)
    if len(set(layers)) == 1:
        return []
    return ["--decoder-first-pipeline-num-layers", str(layers[0]), "--decoder-last-pipeline-num-layers", str(layers[-1])]


def read_flags(folder: str | Path, stages: int = 1) -> list[str]:
    """The Megatron model flags an imported folder records (``megatron_flags.txt``), and for a pipeline of
    ``stages`` the split's (:func:`split_flags`)."""
    path = Path(folder) / FLAGS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a folder `python -m megatron_tah.hf_checkpoint "
                                f"import` wrote")
    flags = path.read_text().split()
    return flags + split_flags(int(flags[flags.index("--num-layers") + 1]), stages) if stages > 1 else flags


def argument_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m megatron_tah.hf_checkpoint``."""
    parser = argparse.ArgumentParser(prog="python -m megatron_tah.hf_checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("import", help="a Hugging Face checkpoint -> a Megatron release checkpoint")
    p.add_argument("source", help="folder of the checkpoint (config.json + safetensors, or the GGUF file's folder)")
    p.add_argument("out", help="folder to write the Megatron checkpoint to")
    p.add_argument("--gguf-file", help="a GGUF file in SOURCE to load (dequantized to fp32)")
    p = sub.add_parser("export", help="a Megatron checkpoint -> a Hugging Face folder (safetensors)")
    p.add_argument("ckpt", help="the Megatron checkpoint folder (its latest iteration)")
    p.add_argument("out", help="folder to write the transformers checkpoint to")
    p.add_argument("--reference", help="the imported folder the training started from (config and tokenizer)")
    p = sub.add_parser("verify", help="Megatron's logits from an imported folder against transformers' (JSON)")
    p.add_argument("ckpt", help="the folder import wrote")
    p.add_argument("source", help="the checkpoint it was imported from")
    p.add_argument("--gguf-file")
    p.add_argument("--tokens", type=int, default=32)
    p = sub.add_parser("flags", help="print the Megatron model flags of an imported folder")
    p.add_argument("folder")
    p.add_argument("--pipeline", type=int, default=1, help="with the split flags of this many pipeline stages")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    try:
        if args.command == "verify":
            print(json.dumps(verify(args.ckpt, args.source, args.gguf_file, args.tokens)))
        elif args.command == "flags":
            print(" ".join(read_flags(args.folder, args.pipeline)))
        elif args.command == "import":
            arch = import_checkpoint(args.source, args.out, args.gguf_file)
            print(f"[hf_checkpoint] {args.out}: {arch.model_type}, {arch.num_layers} layers, hidden "
                  f"{arch.hidden_size}; fine-tune with --load {args.out} --finetune {' '.join(arch.megatron_flags())}")
        else:
            export_checkpoint(args.ckpt, args.out, args.reference)
            print(f"[hf_checkpoint] {args.out}: transformers checkpoint written")
    except (UnsupportedModel, FileNotFoundError) as err:
        print(f"hf_checkpoint: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
