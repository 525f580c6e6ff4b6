"""
Reading a pretraining corpus: the files or hub dataset behind --data, as text pieces with the document
boundaries marked. The algorithm does not need this module: data.prepare_data calls load_corpus and
pieces only when its token cache (token_files.py) misses, and any list of strings would do.

What it reads: a `datasets` hub name ("wikitext:wikitext-103-raw-v1" = load_dataset("wikitext",
"wikitext-103-raw-v1")) or a local file / directory / glob of .txt .raw .jsonl .parquet .arrow (a datasets
save_to_disk folder holds .arrow files), optionally .xz/.gz/.bz2/.zst compressed (text we decompress into the
cache first, datasets the rest; .zst needs the zstandard package); a directory's hidden files and folders
(.name) are skipped and linked folders followed (each real one once, as each real file), and an .arrow file is
read only beside save_to_disk's state.json. A folder laid out in splits (a DatasetDict's, a hub repository's: its
README.md configs, data/train-00000-of-00001.parquet, train.jsonl beside test.jsonl, train/) gives its train split's
files alone, as load_dataset(FOLDER, split="train") and the hub path (split="train") read it (split by names,
with some files naming no split, it is refused: which to read is ambiguous). A file named (by its
path or a glob) with another suffix is text, or JSON Lines when it is .json or starts with a JSON object
(WikiExtractor --json); .csv and .tsv are refused. A
document starts at each file, each jsonl/parquet row, each WikiExtractor `<doc ...>` line (the <doc>/</doc> lines
themselves are dropped) and each WikiText top-level heading ` = Title = ` (after a blank row, in a file that has
them). Blank lines are dropped.

What it guarantees:
- a bad path (missing, an empty file, a glob or directory matching nothing, a folder in splits without a train
  split) is one ValueError naming it,
  raised by resolve_files before anything is loaded or cached;
- a file that is not UTF-8 text (a .jsonl or .parquet row too), holds NUL bytes, is a broken .jsonl or a fake
  .gz/.xz/.zst is one ValueError naming that file (and row), also when it is one of many in a directory;
- a file name that looks like a pattern (b[1].txt) is read as that file, never as the files it matches;
- an unreachable hub (offline) is one line naming the way out (--data FILE), not a page of retries;
- a cache that cannot be written (full, over a quota, read-only) is one OSError naming it, never blamed on
  the corpus.

Tests that hold it to this: test_corpus.py (each format and marker, bad paths, unreadable files, brackets
in paths, the offline hub, read_text of a broken .xz) and test_data.py's test_sample_corpus (WikiText headings).
"""
import bz2
import errno
import glob
import gzip
import hashlib
import json
import logging
import lzma
import os
import re
import string
import sys
import unicodedata
from bisect import bisect_right
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path

from atomic import replace_atomic

try:
    import zstandard  # optional: only a .zst corpus needs it (as datasets' own .zst reading does)
except ImportError:
    zstandard = None

# data.DEFAULT_DATA: the WikiText-2 raw test split, 1.3 MB of real Wikipedia text (0.37 MB as .xz), enough
# for smoke runs and tests without a network
SAMPLE_CORPUS = str(Path(__file__).resolve().parent / "assets" / "wikitext2_test.raw.xz")
BUILDERS = {".txt": "text", ".raw": "text", ".jsonl": "json", ".parquet": "parquet",
            ".arrow": "arrow"}  # .arrow: a datasets save_to_disk folder; no .json: dirs hold configs
COMPRESSIONS = (".xz", ".gz", ".bz2", ".zst")
WIKITEXT_HEADING = re.compile(r"^ = [^=].* =\s*$")  # top-level only: " == Section == " stays in the doc
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit (ulimit -f)
FILES_PER_LOAD = 25  # files per datasets.load_dataset call (see load_corpus)
BATCH_ROWS = 2000  # rows per encode_batch call: large enough to keep every core busy
PIECE_CHARS = 1 << 18  # a longer line or row is cut where words end into pieces about this long (see _cut)
BATCH_CHARS = 1 << 22  # and a batch of pieces ends at this many characters: one enormous line is many batches
# Where _cut may cut a text, as regex classes. CUT_SPACE, for any tokenizer: before a space. CUT_BERT, for BERT's
# normalizer and pre-tokenizer (token_files.cut_at): also before a punctuation character, a word of its own to
# BertPreTokenizer: ASCII's, and what both Unicode 3.2 and Python's Unicode call punctuation (the Rust tables of
# `tokenizers` are older than Python's: U+2E43 and 103 more are punctuation to Python only; 3.2's soft hyphen is a
# format character now, which BertNormalizer removes). CUT_BERT_CJK: also before a CJK ideograph, which BertNormalizer
# (handle_chinese_chars) puts spaces around: BERT's _is_chinese_char ranges less U+2B820-U+2B91F, which `tokenizers`
# leaves out (it reads 0x2B920). Spaceless Chinese or Japanese is then cut too. Normalized (cased or not), each of
# these starts with a space or punctuation, never with a combining mark that NFD would move across the cut: the text
# before it ends a word there, so the pieces hold the same words (test_a_cut_before_punctuation_or_a_cjk_ideograph_...
# checks each character).
CUT_SPACE = " "
_PUNCTUATION = [c for c in map(chr, range(128, 0x10000))  # Unicode 3.2 has none above U+FFFF
                if unicodedata.ucd_3_2_0.category(c)[0] == "P" == unicodedata.category(c)[0]]
CUT_BERT = " " + re.escape(string.punctuation + "".join(_PUNCTUATION))
CUT_BERT_CJK = CUT_BERT + ("\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002b81f"
                           "\U0002b920-\U0002ceaf\U0002f800-\U0002fa1f")


class _ZstdReader:
    """A .zst file's frames one after another, as zstandard.open reads them, except that a file cut short inside
    a frame (a download stopped) raises EOFError, as lzma, gzip and bz2 do: zstandard.open returned the text up
    to the cut, and the run trained on part of the corpus without a word."""

    def __init__(self, path):
        self.file, self.frame, self.out = open(path, "rb"), None, bytearray()

    def read(self, size=-1):
        while size < 0 or len(self.out) < size:
            ended = self.frame is not None and self.frame.eof
            data = (self.frame.unused_data if ended else b"") or self.file.read(1 << 10)  # 1 KiB: at most ~32 MB out (zstd tops out near 32,000:1)
            if not data:
                if self.frame is not None and not ended:
                    raise EOFError("Compressed file ended before the end of its last zstd frame")
                break
            if self.frame is None or ended:  # the next frame (zstd -T, cat a.zst b.zst)
                self.frame = zstandard.ZstdDecompressor().decompressobj()
            self.out += self.frame.decompress(data)
        size = len(self.out) if size < 0 else size
        out = bytes(self.out[:size])
        del self.out[:size]
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def _open_zst(path, mode="rb"):
    if zstandard is None:
        raise ValueError(f"cannot read {path} as text: no zstd decompressor (install the zstandard package: "
                         f"pip install zstandard)")
    return _ZstdReader(path)


DECOMPRESS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open, ".zst": _open_zst}  # text we decompress ourselves
# what reading a truncated or fake compressed file raises (gzip and bz2: OSError)
BROKEN = (EOFError, OSError, lzma.LZMAError) + ((zstandard.ZstdError,) if zstandard else ())


def first_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


@contextmanager
def quiet_hub():
    """Silence huggingface_hub below ERROR: offline, its retry warnings (one per attempt) would bury our
    one-line error."""
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_log.setLevel(level)


def _suffix(path):
    """A file name's suffix, lower case, under any compression suffix: a.JSONL.gz -> .jsonl."""
    name = path.name.lower()
    for ext in COMPRESSIONS:
        name = name.removesuffix(ext)
    return Path(name).suffix

def _builder(path):
    """datasets builder for a file name ("text"/"json"/"parquet"), None if unknown."""
    return BUILDERS.get(_suffix(path))

def read_by_content(path):
    """Whether a file's first bytes decide how it is read (json_lines: a file without a corpus suffix). Known from
    its name alone, so the cache key needs no read into a compressed file (a .bz2's first block: 20 ms a file)."""
    return _builder(path) is None

def json_lines(path):
    """Whether a file that --data names (a file, a glob) but no corpus suffix marks is JSON Lines: a .json file
    (Dataset.to_json's name) or text that starts with a JSON object (WikiExtractor --json's wiki_00). Read as
    text, its JSON syntax, field names and URLs were trained on, its documents one."""
    if not read_by_content(path):
        return False
    if _suffix(path) == ".json":
        return True
    try:
        with DECOMPRESS.get(path.suffix, open)(path, "rb") as f:
            head = f.read(64)
    except (ValueError, *BROKEN):  # a broken file fails again where it is read, with its own error
        return False
    return re.match(rb'\{\s*"', head.removeprefix(b"\xef\xbb\xbf").lstrip()) is not None  # {"id" or { "id"

def _files_below(path):
    """The files below a folder: hidden files and folders (.ipynb_checkpoints/, macOS ._a.txt) skipped, as a glob's
    * skips them; linked folders followed (rglob skipped `AA -> /data/AA` silently), each real folder once."""
    seen = set()
    for folder, dirs, names in os.walk(path, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a second link to it, or a loop
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # sorted: the same link read first each time
        yield from (Path(folder, n) for n in names if not n.startswith(".") and os.path.isfile(os.path.join(folder, n)))

def _saved_arrow_or_other(path):
    """An .arrow file is a corpus file in a save_to_disk folder (its state.json beside it), not in datasets' own
    cache (a --cache_dir inside the data folder: hf/text/.../text-file0.arrow, our earlier reading of it)."""
    return _suffix(path) != ".arrow" or (path.parent / "state.json").is_file()

# a folder laid out in splits is read as load_dataset(FOLDER, split="train") reads it: its README.md's `configs:`
# block, else (datasets.data_files.get_data_patterns) push_to_hub's data/SPLIT-00000-of-00001.* names, else a split's
# name in a folder's name (train/, data/test-2/), else in a file's (train.jsonl, wiki_val_0.txt); a file in no split
# is read by none. SPLIT_KEYWORDS and the separators are datasets' own (SPLIT_KEYWORDS, NON_WORDS_CHARS).
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
SHARDED = re.compile(r"data/([^/]+)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")
_SEP = "[-._ 0-9]"
_IN_FOLDER = {s: re.compile(rf"(.*{_SEP})?({'|'.join(w)})({_SEP}.*)?") for s, w in SPLIT_KEYWORDS.items()}
_IN_FILE = {s: re.compile(rf"(.*{_SEP})?({'|'.join(w)}){_SEP}.*") for s, w in SPLIT_KEYWORDS.items()}

def _card_config(folder):
    """The config of a folder's README.md `configs:` block (a hub dataset card) that load_dataset(FOLDER) reads: the
    one marked default: true, else the one named "default", else the only one; several others are one ValueError."""
    try:
        text = (folder / "README.md").read_text(encoding="utf-8-sig")  # a BOM dropped, as huggingface_hub reads it
    except (OSError, ValueError):  # none, or not text
        return None
    card = re.match(r"\s*---\n(.*?)\n---[ \t]*(\n|$)", text, re.S)  # huggingface_hub's REGEX_YAML_BLOCK
    if card is None or not re.search(r"^configs:", card.group(1), re.M):
        return None
    import yaml  # datasets' own dependency: it reads the card with it
    try:
        configs = yaml.safe_load(card.group(1)).get("configs")
    except (yaml.YAMLError, AttributeError) as e:
        raise ValueError(f"cannot read the configs of {folder / 'README.md'}: {first_line(e)}") from None
    if not configs:  # `configs:` or `configs: []`: none, as datasets reads it
        return None
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise ValueError(f"cannot read the configs of {folder / 'README.md'}: not a list of configs")
    chosen = [c for c in configs if c.get("default")] or [c for c in configs if c.get("config_name") == "default"]
    if len(chosen or configs) > 1:
        names = ", ".join(f"{c.get('config_name')} ({c.get('data_dir') or c.get('data_files')})" for c in configs)
        raise ValueError(f"{folder / 'README.md'} defines several configs and no default: name the files of one "
                         f"with a glob (its train split's); the configs: {names}"[:600])
    return (chosen or configs)[0]

def folder_splits(folder, files):
    """{split: files} of a folder's corpus files (files: all of them, sorted), as datasets splits a folder (a
    dataset repository, a save_to_disk DatasetDict's); {"train": files} when it has no splits."""
    config = _card_config(folder)
    if config is not None:
        folder = folder / str(config.get("data_dir") or "")
        root, real = os.path.join(os.path.realpath(folder), ""), {f: os.path.realpath(f) for f in files}
        # its files, by their real paths: a link to one (a.txt -> en/x.txt, read as en/x.txt's one path) is en/x.txt
        rel = {f: Path(r[len(root):]).as_posix() for f, r in real.items() if r.startswith(root)}
        files = list(rel)
        patterns = config.get("data_files")
        if patterns is not None:  # "*.txt" or [..] (all train), [{split: train, path: ..}, ..], {train: .., ..}
            if isinstance(patterns, list) and all(isinstance(p, dict) for p in patterns):
                patterns = {p.get("split"): p.get("path") for p in patterns}
            splits = {}
            for split, paths in (patterns if isinstance(patterns, dict) else {"train": patterns}).items():
                found = {os.path.realpath(p) for path in ([paths] if isinstance(paths, str) else paths or [])
                         for p in glob.glob(os.path.join(glob.escape(str(folder)), str(path)), recursive=True)}
                splits[str(split)] = [f for f in files if real[f] in found]
            return splits
    else:
        rel = {f: f.relative_to(folder).as_posix() for f in files}
    splits = {}
    if (folder / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict: a folder a split
        try:  # its splits, an empty one too (a folder without .arrow files)
            splits = {str(s): [] for s in json.loads((folder / "dataset_dict.json").read_text("utf-8"))["splits"]}
        except (OSError, ValueError, KeyError, TypeError):
            pass
        for f, r in rel.items():
            splits.setdefault(r.split("/")[0], []).append(f)
        return splits
    for f, r in rel.items():
        if m := SHARDED.fullmatch(r):
            splits.setdefault(m.group(1), []).append(f)
    for rules, names in ((_IN_FOLDER, lambda r: r.split("/")[:-1]), (_IN_FILE, lambda r: r.split("/")[-1:])):
        if splits:
            return splits
        for split, rule in rules.items():
            if chosen := [f for f, r in rel.items() if any(rule.fullmatch(n) for n in names(r))]:
                splits[split] = chosen
    return splits or {"train": list(files)}

def _in_no_split(files, splits):
    """files that no split holds (a set: a list's `in` made 15,000 files take 18 s)."""
    held = {f for split in splits.values() for f in split}
    return [f for f in files if f not in held]

def _names_a_split(rel):
    """Whether a relative path names a split in a folder's or its file's name (val.jsonl beside train/, which
    datasets passes over: its folder rule came first)."""
    *dirs, name = rel.split("/")
    return any(rule.fullmatch(d) for rule in _IN_FOLDER.values() for d in dirs) or any(
        rule.fullmatch(name) for rule in _IN_FILE.values())

def _train_split(data, folder, files):
    """The train split's files of a folder (all of them when it has no splits), as the hub path reads split="train":
    a folder's validation and test files were read along and trained on (the held-out tail was the last split)."""
    splits = folder_splits(folder, files)
    if "train" not in splits:  # a plain folder too, whose test_notes.txt or dev/ names a split
        named = ", ".join(f"{s} ({fs[0].relative_to(folder)}{', ...' * (len(fs) > 1)})" if fs else s
                          for s, fs in splits.items())
        raise ValueError(f"{data} holds the splits {named} and no train split, as datasets reads the folder (a "
                         f"split's name in a file's or folder's name, a README.md configs: block); to read its files "
                         f"as they are, name them with a glob: --data '{_glob_of(data, files)}'")
    if not splits["train"]:
        raise ValueError(f"the train split of {data} (as datasets reads the folder) has no .txt/.raw/.jsonl/.parquet/"
                         f".arrow files (optionally .xz/.gz/.bz2/.zst)")
    in_none = [f for f in _in_no_split(files, splits) if not _names_a_split(f.relative_to(folder).as_posix())]
    if in_none and _card_config(folder) is None and not (folder / "dataset_dict.json").is_file():
        # split by names, with files that name none (a.txt, b.txt beside train_notes.txt): datasets would read
        # train_notes.txt alone, a user may mean them all: which is not ours to guess (train/ beside val.jsonl: train/)
        train = splits["train"]
        raise ValueError(f"{data}: which files to read is ambiguous: {len(train)} name the train split (e.g. "
                         f"{train[0].relative_to(folder)}), {len(in_none)} no split (e.g. {in_none[0].relative_to(folder)})"
                         f"; name them with a glob: --data '{_glob_of(data, files)}' reads every file")
    return splits["train"]

def _glob_of(data, files):
    """A glob naming a folder's files as they are, in no split (the way out of its splits): DIR/**/*.txt, the suffix
    most of them have (with its case and compression: *.TXT, *.jsonl.gz)."""
    ends = [f.name[f.name.lower().rfind(_suffix(f)):] for f in files]
    return f"{data.rstrip('/')}/**/*{max(ends, key=ends.count)}"

def _once(files):
    """files with each real file once: a link to a file that is read anyway (latest.txt -> v2.txt) is not read twice."""
    seen = set()
    return [f for f in files if (real := os.path.realpath(f)) not in seen and not seen.add(real)]

def _corpus_files_below(folder):
    return _once(sorted(p for p in _files_below(folder) if _builder(p) and _saved_arrow_or_other(p)))

def split_note(data):
    """What a folder's other splits hold, which --data leaves out (said when the corpus is read), or None."""
    folder = Path(data).expanduser()
    if not folder.is_dir():
        return None
    splits = folder_splits(folder, files := _corpus_files_below(folder))
    count = lambda files: f"{len(files)} file{'s' * (len(files) != 1)}"
    others = [f"{name} ({count(files)})" for name, files in splits.items() if name != "train"]
    in_none = _in_no_split(files, splits)  # datasets reads them in none
    others += [f"{count(in_none)} in no split, e.g. {in_none[0].relative_to(folder)}"] if in_none else []
    plain = [f for f in in_none if not _names_a_split(f.relative_to(folder).as_posix())]  # not val.jsonl
    if not others:
        return None
    return (f"reading the train split of {data} ({count(splits['train'])}), as load_dataset(split='train') does; "
            f"left out: {', '.join(others)}" + (f"; a glob reads every file: --data '{_glob_of(data, files)}'"
                                                if plain else ""))

def resolve_files(data):
    """Local files for `data` in sorted order, or None when `data` is a hub dataset name."""
    path = Path(data).expanduser()
    if not path.exists() and any(c in data for c in "*?["):  # a path that exists is a path, "[" or not
        files = _once(sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()))
        if not files:
            raise ValueError(f"no files match {data}")
    elif path.is_dir():
        files = _corpus_files_below(path)
        if not files:
            raise ValueError(f"no .txt/.raw/.jsonl/.parquet/.arrow files (optionally .xz/.gz/.bz2/.zst) in {data}; "
                             f"a glob names files of any name (WikiExtractor's: --data '{data.rstrip('/')}/*/wiki_*')")
        files = _train_split(data, path, files)
    elif path.is_file():
        files = [path]
    elif data.startswith(("/", ".", "~")) or _builder(path):
        raise ValueError(f"data path not found: {data}")
    else:
        return None  # "name" or "name:config" on the hub
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"empty data file: {f}")
        if _suffix(f) in (".csv", ".tsv"):  # read as text, its header, quotes and columns were trained on
            raise ValueError(f"{f}: a {_suffix(f)} file is not read; convert it to .jsonl or .parquet with a 'text' "
                             f"field, one document a row")
    return files

def read_text(path):
    """A UTF-8 text file (.xz/.gz/.bz2/.zst too, as --data reads them; a BOM dropped) as one str; bytes that are not
    UTF-8 are one ValueError naming the file and line (eval.py's GLUE TSVs, analysis.py's --text)."""
    suffix = Path(path).suffix
    opener = DECOMPRESS.get(suffix)
    try:
        with (opener or open)(path, "rb") as f:
            raw = f.read()
    except BROKEN as e:  # truncated, or not that format at all
        if opener is None:
            raise
        raise ValueError(f"{path}: not a readable {suffix} file ({first_line(e)})") from None
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
    return first_line(e)

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


def _decompressed(f, hf_cache):
    """A compressed text file as a plain copy in hf_cache/plain (one per path, replaced at each read, its
    mtime the file's so datasets keeps one Arrow copy of it). datasets reads a compressed file through
    fsspec in the locale's encoding, whatever encoding= says: a BOM was kept, and under a locale that is not
    UTF-8 (Windows') the text was misread or refused."""
    plain = Path(hf_cache) / "plain" / f"{hashlib.sha1(os.path.abspath(f).encode()).hexdigest()[:16]}.txt"
    plain.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with DECOMPRESS[Path(f).suffix](f, "rb") as src, open(tmp, "wb") as dst:
            while True:
                try:
                    chunk = src.read(1 << 20)
                except BROKEN as e:  # truncated, or not that format
                    raise ValueError(f"cannot read {f} as text: not a readable {Path(f).suffix} file "
                                     f"({first_line(e)})") from None
                if not chunk:
                    break
                dst.write(chunk)  # an OSError here is the cache's: _load_local says so
        os.utime(tmp, ns=(os.stat(f).st_mtime_ns,) * 2)
    replace_atomic(str(plain), write, tmp=f"{plain}.{os.getpid()}.tmp")  # a concurrent run writes the same text
    return str(plain)


def _cache_error(e, hf_cache, split_files, doing):
    """One line for an OSError that is the cache's (a full disk, a quota, a read-only folder): still an OSError,
    so it exits 1 as any write the system refused, not 2 as bad input."""
    full = e.errno in FULL
    return OSError(f"{'no space left for' if full else 'cannot write'} the cache {hf_cache} ({e.strerror}"
                   f"{f': {e.filename}' if e.filename else ''}) while {doing} {', '.join(split_files.values())}: "
                   f"{'free some, or ' if full else ''}pass --cache_dir elsewhere")


def _load_local(datasets, builder, split_files, hf_cache):
    """load_dataset for local files; a file it cannot read is one ValueError naming that file."""
    try:
        escaped = {name: _decompressed(f, hf_cache) if builder == "text" and Path(f).suffix in DECOMPRESS
                   else _plain_path(f, hf_cache) for name, f in split_files.items()}
    except OSError as e:  # writing our copy or link into the cache: a full disk, a quota, a read-only folder
        raise _cache_error(e, hf_cache, split_files, "preparing") from None
    # a BOM dropped, as read_text does: kept, it hid a WikiExtractor file's first <doc ...> line from pieces
    options = dict(encoding="utf-8-sig") if builder == "text" else {}
    try:
        # read afresh: datasets keys its Arrow copy on path and mtime only, and this runs only when our cache
        # missed, so a file replaced under the same mtime would otherwise come back as its old text
        return datasets.load_dataset(builder, data_files=escaped, cache_dir=hf_cache, download_mode="force_redownload",
                                     verification_mode="no_checks", **options)  # its split sizes are the old copy's
    except Exception as e:
        chain = [e]
        while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__):  # datasets wraps what it hit
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        # the cache's, not the corpus's: a full disk, a quota, a file-size limit (ulimit -f), or a file of datasets'
        # own there that cannot be written (read-only, a path too long; not one of _plain_path's links to the corpus)
        cache = os.path.join(os.path.abspath(hf_cache), "")
        in_cache = lambda path: path.startswith(cache) and not path.startswith(cache + "links")
        ours = [x for x in chain if isinstance(x, OSError) and (
            x.errno in FULL or x.filename and in_cache(os.path.abspath(str(x.filename))))]
        if ours:
            raise _cache_error(ours[0], hf_cache, split_files, "datasets read") from None
        culprit, problem = ", ".join(split_files.values()), _read_problem(e)
        if len(split_files) > 1:  # find the file to blame, one at a time (error path only)
            for name, f in split_files.items():
                try:
                    datasets.load_dataset(builder, data_files={name: escaped[name]}, cache_dir=hf_cache, **options)
                except Exception as e_file:
                    culprit, problem = f, _read_problem(e_file)
                    break
        if culprit.endswith(".zst") and "zstd" in problem:  # datasets reads .zst through the zstandard package
            problem += " (install the zstandard package: pip install zstandard)"
        raise ValueError(f"cannot read {culprit} as {builder}: {problem}") from None

def _check_text(ds, where):
    """A dataset read needs a "text" column of strings (a hub dataset's too: one of lists was a pyarrow traceback)."""
    if "text" not in ds.column_names:
        raise ValueError(f"no 'text' field in {where}: name the documents' column 'text' (Dataset.rename_column); its "
                         f"fields: {', '.join(ds.column_names)}"[:400])
    if getattr(ds.features["text"], "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"the 'text' field of {where} holds {ds.features['text']}, not strings")


def utf8_names(path):
    """Whether pyarrow or Rust (tokenizers), which encode a file name as UTF-8 whatever the locale, open the file
    the OS calls path: not a non-ASCII path under a locale that is not UTF-8 (LANG=en_US is ISO-8859-1; LC_ALL=C
    with PYTHONUTF8=0)."""
    try:
        return os.fsencode(path) == path.encode("utf-8")
    except UnicodeEncodeError:  # a byte the locale could not decode
        return False


def load_corpus(data, files, cache_dir):
    """[(kind, Dataset with a "text" column, name)] in corpus order; kind "lines" or "docs" (row = document).
    files: resolve_files(data)."""
    hf_cache = str(Path(cache_dir) / "hf")
    if not utf8_names(os.path.abspath(hf_cache)):  # datasets' Arrow files were not found, and the corpus was blamed
        raise ValueError(f"--cache_dir {cache_dir}: a path that is not ASCII under this locale's "
                         f"{sys.getfilesystemencoding()} file names, where datasets' Arrow files cannot be written "
                         f"(pyarrow names files in UTF-8): choose a --cache_dir with an ASCII path, or run under a "
                         f"UTF-8 locale (LC_ALL=C.UTF-8)")
    import datasets  # imported here: it costs ~2 s and is only needed on a cache miss
    datasets.disable_progress_bars()  # our own bar is enough
    if files is None:
        name, _, config = data.partition(":")
        try:
            with quiet_hub():
                ds = datasets.load_dataset(name, config or None, split="train", cache_dir=hf_cache)
        except Exception as e:  # offline, or no such dataset: one line, with the way out
            if isinstance(e, ValueError) and str(e).startswith("Unknown split"):  # it loads: no split to train on
                raise ValueError(f"the hub dataset {data} has no train split ({first_line(e)})") from None
            raise ValueError(f"--data {data!r} is neither a local path nor a loadable hub dataset "
                             f"({first_line(e)}); without internet pass --data FILE|DIR|GLOB, "
                             f"e.g. the bundled sample --data {SAMPLE_CORPUS}") from None
        # WikiText rows are lines (articles start at headings); other hub corpora have a doc per row
        _check_text(ds, f"the hub dataset {data}")
        return [("lines" if name.endswith("wikitext") else "docs", ds.select_columns(["text"]), data)]
    # one split per file, so file boundaries stay visible; one load_dataset call per builder and group of
    # FILES_PER_LOAD files: each split copies its call's info of all splits (1,000 files in one call: 30 s)
    if note := split_note(data):
        print(note)
    builders = [_builder(f) or ("json" if json_lines(f) else "text") for f in files]  # a named odd suffix: by content
    splits = {}
    for i, (f, builder) in enumerate(zip(files, builders)):
        splits.setdefault((builder, i // FILES_PER_LOAD), {})[f"file{i}"] = str(f)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # our ValueError says it in one line
    try:
        loaded = {key: _load_local(datasets, key[0], s, hf_cache) for key, s in splits.items()}
    finally:
        datasets.logging.set_verbosity(verbosity)
    parts = []
    for i, (f, builder) in enumerate(zip(files, builders)):
        ds = loaded[builder, i // FILES_PER_LOAD][f"file{i}"]
        _check_text(ds, f)
        parts.append(("lines" if builder == "text" else "docs", ds.select_columns(["text"]), str(f)))
    return parts

def _line_pieces(rows, state):
    """state: one dict a file, carried across its batches (whether it has blank rows; whether the last was one)."""
    for line in rows:
        line = line.rstrip("\r\n")
        stripped = line.strip()
        blank_before, state["blank"] = state.get("blank", True), not stripped
        state["has_blanks"] = state.get("has_blanks", False) or not stripped
        if not stripped or stripped == "</doc>":
            continue
        if stripped.startswith("<doc") and stripped.endswith(">"):  # WikiExtractor article start (note 40)
            yield None
            continue
        # where the file has blank rows (WikiText's original and the hub's), a heading follows one: a formula's
        # continuation line " = 1 henry and capacitance C = " looks like a heading but does not
        if WIKITEXT_HEADING.match(line) and (blank_before or not state["has_blanks"]):
            yield None
        yield line

def _doc_pieces(rows, state):
    for text in rows:
        if text and text.strip():
            yield None
            yield text

def _cut(text, at=CUT_SPACE):
    """text in pieces of at most PIECE_CHARS characters (or up to the cut point that ends a longer stretch without
    one), each cut before a character of the class `at` (a text without one is left whole): the same words, so the
    same WordPiece tokens and vocabulary, but one enormous line (text8 has no newline, a Chinese row no space) no
    longer holds its whole encoding in memory at once (a 30 MB line peaked at 3.4 GB) on one core."""
    start = 0  # the rest is text[start:], never copied: a copy per piece was quadratic (300 MB: 120 s)
    while len(text) - start > PIECE_CHARS:
        last = re.compile(f"(?s:.*)[{at}]").match(text, start + PIECE_CHARS // 2, start + PIECE_CHARS)  # .* backs off
        if last:
            cut = last.end() - 1
        else:  # a long stretch without one (a URL, a table): cut at the next one after it
            after = re.compile(f"[{at}]").search(text, start + PIECE_CHARS)
            if after is None:
                break
            cut = after.start()
        yield text[start:cut]
        start = cut
    yield text[start:]  # the whole text itself when it was not cut

def _batches(ds, name):
    """ds's "text" in batches of at most BATCH_ROWS rows and BATCH_CHARS bytes (a longer row alone), made Python
    strings one batch at a time: 2,000 rows of books (500K characters each) were 1 GB of strings at once, a corpus
    of fewer rows all of it. A string that is not UTF-8 (pyarrow's JSON reader lets one through, to fail when
    Python reads it) is one ValueError naming the file, as the text reader's."""
    import pyarrow.compute as pc  # datasets' own dependency, as the Arrow tables it hands us
    row = 0
    try:
        for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):  # slices of the memory-mapped file
            text = table.column("text")
            ends = list(accumulate(pc.fill_null(pc.binary_length(text), 0).to_pylist()))  # bytes to each row's end
            start = 0
            while start < len(ends):
                stop = max(start + 1, bisect_right(ends, (ends[start - 1] if start else 0) + BATCH_CHARS))
                batch = text.slice(start, stop - start).to_pylist()
                yield batch
                row, start = row + len(batch), stop
    except UnicodeDecodeError as e:
        for row in range(row, min(row + BATCH_ROWS, len(ds))):  # the row to blame (error path only)
            try:
                ds[row]
            except UnicodeDecodeError as e_row:
                e = e_row
                break
        raise ValueError(f"cannot read {name}: row {row + 1} is not UTF-8 text ({e.reason} at byte {e.start} of "
                         f"its text): convert the file with iconv -t UTF-8") from None

def pieces(parts, progress=None, cut_at=CUT_SPACE):
    """Yield batches of text pieces in corpus order; None = document boundary (never first or twice).
    progress: a tqdm bar, advanced by the rows read; cut_at: where a long text may be cut (_cut)."""
    started = False
    for kind, ds, name in parts:
        boundary, state = True, {}  # every file starts a document
        for batch in _batches(ds, name):
            if any(text and "\x00" in text for text in batch):  # valid UTF-8, but not text
                raise ValueError(f"cannot read {name}: NUL bytes in the text (a binary file?" + (")" if kind == "lines"
                                 else ", or a row with a \\u0000: remove it)"))
            out, chars = [], 0
            for piece in (_line_pieces if kind == "lines" else _doc_pieces)(batch, state):
                if piece is None:
                    boundary = True
                    continue
                if boundary and started:
                    out.append(None)
                boundary, started = False, True
                for cut in _cut(piece, cut_at):
                    out.append(cut)
                    chars += len(cut)
                    if chars >= BATCH_CHARS:  # a document's pieces are concatenated: any cut between them is exact
                        yield out
                        out, chars = [], 0
            yield out
            if progress is not None:
                progress.update(len(batch))
