"""
Tokenizer, corpus -> cached token stream, and packed-block batches for BERT pretraining.

- Tokenizer: uncased BERT WordPiece from the `tokenizers` package, specials in BERT order
  [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4. A Hugging Face vocab.txt / tokenizer dir loads too
  (bert-base-uncased keeps its own ids 0/100/101/102/103: always go through special_token_ids).
  Training is deterministic: the same text gives the same vocabulary, ids included (see
  train_tokenizer; two trainings by `tokenizers` alone on the same 20 MB of Wikipedia gave 5,711
  of 30,522 ids differently, and 10 tokens were in only one of the two vocabularies).
- Corpus: a `datasets` hub name ("wikitext:wikitext-103-raw-v1" = load_dataset("wikitext",
  "wikitext-103-raw-v1")) or a local file / directory / glob of .txt .raw .jsonl .parquet,
  optionally .xz/.gz compressed (datasets 5 decompresses them on the fly). Documents are
  separated by one [SEP]. A document starts at each file, each jsonl/parquet row, each
  WikiExtractor `<doc ...>` line (the <doc>/</doc> lines themselves are dropped) and each
  WikiText top-level heading ` = Title = `. Blank lines are dropped; the lines of a document
  are concatenated (RoBERTa-style full-sentence packing). A file that is not UTF-8 text, a broken
  .jsonl or a fake .gz is one ValueError naming the file.
- SAMPLE_CORPUS (the default) ships in assets/: the WikiText-2 raw test split, 1.3 MB of real
  Wikipedia text (0.37 MB as .xz), enough for smoke runs and tests without a network.
  HUB_CORPUS is the English Wikipedia default of the small/base presets.
- The stream is tokenized once into cache_dir/tokens-<key>.<dtype>.bin (np.memmap), keyed by
  the data files (path, size, mtime), the tokenizer and FORMAT_VERSION. A sidecar .json written
  after the .bin holds its size and checksum: a truncated, corrupted or half-written cache is
  rebuilt, never trained on. Without a tokenizer path, one is trained on the corpus and cached in
  cache_dir/tokenizer-<key>/ (rebuilt too if its files are unreadable).
  On 2 cores, enwiki AA.txt.xz (100 MB, 21.6M tokens): 5 s load + 23 s tokenizer training +
  35 s tokenization. Tokenizers' parallel encode_batch_fast was as fast as
  datasets.map(num_proc=2) (34 s vs 37 s) without forking or a second arrow cache.
- Validation = the tail of the stream: val_fraction of the tokens, but at least VAL_MIN_TOKENS
  (32 blocks of 512) unless that exceeds 10% of the corpus, moved back to a document start.
- BlockLoader: rows [CLS] + seq_len-2 stream tokens + [SEP] from non-overlapping windows, one
  seeded permutation per epoch; its state counts sequences, so a run resumes at the same block
  with any batch size or number of processes.
- GLUE (for eval.py): TASKS, each task's TSV columns, labels and hub names; read_tsv, a strict
  reader of the original TSVs; load_task, from --glue_dir or the hub's nyu-mll/glue.
"""
import glob
import hashlib
import json
import logging
import lzma
import math
import os
import re
import shutil
import string
import sys
import time
import unicodedata
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tqdm import tqdm

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SAMPLE_CORPUS = str(Path(__file__).resolve().parent / "assets" / "wikitext2_test.raw.xz")
# The papers pretrain on English Wikipedia + BookCorpus; BookCorpus is no longer openly
# distributed, so the hub default is English Wikipedia alone ("name:config" for load_dataset).
HUB_CORPUS = "wikimedia/wikipedia:20231101.en"
DEFAULT_DATA = SAMPLE_CORPUS  # smoke runs and tests need no network
FORMAT_VERSION = 1  # bump when the stream layout changes: old caches are then ignored
VAL_MIN_TOKENS = 16384
BUILDERS = {".txt": "text", ".raw": "text", ".jsonl": "json", ".parquet": "parquet"}  # no .json: dirs hold configs
COMPRESSIONS = (".xz", ".gz", ".bz2", ".zst")
WIKITEXT_HEADING = re.compile(r"^ = [^=].* = $")  # top-level only: " == Section == " stays in the doc
BATCH_ROWS = 2000  # rows per encode_batch call: large enough to keep every core busy
LIMIT_ALPHABET = 1000  # as HF's BertWordPieceTokenizer: rarer characters map to [UNK]
CHECKSUM_CHUNKS = 1024  # a token cache over CHECKSUM_CHUNKS x 64 KiB is checksummed on that many samples


def _first_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _write_atomic(path, text):
    """Write text to path via a temporary file and os.replace: a kill never leaves a partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@contextmanager
def _making(*paths):
    """Hold .NAME.lock (an OS lock, which the OS releases however its holder dies) while the cache
    files `paths` are checked and made: a second process preparing the same corpus waits, then finds
    them made. Under the lock no one else is writing them, so what killed writers left (PATH.tmpPID:
    a full-size token file, a tokenizer directory) is removed."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; leftovers stay, never read
        yield
        return
    try:
        lock = open(paths[0].parent / f".{paths[0].name}.lock", "a")
    except OSError:  # a read-only cache: reading what is made needs no lock (making it fails on its own)
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"waiting for another process preparing {paths[0]}", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        stale = re.compile("|".join(re.escape(p.name) + r"\.tmp\d+" for p in paths))
        for entry in paths[0].parent.iterdir():
            if stale.fullmatch(entry.name):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        yield

# ----------------------------------------------------------------------------- tokenizer

def _bert_pipeline(tok, lowercase=True, strip_accents=None, chinese_chars=True):
    # strip_accents None follows lowercase, as in HF BertTokenizer
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=chinese_chars,
                                                strip_accents=lowercase if strip_accents is None else strip_accents,
                                                lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")

def _add_template(tok):
    # tok.encode(text) gives [CLS] text [SEP] like HF; the stream encoder passes add_special_tokens=False
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])

def _alphabet(texts, normalizer, limit):
    """The `limit` most frequent characters after normalization (ties by code point), and those of
    them that can continue a word (not punctuation, not CJK, which the pre-tokenizer isolates)."""
    counts, buffer = np.zeros(0x110000, dtype=np.int64), []
    def count(strings):  # numpy on code points: 0.4 s for 20 MB of Wikipedia, 6.5 s via normalize_str
        codes = np.frombuffer("".join(strings).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        found = np.bincount(codes)
        counts[:len(found)] += found
    for item in texts:
        buffer.extend([item] if isinstance(item, str) else [t for t in item if t])
        if len(buffer) >= 4096:
            count(buffer)
            buffer = []
    count(buffer)
    # normalizing each distinct raw character = normalizing the text: BertNormalizer is per character
    normalized = {}
    for code in np.flatnonzero(counts):
        for c in normalizer.normalize_str(chr(code)):
            if not c.isspace():
                normalized[c] = normalized.get(c, 0) + int(counts[code])
    kept = sorted(sorted(normalized, key=lambda c: (-normalized[c], c))[:limit])
    continuing = [c for c in kept if normalizer.normalize_str(c) == c and c not in string.punctuation
                  and not unicodedata.category(c).startswith("P")]
    return kept, continuing

def train_tokenizer(texts, vocab_size=30522, save_dir=None):
    """Train an uncased BERT WordPiece tokenizer, deterministically.

    texts: a list of strings, or a function returning a fresh iterator over strings or lists of
    strings; it is read twice (the alphabet, then the training).
    """
    texts = texts if callable(texts) else list(texts)  # a generator could be read only once
    read = texts if callable(texts) else lambda: iter(texts)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    _bert_pipeline(tok)
    # `tokenizers` trains non-deterministically: it gives the "##x" tokens ids in the iteration order
    # of a randomly seeded Rust HashMap, merges of equal count are then ordered by those ids, and the
    # alphabet limit drops characters of equal count in hash order. Fixing the alphabet ourselves
    # (initial_alphabet with limit_alphabet = its size) and the "##x" ids (passed as leading special
    # tokens, demoted to ordinary vocabulary below) makes every id reproducible.
    alphabet, continuing = _alphabet(read(), tok.normalizer, LIMIT_ALPHABET)
    if not alphabet:
        raise ValueError("no text")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, continuing_subword_prefix="##",
                                        special_tokens=SPECIAL_TOKENS + ["##" + c for c in continuing],
                                        initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                        show_progress=sys.stderr.isatty())  # in a log file: blank lines
    tok.train_from_iterator(read(), trainer)
    tok = Tokenizer(models.WordPiece(tok.get_vocab(), unk_token="[UNK]"))  # "##x" as plain tokens again
    _bert_pipeline(tok)
    tok.add_special_tokens(SPECIAL_TOKENS)
    _add_template(tok)
    if save_dir is not None:
        save_tokenizer(tok, save_dir)
    return tok

def load_tokenizer(path):
    """Load tokenizer.json, a WordPiece vocab.txt, or a directory holding either.

    A name that is no local path (bert-base-uncased, the papers' vocabulary) is fetched from the hub.
    An empty, truncated or otherwise unreadable file is one ValueError naming it."""
    if not Path(path).exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(path)):
        return _hub_tokenizer(str(path))
    path, options = Path(path), {}
    if path.is_dir():
        config = path / "tokenizer_config.json"
        if config.exists():  # HF BertTokenizer's options for a bare vocab.txt
            try:
                options = json.loads(config.read_text(encoding="utf-8"))
                options = dict(lowercase=options.get("do_lower_case", True), strip_accents=options.get("strip_accents"),
                               chinese_chars=options.get("tokenize_chinese_chars", True))
            except (ValueError, AttributeError) as e:
                raise ValueError(f"cannot read tokenizer config {config}: {_first_line(e)}") from None
        path = path / "tokenizer.json" if (path / "tokenizer.json").exists() else path / "vocab.txt"
    if not path.is_file():
        raise ValueError(f"tokenizer not found: {path}")
    if path.suffix == ".json":
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust loader's error: "EOF while parsing a value at line 1..."
            raise ValueError(f"cannot read tokenizer {path}: {_first_line(e)}") from None
    else:
        try:
            words = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"cannot read vocabulary {path}: not UTF-8 text ({e.reason})") from None
        if "[UNK]" not in words:  # also catches an empty or truncated file
            raise ValueError(f"vocabulary {path} has no [UNK] line: empty, truncated or not a WordPiece vocab.txt")
        tok = Tokenizer(models.WordPiece.from_file(str(path), unk_token="[UNK]"))
        _bert_pipeline(tok, **options)
        tok.add_special_tokens(SPECIAL_TOKENS)  # tokens already in the vocab keep their ids
        _add_template(tok)
    tok.no_truncation()  # some hub tokenizer.json files enable it; the stream encoder must not cut
    tok.no_padding()
    return tok

def _hub_tokenizer(name):
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # offline, its retry warnings would bury the error line
    try:
        tok = Tokenizer.from_pretrained(name)
    except Exception as e:
        raise ValueError(f"tokenizer not found: {name} is no local file or directory, and the hub gives no "
                         f"tokenizer by that name ({_first_line(e)})") from None
    finally:
        hub_log.setLevel(level)
    tok.no_truncation()
    tok.no_padding()
    return tok

def save_tokenizer(tok, dir):
    """Write tokenizer.json + vocab.txt + HF configs (each atomically), so transformers.AutoTokenizer loads dir."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    vocab = tok.get_vocab()
    words = sorted(vocab, key=vocab.get)
    assert [vocab[w] for w in words] == list(range(len(words))), "vocab ids must be 0..V-1"
    _write_atomic(dir / "tokenizer.json", tok.to_str(pretty=True))
    _write_atomic(dir / "vocab.txt", "\n".join(words) + "\n")
    lowercase = (json.loads(tok.to_str()).get("normalizer") or {}).get("lowercase", True)
    specials = dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                    cls_token="[CLS]", mask_token="[MASK]")
    config = dict(tokenizer_class="BertTokenizerFast", do_lower_case=lowercase,
                  model_max_length=512, **specials)
    _write_atomic(dir / "tokenizer_config.json", json.dumps(config, indent=2))
    _write_atomic(dir / "special_tokens_map.json", json.dumps(specials, indent=2))

def special_token_ids(tok):
    """dict(pad=, unk=, cls=, sep=, mask=) ids: 0..4 for ours, 0/100/101/102/103 for bert-base."""
    ids = {name: tok.token_to_id(f"[{name.upper()}]") for name in ("pad", "unk", "cls", "sep", "mask")}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens: {missing}")
    return ids

# ----------------------------------------------------------------------------- corpus

def _builder(path):
    """datasets builder for a file name ("text"/"json"/"parquet"), None if unknown."""
    name = path.name.lower()
    for ext in COMPRESSIONS:
        name = name.removesuffix(ext)
    return BUILDERS.get(Path(name).suffix)

def _resolve_files(data):
    """Local files for `data` in sorted order, or None when `data` is a hub dataset name."""
    path = Path(data).expanduser()
    if not path.exists() and any(c in data for c in "*?["):  # a path that exists is a path, "[" or not
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"no files match {data}")
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _builder(p))
        if not files:
            raise ValueError(f"no .txt/.raw/.jsonl/.parquet files (optionally .xz/.gz) in {data}")
    elif path.is_file():
        files = [path]
    elif data.startswith(("/", ".", "~")) or _builder(path):
        raise ValueError(f"data path not found: {data}")
    else:
        return None  # "name" or "name:config" on the hub
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"empty data file: {f}")
    return files

def read_text(path):
    """A UTF-8 text file (.xz too; a BOM dropped) as one str; bytes that are not UTF-8 are one
    ValueError naming the file and line (eval.py's GLUE TSVs, analysis.py's --text)."""
    try:
        with (lzma.open if str(path).endswith(".xz") else open)(path, "rb") as f:
            raw = f.read()
    except (EOFError, lzma.LZMAError) as e:  # truncated, or not xz at all
        raise ValueError(f"{path}: not a readable .xz file ({_first_line(e)})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start}): a binary file, or convert it with iconv -t UTF-8") from None

def _read_problem(e):
    """The innermost cause of a datasets error, in words (DatasetGenerationError says only "An error occurred")."""
    while e.__cause__ is not None:  # explicit causes only: a context may be a fallback parser's error
        e = e.__cause__
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text ({e.reason} at byte {e.start}): a binary file, or convert it with iconv -t UTF-8"
    return _first_line(e)

def _plain_path(f, hf_cache):
    """f for load_dataset, whose data_files are patterns (a[1] is not a1) and, compressed, URLs (where [1] is
    an IPv6 host): a name with brackets is read through a symlink named by its path's hash."""
    if not re.search(r"[][]", Path(f).name):
        return glob.escape(f)
    link = Path(hf_cache) / "links" / (hashlib.sha1(os.path.abspath(f).encode()).hexdigest()[:16]
                                       + "".join(Path(f).suffixes[-2:]))
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.abspath(f), f"{link}.{os.getpid()}.tmp")
        os.replace(f"{link}.{os.getpid()}.tmp", link)  # atomic: a concurrent run makes the same link
    return glob.escape(str(link))


def _load_local(datasets, builder, split_files, hf_cache):
    """load_dataset for local files; a file it cannot read is one ValueError naming that file."""
    escaped = {name: _plain_path(f, hf_cache) for name, f in split_files.items()}
    try:
        return datasets.load_dataset(builder, data_files=escaped, cache_dir=hf_cache)
    except Exception as e:
        culprit, problem = ", ".join(split_files.values()), _read_problem(e)
        if len(split_files) > 1:  # find the file to blame, one at a time (error path only)
            for name, f in split_files.items():
                try:
                    datasets.load_dataset(builder, data_files={name: escaped[name]}, cache_dir=hf_cache)
                except Exception as e_file:
                    culprit, problem = f, _read_problem(e_file)
                    break
        raise ValueError(f"cannot read {culprit} as {builder}: {problem}") from None

def _load_corpus(data, files, cache_dir):
    """[(kind, Dataset with a "text" column, name)] in corpus order; kind "lines" or "docs" (row = document)."""
    import datasets  # imported here: it costs ~2 s and is only needed on a cache miss
    datasets.disable_progress_bars()  # our own bar below is enough
    hf_cache = str(Path(cache_dir) / "hf")
    if files is None:
        name, _, config = data.partition(":")
        hub_log = logging.getLogger("huggingface_hub")
        level = hub_log.level
        hub_log.setLevel(logging.ERROR)  # offline, its retry warnings (one per attempt) would bury the error line
        try:
            ds = datasets.load_dataset(name, config or None, split="train", cache_dir=hf_cache)
        except Exception as e:  # offline, or no such dataset: one line, with the way out
            raise ValueError(f"--data {data!r} is neither a local path nor a loadable hub dataset "
                             f"({_first_line(e)}); without internet pass --data FILE|DIR|GLOB, "
                             f"e.g. the bundled sample --data {SAMPLE_CORPUS}") from None
        finally:
            hub_log.setLevel(level)
        # WikiText rows are lines (articles start at headings); other hub corpora have a doc per row
        return [("lines" if name.endswith("wikitext") else "docs", ds.select_columns(["text"]), data)]
    # one split per file, one load_dataset call per builder: file boundaries stay visible
    builders = [_builder(f) or "text" for f in files]  # an explicitly named odd suffix reads as text
    splits = {}
    for i, (f, builder) in enumerate(zip(files, builders)):
        splits.setdefault(builder, {})[f"file{i}"] = str(f)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # our ValueError says it in one line
    try:
        loaded = {b: _load_local(datasets, b, s, hf_cache) for b, s in splits.items()}
    finally:
        datasets.logging.set_verbosity(verbosity)
    parts = []
    for i, (f, builder) in enumerate(zip(files, builders)):
        ds = loaded[builder][f"file{i}"]
        if "text" not in ds.column_names:
            raise ValueError(f"no 'text' field in {f}")
        if getattr(ds.features["text"], "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"the 'text' field of {f} holds {ds.features['text']}, not strings")
        parts.append(("lines" if builder == "text" else "docs", ds.select_columns(["text"]), str(f)))
    return parts

def _line_pieces(rows):
    for line in rows:
        line = line.rstrip("\r\n")
        stripped = line.strip()
        if not stripped or stripped == "</doc>":
            continue
        if stripped.startswith("<doc") and stripped.endswith(">"):  # WikiExtractor article start
            yield None
            continue
        if WIKITEXT_HEADING.match(line):
            yield None
        yield line

def _doc_pieces(rows):
    for text in rows:
        if text and text.strip():
            yield None
            yield text

def _pieces(parts, progress=None):
    """Yield batches of text pieces in corpus order; None = document boundary (never first or twice)."""
    started = False
    for kind, ds, name in parts:
        boundary = True  # every file starts a document
        for batch in ds.iter(batch_size=BATCH_ROWS):
            if any(text and "\x00" in text for text in batch["text"]):  # valid UTF-8, but not text
                raise ValueError(f"cannot read {name}: NUL bytes in the text (a binary file?)")
            out = []
            for piece in (_line_pieces if kind == "lines" else _doc_pieces)(batch["text"]):
                if piece is None:
                    boundary = True
                    continue
                if boundary and started:
                    out.append(None)
                boundary, started = False, True
                out.append(piece)
            yield out
            if progress is not None:
                progress.update(len(batch["text"]))

def _tokenize(tok, parts, path, dtype, data):
    """Encode the corpus into `path` (atomically); returns the number of tokens."""
    sep = special_token_ids(tok)["sep"]
    tmp, n = f"{path}.tmp{os.getpid()}", 0
    # disable=None: a bar on a terminal, nothing in logs and captured output
    bar = tqdm(total=sum(len(ds) for _, ds, _ in parts), unit="rows", desc="tokenizing", disable=None)
    try:
        with open(tmp, "wb") as f:
            for pieces in _pieces(parts, bar):
                # encode_batch_fast runs on every core and skips the offsets we don't need
                encodings = iter(tok.encode_batch_fast([p for p in pieces if p is not None],
                                                       add_special_tokens=False))
                ids = chain.from_iterable((sep,) if p is None else next(encodings).ids for p in pieces)
                arr = np.fromiter(ids, dtype=dtype)
                f.write(arr.tobytes())
                n += len(arr)
    except BaseException:  # a bad row or Ctrl-C leaves no partial file (a SIGKILL's: the next _making removes it)
        os.remove(tmp)
        raise
    bar.close()
    if n == 0:
        os.remove(tmp)
        raise ValueError(f"no text in {data}")
    os.replace(tmp, path)
    # the sidecar comes last: a run killed before this line leaves a .bin that _cache_ok rejects
    _write_atomic(_sidecar(path), json.dumps({"bytes": path.stat().st_size, "checksum": _checksum(path)}))
    return n

def _hash(obj):
    return hashlib.sha1(json.dumps(obj).encode()).hexdigest()[:16]

def _sidecar(path):
    return path.with_suffix(".json")  # tokens-KEY.uint16.bin -> tokens-KEY.uint16.json

def _checksum(path, chunk=1 << 16):
    """sha1 of the file, or of CHECKSUM_CHUNKS evenly spaced 64 KiB chunks of a larger one (64 MiB
    read, ~0.1 s, whatever the size; the size check still catches any truncation)."""
    size, h = os.path.getsize(path), hashlib.sha1()
    with open(path, "rb") as f:
        if size <= chunk * CHECKSUM_CHUNKS:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            for i in range(CHECKSUM_CHUNKS):
                f.seek(i * (size - chunk) // (CHECKSUM_CHUNKS - 1))
                h.update(f.read(chunk))
    return h.hexdigest()

def _cache_ok(path):
    """True when the token cache exists and matches the size and checksum in its sidecar."""
    if not path.exists():
        return False
    try:
        meta = json.loads(_sidecar(path).read_text())
        if path.stat().st_size == meta["bytes"] and _checksum(path) == meta["checksum"]:
            return True
        problem = "size or checksum differs from its sidecar"
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"no valid sidecar ({type(e).__name__})"
    print(f"token cache {path} is incomplete or corrupt ({problem}): rebuilding it")
    return False

def _cached_tokenizer(dir):
    """The tokenizer cached in dir, or None when it is missing or one of its files is unreadable."""
    if not dir.exists():
        return None
    try:
        tok = load_tokenizer(dir / "tokenizer.json")
        words = (dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
        vocab = tok.get_vocab()
        if words != sorted(vocab, key=vocab.get):
            raise ValueError("vocab.txt disagrees with tokenizer.json")
        load_tokenizer(dir)  # the configs, as transformers and eval.py will read them
        return tok
    except (ValueError, OSError) as e:
        print(f"cached tokenizer {dir} is unreadable ({str(e)[:200]}): training it again")
        shutil.rmtree(dir, ignore_errors=True)
        return None

def split_train_val(tokens, val_fraction, sep_id):
    """Hold out the tail of the stream (deterministic), starting at a document start if one is near."""
    n = len(tokens)
    if val_fraction <= 0:
        return tokens, tokens[n:]
    n_val = max(math.ceil(val_fraction * n), min(VAL_MIN_TOKENS, n // 10))
    cut = n - n_val
    # move the cut back to just after a [SEP] (at most n_val tokens) so no document is split
    seps = np.flatnonzero(np.asarray(tokens[max(cut - n_val, 0):cut]) == sep_id)
    if len(seps):
        cut = max(cut - n_val, 0) + int(seps[-1]) + 1
    return tokens[:cut], tokens[cut:]

def prepare_data(data=DEFAULT_DATA, cache_dir="cache", tokenizer=None, vocab_size=30522,
                 val_fraction=0.005):
    """Return (tok, train_tokens, val_tokens): 1-D np.memmap token streams, cached in cache_dir."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    files = _resolve_files(data)
    stats = [data] if files is None else [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                                          for f in files]
    data_key = _hash([stats, FORMAT_VERSION])
    parts = None  # the corpus is only loaded on a cache miss
    if tokenizer is None:
        tokenizer = cache / f"tokenizer-{data_key}-{vocab_size}"
        with _making(tokenizer):
            if _cached_tokenizer(tokenizer) is None:
                parts = _load_corpus(data, files, cache)
                t0, tmp = time.time(), f"{tokenizer}.tmp{os.getpid()}"
                texts = lambda: ([p for p in pieces if p is not None] for pieces in _pieces(parts))
                try:
                    trained = train_tokenizer(texts, vocab_size, save_dir=tmp)
                except ValueError:  # only whitespace: nothing to tokenize either
                    raise ValueError(f"no text in {data}") from None
                print(f"trained a {trained.get_vocab_size()}-token tokenizer in {time.time() - t0:.1f}s")
                os.replace(tmp, tokenizer)
    tok = load_tokenizer(tokenizer)
    dtype = np.uint16 if tok.get_vocab_size() < 2**16 else np.uint32
    key = _hash([data_key, hashlib.sha1(tok.to_str().encode()).hexdigest()])
    path = cache / f"tokens-{key}.{np.dtype(dtype).name}.bin"
    with _making(path, _sidecar(path)):
        if not _cache_ok(path):
            parts = parts or _load_corpus(data, files, cache)
            t0 = time.time()
            n = _tokenize(tok, parts, path, dtype, data)
            print(f"tokenized {data} into {n:,} tokens in {time.time() - t0:.1f}s -> {path}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    train, val = split_train_val(tokens, val_fraction, special_token_ids(tok)["sep"])
    return tok, train, val

# ----------------------------------------------------------------------------- batches

class BlockLoader:
    """Packed rows [CLS] + seq_len-2 consecutive stream tokens + [SEP], in a seeded order.

    All processes read one global stream of blocks: epoch e is the permutation
    default_rng([seed, e]).permutation(num_blocks), the epochs one after another (a batch may
    straddle two; no block is ever skipped). The state is N, the sequences consumed so far by all
    ranks together: next_batch() on rank r takes stream positions [N + r*B, N + (r+1)*B), B =
    batch_size, then advances N by B*world_size. So the ranks' batches concatenated equal one
    process's batch of B*world_size, and a run resumed with any batch_size or world_size continues
    at exactly sequence N. Every rank holds the same N: save one state, not one per rank.
    """

    def __init__(self, tokens, seq_len, batch_size, cls_id, sep_id, rank=0, world_size=1,
                 seed=0, device="cpu"):
        if seq_len < 3:
            raise ValueError(f"seq_len must be >= 3 (room for [CLS] and [SEP]), got {seq_len}")
        self.tokens, self.seq_len, self.block_len = tokens, seq_len, seq_len - 2
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.cls_id, self.sep_id, self.device = cls_id, sep_id, torch.device(device)
        self.num_blocks = len(tokens) // self.block_len  # sequences per epoch
        global_batch = batch_size * world_size
        if self.num_blocks < global_batch:
            raise ValueError(f"token stream has {len(tokens):,} tokens but one batch of {global_batch}"
                             f" x {seq_len} needs {global_batch * self.block_len:,}")
        self.sequences = 0
        self._epoch, self._order = None, None  # the permutation of the epoch read last

    def state_dict(self):
        return {"sequences": self.sequences}

    def load_state_dict(self, state):
        if "sequences" not in state:
            raise ValueError(f"data loader state {state!r} has no 'sequences' count")
        sequences = int(state["sequences"])
        if sequences < 0:
            raise ValueError(f"data loader state {state!r}: negative position")
        self.sequences = sequences

    def _blocks(self, start, count):
        """Block indices at stream positions [start, start + count)."""
        positions = np.arange(start, start + count)
        epochs, offsets = np.divmod(positions, self.num_blocks)
        blocks = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # at most two: a batch is never longer than an epoch
            if epoch != self._epoch:  # the order depends on (seed, epoch) only: any position is exact
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_blocks)
            blocks[epochs == epoch] = self._order[offsets[epochs == epoch]]
        return blocks

    def next_batch(self):
        blocks = self._blocks(self.sequences + self.rank * self.batch_size, self.batch_size)
        self.sequences += self.batch_size * self.world_size
        rows = np.empty((self.batch_size, self.seq_len), dtype=np.int64)
        rows[:, 0], rows[:, -1] = self.cls_id, self.sep_id
        for i, block in enumerate(blocks):
            rows[i, 1:-1] = self.tokens[block * self.block_len:(block + 1) * self.block_len]
        batch = torch.from_numpy(rows)
        if self.device.type == "cuda":  # pinned memory lets the copy overlap with compute
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)


# ----------------------------------------------------------------------------------------------
# GLUE: the task table, a strict TSV reader and the loaders (eval.py fine-tunes and scores)


@dataclass(frozen=True)
class Task:
    name: str  # our name = the hub config name
    dir: str  # folder in the original GLUE distribution
    metric: str  # mcc | acc | f1_acc | corr
    tsv_text: tuple  # TSV column(s) holding sentence A (and B)
    tsv_label: str
    labels: dict = None  # TSV label -> id, the hub's numbering; None = regression (STS-B)
    hub_text: tuple = ()  # the hub's column names for sentence A (and B)
    dev: dict = field(default_factory=lambda: {"": ("dev", "validation")})  # suffix -> (TSV stem, hub split)
    header: tuple = None  # column names for a train/dev TSV without a header line (CoLA)
    test_index: str = "index"  # the test TSV's index column

    @property
    def num_labels(self):
        return 1 if self.labels is None else len(set(self.labels.values()))


BINARY = {"0": 0, "1": 1}
NLI2 = {"entailment": 0, "not_entailment": 1}
TASKS = {t.name: t for t in [
    Task("cola", "CoLA", "mcc", ("sentence",), "label", BINARY, ("sentence",),
         header=("source", "label", "orig_label", "sentence")),
    Task("sst2", "SST-2", "acc", ("sentence",), "label", BINARY, ("sentence",)),
    Task("mrpc", "MRPC", "f1_acc", ("#1 String", "#2 String"), "Quality", BINARY, ("sentence1", "sentence2")),
    Task("stsb", "STS-B", "corr", ("sentence1", "sentence2"), "score", None, ("sentence1", "sentence2")),
    Task("qqp", "QQP", "f1_acc", ("question1", "question2"), "is_duplicate", BINARY, ("question1", "question2"),
         test_index="id"),
    Task("mnli", "MNLI", "acc", ("sentence1", "sentence2"), "gold_label",
         {"entailment": 0, "neutral": 1, "contradiction": 2}, ("premise", "hypothesis"),
         dev={"m": ("dev_matched", "validation_matched"), "mm": ("dev_mismatched", "validation_mismatched")}),
    Task("qnli", "QNLI", "acc", ("question", "sentence"), "label", NLI2, ("question", "sentence")),
    Task("rte", "RTE", "acc", ("sentence1", "sentence2"), "label", NLI2, ("sentence1", "sentence2")),
    Task("wnli", "WNLI", "acc", ("sentence1", "sentence2"), "label", BINARY, ("sentence1", "sentence2")),
]}

# GLUE leaderboard files (--predict): file stem -> (task whose model predicts it, test TSV under
# --glue_dir, hub config, hub split). The diagnostic set AX is predicted by the MNLI model.
SUBMISSIONS = {
    "CoLA": ("cola", "CoLA/test.tsv", "cola", "test"),
    "SST-2": ("sst2", "SST-2/test.tsv", "sst2", "test"),
    "MRPC": ("mrpc", "MRPC/test.tsv", "mrpc", "test"),
    "STS-B": ("stsb", "STS-B/test.tsv", "stsb", "test"),
    "QQP": ("qqp", "QQP/test.tsv", "qqp", "test"),
    "MNLI-m": ("mnli", "MNLI/test_matched.tsv", "mnli", "test_matched"),
    "MNLI-mm": ("mnli", "MNLI/test_mismatched.tsv", "mnli", "test_mismatched"),
    "QNLI": ("qnli", "QNLI/test.tsv", "qnli", "test"),
    "RTE": ("rte", "RTE/test.tsv", "rte", "test"),
    "WNLI": ("wnli", "WNLI/test.tsv", "wnli", "test"),
    "AX": ("mnli", "diagnostic/diagnostic.tsv", "ax", "test"),
}


class TaskMissing(Exception):
    """A task's data is not there: it is skipped and marked missing."""


def read_tsv(path, task, test=False):
    """One GLUE TSV as a Dataset(text_a[, text_b], label); a test TSV (no labels) as
    Dataset(text_a[, text_b], index). Quoting is off: GLUE sentences hold bare quotes. utf-8-sig
    drops MRPC's BOM. Every row must have the header's column count."""
    import datasets  # imported here, as in _load_corpus: ~2 s that pretraining rarely needs
    lines = read_text(path).split("\n")
    lines = [line.rstrip("\r") for line in (lines[:-1] if lines[-1] == "" else lines)]  # LF or CRLF, last one optional
    if task.header and not test:  # CoLA's train/dev have no header line, its test file has one
        header, first = task.header, 0
    else:
        header, first = (lines[0].split("\t") if lines else []), 1
    col = {name: i for i, name in enumerate(header)}
    target = task.test_index if test else task.tsv_label
    lacking = [c for c in task.tsv_text + (target,) if c not in col]
    if lacking:
        raise ValueError(f"{path}: no column {lacking[0]!r} in the header {header}")
    rows, seen = {"text_a": [], "text_b": [], "index" if test else "label": []}, set()
    for lineno, line in enumerate(lines[first:], first + 1):
        cells = line.split("\t")
        if len(cells) != len(header):
            raise ValueError(f"{path}:{lineno}: expected {len(header)} tab-separated columns, got {len(cells)}")
        raw = cells[col[target]]
        if test:
            if not raw.strip() or raw in seen:  # the leaderboard matches predictions to rows by index
                raise ValueError(f"{path}:{lineno}: {'an empty' if not raw.strip() else 'a repeated'} index {raw!r}")
            seen.add(raw)
            rows["index"].append(raw)
        else:
            try:
                label = float(raw) if task.labels is None else task.labels[raw]
                if not 0 <= label <= 5:  # STS-B's similarity scale (NaN fails too); class ids pass
                    raise ValueError
                rows["label"].append(label)
            except (KeyError, ValueError):
                expected = "a number in [0, 5]" if task.labels is None else "/".join(task.labels)
                raise ValueError(f"{path}:{lineno}: bad label {raw!r} (expected {expected})") from None
        for key, name in zip(("text_a", "text_b"), task.tsv_text):
            rows[key].append(cells[col[name]])
    if len(task.tsv_text) == 1:
        del rows["text_b"]
    return datasets.Dataset.from_dict(rows)


def load_hub(config):
    """All splits of nyu-mll/glue's `config`. Failing to reach the hub is one line with the way out."""
    import datasets
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings, one per attempt, would bury the error line
    try:
        return datasets.load_dataset("nyu-mll/glue", config)
    except Exception as e:  # offline (ConnectionError), or a broken cache: every task would fail alike
        reason = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(f"GLUE from the hub (nyu-mll/glue, {config}) is not reachable ({type(e).__name__}: "
                         f"{reason}); without internet, download the GLUE data (download_glue_data.py) and "
                         "pass --glue_dir DIR, the folder holding CoLA/, SST-2/, ...") from None
    finally:
        hub_log.setLevel(level)


def load_task(task, glue_dir=None, test=False):
    """{"train": Dataset, "dev": {suffix: Dataset}} from the GLUE TSVs in glue_dir, else from the hub.
    test=True adds "test": {submission stem: Dataset(text_a[, text_b], index), or a str saying why
    that test set is absent}."""
    tests = {stem: spec[1:] for stem, spec in SUBMISSIONS.items() if spec[0] == task.name} if test else {}
    if glue_dir:
        files = {"train": "train", **{suffix: stem for suffix, (stem, _) in task.dev.items()}}
        paths = {k: os.path.join(glue_dir, task.dir, stem + ".tsv") for k, stem in files.items()}
        absent = [os.path.relpath(p, glue_dir) for p in paths.values() if not os.path.isfile(p)]
        if absent:
            raise TaskMissing(f"no {', '.join(absent)} in {glue_dir}")
        splits = {k: read_tsv(p, task) for k, p in paths.items()}
        test_sets = {}
        for stem, (rel, _, _) in tests.items():
            path = os.path.join(glue_dir, rel)
            if not os.path.isfile(path):
                test_sets[stem] = f"no {rel} in {glue_dir}"
                continue
            ds = read_tsv(path, task, test=True)
            test_sets[stem] = ds if len(ds) else f"{rel} in {glue_dir} has no rows"
    else:  # needs internet (or the hub cache) and is never exercised by the tests
        hub = {task.name: load_hub(task.name)}
        names = dict(zip(task.hub_text, ("text_a", "text_b")))
        splits = {"train": hub[task.name]["train"],
                  **{suffix: hub[task.name][split] for suffix, (_, split) in task.dev.items()}}
        splits = {k: ds.select_columns([*names, "label"]).rename_columns(names) for k, ds in splits.items()}
        test_sets = {}
        for stem, (_, config, split) in tests.items():
            if config not in hub:
                hub[config] = load_hub(config)
            ds = hub[config][split]
            test_sets[stem] = ds.select_columns([*names, "idx"]).rename_columns({**names, "idx": "index"})
    empty = [k for k, ds in splits.items() if len(ds) == 0]
    if empty:
        stem = "train" if empty[0] == "train" else task.dev[empty[0]][0]  # "" -> dev, "m" -> dev_matched
        raise TaskMissing(f"the {stem} split has no rows")
    return {"train": splits.pop("train"), "dev": splits, **({"test": test_sets} if test else {})}
