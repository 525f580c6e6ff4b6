"""Tests for data.py: the tokenizer and its files, the validation split, BlockLoader order/resume/DDP slicing,
the bundled sample corpus. Corpus formats and the token cache: test_corpus.py."""
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
import token_files

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
    alphabet, continuing = token_files.alphabet([["AAA bbb cCc", rare]], BertNormalizer(lowercase=True), limit=13)
    assert alphabet == sorted(["a", "b", "c"] + sorted(rare)[:10])
    assert continuing == alphabet


def test_save_is_atomic_and_corrupt_files_are_one_error(tok_dir, tmp_path, monkeypatch):
    tok = data.load_tokenizer(tok_dir)
    data.save_tokenizer(tok, tmp_path / "saved")
    good = (tmp_path / "saved/vocab.txt").read_text()

    def killed(src, dst):  # the process dies before the rename: the old file must survive intact
        raise KeyboardInterrupt
    monkeypatch.setattr(token_files.os, "replace", killed)
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
    (tmp_path / "weights_only").mkdir()  # a model directory without its tokenizer: the line names both files
    with pytest.raises(ValueError, match="no tokenizer.json or vocab.txt in .*weights_only: copy the tokenizer"):
        data.load_tokenizer(tmp_path / "weights_only")


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
    monkeypatch.setattr(token_files, "Tokenizer", Hub)
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


def test_a_vocab_txt_reads_special_tokens_as_its_tokenizer_json_does(tok_dir):
    text = "the [MASK] river [SEP] city"
    expected = data.load_tokenizer(tok_dir / "tokenizer.json").encode(text).ids
    assert expected[2] == 4 and data.load_tokenizer(tok_dir / "vocab.txt").encode(text).ids == expected


def test_a_tokenizer_without_the_special_tokens_is_refused():
    from tokenizers import Tokenizer, models
    words = data.SPECIAL_TOKENS[:4] + ["the"]  # no [MASK]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match=r"lacks special tokens: \['mask'\]"):
        data.special_token_ids(tok)


def test_a_tokenizer_saved_with_padding_puts_no_pad_in_the_stream(tok_dir, tmp_path):
    tok, lines = data.load_tokenizer(tok_dir), ["the river", "the city was born in the season of music"]
    unpadded = sum((tok.encode(line, add_special_tokens=False).ids for line in lines), [])
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # as some hub tokenizer.json files come
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
    _, stream, _ = data.prepare_data(str(tmp_path / "a.txt"), tmp_path / "cache",
                                     tokenizer=str(tmp_path / "tokenizer.json"), val_fraction=0)
    assert stream.tolist() == unpadded and 0 not in unpadded


def test_punctuation_and_cjk_never_continue_a_word():
    # the pre-tokenizer isolates them, so "##«" or "##中" would be vocabulary never used
    alphabet, continuing = token_files.alphabet(["ab «c» d—e 中文"], BertNormalizer(lowercase=True), limit=100)
    assert {"«", "»", "—", "中", "文"} <= set(alphabet)
    assert continuing == ["a", "b", "c", "d", "e"]


def test_alphabet_counts_each_text_once_across_its_buffers():
    # 4096 x "x" fill the first buffer, then 5000 x "y": y is the more frequent character
    assert token_files.alphabet([["x"] * 4096, ["y"] * 5000], BertNormalizer(lowercase=True), limit=1) == (["y"], ["y"])


def test_alphabet_holds_a_bounded_share_of_long_texts():
    # long documents come as corpus._cut's 256K-character pieces: 4,096 of them were held, joined, widened to UTF-32
    # and int64 before being counted (~14 GB); the pass holds about ALPHABET_CHARS characters at a time
    import tracemalloc
    pieces = lambda: ([f"{i % 10:05d} " * 10_000] for i in range(256))  # 256 fresh 60K-character texts, 15M in all
    tracemalloc.start()
    try:
        held = tracemalloc.get_traced_memory()[0]
        alphabet, _ = token_files.alphabet(pieces(), BertNormalizer(lowercase=True), limit=None)
        peak = tracemalloc.get_traced_memory()[1] - held
    finally:
        tracemalloc.stop()
    assert alphabet == list("0123456789")
    # ~14 bytes a character counted, and the 8.9 MB of counts; all 15M characters at once: ~215 MB
    assert peak < 1.5 * token_files.ALPHABET_CHARS * 14 + 12e6, f"{peak / 2**20:.0f} MiB"


def test_transformers_autotokenizer(tok_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = data.load_tokenizer(tok_dir)
    data.save_tokenizer(tok, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "The Alpha river was RELEASED in the city."
    assert hf(text)["input_ids"] == tok.encode(text).ids
    assert (hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id) == (0, 2, 3, 4)


@pytest.mark.parametrize("options", [
    dict(lowercase=True, strip_accents=False), dict(lowercase=False, strip_accents=True),
    dict(lowercase=True, chinese_chars=False)])
def test_an_export_normalizes_in_transformers_as_in_training(tmp_path, options):
    # a --tokenizer whose tokenizer_config.json sets strip_accents or tokenize_chinese_chars: the export wrote
    # do_lower_case alone, and BertTokenizerFast rebuilt its normalizer from that ("café" -> "cafe", 中 split)
    transformers = pytest.importorskip("transformers")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "café", "cafe", "Café", "Cafe", "中", "文", "中文", "##文"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    config = dict(do_lower_case=options["lowercase"], strip_accents=options.get("strip_accents"),
                  tokenize_chinese_chars=options.get("chinese_chars", True))
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(config))
    tok = data.load_tokenizer(tmp_path / "src")
    data.save_tokenizer(tok, tmp_path / "out")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    text = "Café 中文"
    assert hf(text)["input_ids"] == tok.encode(text).ids, (hf.tokenize(text), tok.encode(text).tokens)


def test_an_export_without_a_bert_normalizer_normalizes_in_transformers_as_in_training(tmp_path):
    # a tokenizer.json with another normalizer (none, NFC): BertTokenizerFast swapped in a lowercasing BertNormalizer
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, normalizers
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Café", "cafe", "中文"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    for name, normalizer in (("none", None), ("nfc", normalizers.Sequence([normalizers.NFC()]))):
        tok = Tokenizer.from_str(data.load_tokenizer(tmp_path).to_str())
        tok.normalizer = normalizer
        data.save_tokenizer(tok, tmp_path / name)
        hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
        assert hf("Café 中文")["input_ids"] == tok.encode("Café 中文").ids, (name, hf.tokenize("Café 中文"))


# ----------------------------------------------------------------------------- stream split

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


def test_val_cut_rounds_up_and_moves_to_the_nearest_document_start():
    tokens = np.full(100_000, 7, dtype=np.uint16)
    tokens[500::1000] = 3  # documents end at 500, 1500, ...
    train, val = data.split_train_val(tokens, 0.2, 3)
    assert len(val) == 20_499 and train[-1] == 3  # cut at 80_000, back to 79_501: not to an earlier start
    assert len(data.split_train_val(np.full(20_001, 7, dtype=np.uint16), 0.25, 3)[1]) == 5001  # ceil(5000.25)


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


def test_blockloader_seq_len_needs_room_for_cls_and_sep():
    with pytest.raises(ValueError, match="seq_len must be >= 3"):
        _loader(TOKENS, seq_len=2)


def test_blockloader_one_global_batch_is_enough_and_needed():
    assert _loader(TOKENS[:32], batch_size=4).next_batch().shape == (4, 10)  # exactly 4 blocks of 8
    with pytest.raises(ValueError, match="one batch of 6"):  # 5 blocks: one rank's batch, not both ranks'
        _loader(TOKENS[:40], batch_size=3, world_size=2)


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


def test_a_small_corpus_holds_out_a_tenth():
    # the held-out floor (VAL_MIN_TOKENS) is capped at 10% of a small corpus
    train_part, val = data.split_train_val(np.full(20_000, 7, dtype=np.uint16), 0.001, 3)
    assert len(val) == 2000 and len(train_part) == 18_000


@pytest.mark.parametrize("lines, error", [
    (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the"], r"lacks special tokens: \[MASK\]"),
    (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "city", "the"], r"lists 'the' twice \(lines 6 and 8\)")])
def test_a_vocab_txt_without_a_special_token_or_with_a_repeated_line_is_refused(tmp_path, lines, error):
    # a missing [MASK] was appended at id V and trained on; a repeated line left an id without a token, and the
    # run stopped at its first tokenizer save on an AssertionError traceback
    (tmp_path / "vocab.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=error):
        data.load_tokenizer(tmp_path)


def test_a_tokenizer_json_whose_ids_are_not_0_to_v_minus_1_is_refused(tmp_path):
    # a gap (or two tokens on one id): train.py tokenized the corpus, then stopped at its first tokenizer save on
    # an AssertionError traceback (no vocab.txt can list such ids)
    tok = data.train_tokenizer(["the cat sat on the mat"] * 20, vocab_size=60)
    for shift, error in ((5, r"its ids are not 0\.\.\d+ \(no token has id \d+\)"), (-1, r"two tokens have id \d+")):
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        vocab[max(vocab, key=vocab.get)] += shift
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
        with pytest.raises(ValueError, match=error):
            data.load_tokenizer(tmp_path / "tokenizer.json")


# ----------------------------------------------------------------------------- other languages

HINDI, RUSSIAN, JAPANESE, GERMAN = "यह पंक्ति के बाद", "Мой ёжик", "すでに定義されています", "schön"


def test_the_uncased_tokenizer_says_what_it_strips_and_cased_keeps_it(tmp_path, capsys):
    # uncased (BERT-uncased) drops every combining mark: Devanagari's vowel signs and virama, й, ё, で's dakuten too
    text = [HINDI, RUSSIAN, JAPANESE, GERMAN] * 50
    uncased = data.train_tokenizer(text, vocab_size=300)
    assert uncased.decode(uncased.encode(HINDI).ids) == "यह पकति क बाद"
    assert uncased.decode(uncased.encode(RUSSIAN).ids) == "мои ежик"
    note = capsys.readouterr().out
    assert "note: the uncased tokenizer strips accents" in note and "й -> и" in note and "--cased" in note
    cased = data.train_tokenizer(text, vocab_size=300, save_dir=tmp_path / "cased", cased=True)
    for words in (HINDI, RUSSIAN, GERMAN):
        assert cased.decode(cased.encode(words).ids) == words
    assert "すでに" in cased.decode(cased.encode(JAPANESE).ids)
    assert "note" not in capsys.readouterr().out
    assert json.loads((tmp_path / "cased" / "tokenizer_config.json").read_text())["do_lower_case"] is False
    # an English corpus says nothing: an accent here and there is below the note's 0.5%
    data.train_tokenizer([_paragraph(i, 100) + " Café." for i in range(20)], vocab_size=300)
    assert "note" not in capsys.readouterr().out


def test_a_cased_runs_vocab_txt_named_alone_keeps_case(tmp_path):
    # --tokenizer RUN/vocab.txt: the tokenizer_config.json beside it was read only for the directory, so a cased
    # run's vocabulary got the uncased pipeline ("Éric" -> er ##ic, its capitalized tokens never reached)
    text = [HINDI, RUSSIAN, GERMAN, "Éric Müller visited Paris."] * 50
    cased = data.train_tokenizer(text, vocab_size=300, save_dir=tmp_path, cased=True)
    for words in ("Éric Müller visited Paris.", RUSSIAN):
        expected = cased.encode(words).ids
        assert [data.load_tokenizer(tmp_path / f).encode(words).ids for f in ("vocab.txt", ".")] == [expected] * 2
    (tmp_path / "tokenizer_config.json").unlink()  # none: uncased, as transformers' BertTokenizer
    assert "".join(data.load_tokenizer(tmp_path / "vocab.txt").encode("Visited").tokens[1:-1]).replace("#", "") == "visited"


def test_characters_past_limit_alphabet_become_unk_and_the_training_says_so(capsys):
    # 1,500 distinct CJK characters (a Chinese corpus holds thousands): the 500 rarest fall outside the alphabet
    rare = "".join(chr(0x4E00 + i) for i in range(1000, 1500))
    text = ["".join(chr(0x4E00 + i) for i in range(1000))] * 3 + [rare]
    tok = data.train_tokenizer(text, vocab_size=3000)
    assert set(tok.encode(rare).tokens[1:-1]) == {"[UNK]"}
    assert "500 rarer ones" in capsys.readouterr().out
    tok = data.train_tokenizer(text, vocab_size=3000, limit_alphabet=0)  # 0: every character
    assert "[UNK]" not in tok.encode(rare).tokens
    assert "note" not in capsys.readouterr().out


def test_tokenizer_options_name_their_own_cached_tokenizer(tmp_path):
    corpus = tmp_path / "ru.txt"
    corpus.write_text("\n".join([RUSSIAN + " " + _paragraph(i) for i in range(40)]), encoding="utf-8")
    default = data.prepare_data(str(corpus), tmp_path / "cache", vocab_size=300)[0]
    cased = data.prepare_data(str(corpus), tmp_path / "cache", vocab_size=300, cased=True, limit_alphabet=0)[0]
    assert default.decode(default.encode(RUSSIAN).ids) == "мои ежик"
    assert cased.decode(cased.encode(RUSSIAN).ids) == RUSSIAN
    names = sorted(p.name.split("-", 2)[2] for p in (tmp_path / "cache").glob("tokenizer-*"))
    assert names == ["300", "300-cased-limit_alphabet0"]  # the default's name is the one earlier caches have


def test_the_alphabet_of_thousands_of_characters_is_counted_in_linear_time():
    # --limit_alphabet 0 on Chinese text: the [UNK] note rebuilt the kept set per character, quadratic (20k distinct
    # characters: 19 s, now 0.13 s on the 2-core machine)
    import time
    text = ["".join(chr(0x4E00 + i) for i in range(20000))]
    t0 = time.process_time()
    alphabet, _ = token_files.alphabet(iter(text), BertNormalizer(lowercase=True), limit=None)
    assert len(alphabet) == 20000 and time.process_time() - t0 < 5
