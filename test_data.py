"""Tests for data.py: tokenizer, corpus formats and caching, BlockLoader order/resume/DDP slicing."""
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


def test_unreachable_hub_dataset_is_one_clear_error(tok_dir, tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", offline)  # no network in tests, whatever the machine
    with pytest.raises(ValueError, match="without internet pass --data"):
        data.prepare_data("wikitext:wikitext-103-raw-v1", tmp_path / "cache", tokenizer=tok_dir)


# ----------------------------------------------------------------------------- BlockLoader

def _loader(tokens, **kw):
    kw = dict(seq_len=10, batch_size=4, cls_id=2, sep_id=3, seed=0) | kw
    return data.BlockLoader(tokens, **kw)


TOKENS = np.arange(5, 5 + 8 * 100, dtype=np.uint16)  # 100 blocks of 8; values identify positions


def test_blockloader_rows():
    loader = _loader(TOKENS)
    assert loader.steps_per_epoch == 25
    seen = []
    for _ in range(loader.steps_per_epoch):
        batch = loader.next_batch()
        assert batch.dtype == torch.long and batch.shape == (4, 10)
        assert (batch[:, 0] == 2).all() and (batch[:, -1] == 3).all()
        starts = (batch[:, 1] - 5).numpy()
        assert (starts % 8 == 0).all()  # non-overlapping windows
        assert (batch[:, 1:-1] == batch[:, 1:2] + torch.arange(8)).all()  # consecutive tokens
        seen += list(starts // 8)
    assert sorted(seen) == list(range(100))  # one epoch = every block once
    assert loader.next_batch() is not None and loader.epoch == 1


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
    assert single.steps_per_epoch == ranks[0].steps_per_epoch == 16
    for _ in range(40):  # several epochs, including the skipped tail blocks
        assert torch.equal(single.next_batch(), torch.cat([r.next_batch() for r in ranks]))


def test_blockloader_too_few_tokens():
    with pytest.raises(ValueError, match="one batch"):
        _loader(TOKENS[:30], batch_size=4)


# ----------------------------------------------------------------------------- real data

@pytest.mark.skipif(not SHARED_DATA.exists(), reason="shared/data not present")
def test_wikitext2_test_raw(tmp_path):
    path = SHARED_DATA / "corpus/wikitext2_raw_test/wiki.test.raw"
    t0 = time.time()
    tok, train, val = data.prepare_data(str(path), tmp_path, vocab_size=8000)
    assert time.time() - t0 < 30  # the smoke-run corpus must prepare in seconds
    ids = data.special_token_ids(tok)
    assert ids == dict(pad=0, unk=1, cls=2, sep=3, mask=4) and train.dtype == np.uint16
    assert len(train) > 200_000 and len(val) >= data.VAL_MIN_TOKENS
    assert tok.decode(train[:4].tolist()) == "= robert boulter ="
    assert (np.asarray(train) == ids["sep"]).sum() > 40  # ~60 articles
    batch = data.BlockLoader(val, 128, 8, ids["cls"], ids["sep"]).next_batch()
    assert batch.shape == (8, 128)
