"""
The GPU experiments as prepared commands, each sized to one borrowed GPU machine (one command of at most
7 minutes, a bare machine, only the checkout travels, one folder $OUT comes back), and their results merged
into one report. The algorithm does not need this module: it drives reproduce.py and bench.py.

    python device_run.py prepare --shared DIR    # here (DIR holds data/ and wheels/), once: data, tokenizer and wheels into the checkout
    python device_run.py run mlm-taco                   # on the GPU machine, from the checkout, with $OUT set
    python device_run.py merge OUT/*.tar.gz             # here: results/mini/ and results/mini/results.md
    python device_run.py budget                         # each chunk's expected device time, and what it rests on
    python device_run.py run mlm-taco --toy --out /tmp/o --data corpus.txt --glue_dir GLUE   # CPU, same code path

Chunks (CHUNKS): mlm-taco, electra-cocolm, tacl (MLM again, then TaCL and the MLM control from it), speed
(bench.py against Hugging Face, the MLM step's profile, a short test_cuda.py). docs/gpu_chunks.md is the
runbook: the exact device call of each, then the merge.

What it guarantees:
- prepare copies what the chunks read (a Wikipedia shard, AB too if it fits; the GLUE TSVs of CoLA, SST-2,
  MRPC, STS-B, RTE; the wheels the GPU machine lacks) into the git-ignored .repro_data/ (wheels in .repro_data/wheels/), trains the
  mini scale's tokenizer there once (train.py would train the same one on the device), and refuses to leave
  a tree that travels (git-tracked + untracked-not-ignored + shared/ + the carried folders) over 64 MiB;
- run installs only the carried wheels whose package the machine lacks, checks CUDA before any work, runs
  the chunk's stages under one deadline (--budget, default 7 minutes, less the time to pack), stopping the
  stage in flight with SIGTERM (a training run saves its step) when it comes, and skipping what cannot fit;
- run rewrites one archive, $OUT/CHUNK.tar.gz (< 16 MiB), after every stage and every 30 s while one runs,
  so a command killed at its limit still brings back what had finished. It holds logs, JSON, plots and
  chunk.json (the GPU, torch and CUDA versions, the commit, the command, each stage's status and time),
  never weights, checkpoints or token caches;
- merge turns any subset of archives into results/mini/CHUNK/ (profiler traces stay in the archive) and one
  results.md: what has run, what has not, each comparison inside its own chunk (TaCL and its control against
  the tacl chunk's own MLM), the MLM pretrained by two chunks side by side as a reproducibility check (same
  corpus and tokenizer, or it says they are not comparable), and the measured stage times beside the budget's;
- --toy runs the same stages at reproduce.py's toy scale on the CPU.

Tests that hold it to this: test_device_run.py (every chunk end to end at toy scale, merges of subsets and of
a cut archive, a chunk stopped by its deadline, SIGTERM then SIGKILL of a stage, the archive's contents and
size, prepare on a fake shared folder, the budget against eval.py's recipes).
"""
import argparse
import datetime
import gzip
import hashlib
import json
import lzma
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

import reproduce  # torch-free: this file must run before the wheels are installed
from atomic import write_atomic
from corpus import first_line  # standard library only at import, as reproduce

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = ".repro_data"  # git-ignored: the one folder carried to the device machine
WHEEL_DIR = os.path.join(DATA_DIR, "wheels")  # inside it: what the device lacks
TRAVEL_LIMIT = 64 * 2**20  # the device tool's limit on the tree it copies
ARCHIVE_LIMIT = 16 * 2**20  # the largest file that comes back from $OUT
CORPUS = "data/corpus/enwiki_wikiextractor"  # in the shared folder: AA.txt.xz, AB.txt.xz
SHARDS = ("AA.txt.xz", "AB.txt.xz")  # AB only if the tree still fits
GLUE = "data/glue"
GLUE_TASKS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "rte": "RTE"}
MINI_VOCAB = 30522  # the mini scale's vocabulary (preset small's vocab_size): the tokenizer prepare trains
PACK_RESERVE = 15  # seconds kept at the end of --budget for the last pack
PACK_EVERY = 30  # seconds between packs while a stage runs
GRACE = 20  # seconds a stopped stage gets to save and exit before it is killed

# Each chunk: the runs reproduce.py makes (--objectives), then its stages in order. A stage is reproduce.py
# --only ..., or a command of its own (speed); "optional": started only when its estimate fits the time left.
# GLUE runs in one stage, up to four eval.py at a time (run x recipe): fine-tuning a 4-layer model
# leaves the GPU mostly idle. The analysis comes before GLUE: it is cheap and carries TACO's Table 9 claim.
CHUNKS = {
    "mlm-taco": dict(title="MLM against TACO at equal steps", objectives="mlm,taco", stages=[
        ("pretrain mlm", ["pretrain", "mlm"]), ("pretrain taco", ["pretrain", "taco"]),
        ("analysis", ["analysis"]), ("glue", ["glue"])]),
    # their steps cost 1.7x and 2.6x MLM's: GLUE on 3,000 rows a task keeps the command under 7 minutes
    "electra-cocolm": dict(title="ELECTRA against COCO-LM at equal steps", objectives="electra,cocolm",
                           glue_train_rows=3000, stages=[
        ("pretrain electra", ["pretrain", "electra"]), ("pretrain cocolm", ["pretrain", "cocolm"]),
        ("analysis", ["analysis"]), ("glue", ["glue"])]),
    "tacl": dict(title="TaCL against its MLM control, both continued from this chunk's MLM", objectives="tacl",
                 stages=[("pretrain mlm", ["pretrain", "mlm"]), ("continue", ["continue"]),
                         ("analysis", ["analysis"]), ("glue", ["glue", "tacl", "mlm_cont"]),
                         # the MLM row's GLUE: a reproducibility check against mlm-taco's, only if time is left
                         ("glue mlm", ["glue", "mlm"], "optional")]),
    "speed": dict(title="Speed like for like against Hugging Face", objectives="", stages=[
        ("bench small", "bench small"), ("bench base", "bench base"), ("test_cuda", "test_cuda")]),
}
STEPS, EXTRA_STEPS = 3000, 1000  # mini: BERT-small, s128, b256 (32,768 tokens a step): 98M tokens a run
GLUE_JOBS = 4
TOY_STEPS, TOY_EXTRA_STEPS = 20, 10

# ---------------------------------------------------------------------------------------------
# The budget: each stage's expected seconds on one H100, from what was measured (and where) and what is
# assumed. `python device_run.py budget` prints the table in docs/gpu_chunks.md; the merge sets each
# chunk's measured stage times beside these, and the first chunk that runs is the one to update them from.
H100 = dict(
    # measured (H100, an earlier revision, docs/efficiency.md): BERT-small MLM 2.4M tokens/s, s128 b256 bf16 compiled
    mlm_step_s=32768 / 2.4e6,
    dropout_factor=1.10,  # assumed: that was with dropout 0; the mini runs keep BERT's 0.1
    # measured on the last GPU bench: step time against MLM's (upper bounds: CPU-side work lowered them since)
    step_ratio=dict(mlm=1.0, taco=1.46, tacl=1.32, cocolm=2.62, electra=1.72),
    process_s=6,  # assumed: python start, import torch, the CUDA context, the token cache memmapped
    compile_s=(30, 10),  # assumed: torch.compile of the encoder, first in a chunk / again from inductor's cache
    eval_s=0.5,  # assumed: one held-out evaluation (20 eager batches of 64 x 128 + the contextual score)
    ckpt_s=1.0,  # assumed: one checkpoint and export (~0.5 GB written)
    # measured here (2 loaded cores), scaled: AA+AB (42.7M tokens) load in 7 s of CPU (xz, one thread), tokenize in
    # 71 s of CPU of which 4.5 s in the Python thread, the rest in tokenizers' threads: 16 cores, assumed 8x there
    corpus_s=20,
    glue_step_s=0.008,  # assumed: an eager fine-tuning step is launch-bound (~480 kernels, counted here, x ~15 us)
    glue_parallel=2.0,  # assumed: 4 eval.py processes on one GPU finish in half the time of 4 in a row
    # (GLUE's dev batches, forward only, are counted as steps: a margin)
    glue_process_s=10,  # assumed: eval.py's start, the model loaded, the TSVs tokenized
    analysis_s=15,  # assumed: eval.py --analysis on 1,000 held-out sentences per model, plots
    setup_s=8,  # assumed: pip --no-index of 3 wheels, the CUDA check
    pack_s=5,
    bench_row_s=dict(first=40, hf=40, warm=15),  # assumed: build + compile + 38 steps of one bench.py row
    test_cuda_s=60,  # its cap
)
# GLUE's train rows (the original TSVs) and each recipe's batch size and epochs (eval.py's SMALL and SHORT;
# test_device_run.py checks they agree)
GLUE_TRAIN_ROWS = dict(cola=8551, sst2=67349, mrpc=3668, stsb=5749, rte=2490)
GLUE_DEV_ROWS = dict(cola=1043, sst2=872, mrpc=408, stsb=1500, rte=277)
RECIPE_BATCHES = dict(paper=dict(cola=(32, 4), sst2=(64, 4), mrpc=(32, 4), stsb=(32, 4), rte=(32, 4)),
                      short=dict.fromkeys(GLUE_TASKS, (32, 4)))


def glue_rows(chunk):
    """GLUE train rows kept per task in a chunk: its own cap, else the mini scale's."""
    return CHUNKS[chunk].get("glue_train_rows") or reproduce.SCALES["mini"]["glue_train_rows"]


def glue_steps(recipe, rows, seeds):
    """Fine-tuning steps of one model under one recipe (train sets capped at `rows`), and its dev batches."""
    steps = sum(math.ceil(min(rows, GLUE_TRAIN_ROWS[t]) / batch) * epochs * seeds
                for t, (batch, epochs) in RECIPE_BATCHES[recipe].items())
    dev = sum(math.ceil(GLUE_DEV_ROWS[t] / 128) * epochs * seeds for t, (_, epochs) in RECIPE_BATCHES[recipe].items())
    return steps, dev


def pretrain_s(objective, steps, first, corpus, eval_interval=250, ckpt_interval=1000):
    c = H100
    return (c["process_s"] + (c["corpus_s"] if corpus else 0) + c["compile_s"][0 if first else 1]
            + steps * c["mlm_step_s"] * c["dropout_factor"] * c["step_ratio"][objective]
            + (steps // eval_interval + 1) * c["eval_s"] + math.ceil(steps / ckpt_interval) * c["ckpt_s"])


def estimate(chunk, steps=STEPS, extra_steps=EXTRA_STEPS, rows=None):
    """{stage: expected seconds on one H100} of a chunk at mini scale (GLUE train sets capped at `rows`, default
    the scale's), setup and pack included."""
    c, scale = H100, reproduce.SCALES["mini"]
    seeds, recipes = len(scale["seeds"].split(",")), scale["recipes"].split(",")
    rows = rows or glue_rows(chunk)
    out = {"setup": c["setup_s"]}
    if chunk == "speed":
        rows_s = c["bench_row_s"]
        for size in ("small", "base"):  # ours: one cold compile, then warm ones; Hugging Face's: cold
            out[f"bench {size}"] = c["process_s"] + rows_s["first"] + rows_s["hf"] + 4 * rows_s["warm"]
        out["test_cuda"] = c["test_cuda_s"]
    else:
        compiled = []
        for name, only, *optional in CHUNKS[chunk]["stages"]:
            if name.startswith("pretrain"):
                objective = only[1]
                out[name] = pretrain_s(objective, steps, not compiled, not compiled)
                compiled.append(objective)
            elif name == "continue":
                out[name] = pretrain_s("tacl", extra_steps, False, False) + pretrain_s("mlm", extra_steps, False, False)
            elif name == "analysis":
                out[name] = c["analysis_s"]
            else:  # glue: each named run (default: every run of the chunk) x each recipe, GLUE_JOBS at a time
                runs = only[1:] or [r for r in reproduce.SCRATCH + list(reproduce.CONTINUED)
                                    if r in CHUNKS[chunk]["objectives"].split(",")]
                jobs = len(runs) * len(recipes)
                steps_all = sum(sum(glue_steps(r, rows, seeds)) for r in recipes) * len(runs)
                # 1 for one process, glue_parallel for GLUE_JOBS of them, in between linearly
                speedup = 1 + (c["glue_parallel"] - 1) * (min(jobs, GLUE_JOBS) - 1) / (GLUE_JOBS - 1)
                out[name] = math.ceil(jobs / GLUE_JOBS) * c["glue_process_s"] + steps_all * c["glue_step_s"] / speedup
    out["pack"] = c["pack_s"]
    return out


def budget_table():
    lines = ["| chunk | stages (expected seconds on one H100) | total | optional |", "|---|---|---|---|"]
    for chunk, spec in CHUNKS.items():
        est = estimate(chunk)
        optional = {s[0] for s in spec["stages"] if s[2:] == ("optional",)}
        need = sum(v for k, v in est.items() if k not in optional)
        cells = ", ".join(f"{k} {v:.0f}" for k, v in est.items() if k not in optional)
        extra = ", ".join(f"{k} {est[k]:.0f}" for k in optional) or "–"
        lines.append(f"| `{chunk}` | {cells} | **{need:.0f} s ({need / 60:.1f} min)** | {extra} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# prepare (here)


def git(*args, root=HERE):
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, encoding="utf-8")
    except OSError:  # no git program (a bare GPU machine may lack one): the provenance falls back to source.json
        return None
    return done.stdout if done.returncode == 0 else None


def folder_size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def tree_size(root, carried):
    """{what: bytes} of the tree the device tool copies: git-tracked and untracked-not-ignored files, shared/
    (it travels whatever git says), and the carried folders."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", root=root)
    if listed is None:
        sys.exit(f"error: device_run.py prepare needs the git checkout ({root}: git ls-files failed)")
    files = [f for f in listed.split("\0") if f and os.path.isfile(os.path.join(root, f))]
    sizes = {"tracked and untracked files": sum(os.path.getsize(os.path.join(root, f)) for f in files
                                                if not f.startswith(("shared/", *(c + "/" for c in carried))))}
    for folder in ["shared", *carried]:
        sizes[folder + "/"] = folder_size(os.path.join(root, folder))
    return sizes


def copy_if_changed(src, dst):
    if not (os.path.isfile(dst) and os.path.getsize(dst) == os.path.getsize(src)
            and os.path.getmtime(dst) >= os.path.getmtime(src)):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst + ".tmp")
        os.replace(dst + ".tmp", dst)


def source_files(root=HERE):
    """The tracked files whose bytes identify the code that runs: the tracked .py files at the top."""
    listed = git("ls-files", "-z", "*.py", root=root) or ""
    return sorted(f for f in listed.split("\0") if f and "/" not in f)


def source_hash(files, root=HERE):
    h = hashlib.sha256()
    for f in files:
        path = os.path.join(root, f)
        h.update(f.encode() + b"\0" + (open(path, "rb").read() if os.path.isfile(path) else b"(absent)") + b"\0")
    return h.hexdigest()


def prepare(args):
    root = os.path.abspath(args.root)
    shared, data_dir, wheel_dir = os.path.abspath(args.shared), os.path.join(root, DATA_DIR), os.path.join(root,
                                                                                                       WHEEL_DIR)
    glue = [os.path.join(shared, GLUE, task, f"{split}.tsv") for task in GLUE_TASKS.values()
            for split in ("train", "dev")]
    shards = [os.path.join(shared, CORPUS, s) for s in SHARDS]
    wheels = sorted(os.path.join(shared, "wheels", f) for f in os.listdir(os.path.join(shared, "wheels"))
                    if f.endswith(".whl")) if os.path.isdir(os.path.join(shared, "wheels")) else []
    missing = [p for p in shards[:1] + glue if not os.path.isfile(p)]
    if missing:
        sys.exit(f"error: --shared {args.shared}: no {missing[0]}")
    shards = [p for p in shards if os.path.isfile(p)]
    for p in shards:  # read to the end before any copy: a cut or empty shard was copied over the checkout's
        try:  # earlier one, then the tokenizer's training failed with a traceback
            with lzma.open(p) as f:
                text_bytes = sum(len(block) for block in iter(lambda: f.read(1 << 24), b""))
            if not text_bytes:
                raise EOFError("no text in it")
        except (lzma.LZMAError, EOFError, OSError) as e:
            sys.exit(f"error: --shared {args.shared}: {p} is not a readable .xz ({first_line(e)})")
    # the tree once copied: what is there now, less the copies this call rewrites (and the tokenizer, which it may
    # train again: counted as 2 MiB, the trained one in its place), plus what it copies
    carried = [DATA_DIR]
    copies = [os.path.join(wheel_dir, os.path.basename(w)) for w in wheels]
    kept = sum(tree_size(root, carried).values()) - folder_size(os.path.join(data_dir, "corpus")) \
        - folder_size(os.path.join(data_dir, "glue")) - sum(map(os.path.getsize, filter(os.path.isfile, copies))) \
        - folder_size(os.path.join(data_dir, "tokenizer"))
    need = lambda files: kept + sum(map(os.path.getsize, files + glue + wheels)) + 2 * 2**20  # + the tokenizer
    if len(shards) > 1 and need(shards) > TRAVEL_LIMIT:
        print(f"note: {SHARDS[1]} does not fit under the {TRAVEL_LIMIT >> 20} MiB limit: the chunks train on "
              f"{SHARDS[0]} alone")
        shards = shards[:1]
    if need(shards) > TRAVEL_LIMIT:
        sys.exit(f"error: the tree that travels would be {need(shards) / 2**20:.1f} MiB, over the device tool's "
                 f"{TRAVEL_LIMIT >> 20} MiB: remove untracked files (or shared/) from the checkout")
    os.makedirs(os.path.join(data_dir, "corpus"), exist_ok=True)
    for name in os.listdir(os.path.join(data_dir, "corpus")):  # a shard dropped since an earlier prepare
        if name not in map(os.path.basename, shards):
            os.remove(os.path.join(data_dir, "corpus", name))
    for p in shards:
        copy_if_changed(p, os.path.join(data_dir, "corpus", os.path.basename(p)))
    for p in glue:
        copy_if_changed(p, os.path.join(data_dir, "glue", *p.split(os.sep)[-2:]))
    for w, copy in zip(wheels, copies):
        copy_if_changed(w, copy)
    train_tokenizer(os.path.join(data_dir, "corpus"), os.path.join(data_dir, "tokenizer"), args.vocab_size)
    files = source_files(root)
    dirty = bool((git("status", "--porcelain", "--untracked-files=no", root=root) or "").strip())
    save_json(dict(commit=(git("rev-parse", "HEAD", root=root) or "").strip() or None, dirty=dirty, files=files,
                   sha256=source_hash(files, root), prepared=now_iso()), os.path.join(data_dir, "source.json"))
    sizes = tree_size(root, carried)
    total = sum(sizes.values())
    print("\n".join(f"  {k:30} {v / 2**20:7.1f} MiB" for k, v in sizes.items()))
    print(f"  {'the tree that travels':30} {total / 2**20:7.1f} MiB (limit {TRAVEL_LIMIT >> 20} MiB)")
    if total > TRAVEL_LIMIT:
        sys.exit(f"error: the tree that travels is {total / 2**20:.1f} MiB, over the device tool's "
                 f"{TRAVEL_LIMIT >> 20} MiB: remove untracked files (or shared/) from the checkout")
    if TRAVEL_LIMIT - total < 4 * 2**20 and len(shards) > 1:
        print(f"note: {(TRAVEL_LIMIT - total) / 2**20:.1f} MiB to spare: if what is committed later pushes {SHARDS[1]} "
              f"out, later chunks train on another corpus than earlier ones (the merge says they are not comparable)")
    if dirty:
        print("note: the checkout has uncommitted changes: chunk.json will say so (commit first, then prepare)")
    print(f"ready: each chunk's device call carries {DATA_DIR} (docs/gpu_chunks.md)")


def train_tokenizer(corpus_dir, out, vocab_size):
    """The WordPiece tokenizer train.py would train on the carried corpus (data.train_tokenizer is
    deterministic), trained once here: the chunks pass it as --tokenizer instead of each training it."""
    stamp_path = os.path.join(out, "corpus.json")
    corpus_files = sorted(os.listdir(corpus_dir))
    stamp = dict(files={f: os.path.getsize(os.path.join(corpus_dir, f)) for f in corpus_files}, vocab_size=vocab_size)
    if reproduce.read_json(stamp_path) == stamp:
        return
    import tempfile
    import corpus
    import data
    t0 = time.time()
    with tempfile.TemporaryDirectory() as arrow_cache:  # datasets' copy of the text, not kept
        parts = corpus.load_corpus(corpus_dir, corpus.resolve_files(corpus_dir), arrow_cache)
        texts = lambda: ([p for p in pieces if p is not None] for pieces in corpus.pieces(parts))
        shutil.rmtree(out + ".tmp", ignore_errors=True)
        data.train_tokenizer(texts, vocab_size, save_dir=out + ".tmp")
        del parts
    save_json(stamp, os.path.join(out + ".tmp", "corpus.json"))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(out + ".tmp", out)
    print(f"trained the {vocab_size}-token tokenizer on {', '.join(corpus_files)} in {time.time() - t0:.0f} s -> {out}")


# ---------------------------------------------------------------------------------------------
# run (on the device machine)


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def save_json(obj, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    reproduce.save_json(obj, path)


class Log:
    """device_run.log in the work folder, and the console."""

    def __init__(self, path):
        self.file, self.lock = open(path, "a", encoding="utf-8"), threading.Lock()

    def __call__(self, line):
        with self.lock:
            sys.stdout.write(line if line.endswith("\n") else line + "\n")
            sys.stdout.flush()
            self.file.write(line if line.endswith("\n") else line + "\n")
            self.file.flush()


def missing_wheels(wheel_dir):
    """The carried wheels whose distribution this Python lacks, or has in another version."""
    from importlib import metadata
    needed = []
    for f in sorted(os.listdir(wheel_dir)) if os.path.isdir(wheel_dir) else []:
        if not f.endswith(".whl"):
            continue
        name, version = f.split("-")[:2]
        try:
            if metadata.version(name.replace("_", "-")) == version:
                continue
        except metadata.PackageNotFoundError:
            pass
        needed.append(f)
    return needed


def install_wheels(wheel_dir, site, log):
    """pip --no-index the missing wheels into `site`; returns the environment for every child (PYTHONPATH)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8")  # children write UTF-8, as we read
    needed = missing_wheels(wheel_dir)
    if needed:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", site, *[os.path.join(wheel_dir, f) for f in needed]]
        done = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace")
        if done.returncode:
            raise RuntimeError(f"pip could not install {', '.join(needed)}: {done.stderr.strip()[-500:]}")
        env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in [env.get("PYTHONPATH")] if p])
        sys.path.insert(0, site)
    log(f"wheels: installed {', '.join(needed) if needed else 'none'} (the others are here already)")
    return env, needed


CHECK = r"""
import json, platform, subprocess, time, torch
info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
            cuda_available=torch.cuda.is_available(), cpus=__import__("os").cpu_count())
if torch.cuda.is_available():
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    memory = torch.cuda.get_device_properties(0).total_memory
    info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gb=round(memory / 2**30, 1),
                matmul_finite=bool(torch.isfinite(x @ x).all()))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, encoding="utf-8", errors="replace")
        info["driver"] = smi.stdout.strip() or None
    except OSError:  # no nvidia-smi: the driver goes unrecorded, the chunk runs
        info["driver"] = None
import datasets, tokenizers
info.update(datasets=datasets.__version__, tokenizers=tokenizers.__version__)
print("CHECK " + json.dumps(info))
"""


def check_device(env, toy):
    """The machine, asked in a child process (torch is not imported here): versions, the GPU, a bf16 matmul."""
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=HERE, env=env, capture_output=True, text=True,
                          encoding="utf-8", timeout=120)
    line = next((l for l in done.stdout.splitlines() if l.startswith("CHECK ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"the device check failed: {(done.stderr or done.stdout).strip()[-800:]}")
    info = json.loads(line[len("CHECK "):])
    if not toy and not (info["cuda_available"] and info.get("matmul_finite")):
        raise RuntimeError(f"no working CUDA GPU (torch {info['torch']}, CUDA {info['cuda']}): nothing was run")
    return info


def source_provenance():
    """The code that runs: git's commit and local changes where the checkout has its .git, else the commit
    prepare recorded, changed if the .py files are no longer the ones it hashed."""
    prepared = reproduce.read_json(os.path.join(HERE, DATA_DIR, "source.json")) or {}
    sha = source_hash(prepared.get("files") or source_files())
    head = (git("rev-parse", "HEAD") or "").strip() or None
    if head:
        dirty = bool((git("status", "--porcelain", "--untracked-files=no") or "").strip())
    else:
        dirty = (prepared.get("dirty") or sha != prepared.get("sha256")) if prepared else None
    return dict(commit=head or prepared.get("commit"), dirty=dirty, read_from="git" if head else
                "prepare's source.json" if prepared else None, sha256=sha, prepared=prepared.get("prepared"))


def data_identity(args):
    """What the runs read, for the reproducibility check: the corpus files and sizes, the tokenizer's sha256."""
    files = ([os.path.join(args.data, f) for f in sorted(os.listdir(args.data))] if os.path.isdir(args.data or "")
             else [args.data] if args.data and os.path.isfile(args.data) else [])
    tok = os.path.join(args.tokenizer or "", "tokenizer.json")
    return dict(corpus={os.path.basename(f): os.path.getsize(f) for f in files},
                tokenizer_sha256=hashlib.sha256(open(tok, "rb").read()).hexdigest() if os.path.isfile(tok) else None)


def stage_commands(chunk, args, work):
    """[(stage name, argv, optional)] of the chunk, at the toy or mini scale."""
    py = sys.executable
    spec = CHUNKS[chunk]
    out = []
    if chunk == "speed":
        bench = os.path.join(work, "bench")
        if args.toy:  # bench.py's CPU path: the tiny model, a few small steps
            common = ["--device", "cpu", "--batch_size", "4", "--seq_len", "32", "--steps", "2", "--warmup", "1",
                      "--taco_negatives", "4"]
            sizes = dict(small="tiny", base="tiny")
        else:  # like for like with Hugging Face: dropout 0.1 both, bf16 autocast both, b256 s128 (bench.py's defaults)
            common, sizes = [], dict(small="small", base="base")
        for name, size in sizes.items():
            argv = [py, "bench.py", "--model_size", size, "--objectives", "all", "--hf", *common,
                    "--json", os.path.join(bench, f"bench_{name}.json")]
            if name == "small":  # where the MLM small step's time goes (top kernels, a chrome trace)
                argv += ["--profile", "--profile_objectives", "mlm", "--out_dir", os.path.join(bench, "profile")]
            out.append((f"bench {name}", argv, False))
        # the in-process CUDA checks (the subprocess ones take minutes): bf16, compile, TACO's fused kernel, ...
        keep = "not train_on_device and not sigterm and not bench_on_device and not glue_on_device"
        if args.toy:
            keep = "sampled_tokens"
        out.append(("test_cuda", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_cuda.py", "-k", keep],
                    False))
        return out
    base = [py, "reproduce.py", "--objectives", spec["objectives"], "--out_dir", work,
            "--recipes", args.recipes, "--glue_jobs", str(2 if args.toy else GLUE_JOBS)]
    if args.toy:
        base += ["--scale", "toy", "--steps", str(args.steps or TOY_STEPS),
                 "--extra_steps", str(args.extra_steps or TOY_EXTRA_STEPS)]
    else:
        base += ["--scale", "mini", "--steps", str(args.steps or STEPS), "--extra_steps",
                 str(args.extra_steps or EXTRA_STEPS)]
        base += ["--glue_train_rows", str(args.glue_train_rows or glue_rows(chunk))]
    if args.toy and args.glue_train_rows:  # given, not dropped (the toy scale's 64 is reproduce.py's default)
        base += ["--glue_train_rows", str(args.glue_train_rows)]
    if args.tokenizer:  # --toy: only when given
        base += ["--tokenizer", args.tokenizer]
    if args.data:
        base += ["--data", args.data]
    if args.glue_dir:
        base += ["--glue_dir", args.glue_dir]
    for name, only, *optional in spec["stages"]:
        out.append((name, base + ["--only", ",".join(only)], bool(optional)))
    return out


def run_stage(argv, env, log, out_path, deadline, pack, stop_signal=signal.SIGTERM):
    """One stage as a child process in its own process group, its output teed into the log and out_path. At
    the deadline (or when this process is interrupted) it gets stop_signal (reproduce.py passes SIGTERM on,
    and a training run saves its step), GRACE seconds, then SIGKILL for its whole group. The archive is
    repacked every PACK_EVERY seconds meanwhile. Returns (exit code, stopped at the deadline)."""
    log("$ " + " ".join(argv))
    out = open(out_path or os.devnull, "a", encoding="utf-8")  # reproduce.py keeps its own logs: speed's stages only

    def tee():
        for line in proc.stdout:
            log(line)
            out.write(line)
            out.flush()
    reader = threading.Thread(target=tee, daemon=True)
    stopped, last_pack = None, time.time()
    proc = subprocess.Popen(argv, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            encoding="utf-8", errors="replace", start_new_session=True)
    try:  # from the stage's start: an interrupt from here on reaches it (its own session gets no Ctrl-C)
        reader.start()
        while proc.poll() is None:
            time.sleep(0.2)
            if stopped is None and time.time() >= deadline:
                stopped = time.time()
                log(f"device_run: the deadline: {signal.Signals(stop_signal).name} to the stage")
                proc.send_signal(stop_signal)
            elif stopped is not None and time.time() > stopped + GRACE:
                log("device_run: the stage did not exit: SIGKILL")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if time.time() - last_pack > PACK_EVERY:
                pack()
                last_pack = time.time()
    except KeyboardInterrupt:  # SIGINT or SIGTERM to device_run: the stage saves what it can, then we pack
        proc.send_signal(stop_signal)
        try:
            proc.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        if reader.is_alive():
            reader.join(timeout=5)
        out.close()
    return proc.returncode, stopped is not None


def collect_files(work):
    """What a report needs from the work folder, as (path, optional) in packing order: the JSON and logs, then
    the plots, then profiler traces. Never weights, checkpoints, tokenizers or the token cache."""
    essential, plots, traces = [], [], []
    skip_names = {"tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"}
    for d, dirs, files in os.walk(work):
        dirs[:] = sorted(x for x in dirs if x not in ("cache", "models") and not x.startswith("."))
        for f in sorted(files):
            path = os.path.join(d, f)
            if f in skip_names or ".tmp" in f or f.startswith("."):
                continue
            if f.endswith((".json", ".jsonl", ".md", ".out", ".log", ".txt")):
                essential.append(path)
            elif f.endswith(".png"):
                plots.append(path)
            elif f.endswith(".json.gz"):
                traces.append(path)
    return [(p, False) for p in essential] + [(p, True) for p in plots + traces]


def pack(chunk, work, out_dir, record):
    """$OUT/CHUNK.tar.gz, rewritten whole (written beside it, then renamed): chunk.json and what collect_files
    finds; while the archive is over ARCHIVE_LIMIT, packed again without the largest optional file."""
    record["packed"] = now_iso()
    save_json(record, os.path.join(work, "chunk.json"))
    final = os.path.join(out_dir, f"{chunk}.tar.gz")
    files, left_out = collect_files(work), []
    while True:
        with tarfile.open(final + ".tmp", "w:gz") as tar:
            for path, optional in list(files):
                try:  # a stage may run beside this pack: reproduce.py removes a glue.part once merged into glue.json
                    tar.add(path, arcname=os.path.join(chunk, os.path.relpath(path, work)), recursive=False)
                except FileNotFoundError:  # listed, then removed: not in this archive
                    files.remove((path, optional))
        optional = [f for f in files if f[1]]
        if os.path.getsize(final + ".tmp") <= ARCHIVE_LIMIT or not optional:
            break
        largest = max(optional, key=lambda f: os.path.getsize(f[0]))
        files.remove(largest)
        left_out.append(os.path.relpath(largest[0], work))
    os.replace(final + ".tmp", final)
    record["left_out"] = left_out
    return final


def run(args):
    if args.chunk not in CHUNKS:
        sys.exit(f"error: unknown chunk {args.chunk!r} (choose from {', '.join(CHUNKS)})")
    t0 = time.time()
    deadline = t0 + args.budget - PACK_RESERVE
    out_dir = args.out or os.environ.get("OUT")
    if not out_dir:
        sys.exit("error: $OUT is not set: pass --out DIR (on the device machine the tool sets $OUT)")
    for name, folder in (("--out", out_dir), ("--work", args.work)):
        if folder and os.path.exists(folder) and not os.path.isdir(folder):
            sys.exit(f"error: {name} {folder}: a file, not a folder")
    os.makedirs(out_dir, exist_ok=True)
    work = os.path.abspath(args.work or os.path.join(HERE, "out", "device_toy" if args.toy else "device", args.chunk))
    os.makedirs(work, exist_ok=True)
    for name in ("data", "glue_dir", "tokenizer"):  # the carried folders, where prepare put them
        value = getattr(args, name)
        default = dict(data=os.path.join(DATA_DIR, "corpus"), glue_dir=os.path.join(DATA_DIR, "glue"),
                       tokenizer=os.path.join(DATA_DIR, "tokenizer"))[name]
        if value is None and not (args.toy and name != "glue_dir"):
            value = os.path.join(HERE, default) if os.path.exists(os.path.join(HERE, default)) else ""
        setattr(args, name, os.path.abspath(value) if value else "")
    if args.chunk != "speed" and not args.glue_dir:
        sys.exit("error: no GLUE TSVs: run `python device_run.py prepare --shared DIR` first, or pass --glue_dir")
    if args.chunk != "speed" and not args.toy and not args.data:
        sys.exit(f"error: no corpus in {DATA_DIR}/corpus: run `python device_run.py prepare --shared DIR` first")
    log = Log(os.path.join(work, "device_run.log"))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM packs what is done, as Ctrl-C
    command = "python device_run.py " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    record = dict(chunk=args.chunk, title=CHUNKS[args.chunk]["title"], scale="toy" if args.toy else "mini",
                  command=command, started=now_iso(), budget_s=args.budget, host=platform.node(),
                  estimate_s=None if args.toy else estimate(args.chunk, args.steps or STEPS,
                                                            args.extra_steps or EXTRA_STEPS, args.glue_train_rows),
                  source=source_provenance(), data=data_identity(args), stages=[], finished=False)
    packer = lambda: pack(args.chunk, work, out_dir, record)
    log(f"device_run: chunk {args.chunk} ({record['title']}), {record['scale']} scale, budget {args.budget} s, "
        f"work {work}, archive {os.path.join(out_dir, args.chunk + '.tar.gz')}")
    try:
        env, record["wheels_installed"] = install_wheels(os.path.join(HERE, WHEEL_DIR), args.site, log)
        if args.toy:
            env.update(OMP_NUM_THREADS="1", BERTCL_TEST_DEVICE="cpu")
        record["device"] = check_device(env, args.toy)
        log(f"device: {json.dumps(record['device'])}")
        record["setup_s"] = time.time() - t0
        packer()
        for name, argv, optional in stage_commands(args.chunk, args, work):
            entry = dict(name=name, command=" ".join(argv), optional=optional)
            record["stages"].append(entry)
            left = deadline - time.time()
            expected = (record["estimate_s"] or {}).get(name, 0)
            if left < 5 or optional and left < expected:
                entry["status"] = f"skipped: {left:.0f} s left, {expected:.0f} s expected"
                log(f"device_run: {name}: {entry['status']}")
                continue
            stage_deadline = deadline
            if name == "test_cuda":  # a short check, at most its cap
                stage_deadline = min(deadline, time.time() + (20 if args.toy else H100["test_cuda_s"]))
            start = time.time()
            out_path = os.path.join(work, name.replace(" ", "_") + ".out") if args.chunk == "speed" else None
            code, stopped = run_stage(argv, env, log, out_path, stage_deadline, packer,
                                      signal.SIGINT if name == "test_cuda" else signal.SIGTERM)
            entry["wall_s"] = round(time.time() - start, 1)
            entry["status"] = "stopped at the deadline" if stopped else "done" if code == 0 else f"failed (exit {code})"
            log(f"device_run: {name}: {entry['status']} in {entry['wall_s']:.0f} s")
            if args.chunk != "speed":
                absorb_parts(work)  # GLUE tasks a stopped eval.py finished, into glue*.json
            packer()
        record["finished"] = all(s["status"] == "done" for s in record["stages"] if not s["optional"])
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        record["error"] = str(e)
        log(f"device_run: error: {e}")
    except KeyboardInterrupt:
        record["error"] = "interrupted"
        log("device_run: interrupted")
    finally:
        record["total_s"] = round(time.time() - t0, 1)
        path = packer()
        log(f"device_run: {args.chunk}: {'finished' if record['finished'] else 'not finished'} in "
            f"{record['total_s']:.0f} s; {path} {os.path.getsize(path) / 2**20:.2f} MiB"
            + (f"; left out (size): {', '.join(record['left_out'])}" if record.get("left_out") else ""))
        packer()  # the last lines of the log too
    return 0 if record["finished"] else 1


def absorb_parts(work):
    for name in reproduce.SCRATCH + list(reproduce.CONTINUED):
        for recipe in reproduce.RECIPES:
            if os.path.isdir(os.path.join(work, name, reproduce.glue_files(recipe)[1])):
                reproduce.absorb_glue(os.path.join(work, name), recipe)


# ---------------------------------------------------------------------------------------------
# merge (here)


def extract(archive, into):
    """The archive's chunk folder into `into`, replacing that chunk's earlier one. Returns the chunk's name."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        chunks = {m.name.split("/")[0] for m in members}
        if len(chunks) != 1 or next(iter(chunks)) not in CHUNKS:
            raise ValueError(f"{archive}: not an archive of device_run.py (its top folders: {sorted(chunks)[:3]})")
        chunk = chunks.pop()
        tmp = os.path.join(into, f".{chunk}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # profiler traces stay in the archive: megabytes, and the tree that travels is near its limit
        tar.extractall(tmp, members=[m for m in members if m.isdir() or m.isfile() and not m.name.endswith(".json.gz")],
                       filter="data")
    shutil.rmtree(os.path.join(into, chunk), ignore_errors=True)
    os.replace(os.path.join(tmp, chunk), os.path.join(into, chunk))
    shutil.rmtree(tmp, ignore_errors=True)
    return chunk


def chunk_results(chunk_dir, chunk):
    """(reproduce.collect's results, the chunk's own results.md) of a reproduce.py chunk, its plots redrawn."""
    args = reproduce.parse(["--out_dir", chunk_dir, "--only", "report", "--objectives", CHUNKS[chunk]["objectives"]])
    reproduce.check_settings(args)  # the settings the runs were made with (reproduce.json)
    results = reproduce.collect(args, args.runs)
    pngs = reproduce.plot(results, chunk_dir)
    reproduce.save_json(results, os.path.join(chunk_dir, "results.json"))
    write_atomic(os.path.join(chunk_dir, "results.md"), reproduce.markdown(results, pngs))
    return results, pngs


def merge(args):
    into = os.path.abspath(args.into)
    if os.path.exists(into) and not os.path.isdir(into):
        sys.exit(f"error: --into {args.into}: a file, not a folder")
    for archive in args.archives:  # every archive checked before any is merged
        try:
            with gzip.open(archive) as f:  # read to the end: gzip's CRC catches bytes damaged on the way back
                while f.read(1 << 20):
                    pass
            with tarfile.open(archive) as tar:
                chunks = {m.name.split("/")[0] for m in tar.getmembers()}  # a truncated one fails here
                if len(chunks) != 1 or next(iter(chunks)) not in CHUNKS:
                    sys.exit(f"error: {archive}: not an archive of device_run.py (its top folders: {sorted(chunks)[:3]})")
                # was: one without it replaced the merged chunk, then merge said "missing or damaged" of its chunk.json
                record = f"{next(iter(chunks))}/chunk.json"
                member = tar.getmember(record) if record in tar.getnames() else None
                try:
                    readable = member.isfile() and isinstance(json.load(tar.extractfile(member)), dict)
                except (AttributeError, ValueError):  # none, or not JSON
                    readable = False
                if not readable:
                    sys.exit(f"error: {archive}: its {record} is missing or not a JSON object: not merged")
        except (OSError, EOFError, tarfile.TarError) as e:
            sys.exit(f"error: {archive}: not a readable archive ({first_line(e)})")
    if args.archives:  # none: merge re-reads what --into holds, and makes no folder
        os.makedirs(into, exist_ok=True)
    for archive in args.archives:
        try:
            print(f"{archive} -> {os.path.join(into, extract(archive, into))}")
        except (ValueError, OSError, EOFError, tarfile.TarError) as e:  # a damaged member, a full disk
            sys.exit(f"error: {archive}: cannot merge into {into} ({first_line(e)})")
    records = {c: reproduce.read_json(os.path.join(into, c, "chunk.json")) for c in CHUNKS
               if os.path.lexists(os.path.join(into, c))}
    damaged = [c for c, r in records.items() if r is None]  # every archive carries its chunk.json
    if damaged:
        sys.exit(f"error: {os.path.join(into, damaged[0], 'chunk.json')}: missing or damaged; merge {damaged[0]}.tar.gz "
                 f"again")
    if not records:
        sys.exit(f"error: no chunk in {into}: pass the archives (CHUNK.tar.gz) the device runs brought back")
    results = {c: chunk_results(os.path.join(into, c), c) for c in records if c != "speed"}
    text = merged_markdown(records, results, into)
    write_atomic(os.path.join(into, "results.md"), text)
    print(f"wrote {os.path.join(into, 'results.md')} ({', '.join(records)}; not run: "
          f"{', '.join(c for c in CHUNKS if c not in records) or 'none'})")


def fmt_s(value):
    return "–" if value is None else f"{value:.0f} s"


def merged_markdown(records, results, into):
    scales = {r.get("scale") for r in records.values()}
    lines = [f"# Results: {'/'.join(sorted(scales))} scale, from the GPU chunks", "",
             "Made by `python device_run.py merge` from the archives the GPU runs brought back "
             "([the runbook](../../docs/gpu_chunks.md)). Each chunk is one command on one GPU machine; every "
             "comparison is made inside one chunk (TaCL and its MLM control continue from the `tacl` chunk's own "
             "MLM run). Rows of different chunks come from different machines and runs: set side by side they are "
             "context, not a comparison, except the MLM run made by two chunks, shown as a reproducibility check.", "",
             "## Chunks", "",
             *reproduce.table_head("chunk", "what", "status", "GPU", "torch / CUDA", "commit", "command",
                                   "wall-clock")]
    for chunk, spec in CHUNKS.items():
        r = records.get(chunk)
        if r is None:
            lines.append(f"| `{chunk}` | {spec['title']} | **not run yet** | – | – | – | – | – |")
            continue
        done = [s for s in r.get("stages", []) if s.get("status") == "done"]
        status = ("finished" if r.get("finished") else f"partial: {len(done)}/{len(r.get('stages', []))} stages"
                  + (f" ({r['error']})" if r.get("error") else ""))
        dev, src = r.get("device") or {}, r.get("source") or {}
        commit = (src.get("commit") or "?")[:10] + (" + uncommitted changes" if src.get("dirty") else "")
        lines.append(f"| `{chunk}` | {spec['title']} | {status} | {dev.get('gpu') or ('CPU (toy)' if r.get('scale') == 'toy' else '–')} | "
                     f"{dev.get('torch', '?')} / {dev.get('cuda') or '–'} | {commit} | `{r.get('command', '?')}` | "
                     f"{fmt_s(r.get('total_s'))} |")
    lines += ["", *reproducibility(records, results), *budget_section(records)]
    for chunk, (res, pngs) in results.items():
        planned = [r for r in reproduce.SCRATCH + list(reproduce.CONTINUED)
                   if r in reproduce.parse(["--objectives", CHUNKS[chunk]["objectives"]]).runs]
        absent = [r for r in planned if r not in res["runs"]]
        lines += [f"## `{chunk}`: {CHUNKS[chunk]['title']}", "",
                  f"From [`{chunk}/`]({chunk}/) (its own report: [`{chunk}/results.md`]({chunk}/results.md)).", "",
                  *([f"**Not run** (the command ended first): {', '.join(absent)}.", ""] if absent else []),
                  *reproduce.markdown(res, [f"{p}" for p in pngs], level=2, folder=f"{chunk}/").splitlines()[2:], ""]
    if "speed" in records:
        lines += speed_section(into)
    return "\n".join(lines)


def reproducibility(records, results):
    """The MLM run of mlm-taco and of tacl: the same settings should give the same numbers (up to the GPU's
    non-deterministic kernels, and another machine)."""
    have = [c for c in ("mlm-taco", "tacl") if "mlm" in results.get(c, ({"runs": {}},))[0]["runs"]]
    if len(have) < 2:
        return []
    a, b = (results[c][0] for c in have)
    lines = ["## Reproducibility: the MLM run made by two chunks", ""]
    differ = [k for k in ("scale", "seed") if a.get(k) != b.get(k)] + \
        [k for k in ("steps", "tokens_per_step") if a["runs"]["mlm"].get(k) != b["runs"]["mlm"].get(k)] + \
        [f"its {k}" for k in ("corpus", "tokenizer_sha256")
         if (records[have[0]].get("data") or {}).get(k) != (records[have[1]].get("data") or {}).get(k)]
    if differ:
        lines += [f"Not comparable: the two MLM runs differ in {', '.join(differ)}.", ""]
        return lines
    gpus = [((records[c].get("device") or {}).get("gpu") or "CPU") for c in have]
    lines += [f"Same settings (steps, seed, corpus, tokenizer, recipe); machines: {gpus[0]} and {gpus[1]}. A "
              "difference beyond what the GPU's non-deterministic kernels (and another machine) explain would mean "
              "the runs are not what they claim to be.", "",
              *reproduce.table_head("MLM run", *[f"`{c}`" for c in have], "difference")]
    ra, rb = a["runs"]["mlm"], b["runs"]["mlm"]
    rows = [("held-out MLM loss", ra["final"].get("val_mlm_loss"), rb["final"].get("val_mlm_loss"), 4),
            ("held-out MLM accuracy", ra["final"].get("val_mlm_acc"), rb["final"].get("val_mlm_acc"), 4),
            ("contextual score", ra["final"].get("contextual_score"), rb["final"].get("contextual_score"), 4),
            ("tokens/s", ra.get("tokens_per_s"), rb.get("tokens_per_s"), 0)]
    for recipe in a.get("recipes", []):
        ga, gb = (r.get("glue_by_recipe", {}).get(recipe, {}).get("avg") for r in (ra, rb))
        rows.append((f"GLUE Avg, {recipe} recipe", ga, gb, 2))
    for label, x, y, digits in rows:
        diff = reproduce.fmt(y - x, digits) if x is not None and y is not None else "–"
        lines.append(f"| {label} | {reproduce.fmt(x, digits)} | {reproduce.fmt(y, digits)} | {diff} |")
    return lines + [""]


def budget_section(records):
    lines = ["## Device time: the budget's estimate and what each stage took", "",
             "Estimates from `python device_run.py budget` (docs/gpu_chunks.md says what each rests on); measured: "
             "the stage's wall-clock on the device. Update the budget from these.", "",
             *reproduce.table_head("chunk", "stage", "estimate", "measured", "status")]
    for chunk, r in records.items():
        est = r.get("estimate_s") or {}
        lines.append(f"| `{chunk}` | setup | {fmt_s(est.get('setup'))} | {fmt_s(r.get('setup_s'))} | |")
        for s in r.get("stages", []):
            lines.append(f"| `{chunk}` | {s['name']} | {fmt_s(est.get(s['name']))} | {fmt_s(s.get('wall_s'))} | "
                         f"{s.get('status', 'not reached')} |")
        lines.append(f"| `{chunk}` | **whole command** | {fmt_s(sum(est.values()) if est else None)} | "
                     f"{fmt_s(r.get('total_s'))} | |")
    return lines + [""]


def speed_section(into):
    """bench.py's rows and Hugging Face ratios, the MLM small step's top kernels, test_cuda.py's last line."""
    lines = ["## `speed`: like for like against Hugging Face", ""]
    for size in ("small", "base"):
        report = reproduce.read_json(os.path.join(into, "speed", "bench", f"bench_{size}.json"))
        if not report:
            lines += [f"bench {size}: not run.", ""]
            continue
        info = report.get("info", {})
        lines += [f"`{info.get('command', 'bench.py')}` on {info.get('device', '?')}, torch {info.get('torch', '?')}:",
                  "", *reproduce.table_head("size", "objective", "params M", "tokens/s", "step ms", "vs MLM",
                                            "MFU", "peak GB", "spread")]
        for r in report.get("results", []):
            if "error" in r:
                cells = [r.get("model_size"), r.get("objective"), f"failed: {r['error'][:80]}"] + [""] * 6
                lines.append("| " + " | ".join(map(str, cells)) + " |")
                continue
            lines.append(f"| {r['model_size']} | {r['objective']} | {r['params_m']:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['step_ms']:.1f} | {reproduce.fmt(r.get('vs_mlm'), 2)} | "
                         f"{reproduce.fmt(100 * r['mfu'] if r.get('mfu') is not None else None, 1)}"
                         f"{'%' if r.get('mfu') is not None else ''} | {reproduce.fmt(r.get('peak_mem_gb'), 2)} | "
                         f"{reproduce.fmt(100 * r['spread'] if r.get('spread') is not None else None, 1)}"
                         f"{'%' if r.get('spread') is not None else ''} |")
        lines += [""] + [f"- {ratio['line']}" for ratio in report.get("hf_ratios", [])] + [""]
        for r in report.get("results", []):
            prof = r.get("profile")
            if not prof:
                continue
            rows = prof.get("kernels") or prof.get("ops") or []
            lines += [f"Profile of the {prof.get('label')} step ({prof.get('wall_ms_per_step', 0):.1f} ms under the "
                      f"profiler" + (f", GPU busy {prof['gpu_busy_ms_per_step']:.1f} ms" if prof.get(
                          "gpu_busy_ms_per_step") else "") + "): top " + ("kernels" if prof.get("kernels") else "ops"),
                      "", *reproduce.table_head("ms / step", "share", "calls / step", "name")]
            lines += [f"| {k['ms_per_step']:.3f} | {k['share']:.1%} | {k['calls_per_step']:.0f} | "
                      f"`{k['name'][:80].replace('|', '/')}` |" for k in rows] + [""]
    out = os.path.join(into, "speed", "test_cuda.out")
    stage = next((s for s in (reproduce.read_json(os.path.join(into, "speed", "chunk.json")) or {}).get("stages", [])
                  if s["name"] == "test_cuda"), None)
    if stage:
        log = open(out, encoding="utf-8", errors="replace").read().splitlines() if os.path.isfile(out) else []
        summary = [l for l in log if re.search(r"\d+ (passed|failed|error)", l)]
        lines += [f"test_cuda.py (in-process checks, at most {H100['test_cuda_s']} s): {stage.get('status')}; "
                  f"pytest: {summary[-1].strip() if summary else 'no summary line'}", ""]
    return lines


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    p = reproduce.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("prepare", help="here: copy the data, wheels and a trained tokenizer into the checkout")
    q.add_argument("--shared", required=True, help="the shared folder holding data/corpus, data/glue and wheels/")
    q.add_argument("--vocab_size", type=int, default=MINI_VOCAB, help=argparse.SUPPRESS)  # tests: a small one
    q.add_argument("--root", default=HERE, help=argparse.SUPPRESS)  # tests: another checkout
    r = sub.add_parser("run", help="on the GPU machine: one chunk, one archive in $OUT")
    r.add_argument("chunk", help=", ".join(CHUNKS))
    r.add_argument("--budget", type=float, default=420, help="seconds for the whole command, packing included "
                   "(default 7 minutes)")
    r.add_argument("--out", help="where the archive goes (default $OUT)")
    r.add_argument("--work", help="the runs' folder (default out/device/CHUNK; out/device_toy/CHUNK with --toy)")
    r.add_argument("--steps", type=int, help=f"pretraining steps (default {STEPS}; toy {TOY_STEPS})")
    r.add_argument("--extra_steps", type=int, help=f"TaCL / MLM-control steps (default {EXTRA_STEPS}; toy "
                   f"{TOY_EXTRA_STEPS})")
    r.add_argument("--recipes", default=reproduce.SCALES["mini"]["recipes"], help="GLUE recipes, comma-separated "
                   "(eval.py --recipe; default the mini scale's: %(default)s)")
    r.add_argument("--glue_train_rows", type=int, help="GLUE train rows kept per task (default: the chunk's, else the "
                   f"mini scale's {reproduce.SCALES['mini']['glue_train_rows']:,}; --toy: the toy scale's 64)")
    r.add_argument("--data", help=f"pretraining text (default {DATA_DIR}/corpus; --toy: the bundled sample)")
    r.add_argument("--glue_dir", help=f"GLUE TSVs (default {DATA_DIR}/glue)")
    r.add_argument("--tokenizer", help=f"(default {DATA_DIR}/tokenizer when prepare made it; --toy: none)")
    r.add_argument("--site", default="/tmp/site", help="where the missing wheels are installed")
    r.add_argument("--toy", action="store_true", help="reproduce.py's toy scale and bench.py's tiny CPU rows: the "
                   "same stages on a CPU in a minute or two")
    m = sub.add_parser("merge", help="here: archives -> results/mini/ and its results.md")
    m.add_argument("archives", nargs="*", help="CHUNK.tar.gz files (none: rebuild the report of what is merged)")
    m.add_argument("--into", default=os.path.join(HERE, "results", "mini"))
    sub.add_parser("budget", help="each chunk's expected device time")
    words = sys.argv[1:] if argv is None else argv
    if words and words[0].startswith("-") and words[0] not in ("-h", "--help"):  # argparse would say "command required"
        p.error(f"{words[0]}: the first word is the command, one of prepare, run, merge, budget")
    args = p.parse_args(argv)
    args.argv = argv
    if args.command == "run" and not 0 < args.budget < float("inf"):  # NaN too: nothing would be scheduled
        p.error(f"--budget {args.budget}: must be a number of seconds > 0")
    if args.command == "run" and args.glue_dir and not os.path.isdir(args.glue_dir):
        p.error(f"--glue_dir {args.glue_dir}: not a directory")
    # a missing --data or --tokenizer passed here: the wheels and the CUDA check ran, then every stage failed
    problem = args.command == "run" and args.chunk != "speed" and args.data and reproduce.data_problem(args.data)
    if problem:
        p.error(f"--data: {problem}")  # it names the path
    if args.command == "run" and args.chunk != "speed" and args.tokenizer and not os.path.exists(args.tokenizer):
        p.error(f"--tokenizer {args.tokenizer}: no such file or directory")
    for flag in ("steps", "extra_steps", "glue_train_rows") if args.command == "run" else ():
        if getattr(args, flag) is not None and getattr(args, flag) < 1:  # 0 ran the default; < 0 failed on the device
            p.error(f"--{flag} {getattr(args, flag)}: must be >= 1")
    problem = reproduce.parse_recipes(args.recipes)[1] if args.command == "run" else None
    if problem:  # reproduce.py's check, here: before the wheels, the CUDA check and every stage fail
        p.error(problem)
    if args.command == "prepare":
        prepare(args)
    elif args.command == "run":
        return run(args)
    elif args.command == "merge":
        merge(args)
    else:
        print(budget_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
