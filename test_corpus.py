"""Tests for corpus.py and token_files.py's cache: each corpus format and document marker, bad paths and
unreadable files as one clear error, the token cache reused, invalidated and rebuilt when damaged."""
import builtins
import bz2
import gzip
import importlib.util
import json
import lzma
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import corpus
import data
import token_files
from test_data import TITLES, _paragraph, _stream, _wikiextractor_text, tok_dir  # noqa: F401 (tok_dir: a fixture)

# ----------------------------------------------------------------------------- corpus formats

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
    import datasets  # and a datasets save_to_disk folder (its .arrow files; a user's Dataset after .map, say)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), max_shard_size="1KB")  # str: datasets 2.19
    assert len(corpus.resolve_files(str(tmp_path / "saved"))) > 1  # several shards, read in their order
    for name in ["a.txt.xz", "a.txt.gz", "a.jsonl", "a.parquet", "saved"]:
        assert np.array_equal(_stream(tok_dir, tmp_path / name, tmp_path)[1], stream), name


def _zst(raw):
    return pytest.importorskip("zstandard").ZstdCompressor().compress(raw)


@pytest.mark.parametrize("name, compress", [("a.txt", bytes), ("a.txt.gz", gzip.compress), ("a.txt.bz2", bz2.compress),
                                            ("a.txt.zst", _zst)])
def test_a_byte_order_mark_hides_no_doc_line(tok_dir, tmp_path, name, compress):
    # Windows editors start UTF-8 files with a BOM: the first <doc ...> line is still a marker, not text
    # (compressed, it was kept: datasets reads those in the locale's encoding, whatever encoding= says; .zst
    # was read so until it was decompressed as the others are)
    (tmp_path / name).write_bytes(compress(b"\xef\xbb\xbf" + _wikiextractor_text().encode()))
    tok, stream = _stream(tok_dir, tmp_path / name, tmp_path)
    assert (stream == data.special_token_ids(tok)["sep"]).sum() == len(TITLES) - 1
    assert "curid" not in tok.decode(stream.tolist())


def test_compressed_text_is_utf8_under_any_locale(tmp_path):
    # datasets decoded a compressed file in the locale's encoding: under one that is not UTF-8 (here C without
    # Python's UTF-8 mode; Windows' cp1252 misreads instead) the bundled sample, the default run's corpus, was
    # refused as "not UTF-8"
    text = "Caf\u00e9 \u2014 \u201cna\u00efve\u201d \u00d7 \u03c4\n"
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress(text.encode()))
    files = [tmp_path / "a.txt.xz", corpus.SAMPLE_CORPUS]
    if importlib.util.find_spec("zstandard"):  # .zst, read by datasets, was refused so until we decompressed it too
        (tmp_path / "a.txt.zst").write_bytes(_zst(text.encode()))
        files.append(tmp_path / "a.txt.zst")
    script = ("import corpus, json, sys; print(json.dumps([list(corpus.load_corpus(f, corpus.resolve_files(f), "
              "sys.argv[1])[0][1]['text']) for f in sys.argv[2:]]))")
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache"), *map(str, files)],
                          cwd=os.path.dirname(corpus.__file__), env=env, capture_output=True, text=True, encoding="utf-8")
    assert done.returncode == 0, done.stderr
    mine, sample, *zst = json.loads(done.stdout)
    assert mine == [text.strip()] and sample[:3] == corpus.read_text(corpus.SAMPLE_CORPUS).splitlines()[:3]
    assert zst in ([], [[text.strip()]])


@pytest.mark.skipif(os.name == "nt", reason="file names are UTF-16 on Windows")
def test_a_cache_dir_the_locale_cannot_name_for_arrow_is_one_line_about_the_cache(tmp_path):
    # a non-ASCII --cache_dir under a locale that is not UTF-8 (LANG=en_US is ISO-8859-1): pyarrow names datasets'
    # Arrow files in UTF-8, so it did not find them (or could not encode the name), and the corpus was blamed:
    # "cannot read corpus.txt as text: FileNotFoundError: ... Failed to open local file" / "UnicodeEncodeError"
    (tmp_path / "corpus.txt").write_text(_wikiextractor_text())
    cache = tmp_path / "caf\u00e9"
    script = "import corpus, sys; corpus.load_corpus(sys.argv[1], corpus.resolve_files(sys.argv[1]), sys.argv[2])"
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "corpus.txt"), str(cache)],
                          cwd=os.path.dirname(corpus.__file__), env=env, capture_output=True)
    err = done.stderr.decode(errors="replace").strip().splitlines()[-1]
    assert "ValueError: --cache_dir " in err and "choose a --cache_dir with an ASCII path" in err, err
    assert not (cache / "hf").exists()


@pytest.mark.skipif(os.name == "nt", reason="file names are UTF-16 on Windows")
def test_a_tokenizer_under_a_path_the_locale_cannot_name_for_rust_is_read_or_named(tok_dir, tmp_path):
    # tokenizers' from_file names the file in UTF-8: under a locale that is not UTF-8 a run made in a non-ASCII
    # --out_dir could not be resumed, nor evaluated: "cannot read tokenizer DIR/tokenizer.json: No such file"
    run, bare = tmp_path / "caf\u00e9", tmp_path / "na\u00efve"
    run.mkdir(), bare.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", run / "tokenizer.json")
    shutil.copy(tok_dir / "vocab.txt", bare / "vocab.txt")  # a bare vocab.txt (Google's BERT) is read by Rust still
    script = ("import sys, token_files\nfor d in sys.argv[1:]:\n    try:\n        tok, _ = token_files.read_tokenizer(d)\n"
              "        print(tok.get_vocab_size())\n    except ValueError as e:\n        print(e)")
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C"}
    done = subprocess.run([sys.executable, "-c", script, str(run), str(bare / "vocab.txt")],
                          cwd=os.path.dirname(corpus.__file__), env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    size, refused = done.stdout.decode(errors="replace").splitlines()
    assert size == str(len((tok_dir / "vocab.txt").read_text(encoding="utf-8").splitlines())), size
    assert refused.startswith("cannot read vocabulary ") and "move it to an ASCII path" in refused, refused


def test_special_token_spellings_in_the_text_are_text(tok_dir, tmp_path):
    # a literal "[SEP]" was a document boundary in the stream, a literal "[MASK]" the mask id
    text = _wikiextractor_text().replace("</doc>", "a [SEP] b [MASK] c [CLS] [PAD] [UNK]\n</doc>")
    (tmp_path / "a.txt").write_text(text)
    tok, stream = _stream(tok_dir, tmp_path / "a.txt", tmp_path)
    ids = data.special_token_ids(tok)
    assert (stream == ids["sep"]).sum() == len(TITLES) - 1  # the documents' [SEP]s only
    assert not np.isin(stream, [ids["mask"], ids["cls"], ids["pad"]]).any()
    assert tok.encode("[MASK]", add_special_tokens=False).ids == [ids["mask"]]  # elsewhere, as Hugging Face's


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


@pytest.mark.parametrize("batch_rows", [2000, 2])  # the rules hold across datasets' batches too
def test_wikitext_heading_rules(monkeypatch, batch_rows):
    import datasets
    monkeypatch.setattr(corpus, "BATCH_ROWS", batch_rows)

    def boundaries(rows):
        ds = datasets.Dataset.from_dict({"text": rows})
        return sum(p is None for batch in corpus.pieces([("lines", ds, "x.raw")]) for p in batch)
    # WikiText's own layout (blank rows): a formula's continuation line " = ... = " after a text row is no title
    assert boundaries([" = Alpha = ", "", " filter k is ", " = 1 henry and capacitance C = ", "", " = Beta = ",
                       "", " more "]) == 1
    # no blank rows anywhere (the re-exported copies, the bundled sample): every " = Title = " is one
    assert boundaries([" = Alpha = ", " text ", " = Beta = ", " more ", " = Gamma = ", " end "]) == 2
    # trailing whitespace stripped from the file: still titles
    assert boundaries([" = Alpha =", " text ", " = Beta =", " more "]) == 1


def _flat_pieces(*files):
    import datasets
    return [p for batch in corpus.pieces([("lines", datasets.Dataset.from_dict({"text": rows}), f"{i}.raw")
                                          for i, rows in enumerate(files)]) for p in batch]


def test_only_a_whole_doc_tag_starts_an_article():
    rows = ['<doc id="1" title="A">', "alpha", "<doctor who is a show", "</doc>", '<doc id="2">', "beta"]
    assert _flat_pieces(rows) == ["alpha", "<doctor who is a show", None, "beta"]


def test_each_file_keeps_its_own_heading_rule():
    # a file with blank rows before one without: the second's " = Gamma = " after a text row is still a title
    assert _flat_pieces([" = Alpha = ", "", " text ", ""], [" = Beta = ", " text ", " = Gamma = ", " more "]) \
        == [" = Alpha = ", " text ", None, " = Beta = ", " text ", None, " = Gamma = ", " more "]


def test_each_bad_path_is_refused_before_loading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nocorpus").mkdir()
    (tmp_path / "nocorpus" / "notes.md").write_text("not a corpus suffix")
    for bad, problem in [("missing.txt", "data path not found"), ("./missing", "data path not found"),
                         (str(tmp_path / "missing"), "data path not found"), ("nothing*.txt", "no files match"),
                         ("nocorpus", "no .txt/.raw/.jsonl/.parquet/.arrow files (optionally .xz/.gz/.bz2/.zst)"),
                         ("empty.txt", "empty data file"),
                         ("nocorpus", "a glob names files of any name (WikiExtractor's: --data 'nocorpus/*/wiki_*')")]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            corpus.resolve_files(bad)
    assert corpus.resolve_files("wikimedia/wikipedia:20231101.en") is None  # a hub name


def test_a_directory_or_glob_gives_its_files_in_sorted_order(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    for name in ["b.txt", "A.TXT", "notes.md", "sub/a.jsonl", "sub/c.txt.xz", "sub/deeper/d.txt", "sub/e.txt.bz2"]:
        (tmp_path / name).write_text("some words\n")
    assert corpus.resolve_files(str(tmp_path)) == [tmp_path / n for n in  # .bz2 too, as the error says
                                                  ["A.TXT", "b.txt", "sub/a.jsonl", "sub/c.txt.xz", "sub/deeper/d.txt",
                                                   "sub/e.txt.bz2"]]
    assert corpus.resolve_files(str(tmp_path / "**" / "*.txt")) == [tmp_path / "b.txt", tmp_path / "sub/deeper/d.txt"]
    assert corpus.resolve_files(str(tmp_path / "s*" / "*")) == [tmp_path / n for n in
                                                              ["sub/a.jsonl", "sub/c.txt.xz", "sub/e.txt.bz2"]]


def test_a_directory_skips_hidden_files_and_folders(tmp_path):
    # a notebook's .ipynb_checkpoints/ copy would be read twice, macOS's ._a.txt (binary) refused as "not UTF-8"
    (tmp_path / ".ipynb_checkpoints").mkdir()
    for name in ["a.txt", "._a.txt", ".ipynb_checkpoints/a-checkpoint.txt"]:
        (tmp_path / name).write_text("some words\n")
    assert corpus.resolve_files(str(tmp_path)) == [tmp_path / "a.txt"]
    assert corpus.resolve_files(str(tmp_path / "**" / "*.txt")) == [tmp_path / "a.txt"]  # as a glob does
    assert corpus.resolve_files(str(tmp_path / "._a.txt")) == [tmp_path / "._a.txt"]  # named, it is read


def test_a_directory_follows_linked_folders_once(tmp_path):
    # corpus/AA -> shards/AA was skipped silently (Path.rglob follows no links); a loop or a second link reads once
    (tmp_path / "shards" / "AA").mkdir(parents=True)
    (tmp_path / "shards" / "AA" / "a.txt").write_text("some words\n")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "b.txt").write_text("more words\n")
    (tmp_path / "corpus" / "AA").symlink_to(tmp_path / "shards" / "AA")
    (tmp_path / "corpus" / "AA_again").symlink_to(tmp_path / "shards" / "AA")
    (tmp_path / "corpus" / "loop").symlink_to(tmp_path / "corpus")
    assert corpus.resolve_files(str(tmp_path / "corpus")) == [tmp_path / "corpus" / "AA" / "a.txt",
                                                               tmp_path / "corpus" / "b.txt"]
    # a linked file whose target is read anyway (latest.txt -> b.txt) was read twice; one elsewhere is read
    (tmp_path / "corpus" / "latest.txt").symlink_to(tmp_path / "corpus" / "b.txt")
    (tmp_path / "corpus" / "z.txt").symlink_to(tmp_path / "shards" / "AA" / "a.txt")
    (tmp_path / "other.txt").write_text("words from elsewhere\n")
    (tmp_path / "corpus" / "other.txt").symlink_to(tmp_path / "other.txt")
    expected = [tmp_path / "corpus" / n for n in ("AA/a.txt", "b.txt", "other.txt")]
    assert corpus.resolve_files(str(tmp_path / "corpus")) == expected
    assert corpus.resolve_files(str(tmp_path / "corpus" / "*.txt")) == [tmp_path / "corpus" / n for n in
                                                                       ("b.txt", "other.txt", "z.txt")]
    # a ** glob follows the loop and both links to AA: each file was read up to 40 times
    assert sorted(os.path.realpath(f) for f in corpus.resolve_files(str(tmp_path / "corpus" / "**" / "*.txt"))) == \
        sorted(os.path.realpath(f) for f in expected)


def test_brackets_in_a_path_are_not_a_pattern(tmp_path, monkeypatch):
    import config
    home = tmp_path / "runs [v2]"  # a working directory whose name glob would read as a character class
    (home / "corpus").mkdir(parents=True)
    for name in ("a.txt", "b.txt"):
        (home / "corpus" / name).write_text(_paragraph(1))
    monkeypatch.chdir(home)
    assert corpus.resolve_files(config.data_path("corpus/a.txt")) == [home / "corpus" / "a.txt"]
    assert corpus.resolve_files(config.data_path("corpus")) == [home / "corpus" / n for n in ("a.txt", "b.txt")]
    assert corpus.resolve_files(config.data_path("corpus/*.txt")) == [home / "corpus" / n for n in ("a.txt", "b.txt")]
    assert corpus.resolve_files(config.data_path("corpus/[a].txt")) == [home / "corpus" / "a.txt"]  # a real pattern
    # a file named like a pattern is read, not the file the pattern would match
    (home / "corpus" / "b[1].txt").write_text(_paragraph(2))
    (home / "corpus" / "b1.txt").write_text("the wrong file\n")
    [(_, ds, _)] = corpus.load_corpus(str(home / "corpus" / "b[1].txt"), [home / "corpus" / "b[1].txt"], tmp_path)
    assert ds["text"] == [_paragraph(2)]
    with lzma.open(home / "corpus" / "c[1].txt.xz", "wt") as f:  # compressed, datasets read [1] as an IPv6 host
        f.write(_paragraph(3))
    [(_, ds, _)] = corpus.load_corpus(str(home / "corpus" / "c[1].txt.xz"), [home / "corpus" / "c[1].txt.xz"], tmp_path)
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
    monkeypatch.setattr(corpus, "load_corpus", fail)
    tok2, train2, val2 = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    assert tok2.to_str() == tok.to_str()
    assert np.array_equal(train2, train) and np.array_equal(val2, val)
    assert cached[0].stat().st_mtime_ns == mtime
    monkeypatch.undo()

    time.sleep(0.01)
    path.write_text(_wikiextractor_text() + _wikiextractor_text())  # new size + mtime: new cache
    _, train3, _ = data.prepare_data(str(path), tmp_path / "cache", tokenizer=tok_dir, val_fraction=0)
    assert len(train3) > len(train) + len(val)
    # replaced under the same mtime (cp -p, rsync -a), the same size or not: new tokens of the new text
    stamp = path.stat().st_mtime_ns
    for words in ("other words in a file", "fresh texts at a hill"):  # the same length
        path.write_text((words + " ") * 200)
        os.utime(path, ns=(stamp, stamp))
        tok4, train4, _ = data.prepare_data(str(path), tmp_path / "cache", tokenizer=tok_dir, val_fraction=0)
        expected = tok4.encode((words + " ") * 3, add_special_tokens=False).ids
        assert train4[:len(expected)].tolist() == expected, words


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
    # a file that cannot be read says why, while a tokenizer is trained too (not "no text")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe some words " * 100)
    with pytest.raises(ValueError, match="binary.txt.*not UTF-8"):
        data.prepare_data(str(tmp_path / "binary.txt"), tmp_path / "cache")


def test_unreachable_hub_dataset_is_one_clear_error(tok_dir, tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", offline)  # no network in tests, whatever the machine
    with pytest.raises(ValueError, match="without internet pass --data") as info:
        data.prepare_data(data.HUB_CORPUS, tmp_path / "cache", tokenizer=tok_dir)
    assert data.SAMPLE_CORPUS in str(info.value) and "\n" not in str(info.value)


def test_hub_corpora_read_as_lines_or_documents(tok_dir, tmp_path, monkeypatch):
    # offline stand-ins for the hub: WikiText's rows are lines (an article starts at a " = Title = " heading
    # after a blank row; " = = Section = = " does not); any other hub corpus has one document per row
    import datasets
    rows = {"Salesforce/wikitext": ["", " = Alpha = ", "", f" {_paragraph(1)} ", "", " = = Beta = = ", "",
                                    f" {_paragraph(2)} ", "", " = Gamma = ", "", f" {_paragraph(3)} "],
            "wikimedia/wikipedia": [f"Alpha\n\n{_paragraph(1)}", "", f"Gamma\n\n{_paragraph(3)}"]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, **kwargs: datasets.Dataset.from_dict(
        {"text": rows[name], "id": list(range(len(rows[name])))}))
    for name in ("Salesforce/wikitext:wikitext-103-raw-v1", data.HUB_CORPUS):
        tok, stream = _stream(tok_dir, name, tmp_path)
        decoded = tok.decode(stream.tolist(), skip_special_tokens=False)  # a heading's "=" is [UNK] here
        docs = [[w for w in d.split() if w.isalpha()] for d in decoded.split("[SEP]")]
        assert [d[0] for d in docs] == ["alpha", "gamma"] and ("beta" in docs[0]) == ("wikitext" in name), name


def test_hub_datasets_without_a_train_split_or_a_text_column_are_one_clear_error(tok_dir, tmp_path, monkeypatch):
    # a "text" column of lists (or ints) was a pyarrow traceback and exit 1; "content" was datasets' own line
    import datasets
    hub = {"u/content": {"content": ["the river"]}, "u/lists": {"text": [["the", "river"]]}}
    def load_dataset(name, config=None, split=None, **kwargs):
        if name == "u/testonly":
            raise ValueError("Unknown split \"train\". Should be one of ['test'].")
        return datasets.Dataset.from_dict(hub[name])
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)  # no network
    for name, problem in [("u/content", "no 'text' field in the hub dataset u/content: name the documents' column "
                                        "'text' (Dataset.rename_column); its fields: content"),
                          ("u/lists", "the 'text' field of the hub dataset u/lists holds List"),
                          ("u/testonly", "the hub dataset u/testonly has no train split")]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            data.prepare_data(name, tmp_path / "cache", tokenizer=tok_dir)


def _split_docs(split, n=4):
    return [{"text": f"{split} {_paragraph(i)}", "id": i} for i in range(n)]


def test_a_folder_in_splits_is_read_as_its_train_split(tok_dir, tmp_path, capsys):
    # a DatasetDict saved with save_to_disk, or a hub repository's files (downloaded, or a user's), was read whole:
    # its test split trained on, its held-out tail the validation split or the test's. Now its train split, as
    # load_dataset(FOLDER, split="train") and the hub path read it
    import datasets
    import pyarrow as pa, pyarrow.parquet as pq
    splits = {s: _split_docs(s) for s in ("train", "validation", "test")}
    datasets.DatasetDict({s: datasets.Dataset.from_list(rows) for s, rows in splits.items()}).save_to_disk(
        str(tmp_path / "saved"))
    (tmp_path / "repo" / "data").mkdir(parents=True)  # push_to_hub's layout
    (tmp_path / "repo" / "README.md").write_text("---\nlicense: cc-by-sa-4.0\n---\n# A corpus\n")
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "card" / "files").mkdir(parents=True)  # split files named only by the card's configs: block
    (tmp_path / "card" / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n"
                                                 "  - split: train\n    path: files/a-*.parquet\n"
                                                 "  - split: test\n    path: files/b.parquet\n---\n")
    for s, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "repo" / "data" / f"{s}-00000-of-00001.parquet")
        (tmp_path / "jsonl" / f"{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(splits["train"]), tmp_path / "card" / "files" / "a-0.parquet")
    pq.write_table(pa.Table.from_pylist(splits["test"]), tmp_path / "card" / "files" / "b.parquet")
    pq.write_table(pa.Table.from_pylist(splits["train"]), tmp_path / "train.parquet")
    expected = _stream(tok_dir, tmp_path / "train.parquet", tmp_path)[1]
    for name in ("saved", "repo", "jsonl", "card"):
        assert len(corpus.resolve_files(str(tmp_path / name))) == 1, name
        tok, stream = _stream(tok_dir, tmp_path / name, tmp_path)
        assert np.array_equal(stream, expected), name  # no test or validation text
        if name != "card":
            note = capsys.readouterr().out.split("left out: ")[1].split("\n")[0]
            assert sorted(note.split(", ")) == ["test (1 file)", "validation (1 file)"], name
    assert len(corpus.resolve_files(str(tmp_path / "saved" / "test"))) == 1  # a split's own folder is all read
    (tmp_path / "card" / "files" / "c.parquet").write_bytes((tmp_path / "train.parquet").read_bytes())
    assert "left out: test (1 file), 1 file in no split, e.g. files/c.parquet" in corpus.split_note(
        str(tmp_path / "card")) and len(corpus.resolve_files(str(tmp_path / "card"))) == 1  # the card's, said
    (tmp_path / "jsonl" / "notes.jsonl").write_text('{"text": "the river"}\n')  # split by names, and one in none
    with pytest.raises(ValueError, match=re.escape("jsonl: which files to read is ambiguous: 1 name the train split "
                                                   "(e.g. train.jsonl), 1 no split (e.g. notes.jsonl); name them")):
        corpus.resolve_files(str(tmp_path / "jsonl"))


def test_a_folder_in_splits_without_a_train_split_is_refused(tmp_path):
    (tmp_path / "evalonly").mkdir()
    for s in ("test", "validation"):
        (tmp_path / "evalonly" / f"{s}.jsonl").write_text('{"text": "the river"}\n')
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "README.md").write_text("---\nconfigs:\n- config_name: en\n  data_dir: en\n"
                                                    "- config_name: fr\n  data_dir: fr\n---\n")
    for lang in ("en", "fr"):  # wikimedia/wikipedia's layout: each language's train split was read
        (tmp_path / "configs" / lang).mkdir()
        (tmp_path / "configs" / lang / "train-00000-of-00001.jsonl").write_text('{"text": "the river"}\n')
    import datasets
    empty = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": []}),  # no .arrow file is saved
                                  "test": datasets.Dataset.from_dict({"text": ["the river"]})})
    empty.save_to_disk(str(tmp_path / "empty"))
    for folder, problem in [("evalonly", "holds the splits validation (validation.jsonl), test (test.jsonl) and no train"),
                            ("empty", f"the train split of {tmp_path / 'empty'} (as datasets reads the folder) has no"),
                            ("configs", "defines several configs and no default: name the files of one with a glob")]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            corpus.resolve_files(str(tmp_path / folder))
    assert len(corpus.resolve_files(str(tmp_path / "evalonly" / "*.jsonl"))) == 2  # named by a glob, each is read
    (tmp_path / "configs" / "README.md").write_text("---\nconfigs:\n- config_name: en\n  data_dir: en\n"
                                                    "- config_name: fr\n  data_dir: fr\n  default: true\n---\n")
    assert corpus.resolve_files(str(tmp_path / "configs")) == [tmp_path / "configs/fr/train-00000-of-00001.jsonl"]



def test_files_beside_a_split_folder_that_name_a_split_are_not_ambiguous(tmp_path):
    # The Pile's layout: train/ beside val.jsonl and test.jsonl is read as datasets reads it, train/ alone; it was
    # refused as ambiguous, with a glob that reads every file (the test split trained on) as the way out
    for name in ("train/00.jsonl", "train/01.jsonl", "val.jsonl", "test.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "the river"}\n')
    assert corpus.resolve_files(str(tmp_path)) == [tmp_path / "train/00.jsonl", tmp_path / "train/01.jsonl"]
    note = corpus.split_note(str(tmp_path))
    assert "left out: 2 files in no split, e.g. test.jsonl" in note and "glob" not in note
    (tmp_path / "notes.jsonl").write_text('{"text": "the river"}\n')  # a file that names no split still is
    with pytest.raises(ValueError, match=re.escape("2 name the train split (e.g. train/00.jsonl), 1 no split (e.g. "
                                                   "notes.jsonl)")):
        corpus.resolve_files(str(tmp_path))


def test_a_card_data_dir_holds_a_link_to_its_file(tmp_path):
    # a.txt -> en/train.txt is that file's one path (read once): it was "'a.txt' is not in the subpath of 'en'"
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "train.txt").write_text("the river\n")
    (tmp_path / "a.txt").symlink_to("en/train.txt")
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_dir: en\n---\n")
    assert corpus.resolve_files(str(tmp_path)) == [tmp_path / "a.txt"] and corpus.split_note(str(tmp_path)) is None


def test_splitting_a_folder_of_many_files_is_linear(tmp_path, monkeypatch):
    # each file was looked up in each split's list: a plain folder of 15,000 files took 18 s, twice (0.4 s before)
    files = [tmp_path / f"doc{i:05d}.txt" for i in range(3000)]
    compared, eq = [0], pathlib.PurePath.__eq__
    def counted(self, other):
        compared[0] += 1
        return eq(self, other)
    monkeypatch.setattr(pathlib.PurePath, "__eq__", counted)
    assert corpus._train_split(str(tmp_path), tmp_path, files) == files
    assert compared[0] < 3 * len(files), compared[0]  # was 4.5M


@pytest.mark.parametrize("names", [["a.txt", "test_notes.txt", "b.txt"], ["a.TXT", "dev_log.TXT", "dev_log2.TXT"],
                                   ["books/a.txt.gz", "validation_experiments/run1/b.txt.gz"],
                                   ["a.txt", "b.txt", "train_notes.txt"]])
def test_a_plain_folder_that_names_a_split_says_how_to_read_it_whole(tmp_path, names):
    # a folder of text whose test_notes.txt, dev_log.TXT or validation_experiments/ names a split, as datasets reads
    # it: its way out named the split ('*validation*': no files match dev_log.TXT; '*test*': test_notes.txt alone)
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("the river\n")
    # train_notes.txt beside a.txt and b.txt: datasets reads train_notes.txt alone, a user may mean all: refused
    naming = "e.g. train_notes.txt), 2 no split (e.g. a.txt)" if "train_notes.txt" in names else names[1].split('/')[0]
    with pytest.raises(ValueError, match=re.escape(naming)) as e:  # the file naming a split
        corpus.resolve_files(str(tmp_path))
    message = str(e.value)
    assert "\n" not in message
    assert len(corpus.resolve_files(message.split("--data '")[1].split("'")[0])) == len(names)

@pytest.mark.parametrize("layout", [
    ["train.jsonl", "test.jsonl", "validation.jsonl"], ["a.txt", "b.txt"], ["contest.txt", "trainee.txt", "a.txt"],
    ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/random-00000-of-00001.parquet"],
    ["data/train/a.parquet", "data/test/b.parquet"], ["train/a.txt", "dev/b.txt", "other/c.txt"],
    ["wiki_train_0.txt", "wiki_val_0.txt", "wiki_test_1.txt", "notes.txt"], ["training-set/x.txt", "my-eval/y.txt"],
    ["en/train-00000-of-00001.jsonl", "en/test-00000-of-00001.jsonl"], ["Train.txt", "Test.txt"],
    ["dev/train.txt", "dev/x.txt"], ["a/b/c_test/d.txt", "a/b/train/d.txt"], ["test.txt", "valid.txt"]])
def test_a_folder_is_split_by_datasets_own_rules(tmp_path, layout):
    # corpus.py copies datasets' split names (to skip its 2 s import when the cache hits): they must agree
    from datasets.data_files import DataFilesDict, get_data_patterns
    for name in layout:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("the river\n")
    ours = corpus.folder_splits(tmp_path, sorted(tmp_path / name for name in layout))
    theirs = DataFilesDict.from_patterns(get_data_patterns(str(tmp_path)), base_path=str(tmp_path))
    assert {s: sorted(os.path.realpath(f) for f in files) for s, files in ours.items()} == {
        str(s): sorted(os.path.realpath(f) for f in files) for s, files in theirs.items()}


_CARD = "configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: a/*.txt\n  - split: test\n    path: b/*.txt\n"


@pytest.mark.parametrize("readme", ["---\n" + _CARD + "---\n", "\n---\n" + _CARD + "---\n", "\ufeff---\n" + _CARD + "---\n",
                                    "--- \n" + _CARD + "---\n", ("---\n" + _CARD + "---").replace("\n", "\r\n"),
                                    "---\nconfigs: []\n---\n", "---\nconfigs:\n---\n"])
def test_a_card_is_read_as_datasets_reads_it(tmp_path, readme):
    # a README.md whose `---` block follows a blank line or a BOM (an editor's) is a card to huggingface_hub: its configs
    # were missed (train/ read, a/ and b/ not); one after "--- " is none; `configs: []` is none, was a ValueError
    import datasets
    for name in ("a/x.txt", "b/y.txt", "train/z.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("the river\n")
    (tmp_path / "README.md").write_bytes(readme.encode())
    ours = corpus.folder_splits(tmp_path, corpus._corpus_files_below(tmp_path))
    theirs = datasets.load_dataset_builder(str(tmp_path), cache_dir=str(tmp_path / ".cache")).config.data_files
    assert {s: sorted(os.path.realpath(f) for f in files) for s, files in ours.items()} == {
        str(s): sorted(os.path.realpath(f) for f in files) for s, files in theirs.items()}


UNREADABLE = {  # file name -> (bytes, words the one-line error must contain)
    "latin1.txt": ("café au lait\n".encode("latin-1"), "not UTF-8"),
    "image.txt": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "not UTF-8"),
    "nul.txt": (b"text\x00\x00\x00\x01\x02 more\n", "NUL bytes"),
    "nul.jsonl": (b'{"text": "web text\\u0000 crawled"}\n', "or a row with a \\u0000: remove it"),  # escaped: valid JSON
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


def test_a_bad_file_among_good_ones_is_named_alone(tok_dir, tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "good.txt").write_text(_paragraph(0))
    (tmp_path / "corpus" / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    with pytest.raises(ValueError) as info:
        data.prepare_data(str(tmp_path / "corpus"), tmp_path / "cache", tokenizer=tok_dir)
    assert "latin1.txt" in str(info.value) and "good.txt" not in str(info.value)


def test_a_jsonl_or_parquet_row_that_is_not_utf8_is_named(tok_dir, tmp_path):
    # pyarrow's JSON reader takes a Latin-1 row into a string column; reading it failed with a bare
    # "'utf-8' codec can't decode byte 0xe9 in position 3" naming neither the file nor the row
    import pyarrow as pa, pyarrow.parquet as pq
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "good.jsonl").write_text('{"text": "fine words"}\n' * 3)
    (tmp_path / "corpus" / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n' * 2 + '{"text": "café"}\n'.encode("latin-1"))
    pq.write_table(pa.table({"text": pa.array([b"fine", b"caf\xe9 au lait"]).view(pa.string())}), tmp_path / "a.parquet")
    for path, culprit, row in [(tmp_path / "corpus", "latin1.jsonl", 3), (tmp_path / "a.parquet", "a.parquet", 2)]:
        for tokenizer in (tok_dir, None):  # tokenizing, or training a tokenizer first
            with pytest.raises(ValueError, match=rf"^cannot read \S*{culprit}: row {row} is not UTF-8 text \(.*iconv"):
                data.prepare_data(str(path), tmp_path / "cache", tokenizer=tokenizer, vocab_size=100)


def test_one_enormous_line_is_read_in_bounded_batches_of_the_same_tokens(tmp_path, monkeypatch):
    # a corpus without newlines (text8) was one piece, encoded at once: a 30 MB line peaked at 3.4 GB, on one core
    text = " ".join(_paragraph(i) for i in range(40))  # one line of ~14k characters
    (tmp_path / "a.txt").write_text(text)
    whole = data.prepare_data(str(tmp_path / "a.txt"), tmp_path / "whole", vocab_size=200, val_fraction=0)
    monkeypatch.setattr(corpus, "PIECE_CHARS", 300, raising=False)
    monkeypatch.setattr(corpus, "BATCH_CHARS", 1000, raising=False)
    batches = list(corpus.pieces(corpus.load_corpus(str(tmp_path / "a.txt"), [tmp_path / "a.txt"], tmp_path / "c")))
    assert len(batches) > 5 and max(sum(map(len, b)) for b in batches) < 1000 + 300
    assert "".join(p for b in batches for p in b) == text  # cut before spaces, nothing lost
    cut = data.prepare_data(str(tmp_path / "a.txt"), tmp_path / "cut", vocab_size=200, val_fraction=0)
    assert cut[0].get_vocab() == whole[0].get_vocab() and np.array_equal(cut[1], whole[1])


def test_long_rows_are_made_strings_a_bounded_batch_at_a_time(tmp_path, monkeypatch):
    # 2,000 rows were made Python strings at once: a corpus of long documents (books, one a row) with fewer rows than
    # that was held whole in each pass over it (51 MB of 500K-character rows: +117 MiB, twice that for 102 MB)
    import hashlib
    import tracemalloc
    rows = [" ".join(f"w{i}x{j % 97}" for j in range(5000)) for i in range(40)]  # 40 rows of ~33K characters
    (tmp_path / "books.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    parts = corpus.load_corpus(str(tmp_path / "books.jsonl"), [tmp_path / "books.jsonl"], tmp_path / "cache")
    monkeypatch.setattr(corpus, "BATCH_CHARS", 50_000)
    seen, expected = hashlib.sha1(), hashlib.sha1("|".join(rows).encode())
    tracemalloc.start()
    try:
        for batch in corpus.pieces(parts):  # each batch dropped once hashed
            seen.update("".join("|" if p is None else p for p in batch).encode())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen.hexdigest() == expected.hexdigest()  # the same pieces, the same document boundaries
    assert peak < 400_000, f"{peak:,} bytes traced: the 40 rows are {sum(map(len, rows)):,} characters"


def test_cutting_a_line_copies_one_piece_at_a_time(monkeypatch):
    # _cut kept the rest of the line as a new string after each piece: each cut copied the line's tail, quadratic in
    # its length (100 MB, text8's size: 11 s a pass, and a tokenizer is made in three; 300 MB: 120 s) with two copies
    # of the line alive at once
    import tracemalloc
    monkeypatch.setattr(corpus, "PIECE_CHARS", 1000)
    text = "".join(f"w{i % 97} " for i in range(100_000))  # ~450k characters, one line
    total = longest = 0
    tracemalloc.start()
    try:
        for piece in corpus._cut(text):  # each piece dropped once measured
            total, longest = total + len(piece), max(longest, len(piece))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == len(text) and longest <= 1000 and peak < 10 * 1000  # the line's tail: 390,000
    # a stretch without a space (a long URL, a table's row) ended the cutting: the rest of the line was one piece
    text = "x" * 3000 + " " + "".join(f"w{i % 97} " for i in range(10_000))
    pieces = list(corpus._cut(text))
    assert "".join(pieces) == text and len(pieces[0]) == 3000 and max(map(len, pieces[1:])) <= 1000


# characters of each kind that meet at a cut: CJK ideographs (with U+2B820, which `tokenizers` does not isolate),
# kana, Latin, punctuation (U+2E43: Python's only), spaces, combining marks, emoji, controls, Hangul, Thai
MIXTURE = ("中文字漢語日本東京都\U00020000\U0002a700\U0002b820\U0002b91f\U0002b920\U0002ceb0\U0002f800\uf900"
           "ひらがなカタカナ゙ー・゠" "Latin café İstanbul ÉRIC ß" ".,;:!?'\"()[]{}<>/\\-_—…、。「」『』！？（）"
           "\u037e\u0387\u0385\u2e43" "  \u3000\t\n" "\u0301\u0316\u0345\u3099\u200d\ufe0f" "😀👍🏽🇯🇵"
           "\x07\ufffd\u00ad" "한국어ภาษาไทย" "0123456789")


def _tokens(tok, texts):
    tok.encode_special_tokens = True  # as token_files.tokenize
    return [i for e in tok.encode_batch_fast(texts, add_special_tokens=False) for i in e.ids]


def test_a_cut_before_punctuation_or_a_cjk_ideograph_changes_no_word():
    # every character _cut may cut before, after a combining mark and before another, in each BertNormalizer setting:
    # the words (normalized, pre-tokenized) of the text with a space there are the text's own
    from tokenizers import normalizers, pre_tokenizers
    every = "".join(map(chr, [*range(0xD800), *range(0xE000, 0x110000)]))
    for at, chinese in [(corpus.CUT_BERT, False), (corpus.CUT_BERT_CJK, True)]:
        chars = re.findall(f"[{at}]", every)
        assert len(chars) == (81_630 if chinese else 366)  # a space, 365 punctuation, 81,264 ideographs
        whole, spaced = ("".join(f"x\u0345{sep}{c}\u0301y " for c in chars) for sep in ("", " "))
        for lowercase, strip in [(True, None), (False, None)] + [(False, True), (True, False)] * (not chinese):  # 2 s
            norm = normalizers.BertNormalizer(handle_chinese_chars=chinese, lowercase=lowercase, strip_accents=strip)
            pre = pre_tokenizers.BertPreTokenizer()
            words = lambda text: [w for w, _ in pre.pre_tokenize_str(norm.normalize_str(text))]
            assert words(whole) == words(spaced), (at == corpus.CUT_BERT, lowercase, strip)


def test_cut_pieces_are_tokenized_as_the_whole_text(tmp_path, monkeypatch):
    # random mixtures cut into pieces of 1 to 40 characters: the pieces' tokens are the text's, for each tokenizer
    # (trained uncased and cased, a vocab.txt without tokenize_chinese_chars; others are cut before spaces only)
    import random
    from tokenizers import pre_tokenizers
    rng = random.Random(0)
    texts = ["".join(rng.choices(MIXTURE, k=rng.randint(1, 300))) for _ in range(300)]
    uncased = data.train_tokenizer(texts, vocab_size=400, limit_alphabet=0)
    cased = data.train_tokenizer(texts, vocab_size=400, cased=True, limit_alphabet=0)
    (tmp_path / "vocab.txt").write_text("\n".join(sorted(cased.get_vocab(), key=cased.get_vocab().get)) + "\n")
    config = {"do_lower_case": False, "tokenize_chinese_chars": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    unchinese = data.load_tokenizer(tmp_path / "vocab.txt")
    other = data.train_tokenizer(texts, vocab_size=400)  # a tokenizer of another kind: spaces only
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    added = data.train_tokenizer(texts, vocab_size=400)  # a word of its own matched across a cut: spaces only
    added.add_tokens(["中文"])
    expected = [corpus.CUT_BERT_CJK, corpus.CUT_BERT_CJK, corpus.CUT_BERT, corpus.CUT_SPACE, corpus.CUT_SPACE]
    for tok, at in zip([uncased, cased, unchinese, other, added], expected):
        assert token_files.cut_at(tok) == at
        for text in texts:
            monkeypatch.setattr(corpus, "PIECE_CHARS", rng.randint(2, 40))
            pieces = list(corpus._cut(text, at))
            assert "".join(pieces) == text and (len(pieces) > 1 or len(text) <= 80 or at == corpus.CUT_SPACE)
            assert _tokens(tok, pieces) == _tokens(tok, [text]), (len(at), text, pieces)


def test_a_long_spaceless_cjk_row_is_cut_into_the_same_tokens(tmp_path, monkeypatch):
    # a Chinese or Japanese row has no space: it was encoded whole (~110 bytes a character: a 10 MB row, over 1 GB)
    import random
    rng = random.Random(1)
    row = "".join(rng.choice(["東京都", "中文", "ひらがな", "。", "「カタカナ」", "日本語", "、"]) for _ in range(4000))
    (tmp_path / "zh.jsonl").write_text(json.dumps({"text": row}) + "\n")
    whole = data.prepare_data(str(tmp_path / "zh.jsonl"), tmp_path / "whole", vocab_size=300, val_fraction=0)
    longest, cut = [0], corpus._cut
    def measured(text, *at):
        for piece in cut(text, *at):
            longest[0] = max(longest[0], len(piece))
            yield piece
    monkeypatch.setattr(corpus, "_cut", measured)
    monkeypatch.setattr(corpus, "PIECE_CHARS", 500)
    short = data.prepare_data(str(tmp_path / "zh.jsonl"), tmp_path / "short", vocab_size=300, val_fraction=0)
    assert 0 < longest[0] <= 500, f"a piece of {longest[0]} characters of {len(row)}"  # training and tokenizing
    assert short[0].get_vocab() == whole[0].get_vocab() and np.array_equal(short[1], whole[1])


def test_many_files_load_in_groups_in_their_order(tmp_path, monkeypatch):
    # one load_dataset call for all files copied every split's info per split: 2,000 small files took 100 s
    for i in range(7):
        (tmp_path / f"f{i}.jsonl" if i % 3 == 0 else tmp_path / f"f{i}.txt").write_text(
            json.dumps({"text": f"row of file {i}"}) + "\n" if i % 3 == 0 else f"line a of {i}\nline b of {i}\n")
    files = corpus.resolve_files(str(tmp_path))
    read = lambda parts: [(kind, name, list(ds["text"])) for kind, ds, name in parts]
    whole = read(corpus.load_corpus(str(tmp_path), files, tmp_path / "cache"))
    calls = []
    load = corpus._load_local
    monkeypatch.setattr(corpus, "_load_local", lambda *args: calls.append(args[2]) or load(*args))
    monkeypatch.setattr(corpus, "FILES_PER_LOAD", 2)
    assert read(corpus.load_corpus(str(tmp_path), files, tmp_path / "cache")) == whole
    assert len(calls) == 6 and max(len(c) for c in calls) <= 2  # per builder and pair of files: 3 text, 3 json
    assert [name for _, name, _ in whole] == [str(f) for f in files] and whole[1][2] == ["line a of 1", "line b of 1"]


def test_named_json_lines_read_as_json_lines_and_csv_is_refused(tok_dir, tmp_path):
    # a .json file (Dataset.to_json's name) and WikiExtractor --json's wiki_00, named, were read as text: the JSON
    # syntax, field names and URLs were trained on, every row one document; a .csv or .tsv too, header and all
    rows = [{"id": str(i), "url": f"https://en.wikipedia.org/wiki?curid={i}", "title": t,
             "text": f"{t}\n\n{_paragraph(i)}"} for i, t in enumerate(TITLES)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "AA").mkdir()
    for name in ("a.jsonl", "a.json", "AA/wiki_00"):
        (tmp_path / name).write_text(lines)
    (tmp_path / "AA" / "wiki_01.bz2").write_bytes(bz2.compress(("\ufeff " + lines).encode()))
    (tmp_path / "AA" / "wiki_03").write_text(lines.replace('{"', '{ "'))  # a space after the brace: JSON Lines too
    tok, expected = _stream(tok_dir, tmp_path / "a.jsonl", tmp_path)
    assert (expected == data.special_token_ids(tok)["sep"]).sum() == len(TITLES) - 1
    for name in ("a.json", "AA/wiki_00", "AA/wiki_0[0]", "AA/wiki_01.bz2", "AA/wiki_03"):
        assert np.array_equal(_stream(tok_dir, tmp_path / name, tmp_path)[1], expected), name
    # their token files of the text they were read as are not reused: the key says how a file is read
    f = tmp_path / "a.json"
    assert token_files.corpus_key(str(f), [f]) != token_files._hash([[(str(f), f.stat().st_size, f.stat().st_mtime_ns,
                                                                       token_files._ends(f))], 1])
    # and the key never reads into a file to say so (a .bz2's first block: 20 ms a file, 15k files a start)
    sniffed = lambda path: pytest.fail(f"the corpus key read into {path}")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(corpus, "json_lines", sniffed)
        files = corpus.resolve_files(str(tmp_path / "AA" / "wiki_*"))
        token_files.corpus_key(str(tmp_path / "AA" / "wiki_*"), files)
    (tmp_path / "AA" / "wiki_02").write_text("{{Infobox person | name = Ada}}\n")  # wiki markup is text
    assert not corpus.json_lines(tmp_path / "AA" / "wiki_02")
    (tmp_path / "a.csv").write_text("id,text\n1,some words\n")
    (tmp_path / "t.tsv.gz").write_bytes(gzip.compress(b"id\ttext\n1\tsome words\n"))
    for name in ("a.csv", "t.tsv.gz", "*.*"):
        with pytest.raises(ValueError, match=r"\.(csv|tsv) file is not read; convert it to \.jsonl or \.parquet"):
            data.prepare_data(str(tmp_path / name), tmp_path / "cache", tokenizer=tok_dir)


def test_a_file_without_a_text_field_is_named(tok_dir, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "the river"}\n')
    with pytest.raises(ValueError, match=re.escape(f"no 'text' field in {tmp_path / 'a.jsonl'}")):
        data.prepare_data(str(tmp_path / "a.jsonl"), tmp_path / "cache", tokenizer=tok_dir)


def test_a_full_disk_while_tokenizing_names_the_way_out(tok_dir, tmp_path, monkeypatch):
    # the token file filling the disk was a bare "[Errno 28] No space left on device: '.../tokens-....bin'",
    # where the datasets cache's full disk says to free some or move --cache_dir
    import errno
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())

    def full(tok, parts, out, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))
    monkeypatch.setattr(token_files, "tokenize", full)
    with pytest.raises(OSError) as info:  # still an OSError: exit 1, as other full disks
        _stream(tok_dir, path, tmp_path)
    message = str(info.value)
    assert message.startswith(f"no space left for the token cache in {tmp_path / 'cache'} (No space left on device: ")
    assert "tokens-" in message and message.endswith("free some, or pass --cache_dir elsewhere"), message


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


def test_a_sidecar_of_another_shape_means_a_rebuild(tmp_path, capsys):
    path = tmp_path / "tokens-k.uint16.bin"
    path.write_bytes(b"\x05\x00" * 10)
    for text in ["{}", "[]", "null", '{"bytes": 20}', '{"bytes": 20, "checksum": null}']:
        path.with_suffix(".json").write_text(text)
        assert not token_files.cache_ok(path), text
        assert "rebuilding" in capsys.readouterr().out, text


def test_a_token_file_appears_only_by_its_rename(tok_dir, tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())

    def killed(src, dst):  # the process dies before the rename: no token file under its real name
        raise KeyboardInterrupt
    monkeypatch.setattr(token_files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _stream(tok_dir, path, tmp_path)
    assert not list((tmp_path / "cache").glob("tokens-*.bin"))


def test_a_token_file_is_on_disk_before_its_rename(tok_dir, tmp_path, monkeypatch):
    # after a power cut: no token file, or a whole one (the sampled checksum might miss a zeroed region)
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    events, real_fsync, real_replace = [], os.fsync, os.replace
    fd_name = lambda fd: os.readlink(f"/proc/self/fd/{fd}")
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", fd_name(fd))), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b)))
    _stream(tok_dir, path, tmp_path)
    bins = [(what, name) for what, name in events if ".bin.tmp" in name]
    assert [what for what, _ in bins] == ["fsync", "replace"] and bins[0][1] == bins[1][1]


def test_a_token_file_that_cannot_be_created_says_why(tok_dir, tmp_path, monkeypatch):
    # a read-only or full cache: the error is the system's, not a missing temporary file
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    real_open = builtins.open

    def read_only(name, *args, **kwargs):
        if ".bin.tmp" in str(name):
            raise OSError(30, "Read-only file system", str(name))
        return real_open(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", read_only)
    with pytest.raises(OSError, match="Read-only file system"):
        _stream(tok_dir, path, tmp_path)


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


def test_a_run_waits_while_another_makes_the_cache(tok_dir, tmp_path, capsys):
    fcntl = pytest.importorskip("fcntl")  # POSIX: Windows runs take no lock
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    original = _stream(tok_dir, path, tmp_path)[1].copy()
    cached = next((tmp_path / "cache").glob("tokens-*.bin"))
    cached.unlink(), cached.with_suffix(".json").unlink()
    result = {}
    with open(cached.parent / f".{cached.name}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is making this cache
        run = threading.Thread(target=lambda: result.update(stream=_stream(tok_dir, path, tmp_path)[1]))
        run.start()
        run.join(1.0)
        assert run.is_alive() and not cached.exists()  # it waits, and writes nothing meanwhile
    run.join(60)
    assert "waiting for another process" in capsys.readouterr().out
    assert np.array_equal(result["stream"], original)


def test_checksum_samples_large_files(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "CHECKSUM_CHUNKS", 4)  # 4 x 64 KiB: a 1 MiB file is sampled
    path = tmp_path / "big.bin"
    blob = bytearray(np.random.default_rng(0).bytes(1 << 20))
    path.write_bytes(blob)
    before = token_files.checksum(path)
    blob[-1] ^= 1  # the last chunk is always sampled
    path.write_bytes(blob)
    assert token_files.checksum(path) != before


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


def test_a_cached_tokenizer_with_a_damaged_id_is_retrained(tmp_path, capsys):
    # one digit of the last token's id damaged in tokenizer.json: vocab.txt, in id order, read the same, so the
    # tokenizer was used (an id past its embedding rows), the corpus tokenized with it and cached, then
    # train.py's save_tokenizer failed on every run with an AssertionError
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    tok, train, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    tok_json = next((tmp_path / "cache").glob("tokenizer-*")) / "tokenizer.json"
    last = tok.get_vocab_size() - 1
    assert str(last)[0] != "9" and tok_json.read_text().count(f'": {last}\n') == 1
    tok_json.write_text(tok_json.read_text().replace(f'": {last}\n', f'": {last + 10 ** (len(str(last)) - 1)}\n'))
    capsys.readouterr()
    tok2, train2, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    assert f"its ids are not 0..{last} (no token has id {last})): training it again" in capsys.readouterr().out
    assert tok2.get_vocab() == tok.get_vocab() and np.array_equal(train2, train)
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 1  # none made with the damaged one


@pytest.mark.parametrize("suffix, compress", [("xz", lzma.compress), ("gz", gzip.compress), ("bz2", bz2.compress),
                                              ("zst", _zst)])
def test_read_text_reads_what_data_reads(tmp_path, suffix, compress):
    # eval.py --analysis --text a.txt.gz was refused as "not UTF-8 text ... a binary file", though --data reads it
    path = tmp_path / f"t.txt.{suffix}"
    path.write_bytes(compress("a sentence\n".encode()))
    assert corpus.read_text(path) == "a sentence\n"
    path.write_bytes(b"plain text, not compressed\n")
    with pytest.raises(ValueError, match=rf"{path.name}: not a readable \.\w+ file"):
        corpus.read_text(path)


@pytest.mark.parametrize("suffix, content", [("xz", lambda raw: b"plain text, not xz\n")] + [
    (suffix, lambda raw, compress=compress: compress(raw)[:-20]) for suffix, compress in
    [("xz", lzma.compress), ("gz", gzip.compress), ("bz2", bz2.compress), ("zst", _zst)]])
def test_read_text_of_a_broken_or_truncated_file_is_one_clear_error(tmp_path, suffix, content):
    # eval.py --analysis --text and the GLUE reader go through read_text, not the corpus loader. A .zst cut short
    # (a download stopped) was read up to the cut without a word: zstandard.open does not check the frame's end
    (tmp_path / f"t.txt.{suffix}").write_bytes(content(os.urandom(3 << 20).hex().encode()))
    with pytest.raises(ValueError, match=rf"t.txt.{suffix}: not a readable .{suffix} file"):
        corpus.read_text(tmp_path / f"t.txt.{suffix}")


def test_a_zst_of_several_frames_is_read_whole_and_a_cut_one_is_refused(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    frames = [os.urandom(n).hex().encode() + b"\n" for n in (3 << 20, 10, 1 << 20)]  # frames across read chunks
    packed = b"".join(zstandard.ZstdCompressor().compress(f) for f in frames)  # as `cat a.zst b.zst` or zstd -T
    (tmp_path / "a.txt.zst").write_bytes(packed)
    assert corpus.read_text(tmp_path / "a.txt.zst") == b"".join(frames).decode()
    with corpus.DECOMPRESS[".zst"](tmp_path / "a.txt.zst", "rb") as f:  # _decompressed's reads, 1 MiB each
        assert b"".join(iter(lambda: f.read(1 << 20), b"")) == b"".join(frames)
    (tmp_path / "a.txt.zst").write_bytes(packed[:-5])
    with pytest.raises(ValueError, match=r"a.txt.zst: not a readable .zst file \(EOFError: .*zstd frame\)"):
        corpus.read_text(tmp_path / "a.txt.zst")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "a.txt.zst").write_bytes(packed[:len(packed) // 2])  # the corpus loader: one clear line
    with pytest.raises(ValueError, match=r"cannot read .*a.txt.zst as text: not a readable .zst file"):
        corpus.load_corpus(str(tmp_path / "b"), [tmp_path / "b" / "a.txt.zst"], tmp_path / "cache")


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EFBIG"])  # a full disk, a quota, ulimit -f: each blamed the corpus
def test_a_full_cache_disk_blames_the_cache_not_the_corpus(tmp_path, monkeypatch, code):
    import errno
    import datasets

    def full_disk(*args, **kwargs):  # datasets wraps what it hit while writing its arrow cache
        try:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        except OSError as e:
            raise datasets.exceptions.DatasetGenerationError("An error occurred while generating the dataset") from e
    monkeypatch.setattr(datasets, "load_dataset", full_disk)
    (tmp_path / "good.txt").write_text("fine text\n")
    with pytest.raises(OSError) as info:  # exit 1, as other full disks (a ValueError, bad input, exited 2)
        corpus._load_local(datasets, "text", {"train": str(tmp_path / "good.txt")}, str(tmp_path / "hf"))
    message = str(info.value)
    assert "no space left for the cache" in message and "--cache_dir" in message, message
    assert os.strerror(getattr(errno, code)) in message and "cannot read" not in message, message


def test_a_cache_that_cannot_take_the_decompressed_copy_is_blamed_not_the_corpus(tmp_path):
    # compressed text is decompressed into CACHE_DIR/hf/plain first: a cache that cannot take it is the cache's fault
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"fine text\n"))
    (tmp_path / "cache" / "hf").mkdir(parents=True)
    (tmp_path / "cache" / "hf" / "plain").write_text("a file where the folder goes")
    with pytest.raises(OSError, match=r"^cannot write the cache .*hf \(File exists: .*plain\) while preparing "
                                         r".*a.txt.gz: pass --cache_dir elsewhere$"):
        corpus.load_corpus(str(tmp_path / "a.txt.gz"), [tmp_path / "a.txt.gz"], tmp_path / "cache")


def test_two_runs_decompressing_one_file_at_once_each_write_their_own_temporary_file(tmp_path, monkeypatch):
    # two runs on one --cache_dir (two jobs, or a node's ranks) decompress the same .gz into one plain copy: a shared
    # temporary name let the second truncate the file the first was writing, then rename it away under it
    text = b"some text\n" * 1000
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text))
    real_open, other = corpus.DECOMPRESS[".gz"], []

    class Reader:  # the first run's source: the other run starts and finishes once it has begun writing
        def __init__(self, f, mode):
            self.f = real_open(f, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n):
            if not other:
                other.append("started")
                with monkeypatch.context() as m:
                    m.setitem(corpus.DECOMPRESS, ".gz", real_open)
                    m.setattr(corpus.os, "getpid", lambda: os.getppid())  # another process
                    other.append(corpus._decompressed(str(tmp_path / "a.txt.gz"), str(tmp_path / "hf")))
            return self.f.read(n)
    monkeypatch.setitem(corpus.DECOMPRESS, ".gz", Reader)
    plain = corpus._decompressed(str(tmp_path / "a.txt.gz"), str(tmp_path / "hf"))
    assert other[1] == plain and open(plain, "rb").read() == text
    assert os.listdir(tmp_path / "hf" / "plain") == [os.path.basename(plain)]  # no temporary file left


def test_a_zst_file_without_zstandard_names_the_package(tmp_path, monkeypatch):
    # .zst is read through the zstandard package (ours for text, datasets' for .jsonl), which requirements.txt omits
    import datasets
    monkeypatch.setattr(corpus, "zstandard", None)
    (tmp_path / "a.txt.zst").write_bytes(bytes.fromhex("28b52ffd0458510000736f6d6520746578740a02e51a06"))  # "some text"
    with pytest.raises(ValueError, match=r"a.txt.zst as text: .*zstd.*\(install the zstandard package: pip install "
                                         r"zstandard\)$"):
        corpus._load_local(datasets, "text", {"train": str(tmp_path / "a.txt.zst")}, str(tmp_path / "hf"))


def test_a_datasets_cache_that_cannot_be_written_blames_the_cache_not_the_corpus(tmp_path, monkeypatch):
    import errno
    import datasets

    def read_only(*args, **kwargs):  # --cache_dir's hf folder read-only (a cache shared with another user)
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "hf" / "text_default.lock"))
    monkeypatch.setattr(datasets, "load_dataset", read_only)
    (tmp_path / "good.txt").write_text("fine text\n")
    with pytest.raises(OSError) as info:  # was "cannot read good.txt as text: PermissionError: ..."
        corpus._load_local(datasets, "text", {"train": str(tmp_path / "good.txt")}, str(tmp_path / "hf"))
    message = str(info.value)
    assert message.startswith(f"cannot write the cache {tmp_path / 'hf'} (Permission denied: ") and \
        "while datasets read" in message and "pass --cache_dir elsewhere" in message, message


def test_the_cache_keys_on_the_tokenizer_and_the_vocab_size(tok_dir, tmp_path):
    # one corpus, one cache, two vocabulary sizes and a given tokenizer: never each other's files
    path = tmp_path / "a.txt"
    path.write_text("\n".join(_paragraph(i) for i in range(40)))
    tok_a, train_a, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=150, val_fraction=0)
    tok_b, train_b, _ = data.prepare_data(str(path), tmp_path / "cache", vocab_size=300, val_fraction=0)
    assert tok_a.get_vocab_size() < tok_b.get_vocab_size()
    tok_c, train_c, _ = data.prepare_data(str(path), tmp_path / "cache", tokenizer=tok_dir, val_fraction=0)
    for tok, stream in ((tok_a, train_a), (tok_b, train_b), (tok_c, train_c)):
        first = tok.encode(_paragraph(0), add_special_tokens=False).ids
        assert stream[:len(first)].tolist() == first and stream.max() < tok.get_vocab_size()


def test_the_corpus_key_sees_each_kind_of_replacement(tmp_path):
    # every part of the key is needed: size, mtime, and the file's ends
    f = tmp_path / "big.txt"
    base = "".join(_paragraph(i) + "\n" for i in range(200))  # ~70 KB: the ends are 4 KiB of each side

    def key(text, mtime=None):
        f.write_text(text)
        if mtime:
            os.utime(f, ns=(mtime, mtime))
        return token_files.corpus_key(str(f), [f])
    k0 = key(base)
    stamp = f.stat().st_mtime_ns
    mid = len(base) // 2
    assert key(base[:mid] + "X" + base[mid + 1:], stamp + 10**9) != k0  # a middle edit, a new mtime
    assert key(base[:mid] + "extra words" + base[mid:], stamp) != k0  # an insertion, the same mtime
    assert key(base[:-10] + "Z" * 9 + "\n", stamp) != k0  # a tail edit, the same size and mtime
    assert key("Z" + base[1:], stamp) != k0  # a head edit, the same size and mtime


def test_a_format_version_bump_invalidates_every_token_file_but_no_trained_tokenizer(tmp_path, monkeypatch):
    # the stream's format is not the tokenizer's training: a bump that retrained it cost a corpus-sized training
    f = tmp_path / "a.txt"
    f.write_text("some words\n")
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "some": 1}, unk_token="[UNK]"))
    keys = [token_files.corpus_key(str(f), [f]), token_files.corpus_key("wikitext", None)]
    files = [token_files.tokens_file(tmp_path, k, tok, np.uint16) for k in keys]
    monkeypatch.setattr(token_files, "FORMAT_VERSION", token_files.FORMAT_VERSION + 1)
    assert [token_files.tokens_file(tmp_path, k, tok, np.uint16) for k in keys] != files
    assert [token_files.corpus_key(str(f), [f]), token_files.corpus_key("wikitext", None)] == keys
    # the name version 1 gave a trained tokenizer (its corpus key held FORMAT_VERSION 1) is the one looked up now
    assert keys[1] == token_files._hash([["wikitext"], 1])


def test_a_vocabulary_over_65536_pieces_gets_uint32_tokens(tmp_path):
    # ids past uint16 must not wrap (--vocab_size goes up to 1M, a given tokenizer may be that large)
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = data.SPECIAL_TOKENS + [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w69999 w3 w5 w69998\n")
    _, stream, _ = data.prepare_data(str(tmp_path / "a.txt"), tmp_path / "cache",
                                     tokenizer=str(tmp_path / "tokenizer.json"), val_fraction=0)
    assert stream.dtype == np.uint32 and stream.tolist() == [70004, 8, 10, 70003]


def test_blank_jsonl_rows_are_no_documents(tok_dir, tmp_path):
    """A .jsonl row is a document, but one whose text is empty, whitespace or null holds none: it adds no
    boundary, so two documents around it are one [SEP] apart (never two in a row), as a blank line between
    the rows of the file is. (Read as an empty document it would double the [SEP] the token stream keeps
    single, and a whitespace row would be a document of no tokens.)"""
    lines = ['{"text": "the red cat sees a river ."}', "", '{"text": ""}', '{"text": "  \\n\\t "}', '{"text": null}',
             "   ", '{"text": "a quiet engine moves ."}', '{"text": " "}']
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    files = corpus.resolve_files(str(tmp_path / "a.jsonl"))
    parts = corpus.load_corpus(str(tmp_path / "a.jsonl"), files, tmp_path / "cache")
    assert [p for batch in corpus.pieces(parts) for p in batch] == [
        "the red cat sees a river .", None, "a quiet engine moves ."]
    tok, stream = _stream(tok_dir, tmp_path / "a.jsonl", tmp_path)
    sep = data.special_token_ids(tok)["sep"]
    assert (stream == sep).sum() == 1 and stream[0] != sep and stream[-1] != sep
    (tmp_path / "clean.jsonl").write_text("".join(line + "\n" for line in lines if "river" in line or "engine" in line))
    assert np.array_equal(_stream(tok_dir, tmp_path / "clean.jsonl", tmp_path)[1], stream)


def test_a_zst_that_expands_enormously_is_read_in_bounded_memory(tmp_path):
    # 512 MB of zeros in 16 kB of .zst: the reader fed 1 MiB of input a step, whose output (the whole 512 MB here,
    # up to ~32 GB at zstd's highest ratio) was held at once, even for a read(64)
    zstandard = pytest.importorskip("zstandard")
    import tracemalloc
    with open(tmp_path / "zeros.txt.zst", "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w:
        for _ in range(32):
            w.write(bytes(1 << 24))
    assert (tmp_path / "zeros.txt.zst").stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with corpus.DECOMPRESS[".zst"](tmp_path / "zeros.txt.zst", "rb") as f:
            assert f.read(1 << 20) == bytes(1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100e6, f"{peak / 1e6:.0f} MB traced"


def test_a_cached_file_another_user_owns_is_one_error_and_stays(tmp_path, monkeypatch):
    # a shared --cache_dir where another user's umask left their files unreadable to us: the tokenizer was said to be
    # "unreadable: training it again" (its removal failed quietly; the new one could not replace it after the whole
    # training), and the token stream "incomplete or corrupt: rebuilding it"; neither is damaged. (Tests run as
    # root, whom chmod does not stop: open raises as it would for another user.)
    path = tmp_path / "a.txt"
    path.write_text(_wikiextractor_text())
    data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
    kept = {p: p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    real_open = builtins.open
    for theirs in ("tokenizer-*/tokenizer.json", "tokenizer-*/vocab.txt", "tokens-*.bin", "tokens-*.json"):
        locked = next((tmp_path / "cache").glob(theirs))
        monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (_ for _ in ()).throw(PermissionError(
            13, "Permission denied", str(f))) if pathlib.Path(f) == locked else real_open(f, *a, **k))
        with pytest.raises(ValueError, match=rf"cannot read {re.escape(str(locked))} in the cache \(Permission "
                                             rf"denied\): another user's files\? pass a --cache_dir of your own"):
            data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)
        monkeypatch.setattr(builtins, "open", real_open)
        assert {p: p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file()} == kept, theirs
    # Windows' open of a directory is a PermissionError (IsADirectoryError here): the cache's folders are not read
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (_ for _ in ()).throw(PermissionError(
        13, "Permission denied", str(f))) if os.path.isdir(f) else real_open(f, *a, **k))
    data.prepare_data(str(path), tmp_path / "cache", vocab_size=200)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_in_a_cached_tokenizer_is_not_waited_on(tmp_path):
    # the check for another user's files opens each file: a FIFO's open would wait for a writer forever (a process
    # of its own, so that the test fails rather than hangs)
    os.mkfifo(tmp_path / "tokenizer.json")
    code = "import pathlib, sys, token_files; print(token_files.cached_tokenizer(pathlib.Path(sys.argv[1])))"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=os.path.dirname(os.path.abspath(__file__)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("None"), r.stdout + r.stderr
