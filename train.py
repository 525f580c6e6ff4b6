"""
Pretrain BERT with MLM, TACO, TaCL, COCO-LM or ELECTRA. One loop from a laptop CPU to
a multi-node GPU cluster.

    python train.py --objective taco                      # preset "smoke": tiny model, bundled sample text, CPU
    python train.py --objective taco --preset small --data DIR_OF_TEXT   # TACO Table 5 on one GPU
    torchrun --standalone --nproc_per_node=8 train.py --objective taco --preset base

Flags are the TrainConfig fields in config.py (--name value or --name=value); --help lists them
with the chosen preset's values and where each comes from.
"""
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from analysis import contextual_score, wordsim_similarity
from config import RankError, init_dir, parse_args, pool_problem, resume_config, saved_config, validate
from losses import LOSSES, generator_config
from model import Bert, BertConfig, MODEL_PRESETS, write_atomic

# a frozen or dead rank fails the others' next collective after this long, instead of hanging for good
DDP_TIMEOUT = timedelta(minutes=15)
# ranks > 0 wait while rank 0 trains the tokenizer and tokenizes the corpus, hours for a full
# Wikipedia: that one barrier runs on its own gloo group with a long timeout (NCCL's default of
# 10 min would kill the job), so the training collectives keep the short one above
DATA_TIMEOUT = timedelta(hours=6)
NOT_YET = 2 ** 62  # first_bad holds this until a non-finite loss or gradient norm is seen
MIN_LOSS_SCALE = 1e-4  # fp16: a GradScaler scale below this is a divergence (fairseq's --min-loss-scale)


# ---------------------------------------------------------------------------------------
# helpers the loop uses (importable by tests and bench.py)

class Pretrainer(nn.Module):
    """The model and the objective as one module, so DDP sees every trained parameter
    (an objective may own a generator or heads) in a single forward."""

    def __init__(self, model, objective):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, batch, rng):
        return self.objective(self.model, batch, rng)


def configure_optimizer(params, cfg, device_type):
    # weight decay on matrices and embeddings only, as BERT excludes biases and LayerNorm
    params = [p for p in params if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=cfg.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), eps=cfg.adam_eps, fused=device_type == "cuda")


def lr_at(step, cfg):
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.warmup_steps))


def step_seed(seed, step, micro_index, stream=0):
    # every micro-batch's random draws come from generators seeded by (seed, step, global micro-batch
    # index): stream 0 is the objective's (masks, negatives, samples), stream 1 torch's global RNG
    # (dropout). Resuming needs no RNG state, and two DDP ranks draw exactly what one process
    # accumulating two micro-batches draws. Tuples of ints hash the same in every process (CPython >= 3.8,
    # 64-bit: a resume on another build would draw other masks, not wrong ones).
    return hash((seed, step, micro_index, stream)) % (2 ** 62)


def micro_batching(cfg, world):
    """(sequences per micro-step per process, micro-steps per optimizer step). tokens_per_step fixes
    the global batch; batch_size is a memory cap, lowered when `world` processes would exceed it."""
    batch_size = cap = min(cfg.batch_size, max(1, cfg.tokens_per_step // (cfg.seq_len * world)))
    if cfg.negative_pool and cfg.objective in ("taco", "cocolm"):
        # whole pools per process, so the negatives (and the objective) are the same on any layout
        batch_size -= batch_size % cfg.negative_pool
        if batch_size == 0:
            raise ValueError(f"--negative_pool {cfg.negative_pool} needs that many sequences per process and "
                             f"micro-step; --batch_size {cfg.batch_size} with {world} process(es) allows {cap}")
    problem = pool_problem(cfg, cfg.negative_pool or batch_size)  # what each process gets
    if problem:
        name, why = problem
        raise ValueError(f"{world} process(es) leave {batch_size} sequence(s) per process and micro-step; --{name} "
                         f"{getattr(cfg, name)}: {why}; raise --tokens_per_step or use fewer processes"
                         + (", or lower --taco_negatives" if name == "taco_negatives" else ""))
    micro_tokens = batch_size * cfg.seq_len * world
    if cfg.tokens_per_step % micro_tokens:
        raise ValueError(f"tokens_per_step {cfg.tokens_per_step} is not a multiple of batch_size {batch_size} "
                         f"x seq_len {cfg.seq_len} x {world} processes = {micro_tokens}")
    return batch_size, cfg.tokens_per_step // micro_tokens


def atomic_save(obj, path):
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before it can save NaN weights."""


class SaveFailed(Exception):
    """A checkpoint could not be written (a full disk): its partial files are gone, ckpt.pt is the last good one."""


def take_lock(out_dir):
    """Hold out_dir/.lock while a run writes there: a second run on the same out_dir is refused. It is
    an OS file lock (flock), so the OS releases it when the process dies, however it dies, on this host
    or another one sharing the file system: a killed run never leaves a stale lock. The file holds
    "pid host" for the error message. Returns the open file: closing it (or exiting) releases the lock."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, ".lock")
    while True:
        try:
            f = open(path, "a+")
        except OSError as e:  # .lock is a directory, or unwritable
            raise ValueError(f"cannot open the run's lock file {path} ({e.strerror})") from None
        try:
            if os.name == "nt":  # Windows has no flock: lock the first byte
                import msvcrt
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
            else:
                import fcntl
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                f.seek(0)
                pid, host = f.read().split()
                holder = f"process {pid} on {host}"
            except (OSError, ValueError):
                holder = "another process"
            f.close()
            raise ValueError(f"--out_dir {out_dir} is in use by {holder} (it holds {path})") from None
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
        f.write(f"{os.getpid()} {socket.gethostname()}")
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
    lock.close()


# the files a run writes into out_dir, each through NAME.tmp or NAME.tmpPID and a rename
RUN_FILES = (r"ckpt\.pt|model\.safetensors|config\.json|tokenizer\.json|vocab\.txt|tokenizer_config\.json|"
             r"special_tokens_map\.json|code(-step\d+)?\.diff")


def remove_partial_writes(out_dir):
    """A run killed mid-save leaves its temporary file (ckpt.pt.tmp: over a GB for BERT-base); the
    finished files, and any file that is not one of ours, are untouched. Called under the lock, so
    no other run is writing here."""
    for name in os.listdir(out_dir):
        if re.fullmatch(rf"({RUN_FILES})\.tmp\d*", name) and os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


def data_fingerprint(train_tokens, val_tokens):
    """The token streams' sizes and a hash of 4,096 tokens spread over each: a resume refuses other or
    edited data (same path, other files; a corpus changed in place), which would silently move the run."""
    h = hashlib.sha1()
    for tokens in (train_tokens, val_tokens):
        h.update(np.asarray(tokens[np.linspace(0, max(len(tokens) - 1, 0), 4096).astype(np.int64)]).tobytes()
                 if len(tokens) else b"")
    return f"{len(train_tokens)}+{len(val_tokens)} tokens, sha1 {h.hexdigest()[:16]}"


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


def provenance(out_dir=None, diff_name="code.diff"):
    """The code that ran: git commit, whether the checkout had local changes (and the sha1 of
    `git diff HEAD` plus any untracked .py file, saved as out_dir/diff_name), torch version, host.
    Outside git: commit None."""
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *args: subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=30)
    commit, diff = None, ""
    try:
        out = git("rev-parse", "HEAD")
        if out.returncode == 0:
            commit, diff = out.stdout.strip(), git("diff", "HEAD").stdout
            top = git("rev-parse", "--show-toplevel").stdout.strip()
            for name in git("ls-files", "--others", "--exclude-standard", "--full-name", ":/*.py").stdout.split():
                with open(os.path.join(top, name), encoding="utf-8", errors="replace") as f:  # an ablation's new module
                    diff += f"untracked file {name}:\n" + "".join("+" + line for line in f)
    except (OSError, subprocess.SubprocessError):
        pass
    if diff and out_dir:
        write_atomic(os.path.join(out_dir, diff_name), diff)
    return dict(git_commit=commit, dirty=bool(diff), diff_sha1=hashlib.sha1(diff.encode()).hexdigest() if diff else None,
                torch=torch.__version__, host=socket.gethostname())


def export_step(out_dir):
    """The training step recorded in the Hugging Face export (model.safetensors and config.json), or
    None when the two disagree or are missing."""
    try:
        from safetensors import safe_open
        with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
            weights_step = (f.metadata() or {}).get("training_step")
        with open(os.path.join(out_dir, "config.json")) as f:
            config_step = json.load(f).get("training_step")
    except Exception:
        return None
    return config_step if weights_step is not None and str(config_step) == weights_step else None


def duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def objective_flops_per_token(objective, config, cfg, seq_len):
    """Model FLOPs per token of one training step, counting what the objective computes.
    A forward costs 2 FLOPs per multiply-add, a backward twice the forward (so 6 per MAC trained,
    2 per MAC run without grad). Per token and per layer: 4 D^2 + 2 D F matmul MACs, 2 T D for
    attention (QK^T and AV). The MLM head costs D^2 + D V MACs on the mask_prob share of tokens.
      mlm      6 * (L * (4D^2 + 2DF + 2TD) + p (D^2 + DV))
      taco     mlm + 6 * (K + 1) * D           (cosines of every anchor with 1 positive, K negatives)
      tacl     mlm + 2 * L * (...)             (teacher forward, no grad) + 6 * p * T * D (scores)
      electra  6 * gen + 6 * L * (...) + 6 (D^2 + D)                   (generator + disc. head)
      cocolm   6 * gen + 6 * (L * (...) + T_c / T * L * (...)[T = T_c] + p D V + D + 2 D^2 / T)
               + 2 * gen if dropout > 0  (x^MLM; the crop view of T_c = 2 + round(0.9 (T - 2)) tokens;
               LM head, no transform; copy head; SCL head on the two [CLS]; the dropout-off sampling
               forward, no grad)
    gen is the generator's forward MACs at losses.generator_config's width d, FFN F_g and depth G:
      gen = D d (the embeddings projection, if d != D) + G (4d^2 + 2d F_g + 2Td) + p (d D + D V)
    (its head's dense maps d -> D for the tied decoder). ELECTRA samples from its training
    forward, so it pays no extra pass."""
    L, D, F, V = config.num_layers, config.hidden_size, config.intermediate_size, config.padded_vocab_size
    p = cfg.mask_prob
    layer = 4 * D * D + 2 * D * F + 2 * seq_len * D
    mlm_head = p * (D * D + D * V)
    if objective == "mlm":
        return 6 * (L * layer + mlm_head)
    if objective == "taco":
        return 6 * (L * layer + mlm_head + (cfg.taco_negatives + 1) * D)
    if objective == "tacl":
        return 6 * (L * layer + mlm_head + p * seq_len * D) + 2 * L * layer
    if objective not in ("electra", "cocolm"):
        return None  # an objective added to losses.LOSSES: no MFU until its FLOPs are written here
    gen_config, G = generator_config(config, cfg)
    d, gen_ffn = gen_config.hidden_size, gen_config.intermediate_size
    gen = ((D * d if d != D else 0) + G * (4 * d * d + 2 * d * gen_ffn + 2 * seq_len * d)
           + p * (d * D + D * V))
    if objective == "electra":
        return 6 * gen + 6 * (L * layer + D * D + D)
    # Generator.forward reruns the generator without dropout to sample when the model has dropout
    sampling_pass = 2 * gen if config.dropout > 0 else 0
    # the crop view of a packed block is cut to 2 + round(crop_fraction (T - 2)) tokens (losses.crop_views)
    crop_len = 2 + round((seq_len - 2) * cfg.cocolm_crop_fraction)
    crop_layer = 4 * D * D + 2 * D * F + 2 * crop_len * D
    views = L * layer + crop_len / seq_len * L * crop_layer
    # the LM head decodes with the unpadded embedding rows, no transform
    return 6 * gen + sampling_pass + 6 * (views + p * D * config.vocab_size + D + 2 * D * D / seq_len)


def gpu_peak_flops(device):
    # dense bf16 tensor-core peaks from the datasheets; unknown GPUs report no MFU
    name = torch.cuda.get_device_name(device)
    for key, peak in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12), ("4090", 165e12)):
        if key in name:
            return peak
    return None


class Console:
    """stdout / stderr that outlive their reader (a killed reproduce.py, a closed `| tee`): after a broken
    pipe the output goes to os.devnull, so a print cannot stop the run before a SIGTERM's save."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.stream = open(os.devnull, "w")
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.stream = open(os.devnull, "w")

    def __getattr__(self, name):
        return getattr(self.stream, name)


@torch.no_grad()
def evaluate(model, objective, val_loader, cfg, device, autocast):
    """The objective's metrics on a fixed set of held-out blocks with fixed random draws:
    val_mlm_loss / val_mlm_acc for MLM, TACO and TaCL, the generator's val_gen_loss for
    ELECTRA and COCO-LM (their main model has no MLM head). Batch i is drawn with seed i whatever
    the run's --seed and objective: every run is scored on the same masks, so two runs compare."""
    model.eval(), objective.eval()
    rng = torch.Generator(device)
    val_loader.load_state_dict(val_loader.start_state)
    totals = {}
    for i in range(cfg.eval_batches):
        rng.manual_seed(i)  # not one stream: TACO's extra draws would move the masks of the batches after
        with autocast:
            _, metrics = objective(model, {"input_ids": val_loader.next_batch()}, rng)
        for k, v in metrics.items():
            totals["val_" + k] = totals.get("val_" + k, 0.0) + float(v) / cfg.eval_batches
    model.train(), objective.train()
    return totals


# ---------------------------------------------------------------------------------------

def main(argv=None):
    lock = made = None
    rank = int(os.environ.get("RANK", 0))  # torchrun's; errors are printed once, by rank 0
    try:
        cfg, given = parse_args(sys.argv[1:] if argv is None else argv, usage=__doc__)
        if cfg.init_from and "model_size" in given:
            raise ValueError(f"--model_size {cfg.model_size}: with --init_from the model is the checkpoint's own; "
                             f"drop --model_size")
        ckpt = None
        if cfg.resume:
            cfg, ckpt = resume_config(cfg, given)
        validate(cfg)
        if rank == 0:
            made = None if os.path.isdir(cfg.out_dir) else cfg.out_dir
            lock = take_lock(cfg.out_dir)  # before anything is written there
            remove_partial_writes(cfg.out_dir)
        code = train(cfg, ckpt)
    except ValueError as e:  # bad input: one clear line, exit 2, nothing saved is touched
        if rank == 0:  # once, not once per DDP rank: most bad input is the same on every rank
            sys.stderr.write(f"error: {e}\n")
        elif isinstance(e, RankError) or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            sys.stderr.write(f"error (rank {rank}): {e}\n")  # its own GPU; another node's disk
        sys.exit(2)
    except (Diverged, SaveFailed) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # before the training loop, which handles its own
        print("interrupted before training started: nothing was saved", file=sys.stderr)
        sys.exit(130)
    finally:
        if lock:
            release_lock(lock)
        if made and os.path.isdir(made) and not os.listdir(made):  # bad input found late (a --data path)
            os.rmdir(made)
    if code:
        sys.exit(code)


def train(cfg, ckpt=None):
    """The run. Returns 0, or 128 + the signal number when SIGINT / SIGTERM stopped it."""
    # ---- distributed setup: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK
    ddp = "RANK" in os.environ
    device = cfg.device if cfg.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu")
    if ddp:
        rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if sys.platform == "linux":  # a SIGKILLed torchrun leaves its workers training: SIGTERM them (they save)
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if device == "cuda":
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo", timeout=DDP_TIMEOUT)
        data_group = dist.new_group(backend="gloo", timeout=DATA_TIMEOUT)
        stop_group = dist.new_group(backend="gloo", timeout=DDP_TIMEOUT)  # agreeing on a stop, on the CPU
    else:
        rank, world = 0, 1
    master = rank == 0
    device_type = "cuda" if device.startswith("cuda") else device
    torch.manual_seed(cfg.seed)  # the initial weights (DDP broadcasts rank 0's anyway)
    if device_type == "cuda":  # TF32 matmuls: process-wide state, so set only where it acts (a CPU run leaves it alone)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    # ---- weights to start from, then the tokenizer that matches them
    init_model = None
    if cfg.init_from and not ckpt:
        init_model = Bert.from_pretrained(cfg.init_from)
        weights_dir = init_dir(cfg.init_from)
        if not cfg.tokenizer:
            if not any(os.path.isfile(os.path.join(weights_dir, f)) for f in ("tokenizer.json", "vocab.txt")):
                raise ValueError(f"--init_from {cfg.init_from}: no tokenizer.json or vocab.txt in {weights_dir}, so "
                                 "the vocabulary its weights were trained with is unknown; pass --tokenizer DIR or "
                                 "a hub name (e.g. bert-base-uncased)")
            cfg.tokenizer = weights_dir  # the vocabulary the weights were trained with
        if init_model.fresh_head and master and cfg.objective in ("mlm", "taco", "tacl"):
            print(f"note: {cfg.init_from} has no MLM head that its run trained (a BertModel, or an ELECTRA / COCO-LM "
                  f"run): the head starts untrained or stale")
    max_pos = (init_model.config if init_model else BertConfig).max_position_embeddings
    if cfg.seq_len > max_pos:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_position_embeddings {max_pos}")
    batch_size, grad_accum = micro_batching(cfg, world)
    if batch_size != cfg.batch_size and master:
        cap = cfg.tokens_per_step // (cfg.seq_len * world)
        why = [f"{world} process(es) x {cfg.batch_size} sequences would exceed tokens_per_step {cfg.tokens_per_step}"
               if cfg.batch_size > cap else None,
               f"whole pools of --negative_pool {cfg.negative_pool}" if batch_size != min(cfg.batch_size, max(1, cap)) else None]
        print(f"batch_size {cfg.batch_size} -> {batch_size} per process: {'; '.join(w for w in why if w)}")
    cfg.batch_size = batch_size

    # ---- data: rank 0 tokenizes into the cache, the others then read the cache. A resumed run
    # reads its own vocabulary from its directory, never the cache's or a newly trained one.
    tokenizer = cfg.tokenizer or None
    if ckpt:
        tokenizer = cfg.out_dir
        if not any(os.path.isfile(os.path.join(cfg.out_dir, f)) for f in ("tokenizer.json", "vocab.txt")):
            raise ValueError(f"--resume {cfg.out_dir}: the run's tokenizer.json / vocab.txt are missing")
    if ddp and not master:
        try:
            dist.barrier(group=data_group)
        except RuntimeError:  # rank 0 exited on bad input (its error line says why), or took over DATA_TIMEOUT
            raise ValueError(f"rank 0 stopped while preparing the data (its error line says why), or took over "
                             f"{DATA_TIMEOUT}") from None  # said once per node (LOCAL_RANK 0), not once per rank
    tok, train_tokens, val_tokens = data.prepare_data(cfg.data, cfg.cache_dir, tokenizer, cfg.vocab_size,
                                                      cfg.val_fraction)
    if ddp and master:
        dist.barrier(group=data_group)
    special = data.special_token_ids(tok)
    fingerprint = data_fingerprint(train_tokens, val_tokens)
    if ckpt and ckpt.get("data", fingerprint) != fingerprint:  # (checkpoints before this check have none)
        raise ValueError(f"--resume {cfg.out_dir}: --data {cfg.data} is not the data this run was trained on (then "
                         f"{ckpt['data']}, now {fingerprint}): the files were edited, replaced or moved")
    loader_args = dict(seq_len=cfg.seq_len, cls_id=special["cls"], sep_id=special["sep"], device=device)
    train_loader = data.BlockLoader(train_tokens, batch_size=cfg.batch_size, rank=rank, world_size=world,
                                    seed=cfg.seed, **loader_args)
    # the held-out set must not follow the per-process batch (lowered by the process count): a fixed row
    # count, the negative pool where there is one, so TACO's held-out negatives match training's
    try:
        val_loader = data.BlockLoader(val_tokens, batch_size=cfg.negative_pool or 16, seed=0, **loader_args)
    except ValueError as e:
        raise ValueError(f"the held-out split (--val_fraction {cfg.val_fraction}): {e}") from None
    val_loader.start_state = val_loader.state_dict()

    # ---- model and objective
    model_config = BertConfig(**MODEL_PRESETS[cfg.model_size], vocab_size=tok.get_vocab_size(), dropout=cfg.dropout,
                              **{f"{k}_token_id": v for k, v in special.items()})
    if ckpt:
        model_config = replace(BertConfig(**ckpt["model_config"]), dropout=cfg.dropout)  # --dropout may change
    elif init_model:
        mine = (init_model.config.vocab_size, init_model.config.mask_token_id, init_model.config.cls_token_id)
        if mine != (model_config.vocab_size, special["mask"], special["cls"]):
            raise ValueError(f"--init_from {cfg.init_from}: its vocabulary (size, [MASK], [CLS] = {mine}) does not "
                             f"match the tokenizer's in {cfg.tokenizer} ({model_config.vocab_size}, {special['mask']}, "
                             f"{special['cls']}); pass --tokenizer with the one its weights were trained with")
        model_config = replace(init_model.config, dropout=cfg.dropout)
    model = Bert(model_config)
    if init_model:
        # every weight but a pooler (Hugging Face BertModel has one; pretraining has no use for it)
        model.load_state_dict({k: v for k, v in init_model.state_dict().items() if not k.startswith("pooler.")})
    model.to(device)
    objective = LOSSES[cfg.objective](model, cfg).to(device)
    params = list(model.parameters()) + [p for p in objective.parameters() if p.requires_grad]
    optimizer = configure_optimizer(params, cfg, device_type)
    trains_head = any(p.requires_grad for p in model.head.parameters())  # COCO-LM, ELECTRA: export without it

    dtype = cfg.dtype
    if dtype == "auto":
        # bf16 from Ampere on; a V100 / T4 only emulates it (slowly), so it gets fp16 and a GradScaler
        bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = "bf16" if bf16 else "fp16" if device_type == "cuda" else "fp32"
    if device_type == "cpu" and dtype != "fp32" and master:
        print(f"note: --dtype {dtype} on a CPU without AVX512-BF16/AMX is slower than fp32 (4x in a smoke run on a "
              f"2-core AVX2 CPU); --dtype auto picks fp32 on a CPU")
    ptdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    autocast = nullcontext() if dtype == "fp32" else torch.autocast(device_type, dtype=ptdtype)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "fp16")

    step = saved_step = 0
    trained_s = 0.0  # seconds in the training loop before this process: elapsed_s goes on across resumes
    if ckpt:
        try:
            model.load_state_dict(ckpt["model"])
            objective.load_state_dict(ckpt["objective"])
            # the saved param groups would override the flags given now (and fused=, which follows the device)
            state = ckpt["optimizer"]
            for group, decay in zip(state["param_groups"], (cfg.weight_decay, 0.0)):
                group.update(betas=(0.9, cfg.beta2), eps=cfg.adam_eps, weight_decay=decay, fused=device_type == "cuda")
            optimizer.load_state_dict(state)
            for p, moments in optimizer.state.items():  # load_state_dict does not check: a mismatch fails mid-step
                if any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in moments.values()):
                    raise ValueError(f"optimizer state of shape {[tuple(v.shape) for v in moments.values()]} for a "
                                     f"weight of shape {tuple(p.shape)}")
            train_loader.load_state_dict(ckpt["loader"])  # global sequences read: exact on any batch / world size
            if scaler.is_enabled() and ckpt["scaler"]:  # a bf16 / fp32 run saved an empty state: a fresh scale
                scaler.load_state_dict(ckpt["scaler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--resume: checkpoint does not match this run ({' '.join(str(e).split())[:300]})") from None
        step = saved_step = ckpt["step"]
        trained_s = ckpt.get("elapsed_s", 0.0)  # (checkpoints before it was saved: 0)

    # compile the encoder's forward (fixed shapes: one graph, two for COCO-LM's crop): +28% tokens/s on an
    # H100 (README, Efficiency notes). Compiling the whole step graph-breaks at every seeded random
    # draw and is unmeasured on GPU (bench.py --compile 2). The compiled wrapper shares the raw
    # model's weights: saving and evaluation use the raw one. TACO compiles its negative scoring itself
    # under the same flag (losses.fused_gather_dot).
    compiled = torch.compile(model, dynamic=False) if cfg.compile and device_type == "cuda" else model
    trainer = Pretrainer(compiled, objective)
    if ddp:
        trainer = DDP(trainer)

    # ---- the run directory: tokenizer (once), log, export that matches ckpt.pt; what this run will do
    log_file = None
    if master:
        if not ckpt:  # a resumed run's tokenizer is the one in its directory: never rewritten
            data.save_tokenizer(tok, cfg.out_dir)
        log_path = os.path.join(cfg.out_dir, "log.jsonl")
        if not ckpt and os.path.isfile(log_path):
            print(f"note: {cfg.out_dir} holds a run stopped before its first checkpoint: it starts again from step 0 "
                  f"(its log.jsonl goes on; a step logged twice counts once, the later)")
        repair_log(log_path)
        log_file = open(log_path, "a")
        # the code that ran, for each segment of the run: a resume's local changes go to code-step{N}.diff
        diff_name = f"code-step{step}.diff" if ckpt else "code.diff"
        start = {"config": asdict(cfg), "provenance": provenance(cfg.out_dir, diff_name)}
        start.update({"resumed_from_step": step} if ckpt else {"model_config": asdict(model_config)})
        log_file.write(json.dumps(start) + "\n")
        log_file.flush()
        print(f"{cfg.objective} | {model.num_params() / 1e6:.1f}M params | {world} process(es) on {device}, {dtype}")
        print(f"tokens_per_step {cfg.tokens_per_step} = batch_size {cfg.batch_size} x seq_len {cfg.seq_len} "
              f"x {world} process(es) x grad_accum {grad_accum}")
        if cfg.objective in ("taco", "cocolm"):
            pool = cfg.negative_pool or cfg.batch_size
            print(f"negative pool: {pool} sequences" + ("" if cfg.negative_pool else
                  " (the per-process micro-batch: changes with the layout; --negative_pool fixes it)"))
        epochs = cfg.max_steps * (cfg.tokens_per_step // cfg.seq_len) / train_loader.num_blocks
        size = f"{len(train_tokens) / 1e6:.1f}M" if len(train_tokens) >= 1e6 else f"{len(train_tokens) / 1e3:.0f}k"
        print(f"this run reads the {size}-token training split {epochs:.2f} times (epochs): "
              f"{cfg.max_steps:,} steps x {cfg.tokens_per_step:,} tokens")
        if ckpt:
            print(f"resumed from step {step} (of {cfg.max_steps}) in {cfg.out_dir}")
            old = saved_config(ckpt)
            changed = ", ".join(f"{k} {getattr(old, k)} -> {getattr(cfg, k)}" for k in ("lr", "warmup_steps", "max_steps")
                                if getattr(old, k) != getattr(cfg, k))
            if changed:  # said even when the lr at this step is the same (in warm-up): the decay moved
                print(f"the learning-rate schedule moved ({changed}): lr at step {step} was {lr_at(step, old):.2e}, "
                      f"now {lr_at(step, cfg):.2e} (warm-up {cfg.warmup_steps}, linear decay to 0 at {cfg.max_steps})")
            if export_step(cfg.out_dir) != step:  # a run killed between the export and ckpt.pt: ckpt.pt wins
                model.save_pretrained(cfg.out_dir, mlm_head=trains_head, step=step)
                print(f"rewrote the Hugging Face export in {cfg.out_dir} from ckpt.pt (step {step})")

    def log(record):
        if master:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()

    first_bad = torch.full((), NOT_YET, dtype=torch.long, device=device)  # first step with a non-finite loss/grad norm

    def check_finite(metrics, weights=False):
        """Stop with Diverged on a non-finite loss / grad norm since the last check (the device-side
        first_bad, read here only: at log steps and before saves, so no host sync per step); before
        a save (`weights`), the weights too. Collective: all ranks check at the same step and stop together."""
        bad = first_bad.clone()
        if ddp:
            dist.all_reduce(bad, op=dist.ReduceOp.MIN)
        bad = int(bad)
        if bad == NOT_YET and weights and not torch.stack([torch.isfinite(p).all() for p in params]).all():
            bad = step
        scale = scaler.get_scale() if scaler.is_enabled() else None
        if bad == NOT_YET and scale is not None and scale < MIN_LOSS_SCALE:
            bad = step  # fp16: every skipped step halved the scale; the gradients stay non-finite, nothing trains
        if bad != NOT_YET:
            terms = " | ".join(f"{k} {float(v):.4g}" for k, v in {**metrics, "loss_scale": scale}.items()
                               if v is not None)
            kept = (f"{cfg.out_dir}/ckpt.pt and its export keep step {saved_step}" if saved_step else
                    "nothing was saved")
            raise Diverged(f"non-finite loss or gradient norm at step {bad} (step {step}: {terms}); stopped "
                           f"without saving: {kept}. Try a lower learning rate: "
                           + (f"python train.py --resume {cfg.out_dir} --lr {cfg.lr / 2:.3g}" if saved_step else
                              f"--lr {cfg.lr / 2:.3g}"))

    def save_checkpoint(metrics):
        nonlocal saved_step
        check_finite(metrics, weights=True)  # a diverged run never overwrites the last good checkpoint
        if not master:
            saved_step = step  # one writer: the ranks hold the same weights, and the loader state is global
            return
        # the export first, then ckpt.pt (what --resume trusts, and it rewrites an export of another step)
        try:
            model.save_pretrained(cfg.out_dir, mlm_head=trains_head, step=step)
            atomic_save(dict(model=model.state_dict(), model_config=asdict(model_config),
                             objective=objective.state_dict(), optimizer=optimizer.state_dict(),
                             scaler=scaler.state_dict(), step=step, loader=train_loader.state_dict(),
                             elapsed_s=trained_s + time.time() - t0,
                             config=asdict(cfg), data=fingerprint), os.path.join(cfg.out_dir, "ckpt.pt"))
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: torch.save raises RuntimeError
            remove_partial_writes(cfg.out_dir)
            reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
            kept = f"ckpt.pt keeps step {saved_step}, --resume goes on from it" if saved_step else "no ckpt.pt yet"
            raise SaveFailed(f"cannot save step {step} into {cfg.out_dir} ({reason}); {kept}") from None
        saved_step = step

    def run_eval():
        if master:
            record = {"step": step, **evaluate(model, objective, val_loader, cfg, device, autocast)}
            # TACO Fig. 3/6: how contextual the token states are, and how close co-occurring words' embeddings are
            val_loader.load_state_dict(val_loader.start_state)
            rng = torch.Generator(device).manual_seed(0)  # the same partner draws for every --seed (fidelity note 26)
            record["contextual_score"] = contextual_score(model, val_loader.next_batch(), rng, special)["contextual"]
            wordsim = wordsim_similarity(model, tok)
            if wordsim is not None:
                record["wordsim_cooc_sim"] = wordsim
            log(record)
            print(f"step {step:6d} | " + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))

    # SIGINT (Ctrl-C) and SIGTERM (what schedulers send before SIGKILL) stop the run between two steps,
    # never inside one; a second Ctrl-C stops it at once (a second SIGTERM is ignored)
    stop = []

    def on_signal(signum, frame):
        if stop and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        if not stop:  # a repeated SIGTERM (the scheduler and torchrun both send one) must not abort the save
            stop.append(signum)

    def stopping():
        # under DDP a signal reaches the ranks at different moments: they agree (a tiny gloo all-reduce on
        # the CPU, no GPU sync) so that all stop after the same step; one going on would hang in all-reduce.
        # Every step: torchrun kills its workers 30 s after passing on a SIGTERM
        if not ddp:
            return bool(stop)
        flag = torch.tensor([len(stop)])
        dist.all_reduce(flag, group=stop_group)
        if flag.item() and not stop:
            stop.append(signal.SIGTERM)
        return bool(flag.item())

    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    flops = objective_flops_per_token(cfg.objective, model_config, cfg, cfg.seq_len)
    peak = gpu_peak_flops(device) if device_type == "cuda" and flops else None
    first_step, t0 = step, time.time()
    t_log, tokens_since_log = t0, 0
    metrics = {}
    try:
        if step == 0:
            run_eval()  # the untrained baseline
            t0 = t_log = time.time()  # tokens/s and the ETA count training steps only
        while step < cfg.max_steps and not stopping():
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            bad, metrics = torch.zeros((), dtype=torch.bool, device=device), {}
            for micro in range(grad_accum):
                batch = {"input_ids": train_loader.next_batch()}
                rng = torch.Generator(device).manual_seed(step_seed(cfg.seed, step, micro * world + rank))
                torch.manual_seed(step_seed(cfg.seed, step, micro * world + rank, stream=1))  # dropout
                # sync gradients across ranks only on the last micro-step
                sync = trainer.no_sync() if ddp and micro < grad_accum - 1 else nullcontext()
                with sync:
                    with autocast:
                        loss, terms = trainer(batch, rng)
                    scaler.scale(loss / grad_accum).backward()
                bad |= ~torch.isfinite(loss.detach())
                for k, v in {"loss": loss.detach(), **terms}.items():  # logged: the mean over micro-steps (and ranks)
                    metrics[k] = metrics.get(k, 0) + v / grad_accum
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if not scaler.is_enabled():  # under fp16 an inf gradient only makes the GradScaler skip the step
                    bad |= ~torch.isfinite(norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            first_bad.masked_fill_(bad & (first_bad == NOT_YET), step)
            tokens_since_log += cfg.tokens_per_step

            if step % cfg.log_interval == 0 or step == cfg.max_steps:
                if ddp:  # the global batch's mean, not rank 0's share of it
                    values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device)
                                          for v in metrics.values()])
                    dist.all_reduce(values)
                    metrics = dict(zip(metrics, values / world))
                record = {"step": step, **{k: float(v) for k, v in metrics.items()}, "lr": lr}
                if scaler.is_enabled():  # fp16: a falling scale is a run skipping steps
                    record["loss_scale"] = scaler.get_scale()
                check_finite(metrics)
                dt, t_log = time.time() - t_log, time.time()
                record["tokens_per_s"] = tokens_since_log / dt
                tokens_since_log = 0
                if peak:
                    record["mfu"] = record["tokens_per_s"] * flops / (peak * world)
                record["elapsed_s"] = trained_s + time.time() - t0
                log(record)
                if master:
                    terms = " | ".join(f"{k} {v:.4g}" if k == "loss_scale" else f"{k} {v:.4f}"
                                       for k, v in record.items() if k not in ("step", "lr", "tokens_per_s", "mfu",
                                                                                "elapsed_s"))
                    mfu = f" | mfu {record['mfu']:.1%}" if peak else ""
                    eta = (time.time() - t0) / (step - first_step) * (cfg.max_steps - step)
                    print(f"step {step}/{cfg.max_steps} | {terms} | lr {lr:.2e} | "
                          f"{record['tokens_per_s'] / 1e3:.1f}k tok/s{mfu} | {duration(record['elapsed_s'])} "
                          f"| eta {duration(eta)}", flush=True)
            if step % cfg.eval_interval == 0 or step == cfg.max_steps:
                run_eval()
            if step % cfg.ckpt_interval == 0 or step == cfg.max_steps:
                save_checkpoint(metrics)
        if stop:  # between two steps: every rank holds the weights of `step`, rank 0 saves them
            name = signal.Signals(stop[0]).name
            if step > saved_step:
                save_checkpoint(metrics)
            if master:
                print(f"{name}: stopped after step {step}; " + (
                      f"{cfg.out_dir}/ckpt.pt holds step {saved_step}: {'torchrun ... ' if ddp else 'python '}"
                      f"train.py --resume {cfg.out_dir} continues" if saved_step else "no step was done, nothing was saved"), flush=True)
            return 128 + stop[0]
    except KeyboardInterrupt:  # a second signal, mid-step: the last checkpoint stands
        if master:
            print(f"interrupted at step {step}: " + (f"--resume {cfg.out_dir} continues from the last checkpoint, "
                  f"step {saved_step}" if saved_step else "no checkpoint was saved yet"), flush=True)
        return 130
    finally:
        for s, handler in handlers.items():
            if not stop:  # after a stop, keep ignoring a late repeated SIGTERM while exiting
                signal.signal(s, handler)
        if log_file:
            log_file.close()
        if ddp:
            dist.destroy_process_group()
    if master:
        print(f"done: steps {first_step} -> {step} in {duration(time.time() - t0)}. In {cfg.out_dir}: ckpt.pt "
              f"(step {step}, for --resume), model.safetensors + config.json (Hugging Face export, for eval.py --model), "
              f"tokenizer.json + vocab.txt, log.jsonl" + (f", {diff_name}" if os.path.isfile(
                  os.path.join(cfg.out_dir, diff_name)) else ""))
    return 0


if __name__ == "__main__":
    sys.stdout, sys.stderr = Console(sys.stdout), Console(sys.stderr)
    main()
