"""The run directory (out_dir): what makes a run safe to kill, resume and trust. The algorithm does not need it.

It guarantees (test_reliability.py and test_train.py hold it to each):
- one run per out_dir: an OS file lock (flock), released by the OS however the holder dies (a file system
  without locks: a note, and the run goes on unlocked);
- every file is written atomically (NAME.tmp, then a rename); a run killed mid-save leaves its partial
  files, which the next run on the out_dir removes; a half-written last log line is dropped;
- ckpt.pt is what --resume trusts; the Hugging Face export is written after it and rewritten from it
  when the two disagree (a run killed between them); a failed save or log write (a full disk) is one line
  and keeps the last good one;
- a resume reads its own tokenizer and refuses other data (a fingerprint of the token streams), as a run
  refuses ranks that read other tokens than rank 0 (a node's own copy of --data or --cache_dir), run
  other code (a node's own checkout, edited; another torch), were given other flags (but their paths) or
  would go on from another checkpoint step (a node's own --out_dir);
- every segment of a run records the code that ran (git commit, code.diff of local changes, each module's
  hash), torch, host; a resume names the modules that changed since the run last started;
- bad input is one `error:` line and exit 2 (under torchrun from rank 0, plus one `error (rank N):` line from
  each other node's first process and from a rank that alone meets it), nothing saved is touched.
"""
import errno
import hashlib
import json
import math
import os
import re
import socket
import stat
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict, fields, replace

import numpy as np
import torch
from safetensors import SafetensorError

import data
import distributed
import token_files
from atomic import replace_atomic, strict_json, write_atomic
from config import (RankError, TrainConfig, data_path, init_dir, parse_args, pooled, unread_flags, validate,
                    warmup_note)
from hf_io import checkpoint_config, load_checkpoint_file, load_safetensors, still_training
from model import Bert, BertConfig
from monitor import Diverged, duration

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # (Windows has none)

# the files a run writes into out_dir, each through NAME.tmp or NAME.tmpPID and a rename
RUN_FILES = (r"ckpt\.pt|model\.safetensors|config\.json|tokenizer\.json|vocab\.txt|tokenizer_config\.json|"
             r"special_tokens_map\.json|code(-step\d+)?\.diff")


class SaveFailed(Exception):
    """A checkpoint could not be written (a full disk): its partial files are gone, ckpt.pt is the last good one."""


def run_main(train, argv, usage):
    """train.py's command line: flags -> TrainConfig (or a checkpoint's, with --resume), checked, the
    out_dir locked, then train(cfg, ckpt). Errors become one line and an exit code."""
    lock = made = cfg = None
    rank = distributed.env_int("RANK")  # torchrun's; errors are printed once, by rank 0
    handlers = distributed.StopSignals.process_handlers()  # put back on the way out: the caller may go on (a notebook)
    try:
        try:
            cfg, given = parse_args(sys.argv[1:] if argv is None else argv, usage=usage)
        except ValueError as e:  # main() without flags reads the command line, in a notebook the kernel's
            raise ValueError(f"{e}{whose_command_line() if argv is None else ''}") from None
        if cfg.init_from and "model_size" in given:
            raise ValueError(f"--model_size {cfg.model_size}: with --init_from the model is the checkpoint's own; "
                             f"drop --model_size")
        ckpt = None
        if cfg.resume == "auto":  # one command for a requeued job (or torchrun --max_restarts): start, or go on
            saved = os.path.isfile(os.path.join(cfg.out_dir, "ckpt.pt"))
            cfg.resume = given["resume"] = cfg.out_dir if saved else ""
            if not saved and rank == 0:
                print(f"--resume auto: no ckpt.pt in {cfg.out_dir}, so a new run")
        if cfg.resume:
            cfg, ckpt = resume_config(cfg, given)
        validate(cfg)
        if rank == 0:
            for note in unread_flags(cfg, given) + warmup_note(cfg, given):
                print(note)
            made = None if os.path.isdir(cfg.out_dir) else cfg.out_dir
            lock = take_lock(cfg.out_dir)  # before anything is written there
            remove_partial_writes(cfg.out_dir)
            check_log_file(cfg.out_dir)
        code = train(cfg, ckpt)
    except ValueError as e:  # bad input: one clear line, exit 2, nothing saved is touched
        if rank == 0:  # once, not once per DDP rank: most bad input is the same on every rank
            sys.stderr.write(f"error: {e}\n")
        elif isinstance(e, RankError) or distributed.env_int("LOCAL_RANK") == 0:
            sys.stderr.write(f"error (rank {rank}): {e}\n")  # its own GPU; another node's disk
        sys.exit(2)
    except (Diverged, SaveFailed) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:  # the system failed a read or a write outside a save (a full disk, a lost mount)
        sys.stderr.write(f"error{f' (rank {rank})' if rank else ''}: {e}\n")
        sys.exit(1)
    except (RuntimeError, MemoryError) as e:  # another process of a torchrun job died: its own output says why
        if not (peer := distributed.lost_peer(e)):
            if oom := out_of_memory(e, cfg):  # a micro-batch too big for the device: one line and the way out
                sys.stderr.write(f"error{f' (rank {rank})' if rank else ''}: {oom}\n")
                sys.exit(1)
            raise
        left = distributed.env_int("TORCHELASTIC_MAX_RESTARTS") - distributed.env_int("TORCHELASTIC_RESTART_COUNT")
        then = (f"torchrun restarts the job ({left} restart(s) left), which goes on from it where the command has "
                f"--resume auto" if left > 0 else f"rerun with --resume {cfg.out_dir}")
        sys.stderr.write(f"error (rank {rank}): lost another process of this run ({peer}); the last checkpoint "
                         f"stands: {then}\n")
        sys.exit(1)
    except KeyboardInterrupt:  # before the training loop, which handles its own
        print("interrupted before training started: nothing was saved", file=sys.stderr)
        sys.exit(130)
    finally:
        if lock:
            release_lock(lock)
        if made and os.path.isdir(made) and not os.listdir(made):  # bad input found late (a --data path)
            os.rmdir(made)
        distributed.StopSignals.put_back(handlers)
    if code:
        sys.exit(code)


def memory_error(error):
    """What a device out of memory said (CUDA's OutOfMemoryError, MPS's, the CPU allocator's, Python's
    MemoryError): its first two sentences ("CUDA out of memory. Tried to allocate 2.00 GiB"; CUDA's goes on for a
    paragraph). None for any other error."""
    text = str(error).strip()
    if not (isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)) or re.search(
            r"out of memory|can't allocate memory|not enough memory", text)):
        return None
    return ". ".join((text.splitlines() or [type(error).__name__])[0].split(". ")[:2])[:200]


def out_of_memory(error, cfg):
    """One line for a run out of memory saying what to lower; None for any other error."""
    if cfg is None or not (said := memory_error(error)):
        return None
    saved = os.path.isfile(os.path.join(cfg.out_dir, "ckpt.pt"))
    return (f"out of memory ({said}): lower --batch_size (this run's micro-batch, {cfg.batch_size} sequences a "
            f"process; --tokens_per_step stays, with more gradient accumulation), --seq_len or --model_size; " + (
                f"{cfg.out_dir}/ckpt.pt stands: --resume {cfg.out_dir} --batch_size N goes on from it" if saved
                else "no checkpoint was saved yet"))


def whose_command_line():
    """Where main() called without flags read a flag it refused: sys.argv[1:] is another program's where train.main()
    is called from Python (Jupyter's kernel: ['-f', '.../kernel-N.json'])."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if program == "train.py":
        return ""
    return (f", in the command line of {program} (sys.argv[1:] = {sys.argv[1:]}), which train.main() reads when called "
            f"without flags; from Python, pass them: train.main(['--objective', 'taco', '--max_steps', '20'])")


# what --resume may not change: the model and its vocabulary, the data order and the validation split
FIXED_ON_RESUME = ("objective", "model_size", "seq_len", "vocab_size", "data", "tokenizer", "seed", "val_fraction")
# and how its tokenizer was trained: a checkpoint older than these flags holds none (it was trained with their defaults)
TOKENIZER_TRAINING = ("cased", "limit_alphabet")


def resume_config(cfg, given):
    """(config, checkpoint) of --resume: the checkpoint's config with the flags given now on top."""
    path = os.path.join(cfg.resume, "ckpt.pt") if os.path.isdir(cfg.resume) else cfg.resume
    if not os.path.exists(cfg.resume):
        raise ValueError(f"--resume {cfg.resume}: no such run directory or checkpoint file")
    run_dir = os.path.dirname(path) or "."
    if not os.path.isfile(path) and os.path.isfile(os.path.join(run_dir, "config.json")):
        raise ValueError(f"--resume {cfg.resume}: a model (config.json) but no ckpt.pt to resume; to train on from "
                         f"its weights, start a new run with --init_from {run_dir}")
    if not os.path.isfile(path):
        raise ValueError(f"--resume {cfg.resume}: no checkpoint there (a run stopped before its first save: "
                         f"run its original command again)")
    ckpt = load_checkpoint_file(path)  # a model.safetensors or vocab.txt given for its directory is refused here
    own = os.path.join(run_dir, "ckpt.pt")
    if os.path.isfile(own) and not os.path.samefile(own, path):  # the run would save over its directory's newer one
        raise ValueError(f"--resume {path}: the run would go on in {run_dir} and save over its ckpt.pt, another "
                         f"checkpoint; copy the directory, put {os.path.basename(path)} there as ckpt.pt, resume the copy")
    missing = {"model", "model_config", "objective", "optimizer", "scaler", "step", "loader", "config"} - set(ckpt)
    model_config = ckpt["model_config"] if isinstance(ckpt["model_config"], dict) else {"(not a dict)": None}
    unknown = set(model_config) - {f.name for f in fields(BertConfig)}
    if missing or unknown:
        raise ValueError(f"--resume {path}: not a resumable checkpoint of this version (missing "
                         f"{sorted(missing)}, unknown model_config keys {sorted(unknown)})")
    checkpoint_config(ckpt, f"--resume {path}")  # its sizes against its weights: never a model built too big to fit
    if type(ckpt["step"]) is not int or ckpt["step"] < 0:
        raise ValueError(f"--resume {path}: its step is {ckpt['step']!r}, not an integer >= 0 (an edited or corrupt "
                         f"checkpoint)")
    elapsed, loader = ckpt["elapsed_s"] if "elapsed_s" in ckpt else 0.0, ckpt["loader"]
    if type(elapsed) not in (int, float) or not elapsed >= 0:
        raise ValueError(f"--resume {path}: its elapsed_s is {elapsed!r}, not seconds >= 0 (an edited or corrupt checkpoint)")
    if not isinstance(loader, dict) or type(loader.get("sequences")) is not int or not 0 <= loader["sequences"] < 2 ** 62:
        raise ValueError(f"--resume {path}: its loader state is {loader!r}, not {{'sequences': a count >= 0}} (an "
                         f"edited or corrupt checkpoint)")
    saved = ckpt["config"]  # not a dict: saved_config says so
    absent = [k for k in (*FIXED_ON_RESUME, "max_steps") if k not in saved] if isinstance(saved, dict) else []
    if absent:
        raise ValueError(f"--resume {path}: its config lacks {', '.join(absent)} (an edited or corrupt checkpoint)")
    saved = saved_config(ckpt, path)
    for name in (n for n in FIXED_ON_RESUME + TOKENIZER_TRAINING if n in given):
        if given[name] != (data_path(saved.data) if name == "data" else getattr(saved, name)):
            raise ValueError(f"--resume {path}: checkpoint has {name}={getattr(saved, name)!r}, flags say "
                             f"{given[name]!r} (it would change the model, its vocabulary or the data order)")
    for name in ("preset", "init_from"):  # a resume keeps its checkpoint's config and weights: these would do nothing
        old, new = getattr(saved, name), given.get(name, getattr(saved, name))
        if (os.path.realpath(old) != os.path.realpath(new)) if old and new and name == "init_from" else old != new:
            raise ValueError(f"--{name} {new}: the run in {run_dir} was made with {name} {old!r}, and a resume goes "
                             f"on with its own (to start a new run from its weights: --init_from {run_dir})")
    # how this directory's run last started: a ckpt.pt copied in from another run differs
    started = last_start_config(run_dir)
    other = [k for k in ("objective", "model_size", "seed", "vocab_size", "seq_len")
             if k in started and started[k] != getattr(saved, k)]
    if other:
        raise ValueError(f"--resume {path}: its checkpoint has {', '.join(f'{k} {getattr(saved, k)!r}' for k in other)}"
                         f", but {os.path.join(run_dir, 'log.jsonl')} last started with "
                         f"{', '.join(f'{k} {started[k]!r}' for k in other)}: a ckpt.pt from another run, or an edited "
                         f"log.jsonl (keep both until you know which)")
    if given.get("max_steps", saved.max_steps) < ckpt["step"]:
        raise ValueError(f"--max_steps {given.get('max_steps', saved.max_steps)}: the run in {run_dir} is already at "
                         f"step {ckpt['step']}; to train on, pass a larger --max_steps")
    if "out_dir" in given and os.path.realpath(given["out_dir"]) != os.path.realpath(run_dir):
        raise ValueError(f"--resume continues the run in {run_dir}; --out_dir {given['out_dir']} is another "
                         f"directory (to start a new run from its weights, use --init_from {run_dir})")
    return replace(saved, **{**{k: v for k, v in given.items() if k != "preset"}, "out_dir": run_dir}), ckpt


def last_start_config(run_dir, key="config"):
    """The config (or another part: provenance) of log.jsonl's last start or resume line (the run's latest
    start), or {} when none is readable."""
    config, path = {}, os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):  # none, or a FIFO (whose open would wait for a writer forever)
        return config
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith('{"config"'):
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    config = record[key] if isinstance(record.get(key), dict) else config
    except (OSError, UnicodeDecodeError):
        return {}
    return config


def saved_config(ckpt, path="checkpoint"):
    """The TrainConfig a checkpoint was trained with (fields it does not know are dropped); a value of the
    wrong type (an edited or corrupt checkpoint) is one ValueError."""
    types = {f.name: f.type for f in fields(TrainConfig)}
    saved = ckpt["config"]
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: its config is a {type(saved).__name__}, not a dict (an edited or corrupt checkpoint)")
    for k, v in saved.items():
        if k in types and not (type(v) is types[k] or types[k] is float and type(v) is int):
            raise ValueError(f"{path}: its config has {k} = {v!r}, not a {types[k].__name__} (an edited or corrupt "
                             f"checkpoint)")
    return TrainConfig(**{k: v for k, v in saved.items() if k in types})


# the errors of a lock another process holds (EACCES and EDEADLK: Windows' msvcrt.locking); any other is a file
# system without locks
LOCK_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK)


def take_lock(out_dir, name=".lock", what=None):
    """Hold out_dir/.lock while a run writes there: a second run on the same out_dir is refused. It is
    an OS file lock (flock), so the OS releases it when the process dies, however it dies, on this host
    or another one sharing the file system: a killed run never leaves a stale lock. The file holds
    "pid host" for the error message. Returns the open file: closing it (or exiting) releases the lock.
    On a file system without locks it says so and goes on unlocked.
    name and what: another writer's lock in out_dir and what its error calls out_dir (eval.py's, locked)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    while True:
        try:  # never through a symbolic link: the "pid host" below would truncate the file it points to
            if not NOFOLLOW and os.path.islink(path):  # Windows: no O_NOFOLLOW to refuse it
                raise OSError(errno.ELOOP, "a symbolic link")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | NOFOLLOW, 0o666)
        except OSError as e:  # .lock is a directory, a symbolic link, or unwritable
            why = "a symbolic link: a lock file is one this project makes; remove it" if e.errno == errno.ELOOP \
                else e.strerror
            raise ValueError(f"cannot open the lock file {path} ({why})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device put there
            os.close(fd)
            raise ValueError(f"cannot open the lock file {path} (not a regular file: a lock file is one this project "
                             f"makes; remove it)")
        f = open(path, "a+", encoding="utf-8", opener=lambda *_: fd)  # (named: release_lock removes f.name)
        try:
            if os.name == "nt":  # Windows has no flock: lock the first byte
                import msvcrt
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
            else:
                import fcntl
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in LOCK_HELD:  # a file system without locks (Lustre without -o flock, some NFS and
                # FUSE mounts): no run holds this lock, and refusing would stop every run there. Go on unlocked
                print(f"note: cannot lock {path} ({e.strerror}): this file system has no file locks, so another "
                      f"writer into {what or f'--out_dir {out_dir}'} would not be refused; run one at a time there",
                      file=sys.stderr)
                break
            try:
                f.seek(0)
                pid, host = f.read().split()
                holder = f"process {pid} on {host}"
            except (OSError, ValueError):
                holder = "another process"
            f.close()
            raise ValueError(f"{what or f'--out_dir {out_dir}'} is in use by {holder} (it holds {path})") from None
        try:  # the holder we waited on may have deleted the file on its way out: lock the one at path
            same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    try:  # "pid host" only names the holder in another run's error: a full disk must not stop this one here
        f.seek(0)
        f.truncate()
        # a host name that is not UTF-8 (the kernel takes any bytes): its bytes as \xNN, not a UnicodeEncodeError
        host = socket.gethostname().encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        f.write(f"{os.getpid()} {host}")
        f.flush()
    except OSError:
        pass
    return f


def release_lock(lock):
    """Delete the .lock, then release it (in this order: see take_lock's samestat check)."""
    try:
        os.remove(lock.name)
    except OSError:
        pass
    try:  # on a full disk the "pid host" take_lock could not write is still buffered: closing fails to flush it
        lock.close()  # (the file is closed all the same, so the lock is released)
    except OSError:
        pass


@contextmanager
def locked(out_dir, name, what):
    """take_lock for eval.py, whose GLUE results and analyses are sets of files in one directory (a run's, by
    default) read back and rewritten: a second eval.py into the same directory is refused, rather than
    overwriting the first one's files or moving them aside under it. A directory made here and left empty
    is removed."""
    made = not os.path.isdir(out_dir)
    lock = take_lock(out_dir, name, what)
    try:
        yield
    finally:
        release_lock(lock)
        if made and os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)


def move_aside(folder, moves):
    """Move a set of files (eval.py's earlier GLUE results, an earlier analysis) aside to the first number k free
    for all of them; moves(k) lists (name, its name at k) in the order they move, the one whose presence says the
    set is still here last. A k whose first file is there, where nothing still here would land on a file, is such
    a move cut short by a kill: the rest goes there, not to the next k. Returns k."""
    here = lambda name: os.path.exists(os.path.join(folder, name))
    k = 1
    while any(here(aside) for _, aside in moves(k)) and not (
            here(moves(k)[0][1]) and not any(here(name) and here(aside) for name, aside in moves(k))):
        k += 1
    for name, aside in moves(k):
        if here(name):
            os.replace(os.path.join(folder, name), os.path.join(folder, aside))
    return k


def remove_partial_writes(out_dir):
    """A run killed mid-save leaves its temporary file (ckpt.pt.tmp: over a GB for BERT-base); the
    finished files, and any file that is not one of ours, are untouched. Called under the lock, so
    no other run is writing here."""
    for name in os.listdir(out_dir):
        if re.fullmatch(rf"({RUN_FILES})\.tmp\d*", name) and os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


def check_log_file(out_dir):
    """log.jsonl is the one file a run writes in place (appended to, a half-written last line cut): a symbolic link
    there (a run directory one was handed) would have it write into the file it points to, a FIFO hang the run."""
    path = os.path.join(out_dir, "log.jsonl")
    if os.path.islink(path) or os.path.lexists(path) and not os.path.isfile(path):
        raise ValueError(f"{path} is {'a symbolic link' if os.path.islink(path) else 'not a regular file'}: a run "
                         f"appends to its own log.jsonl only; replace it with a copy of the file")


def atomic_save(obj, path):
    try:
        replace_atomic(path, lambda tmp: torch.save(obj, tmp))
    except RuntimeError as e:
        # torch.save's words for a write the disk refused lose the system's reason: say which file, and what most
        # likely stopped it (any other RuntimeError is a bug's, and keeps its traceback)
        if not re.search(r"unexpected pos|iostream error|file write failed", str(e)):
            raise
        raise OSError(f"torch.save could not write {os.path.basename(path)}: is the disk full, or a file-size limit "
                      f"reached? (torch: {(str(e).splitlines() or [''])[0][:120]})") from None


def data_fingerprint(train_tokens, val_tokens):
    """The token streams' sizes and a hash of 4,096 tokens spread over each: a resume refuses other or
    edited data (same path, other files; a corpus changed in place), which would silently move the run."""
    h = hashlib.sha1()
    for tokens in (train_tokens, val_tokens):
        h.update(np.asarray(tokens[np.linspace(0, max(len(tokens) - 1, 0), 4096).astype(np.int64)]).tobytes()
                 if len(tokens) else b"")
    return f"{len(train_tokens)}+{len(val_tokens)} tokens, sha1 {h.hexdigest()[:16]}"


def code_fingerprint():
    """{file: sha1} of this project's modules (every .py file beside this one but the tests) and torch's version."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = {"torch": torch.__version__}
    for name in sorted(os.listdir(here)):
        if name.endswith(".py") and not name.startswith("test_") and name != "conftest.py":
            with open(os.path.join(here, name), "rb") as f:
                code[name] = hashlib.sha1(f.read()).hexdigest()[:12]
    return code


# the flags a node may give its own way: its own paths (a copy of --data, the tokenizer or the weights on its disk, a
# local --cache_dir; rank 0 alone writes out_dir) and device choices that change no number of the recipe
NODE_FLAGS = ("data", "tokenizer", "cache_dir", "out_dir", "resume", "init_from", "device", "compile")


def same_on_every_rank(cfg, layout, fingerprint=None, ckpt=None):
    """Every node runs the same code (an ablation's edit on one node would mix two objectives in one run) with
    the same flags but NODE_FLAGS (a node launched with its own --lr trained its replica with it, silently),
    goes on from the same checkpoint step (`ckpt`: a node whose --out_dir is not the shared one would resume
    another step, or start anew under --resume auto) and, with its own copy of --data or its own --cache_dir,
    has read the same tokens (`fingerprint`: checked once the data is read; train.py checks code, flags and
    step before): else every rank raises, and rank 0 and each other node's first process say why."""
    code = code_fingerprint()
    flags = {k: v for k, v in asdict(cfg).items() if k not in NODE_FLAGS}
    step = ckpt["step"] if ckpt else None
    ranks = distributed.every_rank(layout, (code, flags, fingerprint, step))
    # code first, by position: another checkout may gather another tuple (a 3-tuple before the step was added)
    others = {r: value[0] for r, value in enumerate(ranks) if value[0] != code}
    if others:
        theirs = others[min(others)]
        differ = sorted(name for name in code.keys() | theirs.keys() if code.get(name) != theirs.get(name))
        raise ValueError(f"rank(s) {', '.join(map(str, others))} run other code than rank {layout.rank} "
                         f"(on rank {min(others)}, other {', '.join(differ)}): every node needs the same "
                         f"checkout of this project and the same torch")
    others = {r: s for r, (_, _, _, s) in enumerate(ranks) if s != step}
    if others:
        say = lambda s: f"step {s}" if s is not None else "a new run"
        whose = f" (rank {min(others)}'s)" if len(others) > 1 else ""
        raise ValueError(f"rank(s) {', '.join(map(str, others))} start from {say(others[min(others)])}{whose}, rank "
                         f"{layout.rank} from {say(step)}: every node must see the same --out_dir {cfg.out_dir} and "
                         f"its ckpt.pt (a filesystem they share)")
    others = {r: f for r, (_, f, _, _) in enumerate(ranks) if f != flags}
    if others:
        theirs = others[min(others)]
        differ = [f"--{k} {theirs[k]} (here {v})" for k, v in flags.items() if theirs.get(k) != v]
        raise ValueError(f"rank(s) {', '.join(map(str, others))} run with other flags than rank {layout.rank} "
                         f"(on rank {min(others)}: {', '.join(differ)}): every node needs the same train.py flags "
                         f"(but its own paths: --{', --'.join(NODE_FLAGS[:6])})")
    others = {r: f for r, (_, _, f, _) in enumerate(ranks) if f != fingerprint}
    if others:
        raise ValueError(f"--data {cfg.data}: rank(s) {', '.join(map(str, others))} read other data than rank "
                         f"{layout.rank} ({fingerprint}; rank {min(others)}: {others[min(others)]}): every node "
                         f"needs the same data files and tokenizer")


def repair_log(path):
    """A run killed mid-write leaves a partial last line in log.jsonl: drop it, so the next record
    starts on its own line. A whole record that lacks only its newline is kept and ended."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        text = f.read()
        start = text.rfind(b"\n") + 1
        try:
            json.loads(text[start:])
            f.write(b"\n")  # at the end: the record was whole
        except ValueError:
            f.seek(start)
            f.truncate()


GIT_TIMEOUT = 30  # seconds for each git call (a hung git: a stale NFS mount, a fsmonitor hook)


def provenance(out_dir=None, diff_name="code.diff"):
    """The code that ran: git commit, whether the checkout had local changes (and the sha1 of
    `git diff HEAD` plus any untracked .py file, saved as out_dir/diff_name), torch version, host.
    Outside git: commit None. A checkout git cannot read (another user's: "dubious ownership"; an edited file
    this user cannot read; a git that hangs) is one note, and dirty None (unknown), not a clean checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    # bytes that are not UTF-8 (a latin-1 comment in an edited file) are replaced: strict, they stopped the run;
    # LC_ALL=C: git's messages in English, which "not a git repository" below is matched against
    git = lambda *args: subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, encoding="utf-8",
                                       errors="replace", env={**os.environ, "LC_ALL": "C"}, timeout=GIT_TIMEOUT)
    failed = lambda done: (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0][:200]
    commit, diff, unread = None, "", None  # unread: why git could not say what this checkout holds
    try:
        out = git("rev-parse", "HEAD")
        if out.returncode == 0:
            commit, diffed = out.stdout.strip(), git("diff", "HEAD")
            if diffed.returncode:
                unread = f"`git diff HEAD` failed ({failed(diffed)})"
            else:
                diff = diffed.stdout
                top = git("rev-parse", "--show-toplevel").stdout.strip()
                for name in git("ls-files", "--others", "--exclude-standard", "--full-name", ":/*.py").stdout.split():
                    with open(os.path.join(top, name), encoding="utf-8", errors="replace") as f:  # an ablation's module
                        diff += f"untracked file {name}:\n" + "".join("+" + line for line in f)
        elif not re.search("not a git repository|ambiguous argument 'HEAD'", out.stderr):  # (or no commit yet)
            unread = f"`git rev-parse HEAD` failed ({failed(out)})"
    except subprocess.TimeoutExpired as e:
        unread = f"`{' '.join(e.cmd)}` did not answer in {GIT_TIMEOUT} s"
    except (OSError, subprocess.SubprocessError):
        pass  # no git installed
    if unread:
        recorded = f"commit {commit[:7]} with its local changes unknown" if commit else "no commit"
        print(f"note: {unread}: log.jsonl records {recorded} (each module's sha1 still says which code ran)")
    if diff and out_dir and not unread:
        write_atomic(os.path.join(out_dir, diff_name), diff)
    return dict(git_commit=commit, dirty=None if unread else bool(diff),
                diff_sha1=hashlib.sha1(diff.encode()).hexdigest() if diff and not unread else None,
                torch=torch.__version__, host=socket.gethostname(), modules=code_fingerprint())


def export_step(out_dir):
    """The training step recorded in the Hugging Face export (model.safetensors and config.json), or
    None when the two disagree, are missing or the weights are corrupt."""
    try:
        from safetensors import safe_open
        if not all(os.path.isfile(os.path.join(out_dir, f)) for f in ("model.safetensors", "config.json")):
            return None  # missing, or a FIFO (whose open would wait for a writer forever): the export is rewritten
        with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
            weights_step = (f.metadata() or {}).get("training_step")
        load_safetensors(os.path.join(out_dir, "model.safetensors"))  # checks its weights_sha1
        with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
            config_step = json.load(f).get("training_step")
    except Exception:
        return None
    return config_step if weights_step is not None and str(config_step) == weights_step else None


def start_weights(cfg, master):
    """--init_from's model (TaCL's teacher and start; continued MLM), and the tokenizer its weights were
    trained with (cfg.tokenizer is set to it). None for a run from scratch or a resume."""
    init_model = Bert.from_pretrained(cfg.init_from)
    weights_dir = init_dir(cfg.init_from)
    if master and still_training(cfg.init_from):  # its export moves on at each checkpoint: say which one this is
        print(f"note: {cfg.init_from} is still training (a train.py holds its .lock): this run starts from its step "
              f"{init_model.training_step} export, not the one it will end with")
    if not cfg.tokenizer:
        if not any(os.path.isfile(os.path.join(weights_dir, f)) for f in ("tokenizer.json", "vocab.txt")):
            raise ValueError(f"--init_from {cfg.init_from}: no tokenizer.json or vocab.txt in {weights_dir}, so "
                             "the vocabulary its weights were trained with is unknown; pass --tokenizer DIR or "
                             "a hub name (e.g. bert-base-uncased)")
        cfg.tokenizer = weights_dir  # the vocabulary the weights were trained with
    return init_model


def trains_head(model):
    """Whether the built objective trains the MLM head: its parameters still need a gradient (MLM, TACO, TaCL, an
    objective added to losses.LOSSES; ELECTRA and COCO-LM switch it off, and their export leaves it out)."""
    return any(p.requires_grad for p in model.head.parameters())


def note_fresh_head(cfg, init_model, model, master):
    """Says (rank 0) that --init_from's MLM head was never trained, where this run's objective trains that head."""
    if master and init_model is not None and init_model.fresh_head and trains_head(model):
        print(f"note: {cfg.init_from} has no MLM head that its run trained (a BertModel, or an ELECTRA / COCO-LM "
              f"run): the head starts untrained or stale")


def load_start_weights(model, init_model, ckpt):
    """--init_from's weights into a new model. A start model's pooler (a Hugging Face BERT's, or one carried by
    an earlier run) rides along unchanged into the export: nothing here trains it (fidelity note 37)."""
    if "pooler.weight" in (init_model.state_dict() if init_model else ckpt["model"] if ckpt else {}):
        size = model.config.hidden_size
        model.pooler = torch.nn.Linear(size, size).requires_grad_(False)
    if init_model:
        model.load_state_dict(init_model.state_dict())


def run_tokenizer(cfg, ckpt):
    """A resumed run reads its own vocabulary from its directory, never the cache's or a newly trained one."""
    if not ckpt:
        return cfg.tokenizer or None
    if not any(os.path.isfile(os.path.join(cfg.out_dir, f)) for f in ("tokenizer.json", "vocab.txt")):
        raise ValueError(f"--resume {cfg.out_dir}: the run's tokenizer.json / vocab.txt are missing")
    # the run reads tokenizer.json (the data check covers it), transformers' BertTokenizer its vocab.txt
    both = [os.path.join(cfg.out_dir, f) for f in ("tokenizer.json", "vocab.txt")]
    if all(map(os.path.isfile, both)):
        try:
            tok = token_files.read_tokenizer(both[0])[0]
        except (ValueError, OSError):
            tok = None  # unreadable: data.load_tokenizer's error line says so
        if tok and not token_files.vocab_matches(tok, cfg.out_dir):
            raise ValueError(f"--resume {cfg.out_dir}: its vocab.txt disagrees with its tokenizer.json (one of "
                             f"them edited, replaced or damaged); put back the run's copies (the cache's tokenizer-* "
                             f"directory has both)")
    return cfg.out_dir


def model_config_for(cfg, ckpt, init_model, fresh, special):
    """The model's shape: a resume's own, --init_from's (checked against the tokenizer), else `fresh`."""
    if ckpt:
        return replace(BertConfig(**ckpt["model_config"]), dropout=cfg.dropout)  # --dropout may change
    if init_model:
        # [PAD] and [SEP] too, as eval.py checks them: a run started from a config.json whose pad_token_id is not
        # the tokenizer's [PAD] trained, then exported that config, which eval.py refused
        c = init_model.config
        mine = (c.vocab_size, c.mask_token_id, c.cls_token_id, c.pad_token_id, c.sep_token_id)
        theirs = (fresh.vocab_size, special["mask"], special["cls"], special["pad"], special["sep"])
        if mine != theirs:
            why = ("training needs them equal: MLM predicts over the rows and random replacements draw from them"
                   if mine[1:] == theirs[1:] else "pass --tokenizer with the one its weights were trained with")
            raise ValueError(f"--init_from {cfg.init_from}: its vocabulary (size, [MASK], [CLS], [PAD], [SEP] = {mine}) "
                             f"does not match the tokenizer's in {cfg.tokenizer} {theirs}; {why}")
        return replace(init_model.config, dropout=cfg.dropout)
    return fresh


class Run:
    """The run directory as the loop sees it: attach() the objects a checkpoint holds, then restore(),
    start(), log(), save(), close()."""

    def __init__(self, cfg, layout, ckpt, fingerprint):
        if ckpt and ckpt.get("data", fingerprint) != fingerprint:  # (checkpoints before this check have none)
            made = ckpt.get("token_format", "not recorded (1 before 2026-11-27)")  # how the code tokenized the data
            raise ValueError(f"--resume {cfg.out_dir}: --data {cfg.data} is not the data this run was trained on "
                             f"(then {ckpt['data']}, now {fingerprint}): the files were edited, replaced or moved, or the run's "
                             f"tokenizer files in {cfg.out_dir} were (they make the tokens)" + (
                                 f", or the code that makes them: the run's token format is {made}, this version's "
                                 f"{token_files.FORMAT_VERSION} (2: a '[SEP]' written in the text is text): finish the "
                                 f"run with the version it started with (log.jsonl's git_commit)"
                                 if made != token_files.FORMAT_VERSION else ""))
        same_on_every_rank(cfg, layout, fingerprint, ckpt)
        self.cfg, self.layout, self.ckpt, self.fingerprint = cfg, layout, ckpt, fingerprint
        self.saved_step, self.log_file, self.diff_name, self.code_changed = 0, None, "code.diff", []
        self.local_changes = None  # rank 0: the path of this segment's code diff, where the code had local changes

    def attach(self, model, model_config, objective, optimizer, train_loader, scaler):
        self.model, self.model_config, self.objective = model, model_config, objective
        self.optimizer, self.train_loader, self.scaler = optimizer, train_loader, scaler
        self.trains_head = trains_head(model)  # COCO-LM, ELECTRA: export without it

    def restore(self):
        """Load ckpt.pt into the attached objects. Returns (step, training seconds so far); (0, 0.0) when new."""
        ckpt, cfg = self.ckpt, self.cfg
        if not ckpt:
            return 0, 0.0
        try:
            self.model.load_state_dict(ckpt["model"])
            self.objective.load_state_dict(ckpt["objective"])
            # the saved param groups would override the flags given now (and fused=, which follows the device)
            state = ckpt["optimizer"]
            for group, decay in zip(state["param_groups"], (cfg.weight_decay, 0.0)):
                group.update(betas=(0.9, cfg.beta2), eps=cfg.adam_eps, weight_decay=decay,
                             fused=self.layout.device_type == "cuda")
            self.optimizer.load_state_dict(state)
            for p, moments in self.optimizer.state.items():  # load_state_dict does not check: a mismatch fails mid-step
                if any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in moments.values()):
                    raise ValueError(f"optimizer state of shape {[tuple(v.shape) for v in moments.values()]} for a "
                                     f"weight of shape {tuple(p.shape)}")
            self.train_loader.load_state_dict(ckpt["loader"])  # global sequences read: exact on any batch / world size
            if self.scaler.is_enabled() and ckpt["scaler"]:  # a bf16 / fp32 run saved an empty state: a fresh scale
                self.scaler.load_state_dict(ckpt["scaler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--resume: checkpoint does not match this run ({' '.join(str(e).split())[:300]})") from None
        self.saved_step = ckpt["step"]
        return ckpt["step"], ckpt.get("elapsed_s", 0.0)  # (checkpoints before elapsed_s was saved: 0)

    def start(self, tok, step):
        """Rank 0: the tokenizer (once) and log.jsonl's first record: the config and the code that ran."""
        if not self.layout.master:
            return
        cfg, ckpt = self.cfg, self.ckpt
        if not ckpt:  # a resumed run's tokenizer is the one in its directory: never rewritten
            data.save_tokenizer(tok, cfg.out_dir, self.model_config.max_position_embeddings)
        log_path = os.path.join(cfg.out_dir, "log.jsonl")
        if not ckpt and os.path.isfile(log_path):
            print(f"note: {cfg.out_dir} holds a run stopped before its first checkpoint: it starts again from step 0 "
                  f"(its log.jsonl goes on; a step logged twice counts once, the later)")
        repair_log(log_path)
        self.log_file = open(log_path, "a", encoding="utf-8")
        # the code that ran, for each segment of the run: a resume's local changes go to code-step{N}.diff
        self.diff_name = f"code-step{step}.diff" if ckpt else "code.diff"
        start = {"config": asdict(cfg), "provenance": provenance(cfg.out_dir, self.diff_name)}
        old, new = last_start_config(cfg.out_dir, "provenance"), start["provenance"]
        self.local_changes = os.path.join(cfg.out_dir, self.diff_name) if new["dirty"] else None
        before, now = old.get("modules"), new["modules"]
        if ckpt and isinstance(before, dict):  # an edit between two segments: one run, two codes (said on resume)
            self.code_changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        elif ckpt and isinstance(old.get("git_commit"), str) and (
                old["git_commit"], old.get("diff_sha1")) != (new["git_commit"], new["diff_sha1"]):
            # a log.jsonl of an earlier version, without the modules' hashes: its commit and local changes say it
            code = lambda p: (p["git_commit"] or "none")[:7] + (" + local changes" if p.get("diff_sha1") else "")
            self.code_changed = [f"the code (commit {code(old)}, now {code(new)}; this log.jsonl records no module "
                                 f"hashes, so which modules is unknown)"]
        start.update({"resumed_from_step": step} if ckpt else {"model_config": asdict(self.model_config)})
        self.log(start)

    def report_resume(self, step, lr_at):
        """Rank 0, on a resume: what moved, and an export that matches ckpt.pt."""
        cfg, ckpt = self.cfg, self.ckpt
        if not ckpt or not self.layout.master:
            return
        print(f"resumed from step {step} (of {cfg.max_steps}) in {cfg.out_dir}")
        old = saved_config(ckpt)
        changed = ", ".join(f"{k} {getattr(old, k)} -> {getattr(cfg, k)}" for k in ("lr", "warmup_steps", "max_steps")
                            if getattr(old, k) != getattr(cfg, k))
        if changed:  # said even when the lr at this step is the same (in warm-up): the decay moved
            print(f"the learning-rate schedule moved ({changed}): lr at step {step} was {lr_at(step, old):.2e}, "
                  f"now {lr_at(step, cfg):.2e} (warm-up {cfg.warmup_steps}, linear decay to 0 at {cfg.max_steps})")
        if self.code_changed:
            print(f"note: {', '.join(self.code_changed)} changed since this run last started: the steps after {step} "
                  f"run the new code, those before it the old (log.jsonl's start lines record each); to compare an "
                  f"edit with the code before it, start a new run")
        if pooled(cfg.objective) and not cfg.negative_pool and old.batch_size != cfg.batch_size:
            print(f"note: the negative pool is the per-process micro-batch, now {cfg.batch_size} sequences (was "
                  f"{old.batch_size}: another layout or --batch_size); --negative_pool N fixes a pool's size")
        if export_step(cfg.out_dir) != step:  # a run killed between ckpt.pt and the export: ckpt.pt wins
            with self.failing_write(f"rewrite the Hugging Face export of step {step} in {cfg.out_dir}"):
                self.model.save_pretrained(cfg.out_dir, mlm_head=self.trains_head, step=step)
            print(f"rewrote the Hugging Face export in {cfg.out_dir} from ckpt.pt (step {step})")

    def log(self, record):
        """One strict-JSON line: a non-finite value (a held-out loss of NaN weights) is null, and `non_finite`
        says which it was ({"val_tc_loss": "inf"}), so --plot_log's table still shows inf or nan."""
        if self.log_file:
            bad = {k: repr(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
            with self.failing_write(f"write {self.log_file.name}"):
                self.log_file.write(strict_json({**record, "non_finite": bad} if bad else record) + "\n")
                self.log_file.flush()

    @contextmanager
    def failing_write(self, what):
        """A write that fails (a full disk) stops the run with one line saying what ckpt.pt keeps."""
        try:
            yield
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: torch.save raises RuntimeError
            remove_partial_writes(self.cfg.out_dir)
            reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
            kept = (f"ckpt.pt keeps step {self.saved_step}, --resume goes on from it" if self.saved_step
                    else "no ckpt.pt yet")
            raise SaveFailed(f"cannot {what} ({reason}); {kept}") from None

    def save(self, step, elapsed_s):
        """ckpt.pt first (what --resume trusts: it rewrites an export of another step), then the export. In
        the other order a kill inside the first ckpt.pt left an export and no checkpoint: --resume had
        nothing to resume, and a new run refused to overwrite the export. One writer: the ranks hold the
        same weights, and the loader state is global."""
        cfg = self.cfg
        if self.layout.master:
            with self.failing_write(f"save step {step} into {cfg.out_dir}"):
                atomic_save(dict(model=self.model.state_dict(), model_config=asdict(self.model_config),
                                 objective=self.objective.state_dict(), optimizer=self.optimizer.state_dict(),
                                 scaler=self.scaler.state_dict(), step=step, loader=self.train_loader.state_dict(),
                                 elapsed_s=elapsed_s, config=asdict(cfg), data=self.fingerprint,
                                 token_format=token_files.FORMAT_VERSION,  # how the tokens were made
                                 mlm_head_trained=self.trains_head),  # hf_io: --init_from's ckpt.pt says so
                            os.path.join(cfg.out_dir, "ckpt.pt"))
                self.saved_step = step
                self.model.save_pretrained(cfg.out_dir, mlm_head=self.trains_head, step=step)
        self.saved_step = step

    def close(self, step, first_step=None, seconds=None, stopped_by=None):
        """Closes log.jsonl; rank 0 says where the run stopped and how to go on."""
        if self.log_file:
            self.log_file.close()
        if not self.layout.master:
            return
        cfg, saved = self.cfg, self.saved_step
        if stopped_by == "KeyboardInterrupt":  # a second signal, mid-step: the last checkpoint stands
            print(f"interrupted at step {step}: " + (f"--resume {cfg.out_dir} continues from the last checkpoint, "
                  f"step {saved}" if saved else "no checkpoint was saved yet"), flush=True)
        elif stopped_by:  # between two steps: rank 0 saved the weights of `step`
            print(f"{stopped_by}: stopped after step {step}; " + (
                  f"{cfg.out_dir}/ckpt.pt holds step {saved}: {'torchrun ... ' if self.layout.ddp else 'python '}"
                  f"train.py --resume {cfg.out_dir} continues" if saved else "no step was done, nothing was saved"),
                  flush=True)
        else:
            print(f"done: steps {first_step} -> {step} in {duration(seconds)}. In {cfg.out_dir}: ckpt.pt "
                  f"(step {step}, for --resume), model.safetensors + config.json (Hugging Face export, for eval.py "
                  f"--model), tokenizer.json + vocab.txt, log.jsonl" + (f", {self.diff_name}" if os.path.isfile(
                      os.path.join(cfg.out_dir, self.diff_name)) else ""))
