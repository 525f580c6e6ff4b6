"""Tests for data.py: tokenizer, corpus formats and caching, BlockLoader order/resume/DDP slicing."""
import builtins
import gzip
import json
import lzma
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers.normalizers import BertNormalizer

import data

SHARED_DATA = Path(__file__).parent.parent / "shared/data"
WORDS = ("the of and in a to was is for on as by with he that at from his it an were are which "
         "this be or has had first new one two their after its who but also they alpha beta "
         "gamma delta river city music played released school university born team season").split()
TITLES = ["Anarchism", "Autism", "Albedo", "Alabama", "Achilles"]


def _paragraph(seed, n=60):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _wikiextractor_text():
    docs = []
    for i, title in enumerate(TITLES):
        docs.append(f'<doc id="{i}" url="http://en.wikipedia.org/wiki?curid={i}" title="{title}">\n'
                    f"{title}\n\n{_paragraph(2 * i)}\n{_paragraph(2 * i + 1)}\n</doc>\n")
    return "".join(docs)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small tokenizer trained once on the tiny corpus (training is the slow part)."""
    d = tmp_path_factory.mktemp("tok")
    lines = [line for line in _wikiextractor_text().splitlines() if line and not line.startswith("<")]
    data.train_tokenizer(lines, vocab_size=300, save_dir=d)
    return d


def _stream(tok_dir, path, tmp_path):
    """Whole token stream (no validation split) of `path`, cached under tmp_path."""
    tok, train, val = data.prepare_data(str(path), tmp_path / "cache", tokenizer=tok_dir, val_fraction=0)
    assert len(val) == 0
    return tok, np.asarray(train)


# ----------------------------------------------------------------------------- tokenizer

def test_special_token_order(tok_dir):
    tok = data.load_tokenizer(tok_dir)
    assert data.special_token_ids(tok) == dict(pad=0, unk=1, cls=2, sep=3, mask=4)
    ids = tok.encode("The river").ids
    assert ids[0] == 2 and ids[-1] == 3
    assert tok.encode("The river", add_special_tokens=False).tokens == ["the", "river"]  # uncased


def test_save_load_roundtrip(tok_dir, tmp_path):
    tok = data.load_tokenizer(tok_dir)
    data.save_tokenizer(tok, tmp_path / "saved")
    names = {p.name for p in (tmp_path / "saved").iterdir()}
    assert {"tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"} <= names
    text = "Alpha BÉTA Gammaville river, Zürich!"
    expected = tok.encode(text).ids
    for path in ["saved", "saved/tokenizer.json", "saved/vocab.txt"]:
        assert data.load_tokenizer(tmp_path / path).encode(text).ids == expected, path


def test_training_is_deterministic():
    # plain `tokenizers` training gave the "##x" tokens different ids on each call, even in one process
    text = [_paragraph(i, 200) + " Zürich naïve Ωmega fjord 1989 x-ray ##hash" for i in range(40)]
    first = data.train_tokenizer(text, vocab_size=150)
    for _ in range(3):
        assert data.train_tokenizer(text, vocab_size=150).get_vocab() == first.get_vocab()
    vocab = first.get_vocab()
    assert sorted(vocab.values()) == list(range(len(vocab))) and len(vocab) == 150
    assert "##" + "a" in vocab and "##." not in vocab  # punctuation never continues a word
    assert data.special_token_ids(first) == dict(pad=0, unk=1, cls=2, sep=3, mask=4)
    assert first.decode(first.encode("Zürich fjord").ids) == "zurich fjord"  # no [UNK]: the alphabet is whole
    assert first.encode("##a").tokens == ["[CLS]", "#", "#", "a", "[SEP]"]  # "##a" is no special token


def test_alphabet_limit_ties_are_deterministic():
    # 30 characters seen once each, only 10 kept: ties broken by code point, not by hash order
    rare = "".join(chr(0x3b1 + i) for i in range(20)) + "klmnopqrst"
    alphabet, continuing = data._alphabet([["AAA bbb cCc", rare]], BertNormalizer(lowercase=True), limit=13)
    assert alphabet == sorted(["a", "b", "c"] + sorted(rare)[:10])
    assert continuing == alphabet


def test_save_is_atomic_and_corrupt_files_are_one_error(tok_dir, tmp_path, monkeypatch):
    tok = data.load_tokenizer(tok_dir)
    data.save_tokenizer(tok, tmp_path / "saved")
    good = (tmp_path / "saved/vocab.txt").read_text()

    def killed(src, dst):  # the process dies before the rename: the old file must survive intact
        raise KeyboardInterrupt
    monkeypatch.setattr(data.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        data.save_tokenizer(tok, tmp_path / "saved")
    monkeypatch.undo()
    assert (tmp_path / "saved/vocab.txt").read_text() == good
    assert data.load_tokenizer(tmp_path / "saved").get_vocab() == tok.get_vocab()

    for name, content in [("tokenizer.json", ""), ("tokenizer.json", '{"version": "1.0", "mod'),
                          ("vocab.txt", ""), ("vocab.txt", "[PAD]\nthe\n"), ("vocab.txt", b"\xff\xfe[UNK]")]:
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ValueError, match=re.escape(str(d / name))) as info:
            data.load_tokenizer(d)
        assert "\n" not in str(info.value)


def test_a_hub_name_fetches_that_tokenizer(tmp_path, monkeypatch):
    # --tokenizer bert-base-uncased: the papers' vocabulary, from the hub (faked: tests have no network)
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    hub = data.load_tokenizer(tmp_path / "vocab.txt")
    hub.enable_truncation(8)  # as some hub tokenizer.json files come

    class Hub:
        @staticmethod
        def from_pretrained(name):
            if name != "bert-base-uncased":
                raise RuntimeError(f"Repository Not Found for url: https://huggingface.co/{name}")
            return hub
    monkeypatch.setattr(data, "Tokenizer", Hub)
    monkeypatch.chdir(tmp_path)
    tok = data.load_tokenizer("bert-base-uncased")
    assert data.special_token_ids(tok)["cls"] == 101 and tok.truncation is None  # the stream encoder must not cut
    with pytest.raises(ValueError, match="bert-base-uncasd is no local file or directory.*Repository Not Found"):
        data.load_tokenizer("bert-base-uncasd")


def test_hf_style_vocab(tmp_path):
    # bert-base-uncased layout: [PAD] 0, [unused*], then [UNK] [CLS] [SEP] [MASK] at 100..103
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += ["hello", "world", "un", "##aff", "##able", ",", "!"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = data.load_tokenizer(tmp_path / "vocab.txt")
    assert data.special_token_ids(tok) == dict(pad=0, unk=100, cls=101, sep=102, mask=103)
    enc = tok.encode("Unaffable, HÉLLO world!")
    assert enc.tokens == ["[CLS]", "un", "##aff", "##able", ",", "hello", "world", "!", "[SEP]"]
    assert enc.ids[0] == 101 and enc.ids[-1] == 102
    # a directory's tokenizer_config.json sets lowercasing and accent stripping apart, as HF BertTokenizer
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": true, "strip_accents": false}')
    assert data.load_tokenizer(tmp_path).encode("HÉLLO world").tokens == ["[CLS]", "[UNK]", "world", "[SEP]"]


def test_transformers_autotokenizer(tok_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = data.load_tokenizer(tok_dir)
    data.save_tokenizer(tok, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "The Alpha river was RELEASED in the city."
    assert hf(text)["input_ids"] == tok.encode(text).ids
    assert (hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id) == (0, 2, 3, 4)


# ----------------------------------------------------------------------------- corpus

def test_wikiextractor_markers_and_formats(tok_dir, tmp_path):
    text = _wikiextractor_text()
    (tmp_path / "a.txt").write_text(text)
    tok, stream = _stream(tok_dir, tmp_path / "a.txt", tmp_path)
    sep = data.special_token_ids(tok)["sep"]
    assert (stream == sep).sum() == len(TITLES) - 1  # one [SEP] between documents, none at the ends
    decoded = tok.decode(stream.tolist(), skip_special_tokens=False)
    assert "doc" not in decoded and "curid" not in decoded
    docs = [d.strip() for d in decoded.split("[SEP]")]
    assert [d.split()[0] for d in docs] == [t.lower() for t in TITLES]

    # the same articles as .txt.xz, .txt.gz, one-document-per-row .jsonl and .parquet
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress(text.encode()))
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
    rows = [{"text": f"{t}\n{_paragraph(2 * i)}\n{_paragraph(2 * i + 1)}", "id": i}
            for i, t in enumerate(TITLES)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa, pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    for name in ["a.txt.xz", "a.txt.gz", "a.jsonl", "a.parquet"]:
        assert np.array_equal(_stream(tok_dir, tmp_path / name, tmp_path)[1], stream), name


def test_directory_glob_and_wikitext_headings(tok_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # WikiText: top-level " = Title = " starts a document, " = = Section = = " does not
    (corpus / "b.raw").write_text(f" = Alpha = \r\n {_paragraph(1)} \r\n = = Beta = = \r\n"
                                  f" {_paragraph(2)} \r\n\r\n = Gamma = \r\n {_paragraph(3)} \r\n")
    (corpus / "c.txt").write_text(f"{_paragraph(4)}\n{_paragraph(5)}\n")  # no markers: one document
    (corpus / "notes.md").write_text("ignored: not a corpus suffix")
    tok, stream = _stream(tok_dir, corpus, tmp_path)
    assert (stream == data.special_token_ids(tok)["sep"]).sum() == 2  # Alpha | Gamma | c.txt
    assert "ignored" not in tok.decode(stream.tolist())
    _, globbed = _stream(tok_dir, corpus / "*.*", tmp_path)  # a glob names files explicitly: .md too
    assert len(globbed) > len(stream)


def test_brackets_in_a_path_are_not_a_pattern(tmp_path, monkeypatch):
    import config
    home = tmp_path / "runs [v2]"  # a working directory whose name glob would read as a character class
    (home / "corpus").mkdir(parents=True)
    for name in ("a.txt", "b.txt"):
        (home / "corpus" / name).write_text(_paragraph(1))
    monkeypatch.chdir(home)
    assert data._resolve_files(config.data_path("corpus/a.txt")) == [home / "corpus" / "a.txt"]
    assert data._resolve_files(config.data_path("corpus")) == [home / "corpus" / n for n in ("a.txt", "b.txt")]
    assert data._resolve_files(config.data_path("corpus/*.txt")) == [home / "corpus" / n for n in ("a.txt", "b.txt")]
    assert data._resolve_files(config.data_path("corpus/[a].txt")) == [home / "corpus" / "a.txt"]  # a real pattern
    # a file named like a pattern is read, not the file the pattern would match
    (home / "corpus" / "b[1].txt").write_text(_paragraph(2))
    (home / "corpus" / "b1.txt").write_text("the wrong file\n")
    [(_, ds, _)] = data._load_corpus(str(home / "corpus" / "b[1].txt"), [home / "corpus" / "b[1].txt"], tmp_path)
    assert ds["text"] == [_paragraph(2)]
    with lzma.open(home / "corpus" / "c[1].txt.xz", "wt") as f:  # compressed, datasets read [1] as an IPv6 host
        f.write(_paragraph(3))
    [(_, ds, _)] = data._load_corpus(str(home / "corpus" / "c[1].txt.xz"), [home / "corpus" / "c[1].txt.xz"], tmp_path)
    assert ds["text"] == [_paragraph(3)]


def test_cache_reused_and_invalidated(tok_dir, tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    tok, train, val = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)  # trains a tokenizer
    cached = sorted((tmp_path / "cache").glob("tokens-*.bin"))
    assert len(cached) == 1 and any((tmp_path / "cache").glob("tokenizer-*"))
    mtime = cached[0].stat().st_mtime_ns

    def fail(*args):
        raise AssertionError("corpus reloaded despite the cache")
    monkeypatch.setattr(data, "_load_corpus", fail)
    tok2, train2, val2 = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    assert tok2.to_str() == tok.to_str()
    assert np.array_equal(train2, train) and np.array_equal(val2, val)
    assert cached[0].stat().st_mtime_ns == mtime
    monkeypatch.undo()

    time.sleep(0.01)
    path.write_text(_wikiextractor_text() + _wikiextractor_text())  # new size + mtime: new cache
    _, train3, _ = data.prepare_data(str(path), tmp_path / "cache", tokenizer=tok_dir, val_fraction=0)
    assert len(train3) > len(train) + len(val)


def test_val_split(tmp_path):
    sep = 3
    tokens = np.full(100_000, 7, dtype=np.uint16)
    tokens[::1000] = sep  # a document every 1000 tokens
    train, val = data.split_train_val(tokens, 0.05, sep)
    assert np.array_equal(np.concatenate([train, val]), tokens)
    assert train[-1] == sep and len(val) >= 5000  # val starts at a document start
    train, val = data.split_train_val(tokens[:20_000], 0.001, sep)
    assert len(val) >= 2000  # small corpus: the floor is 10% of the stream, not VAL_MIN_TOKENS
    assert len(data.split_train_val(tokens, 0, sep)[1]) == 0


BAD_PATHS = {"missing.txt": None, "nothing*.txt": None, "empty.txt": "", "blank.txt": "\n\n  \n",
             "emptydir": "dir"}


@pytest.mark.parametrize("name", BAD_PATHS)
def test_bad_paths(tok_dir, tmp_path, name):
    content, path = BAD_PATHS[name], tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(name)):
        data.prepare_data(str(path), tmp_path / "cache", tokenizer=tok_dir)


def test_blank_text_trains_no_tokenizer(tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("\n\n  \t \n")
    with pytest.raises(ValueError, match="no text in .*blank.txt"):
        data.prepare_data(str(tmp_path / "blank.txt"), tmp_path / "cache")
    assert capsys.readouterr().out == "" and not list((tmp_path / "cache").glob("tokenizer-*"))


def test_unreachable_hub_dataset_is_one_clear_error(tok_dir, tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", offline)  # no network in tests, whatever the machine
    with pytest.raises(ValueError, match="without internet pass --data") as info:
        data.prepare_data(data.HUB_CORPUS, tmp_path / "cache", tokenizer=tok_dir)
    assert data.SAMPLE_CORPUS in str(info.value) and "\n" not in str(info.value)


UNREADABLE = {  # file name -> (bytes, words the one-line error must contain)
    "latin1.txt": ("café au lait\n".encode("latin-1"), "not UTF-8"),
    "image.txt": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "not UTF-8"),
    "nul.txt": (b"text\x00\x00\x00\x01\x02 more\n", "NUL bytes"),
    "broken.jsonl": (b'{"text": "fine"}\n{"text": "no closing quote}\n', "JSON parse error"),
    "fake.txt.gz": (b"plain text, not gzip\n", "Not a gzipped file"),
    "fake.txt.xz": (b"plain text, not xz\n", "LZMAError"),
    "number.jsonl": (b'{"text": 5}\n', "not strings"),
    "list.jsonl": (b'{"text": ["a", "b"]}\n', "not strings"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", UNREADABLE)
def test_unreadable_corpus_is_one_clear_error(tok_dir, tmp_path, name):
    content, problem = UNREADABLE[name]
    (tmp_path / name).write_bytes(content)
    (tmp_path / "good.txt").write_text(_paragraph(0))  # in a directory, the bad file is still named
    for data_arg in [tmp_path / name, tmp_path]:
        with pytest.raises(ValueError) as info:
            data.prepare_data(str(data_arg), tmp_path / "cache", tokenizer=tok_dir)
        message = str(info.value)
        assert str(tmp_path / name) in message and problem in message and "\n" not in message, message
        left = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
        assert left == ["hf"]  # no partial token file left behind


def test_corrupt_token_cache_is_rebuilt(tok_dir, tmp_path, capsys):
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    original = _stream(tok_dir, path, tmp_path)[1].copy()  # a copy: the stream is a view of the file
    cached = next((tmp_path / "cache").glob("tokens-*.bin"))
    sidecar = json.loads(cached.with_suffix(".json").read_text())
    assert sidecar["bytes"] == cached.stat().st_size == original.nbytes
    damages = {
        "truncated": lambda: cached.write_bytes(cached.read_bytes()[:-7]),
        "flipped byte": lambda: cached.write_bytes(cached.read_bytes()[:50] + b"\xff" + cached.read_bytes()[51:]),
        "killed before the sidecar": lambda: cached.with_suffix(".json").unlink(),
        "empty sidecar": lambda: cached.with_suffix(".json").write_text(""),
    }
    for damage, apply in damages.items():
        apply()
        capsys.readouterr()
        _, rebuilt = _stream(tok_dir, path, tmp_path)
        assert "rebuilding" in capsys.readouterr().out, damage
        assert np.array_equal(rebuilt, original), damage
        assert np.array_equal(np.fromfile(cached, dtype=original.dtype), original), damage
    _stream(tok_dir, path, tmp_path)
    assert "rebuilding" not in capsys.readouterr().out  # an intact cache is reused silently


def test_what_killed_writers_left_in_the_cache_is_removed(tmp_path, capsys, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    tok, train, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    cache = tmp_path / "cache"
    tokens, tokenizer = next(cache.glob("tokens-*.bin")), next(cache.glob("tokenizer-*"))
    # what a SIGKILL mid-tokenization / mid-training leaves (a full-size copy of the token file for a real corpus)
    left = [tokens.with_name(tokens.name + ".tmp4242"), tokens.with_suffix(".json.tmp4242"),
            tokenizer.with_name(tokenizer.name + ".tmp4242")]
    left[0].write_bytes(b"half"), left[1].write_text("{"), left[2].mkdir()
    (left[2] / "vocab.txt").write_text("[PAD]")
    other = tokens.with_name(tokens.name + "x.tmp4242")  # not one of this corpus's files: kept
    other.write_text("mine")
    tok2, train2, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)  # a cache hit cleans too
    assert not any(p.exists() for p in left) and other.read_text() == "mine"
    assert tok2.get_vocab() == tok.get_vocab() and np.array_equal(train2, train)
    # a cache made earlier, now read-only (shared, mounted): reading it takes no lock
    real_open = builtins.open
    def read_only(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", read_only)
    tok3, train3, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    assert tok3.get_vocab() == tok.get_vocab() and np.array_equal(train3, train)


def test_checksum_samples_large_files(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CHECKSUM_CHUNKS", 4)  # 4 x 64 KiB: a 1 MiB file is sampled
    path = tmp_path / "big.bin"
    blob = bytearray(np.random.default_rng(0).bytes(1 << 20))
    path.write_bytes(blob)
    before = data._checksum(path)
    blob[-1] ^= 1  # the last chunk is always sampled
    path.write_bytes(blob)
    assert data._checksum(path) != before


def test_corrupt_cached_tokenizer_is_retrained(tmp_path, capsys):
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    tok, train, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    tok_cache = next((tmp_path / "cache").glob("tokenizer-*"))
    for name, content in [("tokenizer.json", ""), ("vocab.txt", "[PAD]\n"), ("tokenizer_config.json", "{")]:
        (tok_cache / name).write_text(content)
        capsys.readouterr()
        tok2, train2, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
        assert "training it again" in capsys.readouterr().out, name
        assert tok2.get_vocab() == tok.get_vocab() and np.array_equal(train2, train), name  # deterministic


# ----------------------------------------------------------------------------- BlockLoader

def _loader(tokens, **kw):
    kw = dict(seq_len=10, batch_size=4, cls_id=2, sep_id=3, seed=0) | kw
    return data.BlockLoader(tokens, **kw)


TOKENS = np.arange(5, 5 + 8 * 100, dtype=np.uint16)  # 100 blocks of 8; values identify positions


def _starts(batch):
    return ((batch[:, 1] - 5) // 8).tolist()  # block index of each row (TOKENS values are positions)


def _reference_stream(num_blocks, seed, count):
    """The first `count` blocks of the global stream: epoch permutations back to back."""
    epochs = range(count // num_blocks + 1)
    return np.concatenate([np.random.default_rng([seed, e]).permutation(num_blocks) for e in epochs])[:count]


def test_blockloader_rows():
    loader = _loader(TOKENS)
    assert loader.num_blocks == 100
    seen = []
    for _ in range(25):
        batch = loader.next_batch()
        assert batch.dtype == torch.long and batch.shape == (4, 10)
        assert (batch[:, 0] == 2).all() and (batch[:, -1] == 3).all()
        assert ((batch[:, 1] - 5) % 8 == 0).all()  # non-overlapping windows
        assert (batch[:, 1:-1] == batch[:, 1:2] + torch.arange(8)).all()  # consecutive tokens
        seen += _starts(batch)
    assert sorted(seen) == list(range(100))  # one epoch = every block once
    assert loader.state_dict() == {"sequences": 100}


def test_blockloader_epochs_straddle_and_cover():
    # 100 blocks in batches of 3 x 2 ranks: global batches straddle epochs, no block is skipped
    ranks = [_loader(TOKENS, batch_size=3, rank=r, world_size=2) for r in range(2)]
    stream = []
    for _ in range(60):  # 360 sequences: 3.6 epochs
        stream += sum((_starts(r.next_batch()) for r in ranks), [])
    assert stream == _reference_stream(100, 0, 360).tolist()
    for epoch in range(3):
        assert sorted(stream[epoch * 100:(epoch + 1) * 100]) == list(range(100))  # each block once per epoch
    assert stream[:100] != stream[100:200]  # a new order each epoch
    assert ranks[0].state_dict() == ranks[1].state_dict() == {"sequences": 360}


def test_blockloader_deterministic_and_resume():
    a, b, c = _loader(TOKENS), _loader(TOKENS), _loader(TOKENS, seed=1)
    first = [a.next_batch() for _ in range(3)]
    assert all(torch.equal(x, b.next_batch()) for x in first)
    assert not torch.equal(first[0], c.next_batch())
    for _ in range(30):  # run past an epoch boundary
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(30)]
    resumed = _loader(TOKENS)
    resumed.load_state_dict(state)
    assert all(torch.equal(x, resumed.next_batch()) for x in expected)


def test_blockloader_ddp_slicing():
    single = _loader(TOKENS, batch_size=6)
    ranks = [_loader(TOKENS, batch_size=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(40):  # several epochs, with global batches across epoch boundaries
        assert torch.equal(single.next_batch(), torch.cat([r.next_batch() for r in ranks]))


def test_blockloader_resume_with_another_layout():
    # 3 batches of B=4 on 1 process, then resume on 2 ranks of B=2 (and later 1 process of B=7):
    # the concatenated batches continue the uninterrupted B=4 stream exactly
    uninterrupted = _loader(TOKENS, batch_size=4)
    expected = torch.cat([uninterrupted.next_batch() for _ in range(40)])
    first = _loader(TOKENS, batch_size=4)
    got = [first.next_batch() for _ in range(3)]
    state = first.state_dict()
    assert state == {"sequences": 12}
    ranks = [_loader(TOKENS, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for _ in range(20):
        got += [r.next_batch() for r in ranks]
    single = _loader(TOKENS, batch_size=7)
    single.load_state_dict(ranks[0].state_dict())
    got += [single.next_batch() for _ in range(10)]
    got = torch.cat(got)
    assert len(got) == 12 + 80 + 70
    assert torch.equal(got[:len(expected)], expected)
    assert _starts(got) == _reference_stream(100, 0, len(got)).tolist()


def test_blockloader_state_is_checked():
    loader = _loader(TOKENS, batch_size=3, world_size=2)
    loader.load_state_dict({"sequences": 230})
    assert loader.state_dict() == {"sequences": 230}
    for bad in [{}, {"epoch": 2, "step": 5}, {"sequences": -1}]:
        with pytest.raises(ValueError):
            _loader(TOKENS).load_state_dict(bad)


def test_blockloader_too_few_tokens():
    with pytest.raises(ValueError, match="one batch"):
        _loader(TOKENS[:30], batch_size=4)


# ----------------------------------------------------------------------------- real data

def test_sample_corpus(tmp_path, monkeypatch):
    # the bundled WikiText-2 test split: the default --data, readable from any working directory
    assert data.DEFAULT_DATA == data.SAMPLE_CORPUS and Path(data.SAMPLE_CORPUS).is_absolute()
    assert Path(data.SAMPLE_CORPUS).stat().st_size < 2_000_000
    monkeypatch.chdir(tmp_path)
    t0 = time.time()
    tok, train, val = data.prepare_data(cache_dir="cache", vocab_size=8000)
    assert time.time() - t0 < 30  # the smoke-run corpus must prepare in seconds
    ids = data.special_token_ids(tok)
    assert ids == dict(pad=0, unk=1, cls=2, sep=3, mask=4) and train.dtype == np.uint16
    assert len(train) > 200_000 and len(val) >= data.VAL_MIN_TOKENS
    assert tok.decode(train[:4].tolist()) == "= robert boulter ="  # the CRLF heading line, decoded
    stream = np.concatenate([train, val])
    assert (stream == ids["sep"]).sum() == 61  # 62 top-level " = Title = " headings = 62 documents
    batch = data.BlockLoader(val, 128, 8, ids["cls"], ids["sep"]).next_batch()
    assert batch.shape == (8, 128)


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="shared/data not present")
def test_sample_corpus_is_the_wikitext2_test_split():
    raw = (SHARED_DATA / "corpus/wikitext2_raw_test/wiki.test.raw").read_bytes()
    assert lzma.decompress(Path(data.SAMPLE_CORPUS).read_bytes()) == raw


@pytest.mark.parametrize("content", [b"plain text, not xz\n", lzma.compress(b"a sentence\n" * 100)[:-20]])
def test_read_text_of_a_broken_xz_is_one_clear_error(tmp_path, content):
    # eval.py --analysis --text and the GLUE reader go through read_text, not the corpus loader
    (tmp_path / "t.txt.xz").write_bytes(content)
    with pytest.raises(ValueError, match=r"t.txt.xz: not a readable .xz file"):
        data.read_text(tmp_path / "t.txt.xz")
