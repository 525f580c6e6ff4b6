"""
The files behind data.py besides the corpus: the tokenizer's files (and the alphabet that makes its training
deterministic) and the token cache. The algorithm does not
need this module: data.load_tokenizer and save_tokenizer are short calls into here, and data.prepare_data
(through CorpusCache) would give the same stream by tokenizing the corpus on every run; the cache only makes
the second run start in seconds and keeps a killed run from poisoning the next.

Tokenizer files: tokenizer.json, a WordPiece vocab.txt (with a Hugging Face tokenizer_config.json beside
it), or a hub name (bert-base-uncased); save_tokenizer's directories load in transformers.AutoTokenizer.

Files in cache_dir (their names are part of the format: existing caches stay valid while they hold):
- tokens-<key>.<dtype>.bin, the stream, and its sidecar tokens-<key>.<dtype>.json {"bytes", "checksum"};
  key = the data files (path, size, mtime, first and last 4 KiB; "by content" for one read as text or JSON Lines
  by its first bytes, corpus.read_by_content: their reading changed) or the hub name, FORMAT_VERSION and the
  tokenizer's JSON;
- tokenizer-<corpus key>-<vocab_size>/, the tokenizer trained on the corpus when no --tokenizer is given (a
  FORMAT_VERSION bump keeps it: it changes the stream, not the training);
- .NAME.lock, the lock for NAME; NAME.tmpPID, what a writer writes before the rename.
On 2 cores, enwiki AA.txt.xz (100 MB, 21.3M tokens): 5 s load + 23 s tokenizer training + 35 s
tokenization. Tokenizers' parallel encode_batch_fast was as fast as datasets.map(num_proc=2) (34 s vs 37 s)
without forking or a second arrow cache.

What it guarantees:
- an empty, truncated or otherwise unreadable tokenizer file or config, a vocab.txt without one of BERT's
  five special tokens or listing a token twice, a tokenizer.json whose ids are not 0..V-1, or a name the hub
  does not know, is one ValueError naming it;
- a token file is reused only when it has the size and checksum its sidecar records, and the sidecar is
  written last: a truncated or half-written cache is rebuilt (and says so), never trained on, and so is a
  corrupted one where the checksum reads (all of a file up to 64 MiB, sampled chunks of a larger one);
  a cached tokenizer with an unreadable or inconsistent file is trained again; a cached file this user may not
  read (another user's, in a shared cache) is one ValueError, and stays;
- every file appears whole (a temporary file, on disk, then os.replace): a kill or a power cut never
  leaves a partial file under its real name, and what killed writers left is removed by the next run that
  takes the lock;
- concurrent runs on one cache do not corrupt it: the second waits on an OS lock (released however its
  holder dies), then finds the files made; a read-only cache is read without a lock (eval.py --analysis
  reading a run's held-out split; train.py refuses a --cache_dir it cannot write, before any work);
- editing, touching or replacing a data file, or changing the tokenizer, gives a new key (a file's path, size,
  mtime and first and last 4 KiB): a cache does not serve stale tokens unless a file is replaced by one of
  the same size, mtime and ends; a hub dataset's key is its name (an update on the hub is not seen).

Tests that hold it to this: test_data.py (test_save_is_atomic_and_corrupt_files_are_one_error,
test_a_hub_name_fetches_that_tokenizer, test_hf_style_vocab, test_transformers_autotokenizer,
test_a_vocab_txt_without_a_special_token_or_with_a_repeated_line_is_refused,
test_a_tokenizer_json_whose_ids_are_not_0_to_v_minus_1_is_refused) and
test_corpus.py (test_cache_reused_and_invalidated, test_corrupt_token_cache_is_rebuilt,
test_what_killed_writers_left_in_the_cache_is_removed, test_a_run_waits_while_another_makes_the_cache,
test_checksum_samples_large_files, test_corrupt_cached_tokenizer_is_retrained).
"""
import errno
import hashlib
import inspect
import json
import os
import re
import shutil
import string
import sys
import time
import unicodedata
from contextlib import contextmanager
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from tqdm import tqdm

import atomic
import corpus
from corpus import first_line, quiet_hub

FORMAT_VERSION = 2  # bump when the stream layout changes: old token files are then ignored (2: "[SEP]" in text is text)
CORPUS_KEY_VERSION = 1  # in the corpus key, so in the trained tokenizer's name: bump only when its training changes
ALPHABET_CHARS = 1 << 20  # characters counted at a time by alphabet(): ~14 MB
CHECKSUM_CHUNKS = 1024  # a token cache over CHECKSUM_CHUNKS x 64 KiB is checksummed on that many samples


# ----------------------------------------------------------------------------- tokenizer files

def alphabet(texts, normalizer, limit):
    """data.train_tokenizer's alphabet, fixed here because `tokenizers` picks it in hash order: the `limit`
    most frequent characters after normalization (ties by code point; None: all), and those of them that can
    continue a word (not punctuation, not CJK, which the pre-tokenizer isolates). It says (one note each) when
    the normalizer strips the marks of more than 0.5% of the characters (accents, but also й, で, Devanagari's
    vowel signs) or the limit sends more than 0.1% of them to [UNK] (Chinese, Japanese, emoji)."""
    counts, buffer, chars = np.zeros(0x110000, dtype=np.int64), [], 0
    def count(strings):  # numpy on code points: 0.4 s for 20 MB of Wikipedia, 6.5 s via normalize_str
        codes = np.frombuffer("".join(strings).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        found = np.bincount(codes)
        counts[:len(found)] += found
    for item in texts:
        item = [item] if isinstance(item, str) else [t for t in item if t]
        buffer.extend(item)
        chars += sum(map(len, item))
        # counted every 4,096 texts or ALPHABET_CHARS characters, ~14 bytes each while counted (the texts, their
        # join, UTF-32, bincount's int64): 4,096 of corpus._cut's 256K-character pieces (long documents, a one-line
        # file) were 1G characters, ~14 GB (400 of them measured 1.3 GB)
        if len(buffer) >= 4096 or chars >= ALPHABET_CHARS:
            count(buffer)
            buffer, chars = [], 0
    count(buffer)
    # normalizing each distinct raw character = normalizing the text: BertNormalizer is per character
    normalized, stripped = {}, {}  # stripped: raw character -> (count, normalized) where marks were removed
    for code in np.flatnonzero(counts):
        raw = chr(code)
        norm = normalizer.normalize_str(raw)
        for c in norm:
            if not c.isspace():
                normalized[c] = normalized.get(c, 0) + int(counts[code])
        if _marks(raw) > _marks(norm):
            stripped[raw] = int(counts[code]), norm
    kept = sorted(sorted(normalized, key=lambda c: (-normalized[c], c))[:limit])
    _say_what_is_lost(normalized, kept, stripped, limit)
    continuing = [c for c in kept if normalizer.normalize_str(c) == c and c not in string.punctuation
                  and not unicodedata.category(c).startswith("P")]
    return kept, continuing


def _marks(text):
    """Combining marks in text, decomposed (NFD), variation selectors (an emoji's U+FE0F) left out."""
    return sum(unicodedata.category(c).startswith("M") and not 0xFE00 <= ord(c) <= 0xFE0F
               for c in unicodedata.normalize("NFD", text))

def _say_what_is_lost(normalized, kept, stripped, limit):
    total = sum(normalized.values())
    share = sum(n for n, _ in stripped.values()) / max(total, 1)
    if share > 0.005:
        examples = sorted(stripped.items(), key=lambda item: -item[1][0])[:6]
        changes = ", ".join(f"{c} -> {n or chr(8709)}" for c, (_, n) in examples)  # chr(8709): the empty set
        print(f"note: the uncased tokenizer strips accents and other combining marks, as BERT-uncased: it changes "
              f"{share:.1%} of the corpus's characters ({changes}); train.py --cased keeps them (multilingual BERT cased)")
    kept = set(kept)  # (built once: per character, 20k distinct CJK characters at --limit_alphabet 0 took 19 s)
    unknown = [c for c in normalized if c not in kept]
    share = sum(normalized[c] for c in unknown) / max(total, 1)
    if share > 0.001:
        print(f"note: the tokenizer's alphabet keeps the {limit:,} most frequent characters: {len(unknown):,} rarer "
              f"ones, {share:.2%} of the corpus's characters, become [UNK]; train.py --limit_alphabet 0 keeps all "
              f"{len(normalized):,}")


def write_atomic(path, text):
    """atomic.write_atomic with a temporary name of this process's own: two runs may write one cache."""
    atomic.write_atomic(str(path), text, tmp=f"{path}.tmp{os.getpid()}")

def read_tokenizer(path):
    """(tokenizer, None) from tokenizer.json, a directory holding one, or a hub name; (bare WordPiece, options)
    from a vocab.txt or a directory holding one: data.load_tokenizer puts the BERT pipeline around it, with
    the options (lowercase, strip_accents, chinese_chars) of the tokenizer_config.json in its directory."""
    if not Path(path).exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(path)):
        return _hub_tokenizer(str(path)), None
    path, options = Path(path), {}
    if path.is_dir() or (path.is_file() and path.suffix != ".json"):  # a vocab.txt: its folder's config too
        config = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
        if config.exists():  # HF BertTokenizer's options for a bare vocab.txt
            if not config.is_file():  # a FIFO's read would wait for a writer forever
                raise ValueError(f"cannot read tokenizer config {config}: not a regular file")
            try:
                options = json.loads(config.read_text(encoding="utf-8"))
                options = dict(lowercase=options.get("do_lower_case", True), strip_accents=options.get("strip_accents"),
                               chinese_chars=options.get("tokenize_chinese_chars", True))
            except (ValueError, AttributeError) as e:
                raise ValueError(f"cannot read tokenizer config {config}: {first_line(e)}") from None
    if path.is_dir():
        if not (path / "tokenizer.json").exists() and not (path / "vocab.txt").exists():
            raise ValueError(f"no tokenizer.json or vocab.txt in {path}: copy the tokenizer its weights were "
                             f"trained with there")
        path = path / "tokenizer.json" if (path / "tokenizer.json").exists() else path / "vocab.txt"
    if not path.is_file():
        raise ValueError(f"tokenizer not found: {path}")
    if path.suffix == ".json":
        try:
            # read here, not by from_file: Rust names the file in UTF-8, so under a locale that is not (LANG=en_US is
            # ISO-8859-1) a non-ASCII path was "No such file or directory"
            tok = Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception as e:  # the Rust loader's error: "EOF while parsing a value at line 1..."
            raise ValueError(f"cannot read tokenizer {path}: {first_line(e)}") from None
        ids = sorted(tok.get_vocab().values())  # 0..V-1, or no vocab.txt can list them (the first save failed)
        if ids != list(range(len(ids))):
            i = next(i for i, j in enumerate(ids) if i != j)
            raise ValueError(f"tokenizer {path}: its ids are not 0..{len(ids) - 1} "
                             f"({f'no token has id {i}' if ids[i] > i else f'two tokens have id {ids[i]}'})")
        return tok, None
    try:
        words = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read vocabulary {path}: not UTF-8 text ({e.reason})") from None
    if "[UNK]" not in words:  # also catches an empty or truncated file
        raise ValueError(f"vocabulary {path} has no [UNK] line: empty, truncated or not a WordPiece vocab.txt")
    # as tokenizer.json's check (data.special_token_ids): data.load_tokenizer would append a missing one at id V
    missing = [t for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]") if t not in words]
    if missing:
        raise ValueError(f"vocabulary {path} lacks special tokens: {', '.join(missing)}")
    seen = {}  # a repeated line leaves its first id to no token: ids are not 0..V-1, and exports cannot list them
    for i, word in enumerate(words):
        if seen.setdefault(word, i) != i:
            raise ValueError(f"vocabulary {path} lists {word!r} twice (lines {seen[word] + 1} and {i + 1})")
    if not corpus.utf8_names(str(path)):  # the Rust reader below would not find it
        raise ValueError(f"cannot read vocabulary {path}: a path that is not ASCII under this locale's "
                         f"{sys.getfilesystemencoding()} file names (the tokenizers library names files in UTF-8): "
                         f"move it to an ASCII path, or run under a UTF-8 locale (LC_ALL=C.UTF-8)")
    return Tokenizer(models.WordPiece.from_file(str(path), unk_token="[UNK]")), options

def _hub_tokenizer(name):
    try:
        with quiet_hub():
            return Tokenizer.from_pretrained(name)
    except Exception as e:
        raise ValueError(f"tokenizer not found: {name} is no local file or directory, and the hub gives no "
                         f"tokenizer by that name ({first_line(e)})") from None

def write_tokenizer(tok, dir, model_max_length=512):
    """tokenizer.json + vocab.txt + HF configs (each atomically), so transformers.AutoTokenizer loads dir;
    model_max_length (the model's positions) is where transformers' truncation=True cuts."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    vocab = tok.get_vocab()
    words = sorted(vocab, key=vocab.get)
    assert [vocab[w] for w in words] == list(range(len(words))), "vocab ids must be 0..V-1"
    write_atomic(dir / "tokenizer.json", tok.to_str(pretty=True))
    write_atomic(dir / "vocab.txt", "\n".join(words) + "\n")
    norm = json.loads(tok.to_str()).get("normalizer") or {}
    specials = dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                    cls_token="[CLS]", mask_token="[MASK]")
    # BertTokenizerFast rebuilds its normalizer from these three (strip_accents missing: it follows lowercase),
    # and replaces any other normalizer with a BertNormalizer: then transformers reads tokenizer.json as it is
    bert = norm.get("type") == "BertNormalizer"
    options = dict(do_lower_case=norm.get("lowercase", True), strip_accents=norm.get("strip_accents"),
                   tokenize_chinese_chars=norm.get("handle_chinese_chars", True)) if bert else {}
    config = dict(tokenizer_class="BertTokenizerFast" if bert else "PreTrainedTokenizerFast", **options,
                  model_max_length=model_max_length, **specials)
    write_atomic(dir / "tokenizer_config.json", json.dumps(config, indent=2))
    write_atomic(dir / "special_tokens_map.json", json.dumps(specials, indent=2))

# ----------------------------------------------------------------------------- token cache

def _hash(obj):
    return hashlib.sha1(json.dumps(obj).encode()).hexdigest()[:16]

def corpus_key(data, files):
    """The cache key of the corpus: its files' paths, sizes, mtimes and ends (files = corpus.resolve_files(data)),
    or the hub name."""
    stats = [data] if files is None else [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns, _ends(f))
                                          + (("by content",) if corpus.read_by_content(f) else ()) for f in files]
    return _hash([stats, CORPUS_KEY_VERSION])  # 1: the value FORMAT_VERSION had here, so trained tokenizers stay

def _ends(path, n=1 << 12):
    """sha1 of a file's first and last 4 KiB (8 KiB read a file, at every start): a file replaced under the same
    size and mtime (cp -p, rsync -a, tar x) differs there, unless the change is all in its middle."""
    with open(path, "rb") as f:
        head = f.read(n)
        f.seek(max(0, os.path.getsize(path) - n))
        return hashlib.sha1(head + f.read(n)).hexdigest()

def tokenizer_dir(cache_dir, corpus_key, vocab_size, options=""):
    return Path(cache_dir) / f"tokenizer-{corpus_key}-{vocab_size}{options}"

def stream_dtype(tok):
    return np.uint16 if tok.get_vocab_size() < 2**16 else np.uint32  # half the disk of uint32 for BERT's 30,522

def tokens_file(cache_dir, corpus_key, tok, dtype):
    key = _hash([corpus_key, hashlib.sha1(tok.to_str().encode()).hexdigest(), FORMAT_VERSION])
    return Path(cache_dir) / f"tokens-{key}.{np.dtype(dtype).name}.bin"

def sidecar(path):
    return path.with_suffix(".json")  # tokens-KEY.uint16.bin -> tokens-KEY.uint16.json


@contextmanager
def making(*paths):
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
        lock = open(paths[0].parent / f".{paths[0].name}.lock", "a", encoding="utf-8")
    except OSError:  # a read-only cache: reading what is made needs no lock (making it fails on its own)
        yield
        return
    with lock:
        no_locks = False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            no_locks = e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)  # a file system without locks
            if not no_locks:
                print(f"waiting for another process preparing {paths[0]}", flush=True)
                fcntl.flock(lock, fcntl.LOCK_EX)
        if no_locks:  # as on Windows: leftovers stay, never read
            yield
            return
        stale = re.compile("|".join(re.escape(p.name) + r"\.tmp\d+" for p in paths))
        for entry in paths[0].parent.iterdir():
            if stale.fullmatch(entry.name):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        yield


class CorpusCache:
    """data.prepare_data's tokenizer and token stream for one corpus, each made once under cache_dir (locked,
    written atomically, checked before reuse); the corpus itself is loaded only when one of them misses."""

    def __init__(self, data, cache_dir):
        self.data, self.cache = data, Path(cache_dir)
        self.cache.mkdir(parents=True, exist_ok=True)
        self.files = corpus.resolve_files(data)  # None for a hub dataset; a bad path fails here
        self.key = corpus_key(data, self.files)
        self._parts = None

    def parts(self):
        if self._parts is None:
            self._parts = corpus.load_corpus(self.data, self.files, self.cache)
        return self._parts

    def tokenizer(self, vocab_size, train, **options):
        """The directory of the tokenizer that train(texts, vocab_size, save_dir, **options) makes from the corpus;
        options other than train's defaults name it (tokenizer-KEY-30522-cased-limit_alphabet8000)."""
        defaults = inspect.signature(train).parameters
        name = "".join(f"-{k}" if v is True else f"-{k}{v}" for k, v in options.items() if v != defaults[k].default)
        path = tokenizer_dir(self.cache, self.key, vocab_size, name)
        with making(path):
            if cached_tokenizer(path) is None:
                t0, tmp = time.time(), f"{path}.tmp{os.getpid()}"
                texts = lambda: ([p for p in pieces if p is not None]  # train_tokenizer's pipeline is BERT's (cut_at)
                                 for pieces in corpus.pieces(self.parts(), cut_at=corpus.CUT_BERT_CJK))
                try:
                    trained = train(texts, vocab_size, save_dir=tmp, **options)
                except ValueError as e:  # a reading error names its file; "no text" (only whitespace) the corpus
                    if str(e) != "no text":
                        raise
                    raise ValueError(f"no text in {self.data}") from None
                print(f"trained a {trained.get_vocab_size()}-token tokenizer in {time.time() - t0:.1f}s")
                os.replace(tmp, path)  # the directory appears whole
        return path

    def tokens(self, tok, sep):
        """(N,) np.memmap: the corpus as tok's ids, one `sep` between documents."""
        dtype = stream_dtype(tok)
        path = tokens_file(self.cache, self.key, tok, dtype)
        with making(path, sidecar(path)):
            if not cache_ok(path):
                try:
                    tokenize(tok, self.parts(), path, dtype, sep, self.data)
                except OSError as e:  # a full disk: the way out, as the corpus's own cache errors say it
                    if e.errno not in corpus.FULL:
                        raise
                    raise OSError(f"no space left for the token cache in {self.cache} ({e.strerror}: {e.filename}): "
                                  f"free some, or pass --cache_dir elsewhere") from None
        return np.memmap(path, dtype=dtype, mode="r")


def checksum(path, chunk=1 << 16):
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

def ours_to_read(*paths):
    """Refuse, in one line, a cached file this user may not read: another user's, in a shared --cache_dir. It is
    not damaged, so it is neither removed nor made again over theirs (which failed only after the whole work)."""
    for path in filter(os.path.isfile, paths):  # (missing, a folder, a FIFO whose open would wait: checked after this)
        try:
            open(path, "rb").close()
        except PermissionError as e:
            raise ValueError(f"cannot read {path} in the cache ({e.strerror}): another user's files? pass a "
                             f"--cache_dir of your own") from None
        except OSError:  # the checks after this say what
            pass

def cache_ok(path):
    """True when the token cache exists and matches the size and checksum in its sidecar."""
    if not path.exists():
        return False
    ours_to_read(path, sidecar(path))
    try:
        meta = json.loads(sidecar(path).read_text(encoding="utf-8"))
        if path.stat().st_size == meta["bytes"] and checksum(path) == meta["checksum"]:
            return True
        problem = "size or checksum differs from its sidecar"
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"no valid sidecar ({type(e).__name__})"
    print(f"token cache {path} is incomplete or corrupt ({problem}): rebuilding it")
    return False

def vocab_matches(tok, dir):
    """Whether dir's vocab.txt (what transformers' BertTokenizer reads) lists tok's vocabulary, line i the token
    of id i (False when it cannot be read, or when tok's ids are not 0..V-1: a digit damaged in tokenizer.json
    gives two tokens one id, or an id past the end, and vocab.txt, in id order, still looked the same)."""
    vocab = tok.get_vocab()
    try:
        words = Path(dir, "vocab.txt").read_text(encoding="utf-8").splitlines()
    except (ValueError, OSError):  # not UTF-8, a directory, unreadable
        return False
    return len(words) == len(vocab) and all(vocab.get(w) == i for i, w in enumerate(words))

def cached_tokenizer(dir):
    """The tokenizer cached in dir, or None when it is missing or one of its files is unreadable (dir is
    then removed)."""
    if not dir.exists():
        return None
    ours_to_read(*(dir / name for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")))
    try:
        tok, _ = read_tokenizer(dir / "tokenizer.json")
        if not vocab_matches(tok, dir):
            raise ValueError("vocab.txt disagrees with tokenizer.json")
        read_tokenizer(dir)  # the configs, as transformers and eval.py will read them
        return tok
    except (ValueError, OSError) as e:
        print(f"cached tokenizer {dir} is unreadable ({str(e)[:200]}): training it again")
        shutil.rmtree(dir, ignore_errors=True)
        return None

def cut_at(tok):
    """Where corpus._cut may cut a long text for tok: before a space (any tokenizer), and, where tok's words are
    BERT's (its normalizer and pre-tokenizer; no added token that is not special, which would be matched across a
    cut), also before punctuation and (handle_chinese_chars) a CJK ideograph, around which they always end."""
    norm, pre = tok.normalizer, tok.pre_tokenizer
    if not (isinstance(norm, normalizers.BertNormalizer) and isinstance(pre, pre_tokenizers.BertPreTokenizer)
            and all(t.special for t in tok.get_added_tokens_decoder().values())):
        return corpus.CUT_SPACE
    return corpus.CUT_BERT_CJK if norm.handle_chinese_chars else corpus.CUT_BERT

def tokenize(tok, parts, path, dtype, sep, data):
    """Encode the corpus (corpus.load_corpus's parts) into `path` (atomically), one `sep` id between
    documents, then write its sidecar; returns the number of tokens."""
    t0, n = time.time(), 0
    # disable=None: a bar on a terminal, nothing in logs and captured output
    bar = tqdm(total=sum(len(ds) for _, ds, _ in parts), unit="rows", desc="tokenizing", disable=None)

    def write(tmp):
        nonlocal n
        # "[SEP]" or "[MASK]" written in the text is text, as in BERT's own pretraining data: matched as a special
        # token it would end a document, or be a [MASK] no loss asks about
        tok.encode_special_tokens = True
        with open(tmp, "wb") as f:
            for pieces in corpus.pieces(parts, bar, cut_at(tok)):
                # encode_batch_fast runs on every core and skips the offsets we don't need
                encodings = iter(tok.encode_batch_fast([p for p in pieces if p is not None],
                                                       add_special_tokens=False))
                ids = chain.from_iterable((sep,) if p is None else next(encodings).ids for p in pieces)
                arr = np.fromiter(ids, dtype=dtype)
                f.write(arr.tobytes())
                n += len(arr)
        if n == 0:
            raise ValueError(f"no text in {data}")
    # on disk, then renamed; a bad row or Ctrl-C leaves no partial file (a SIGKILL's: the next making removes it)
    encode_special_tokens = tok.encode_special_tokens
    try:
        atomic.replace_atomic(str(path), write, tmp=f"{path}.tmp{os.getpid()}")
    finally:
        tok.encode_special_tokens = encode_special_tokens  # the caller's tokenizer as it was
    bar.close()
    # the sidecar comes last: a run killed before this line leaves a .bin that cache_ok rejects
    write_atomic(sidecar(path), json.dumps({"bytes": path.stat().st_size, "checksum": checksum(path)}))
    print(f"tokenized {data} into {n:,} tokens in {time.time() - t0:.1f}s -> {path}")
    return n
