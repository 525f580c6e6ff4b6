"""
Atomic writes, for every file the project writes: checkpoints, exports, the tokenizer and token cache (through
hf_io and token_files), JSON and Markdown results, plots, and reproduce.py's and bench.py's outputs. Standard
library only: reproduce.py and device_run.py use it before any wheel is installed. The algorithm does not
need it.

What it guarantees (test_reliability.py: test_an_atomic_write_is_on_disk_before_its_rename,
test_an_atomic_write_stopped_by_ctrl_c_leaves_no_temporary_file,
test_a_full_disk_anywhere_is_one_error_line_and_keeps_the_last_checkpoint; test_reproduce.py and test_bench.py
for their writers):
- a file appears whole under its name: written to a temporary file, fsynced, then os.replace'd, so neither a
  kill nor a power cut (the data is on disk before the rename) leaves a partial or empty file there;
- it never writes through a link: a temporary file already there (a symbolic link to a file elsewhere, or a
  FIFO, in a directory one was handed) is removed first, not overwritten where it points nor waited on;
- a write that fails (a full disk, an exception, Ctrl-C) removes its temporary file before the error goes on (a
  kill's is removed by the next run), and an OSError that names no file names `path`;
- the JSON written through strict_json is strict (RFC 8259): a NaN or +-inf float, which Python's json writes as a
  bare NaN / Infinity that jq, JavaScript's JSON.parse and most readers refuse, is written as null.
"""
import json
import math
import os
from pathlib import Path


def replace_atomic(path, write, tmp=None):
    """write(tmp), fsync, then os.replace(tmp, path)."""
    tmp = tmp or path + ".tmp"
    try:
        if os.path.islink(tmp) or os.path.lexists(tmp) and not os.path.isdir(tmp):  # a kill's leftover, or a link
            os.remove(tmp)  # or FIFO in a directory one was handed: written through, a link would overwrite the file
            # it points to, wherever that is, and a FIFO's open would wait for a reader forever
        write(tmp)
        with open(tmp, "rb+") as f:  # rb+: Windows' fsync wants a writable handle; nothing is truncated
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.isfile(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno and e.filename is None:  # a write the disk refused names no file
            e.filename = path
        raise


def write_atomic(path, text, tmp=None):
    """Text, as UTF-8, through replace_atomic."""
    replace_atomic(path, lambda name: Path(name).write_text(text, encoding="utf-8"), tmp)


def finite_or_null(obj):
    """NaN or +-inf -> None, in nested dicts and lists (a one-sentence context has no score, a diverged run no loss)."""
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def strict_json(obj, **kwargs):
    """json.dumps, strict: each non-finite float written as null."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kwargs)
