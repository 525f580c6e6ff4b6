"""
train.py's flags: the TrainConfig fields, the presets (with the source of each value), and their
parsing and checking. --help prints them with the chosen preset's values and sources.

    cfg, given = parse_args(["--objective", "taco", "--preset", "small"])
    validate(cfg)  # every flag's value, before the run writes anything (checks that need the data, the
                   # checkpoint's model or the world size follow in train.py, before the first step)
"""
import argparse
import glob
import inspect
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import PurePath

import torch

import distributed
from data import DEFAULT_DATA, HUB_CORPUS, LIMIT_ALPHABET
from model import MODEL_PRESETS


@dataclass
class TrainConfig:
    # what to train
    objective: str = "mlm"  # mlm | taco | tacl | cocolm | electra (losses.LOSSES)
    preset: str = "smoke"  # smoke (tiny, CPU) | small | base | tacl (TaCL's, needs --init_from): sets the defaults below, flags override
    model_size: str = "tiny"  # model.MODEL_PRESETS: tiny | small (TACO's BERT-small) | base
    init_from: str = ""  # start from these weights: a run dir, a ckpt.pt, or a Hugging Face BERT dir
    resume: str = ""  # continue a run exactly: its out_dir or ckpt.pt; auto: --out_dir's run if it saved one, else a new run
    # data
    data: str = DEFAULT_DATA  # a local file / dir / glob, or a datasets hub name ("name:config"); smoke: the sample in assets/
    tokenizer: str = ""  # tokenizer.json, vocab.txt, a dir with them or a hub name (bert-base-uncased); empty = the init_from dir's, else train one
    vocab_size: int = 30522  # size of a newly trained WordPiece vocabulary (BERT's 30,522; smoke: 8,192)
    cased: bool = False  # a trained tokenizer keeps case and accents (multilingual BERT cased); default: uncased, accents and other marks stripped (BERT-uncased)
    limit_alphabet: int = LIMIT_ALPHABET  # a trained tokenizer's characters: the most frequent N (rarer ones become [UNK]); 0 = all (CJK text needs thousands; every character is a token, so the vocabulary may outgrow --vocab_size)
    val_fraction: float = 0.005  # share of the corpus held out for the validation MLM loss (at least 16,384 tokens, up to 10% of a small corpus)
    cache_dir: str = "cache"  # tokenizers and token files, reused across runs
    seq_len: int = 128  # tokens per packed block, [CLS] and [SEP] included
    # optimisation (these defaults are the smoke run's; --preset small/base set TACO Table 5's)
    batch_size: int = 16  # sequences per micro-step per process: a memory cap, lowered to fit tokens_per_step
    tokens_per_step: int = 2048  # global tokens per optimizer step: gradient accumulation is derived from it
    max_steps: int = 300  # optimizer steps; the schedule decays to 0 here
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 30  # linear warmup, then linear decay to 0 at max_steps
    weight_decay: float = 0.01  # on >= 2-D weights only (not biases or LayerNorm), as BERT
    beta2: float = 0.999  # AdamW beta2 (Table 5; RoBERTa's 0.98 is steadier with huge batches)
    adam_eps: float = 1e-8  # AdamW epsilon (Table 5; BERT and RoBERTa use 1e-6)
    grad_clip: float = 1.0  # clip the global grad norm (0 = off)
    dropout: float = 0.1  # BERT pretraining dropout, hidden and attention (smoke: 0, a 300-step run has nothing to regularise)
    mask_prob: float = 0.15  # share of non-special tokens selected for prediction (BERT)
    # objective hyperparameters, with their sources
    mlm_predict_all: bool = False  # MLM+TP ablation (TACO §5.2): also predict every unmasked token
    taco_window: int = 5  # W (odd): positives within +-W//2 (TACO App. A, official scripts)
    taco_negatives: int = 50  # K negatives per anchor (TACO App. A)
    taco_temperature: float = 0.07  # tau (TACO App. A)
    taco_weight: float = 1.0  # lambda in L_MLM + lambda * L_TC (TACO Eq. 11 adds the two unweighted: 1)
    taco_anchors: str = "all"  # all non-pad positions (official default) | masked ("concentrated TACO", §5.2)
    taco_stop_grad: bool = True  # detach positives/negatives (official code); False = the paper's Eq. 6-10 as written (note 41)
    negative_pool: int = 0  # sequences sharing one pool of negatives (TACO rows, COCO-LM NT-Xent); 0 = the per-process micro-batch (fidelity note 4)
    tacl_temperature: float = 0.01  # tau (TaCL §3, official scripts)
    gen_shape: str = "cocolm"  # generator: cocolm = same width, max(1, round(L/3)) layers (COCO-LM §4) | electra = full depth, 1/4 width (1/3 for base) (ELECTRA Table 6)
    gen_layers: int = 0  # generator depth; 0 = the gen_shape's own
    cocolm_copy_weight: float = 50.0  # lambda_copy (COCO-LM §3, "Corrective Language Modeling")
    cocolm_scl_temperature: float = 1.0  # tau of the SCL NT-Xent (COCO-LM §4)
    cocolm_crop_fraction: float = 0.9  # share of tokens kept in SCL's cropped view (COCO-LM §3, "Sequence Contrastive Learning")
    cocolm_mask_all: bool = False  # generator input: every selected token -> [MASK] (MC-BERT's default) instead of BERT's 80/10/10 (ours)
    electra_disc_weight: float = 50.0  # lambda on the discriminator loss (ELECTRA §2; the value: App. A)
    # system
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto (bf16 on GPUs that have it, else fp16 with a GradScaler; fp32 on CPU) | fp32 | bf16 | fp16
    compile: bool = True  # torch.compile the encoder and TACO's negative scoring (CUDA only)
    seed: int = 1337  # model init, data order and every random draw of the objectives
    # logging, evaluation, checkpoints
    out_dir: str = "out/smoke"  # checkpoint, Hugging Face export, tokenizer and log.jsonl go here (out/PRESET)
    log_interval: int = 10  # steps between log lines (where the loss is read back: the loop's host syncs, with saves)
    eval_interval: int = 100  # steps between held-out evaluations
    eval_batches: int = 8  # held-out batches per evaluation
    ckpt_interval: int = 100  # steps between checkpoints (also at the end, and on Ctrl-C or SIGTERM)


# small / base are TACO's Table 5 (App. A), the pretraining recipe of both MLM and TACO. The official
# scripts differ (256 sequences x 4 accumulation x 2 GPUs = 2,048 per step); we follow the paper.
# Deviations: bf16 where the paper has fp16; our own 30,522-piece WordPiece, not bert-base-uncased's.
# COCO-LM and ELECTRA get this recipe too, so that all objectives compare on one (not their papers' own). Fidelity note 1.
PAPER_RECIPE = dict(seq_len=256, vocab_size=30522, tokens_per_step=1280 * 256, lr=1e-4, beta2=0.999, adam_eps=1e-8,
                    weight_decay=0.01, grad_clip=1.0, dropout=0.1, mask_prob=0.15, data=HUB_CORPUS,
                    batch_size=80, negative_pool=80, log_interval=100, eval_batches=20)
PRESETS = {
    # a tiny model on the sample corpus in assets/: learns visibly in about a minute on a laptop CPU
    "smoke": dict(model_size="tiny", data=DEFAULT_DATA, vocab_size=8192, seq_len=128, batch_size=16,
                  tokens_per_step=2048, max_steps=300, lr=1e-3, warmup_steps=30, log_interval=10,
                  eval_interval=100, ckpt_interval=100, dropout=0.0),
    "small": dict(PAPER_RECIPE, model_size="small", max_steps=250_000, warmup_steps=2_500,
                  eval_interval=2000, ckpt_interval=2000, out_dir="out/small"),
    "base": dict(PAPER_RECIPE, model_size="base", max_steps=500_000, warmup_steps=10_000,
                 eval_interval=5000, ckpt_interval=5000, out_dir="out/base"),
    # TaCL's own recipe (official train_tacl_english.sh and train.py): continual pretraining of
    # bert-base-uncased (--init_from), 256 x 256 tokens, 150k steps, 10% warm-up, transformers' AdamW
    # defaults (eps 1e-6, no weight decay). Not reproduced: its NSP loss on sentence pairs, and its
    # clipping on every micro-batch of a summed accumulation (we clip the mean once per step; fidelity note 3).
    "tacl": dict(objective="tacl", model_size="base", seq_len=256, vocab_size=30522, tokens_per_step=256 * 256,
                 batch_size=64, max_steps=150_000, warmup_steps=15_000, lr=1e-4, beta2=0.999, adam_eps=1e-6,
                 weight_decay=0.0, grad_clip=1.0, dropout=0.1, mask_prob=0.15, data=HUB_CORPUS,
                 log_interval=100, eval_interval=5000, eval_batches=20, ckpt_interval=5000, out_dir="out/tacl"),
}
# where each preset value comes from, printed by --help
_TABLE5 = "TACO Table 5"
PRESET_SOURCES = {
    "small": dict(model_size=_TABLE5 + ": 4 layers, 512 hidden, 8 heads, FFN 2,048", seq_len=_TABLE5, vocab_size=_TABLE5,
                  tokens_per_step=_TABLE5 + ": 1,280 sequences x 256", max_steps=_TABLE5, warmup_steps=_TABLE5,
                  lr=_TABLE5 + ", linear decay", beta2=_TABLE5, adam_eps=_TABLE5, weight_decay=_TABLE5,
                  grad_clip=_TABLE5, dropout=_TABLE5, mask_prob=_TABLE5,
                  data="ours: English Wikipedia (the paper adds BookCorpus, no longer distributed)",
                  batch_size="ours: a per-process cap; accumulation makes up 1,280",
                  negative_pool="ours: our reading of the paper's 1,280 on 16 GPUs, kept on any layout"),
    "tacl": dict(model_size="TaCL: bert-base-uncased", seq_len="TaCL script: max_len 256",
                 tokens_per_step="TaCL script: effective batch 256", max_steps="TaCL: 150k steps (its script: 150,010)",
                 warmup_steps="TaCL train.py: 10% of steps", lr="TaCL script", adam_eps="transformers AdamW default",
                 weight_decay="transformers AdamW default", grad_clip="TaCL train.py: max_grad_norm 1.0",
                 beta2="transformers AdamW default", vocab_size="bert-base-uncased's", dropout="bert-base-uncased's",
                 mask_prob="TaCL's data code (its own count: fidelity note 6)",
                 batch_size="ours: a per-process cap; accumulation makes up 256",
                 data="ours: English Wikipedia 20231101 (TaCL: 20M lines of 20200501; fidelity note 2)"),
}
WARMUP_IS_10_PERCENT = ("tacl",)  # its warm-up is a rule (TaCL train.py), not Table 5's step counts
PRESET_SOURCES["base"] = dict(PRESET_SOURCES["small"], model_size=_TABLE5 + ": 12 layers, 768 hidden, 12 heads, FFN 3,072")


def field_help():
    """name -> (type, default, the comment written beside the field above)."""
    src = inspect.getsource(TrainConfig)
    comments = dict(re.findall(r"^\s+(\w+): \w+ = .*?(?:#\s*(.*))?$", src, re.M))
    return {f.name: (f.type, f.default, comments.get(f.name, "")) for f in fields(TrainConfig)}


def parse_value(name, typ, text):
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{name} expects true or false, got {text!r}")
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"--{name} expects {typ.__name__}, got {text!r}") from None


def print_help(spec, argv, usage):
    """Each flag with the chosen preset's value (--preset NAME before or after --help) and its source."""
    preset = TrainConfig.preset
    for i, arg in enumerate(argv):  # the last --preset wins, as in parse_args
        name, eq, value = arg.partition("=")
        if name == "--preset":
            preset = value if eq else argv[i + 1] if i + 1 < len(argv) else ""
    values, sources = {**PRESETS.get(preset, {}), "preset": preset}, PRESET_SOURCES.get(preset, {})
    from losses import LOSSES  # every objective there, an ablation's new one too (the field's comment lists the five)
    spec = {**spec, "objective": (*spec["objective"][:2], " | ".join(LOSSES) + " (losses.LOSSES)")}
    print(usage or __doc__)
    print(f"flags, with the values of --preset {preset} (choices: {', '.join(PRESETS)}):")
    for name, (typ, default, comment) in spec.items():
        value = values.get(name, default)
        source = f"  [{sources[name]}]" if name in sources else ""
        print(f"  --{name:<24} {value!r:<32} {comment}{source}")


def parse_args(argv, usage=None):
    """--name value / --name=value flags over a preset over the defaults. Returns (config, names given);
    --help prints `usage` (train.py's docstring), then the flags."""
    spec = field_help()
    given = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            try:
                print_help(spec, argv, usage)
                sys.stdout.flush()
            except BrokenPipeError:  # `--help | head` closed the pipe: no traceback (Python's documented fix)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r} (flags look like --name value)")
        name, eq, value = arg[2:].partition("=")
        if name not in spec:
            raise ValueError(f"unknown flag --{name} (see --help)")
        if not eq:
            is_bool = spec[name][0] is bool
            if i + 1 < len(argv) and not (is_bool and argv[i + 1].startswith("--")):
                value, i = argv[i + 1], i + 1
            elif is_bool:
                value = "true"  # a bare boolean flag
            else:
                raise ValueError(f"--{name} needs a value")
        given[name] = parse_value(name, spec[name][0], value)
        i += 1
    preset = given.get("preset", TrainConfig.preset)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if "data" in given:
        given["data"] = data_path(given["data"])
    if "cache_dir" in given:  # absolute, as data: a resume or `eval.py --analysis` from elsewhere reuses the cache
        given["cache_dir"] = os.path.abspath(os.path.expanduser(given["cache_dir"]))
    for name in ("out_dir", "resume", "init_from", "tokenizer"):  # ~ as in data and cache_dir: the shell leaves
        if name in given:  # `--out_dir=~/runs` alone, which made a folder named ~ in the working directory
            given[name] = os.path.expanduser(given[name])
    cfg = replace(TrainConfig(), **{**PRESETS[preset], **given})
    cfg.cache_dir = os.path.abspath(os.path.expanduser(cfg.cache_dir))
    if "warmup_steps" not in given and (preset in WARMUP_IS_10_PERCENT or cfg.warmup_steps > cfg.max_steps):
        cfg.warmup_steps = cfg.max_steps // 10  # TaCL's rule at any --max_steps; a short run of another preset
    return cfg, given


def data_path(data):
    """A local --data (file, directory, glob) as an absolute path, so that a resume started from another
    directory reads the same files and the checkpoint says which; a hub dataset name stays as it is."""
    local = os.path.expanduser(data)
    pattern = not os.path.exists(local) and any(c in data for c in "*?[")
    if pattern and not os.path.isabs(local):  # brackets in the working directory's own name are not a pattern
        return os.path.normpath(os.path.join(glob.escape(os.getcwd()), local))
    if os.path.exists(local) or pattern or data.startswith(("/", ".", "~")):
        return os.path.abspath(local)
    return data


WRITTEN = ("vocab.txt", "log.jsonl", "tokenizer.json", "config.json")  # a run's or the token cache's files


def reads_into(data, directory):
    """Whether a local --data (a directory or a glob) would read the files that a run or the token cache
    writes in `directory` (WRITTEN, there or one folder down): they would become corpus, and the corpus change."""
    local, target = os.path.expanduser(data), os.path.abspath(directory)
    magic = lambda p: any(c in re.sub(r"\[[\[*?]\]", "", p) for c in "*?[")  # glob.escape's [[], [*], [?] are not
    if os.path.isdir(local):
        root = local
    elif os.path.exists(local) or not magic(local):
        return False  # one file, or a hub dataset
    elif "**" in local:  # a recursive glob reads below its fixed part
        parts = local.split(os.sep)
        root = re.sub(r"\[([\[*?])\]", r"\1", os.sep.join(parts[:next(i for i, p in enumerate(parts) if magic(p))]))
    else:
        probes = [os.path.join(target, *sub, name) for sub in ((), ("tokenizer-x",)) for name in WRITTEN]
        return any(PurePath(p).match(os.path.abspath(local)) for p in probes)
    return os.path.relpath(os.path.realpath(target), os.path.realpath(root or ".")).split(os.sep)[0] != ".."


DTYPES = ("auto", "fp32", "bf16", "fp16")
# lower bounds, with the reason a smaller value cannot work
MINIMUM = dict(seq_len=(3, "room for [CLS] and [SEP]"), batch_size=(1, ""), tokens_per_step=(1, ""),
               max_steps=(1, ""), warmup_steps=(0, ""), seed=(0, ""), log_interval=(1, ""), eval_interval=(1, ""),
               eval_batches=(1, ""), ckpt_interval=(1, ""), weight_decay=(0, ""), grad_clip=(0, "0 = off"),
               gen_layers=(0, "0 = the gen_shape's own"), negative_pool=(0, "0 = the micro-batch"),
               vocab_size=(100, "5 special tokens and enough WordPiece pieces to spell words"),
               taco_window=(3, "positives within +-W//2: W = 3 is the smallest with one offset"),
               limit_alphabet=(0, "0 = every character of the corpus"), taco_negatives=(1, ""), taco_weight=(0, ""), cocolm_copy_weight=(0, ""), electra_disc_weight=(0, ""))
POSITIVE = ("lr", "adam_eps", "taco_temperature", "tacl_temperature", "cocolm_scl_temperature")
# ranges (low, high, low included, high included)
RANGES = dict(mask_prob=(0, 1, False, False), dropout=(0, 1, True, False), beta2=(0, 1, True, False),
              cocolm_crop_fraction=(0, 1, False, True), val_fraction=(0, 0.5, False, True))


def pooled(objective):
    """Whether the objective draws negatives from a pool of rows (its class in losses.LOSSES says so with
    uses_negative_pool: TACO, COCO-LM's SCL): each process then gets whole pools, of a checked size."""
    from losses import LOSSES
    return getattr(LOSSES.get(objective), "uses_negative_pool", False)


def pool_problem(cfg, pool):
    """(flag, why) when `pool` sequences cannot be TACO's or COCO-LM's negative pool (losses.pool_size), else
    None: asked of the flags before a run, and of what each process gets once the world size caps its batch."""
    if not pooled(cfg.objective):
        return None
    if pool < 2:  # the flag that set the pool: --negative_pool 1 is its own mistake, not --batch_size's
        flag = "negative_pool" if cfg.negative_pool else "batch_size"
        return flag, ("TACO and COCO-LM's SCL draw negatives from the other sequences of their pool: they "
                      f"need a pool (negative_pool, else batch_size) of >= 2 sequences, not {pool}")
    candidates = (pool - 1) * cfg.seq_len  # tokens in the other rows of a pool
    if cfg.objective == "taco" and cfg.taco_negatives > candidates:
        return "taco_negatives", (f"must be <= {candidates:,}, the tokens of the other rows of a pool of {pool} "
                                  "((pool - 1) x seq_len): more would only repeat them, at B x T x K memory (paper: 50)")
    return None


# flag (or prefix) -> the objectives whose loss reads it; every other flag acts on every objective. An objective
# added to losses.LOSSES with flags of its own (NAME_...) goes here (test_train checks), and then must be named
# among the readers of each shared flag it reads (mlm_predict_all, if it calls mlm_loss with it) or get a false note
OBJECTIVE_FLAGS = {"mlm_predict_all": "mlm taco tacl", "taco_": "taco", "tacl_": "tacl", "gen_": "cocolm electra",
                   "cocolm_": "cocolm", "electra_": "electra"}


def warmup_note(cfg, given):
    """A new run of a preset shortened to near its warm-up (--preset small --max_steps 3000 keeps 2,500 warm-up
    steps): a note, since the lr then barely decays. A warm-up longer than the run is cut to 10% in parse_args."""
    if cfg.resume or "warmup_steps" in given or "max_steps" not in given or cfg.warmup_steps <= cfg.max_steps // 2:
        return []
    return [f"note: the preset's warm-up is {cfg.warmup_steps:,} of the {cfg.max_steps:,} steps: the learning rate "
            f"peaks at step {cfg.warmup_steps:,} of {cfg.max_steps:,}; --warmup_steps N shortens it (10%: "
            f"--warmup_steps {cfg.max_steps // 10})"]


def unread_flags(cfg, given):
    """Notes on the flags given that cfg.objective never reads (a note, not an error: a script may pass one
    set of flags to every objective), e.g. --taco_window under --objective mlm. No note for an objective that
    OBJECTIVE_FLAGS does not name (one added to losses.LOSSES may read any: mlm_loss's predict_all, TACO's)."""
    if not any(cfg.objective in users.split() for users in OBJECTIVE_FLAGS.values()):
        return []
    return [f"note: --{name} does nothing under --objective {cfg.objective} (it is read by {users.replace(' ', ', ')})"
            for name in given for prefix, users in OBJECTIVE_FLAGS.items()
            if name.startswith(prefix) and cfg.objective not in users.split()]


def micro_batching(cfg, world, advise=True):
    """(sequences per micro-step per process, micro-steps per optimizer step). tokens_per_step fixes
    the global batch; batch_size is a memory cap, lowered when `world` processes would exceed it. A step that
    does not split says what would (advise)."""
    batch_size = cap = min(cfg.batch_size, max(1, cfg.tokens_per_step // (cfg.seq_len * world)))
    if cfg.negative_pool and pooled(cfg.objective):
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
        lowered = f" (--batch_size {cfg.batch_size}, lowered)" if batch_size != cfg.batch_size else ""
        raise ValueError(f"tokens_per_step {cfg.tokens_per_step} is not a multiple of batch_size {batch_size}{lowered} "
                         f"x seq_len {cfg.seq_len} x {world} processes = {micro_tokens}"
                         + (split_advice(cfg, world) if advise else ""))
    return batch_size, cfg.tokens_per_step // micro_tokens


def split_advice(cfg, world):
    """What would split the step, for micro_batching's error: a smaller --batch_size, another process count
    (a 6-GPU node does not split --preset small's 1,280 sequences into pools of 80), the nearest --tokens_per_step."""
    def splits(w=world, **change):
        try:
            return bool(micro_batching(replace(cfg, **change), w, advise=False))
        except ValueError:
            return False
    n = cfg.tokens_per_step // (cfg.seq_len * world)  # sequences per process, if they split at all
    divisors = {d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i) if d < cfg.batch_size}
    batch = next((b for b in sorted(divisors, reverse=True) if splits(batch_size=b)), None)
    worlds = [w for w in range(1, 1025) if splits(w)][:8]
    step, near = cfg.seq_len, cfg.tokens_per_step - cfg.tokens_per_step % cfg.seq_len
    tokens = [t for candidates in (range(near, max(0, near - 2000 * step), -step),
                                   range(near + step, near + 2001 * step, step))
              for t in [next((t for t in candidates if t != cfg.tokens_per_step and splits(tokens_per_step=t)), None)]
              if t]
    advice = ([f"with --batch_size {batch}"] if batch else []) + (
        [f"on {', '.join(map(str, worlds[:-1]))}{' or ' if worlds[1:] else ''}{worlds[-1]} processes"] if worlds else []) + (
        [f"with --tokens_per_step {' or '.join(map(str, tokens))}"] if tokens else [])
    return f"; it splits {'; or '.join(advice)}" if advice else ""


def batch_note(cfg, batch_size, world):
    """Why the per-process batch is not --batch_size, or None."""
    if batch_size == cfg.batch_size:
        return None
    cap = cfg.tokens_per_step // (cfg.seq_len * world)
    why = [f"{world} process(es) x {cfg.batch_size} sequences would exceed tokens_per_step {cfg.tokens_per_step}"
           if cfg.batch_size > cap else None,
           f"whole pools of --negative_pool {cfg.negative_pool}" if batch_size != min(cfg.batch_size, max(1, cap)) else None]
    return f"batch_size {cfg.batch_size} -> {batch_size} per process: {'; '.join(w for w in why if w)}"


def validate(cfg):
    """Every flag's value checked once, before the run writes anything: a violation is a ValueError
    naming the flag, its value and what is allowed (main() prints it as one `error:` line, exit 2)."""
    from losses import LOSSES

    def need(ok, name, allowed):
        if not ok:
            raise ValueError(f"--{name} {getattr(cfg, name)!r}: {allowed}")

    for f in fields(cfg):
        if isinstance(getattr(cfg, f.name), float):
            need(math.isfinite(getattr(cfg, f.name)), f.name, "must be a finite number")
    for name, allowed in dict(objective=LOSSES, model_size=MODEL_PRESETS, preset=PRESETS, dtype=DTYPES,
                              taco_anchors=("all", "masked"), gen_shape=("cocolm", "electra")).items():
        need(getattr(cfg, name) in allowed, name, "choose from " + ", ".join(allowed))
    for name, (low, why) in MINIMUM.items():
        need(getattr(cfg, name) >= low, name, f"must be >= {low}" + (f" ({why})" if why else ""))
    for name in POSITIVE:
        need(getattr(cfg, name) > 0, name, "must be > 0")
    for name, (low, high, low_in, high_in) in RANGES.items():
        v = getattr(cfg, name)
        need((v >= low if low_in else v > low) and (v <= high if high_in else v < high), name,
             f"must be in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}")
    # the official sampler.py requires an odd window; an even W would behave as W + 1 (fidelity note 30)
    need(cfg.taco_window % 2 == 1, "taco_window", "must be odd (W = 2k + 1: positives within +-k, as TACO's sampler)")
    need(cfg.taco_window < 2 * cfg.seq_len, "taco_window", f"must be < 2 x seq_len ({2 * cfg.seq_len}): wider offsets "
         "leave every row, and their positives would all be the fallback's random tokens of the row")
    need(cfg.seed < 2 ** 64, "seed", "must be < 2**64 (torch seeds are unsigned 64-bit integers)")
    need(cfg.data.strip(), "data", "must name a file, a directory, a glob or a hub dataset")
    need(cfg.tokens_per_step <= 2 ** 30, "tokens_per_step", "must be <= 2**30 (TACO's base step is 327,680 tokens; "
         "a larger one is a step of hours of accumulation that a signal would wait for)")
    need(not (cfg.cased or cfg.limit_alphabet != LIMIT_ALPHABET) or not (cfg.tokenizer or cfg.init_from),
         "cased" if cfg.cased else "limit_alphabet", "shapes a tokenizer trained on --data: with --tokenizer or "
         "--init_from that tokenizer is used as it is")
    need(cfg.vocab_size <= 1_000_000, "vocab_size", "must be <= 1,000,000 (BERT's is 30,522; multilingual ones 120k-250k)")
    # masking picks round(mask_prob x eligible) tokens a row (losses.mask_tokens): none would train nothing. In
    # float32, as mask_tokens rounds: seq_len 5 x 0.16666667 is 0.50000001 in Python but 0.5 -> 0 there
    masked = (torch.tensor(cfg.seq_len - 2) * cfg.mask_prob).round()
    need(masked >= 1, "mask_prob", f"x (seq_len {cfg.seq_len} - 2) tokens rounds to "
         "0 masked tokens a row: nothing to predict (raise --mask_prob or --seq_len)")
    for name in ("out_dir", "cache_dir"):
        need(not reads_into(cfg.data, getattr(cfg, name)), name, f"is inside --data {cfg.data}: its files would be "
             "read as corpus; choose a directory outside it")
    need(cfg.warmup_steps <= cfg.max_steps, "warmup_steps", f"must be <= --max_steps {cfg.max_steps}")
    problem = pool_problem(cfg, cfg.negative_pool or cfg.batch_size)  # the flags' pool, before any process count
    if problem:
        need(False, *problem)
    # every objective's held-out batch has --negative_pool rows: its contextual score needs a second block
    need(cfg.negative_pool != 1, "negative_pool", "must be 0 or >= 2 (it sets the held-out batch's rows too: one "
         "row has no other block for the contextual score)")
    need(cfg.objective != "tacl" or cfg.init_from or cfg.resume, "init_from",
         "TaCL continues a trained model: pass --init_from a run dir or a Hugging Face BERT dir "
         "(e.g. first python train.py --objective mlm --out_dir out/mlm, then --init_from out/mlm)")
    device = re.fullmatch(r"auto|cpu|mps|cuda(?::(\d+))?", cfg.device)
    need(device, "device", "choose from auto, cpu, cuda, cuda:N, mps")
    need(not (device.group(1) and "RANK" in os.environ), "device",
         "under torchrun each process takes cuda:LOCAL_RANK: pass --device cuda (or auto)")
    if cfg.device.startswith("cuda"):
        need(torch.cuda.is_available(), "device", "CUDA is not available on this machine (use cpu or auto)")
        need(device.group(1) is None or int(device.group(1)) < torch.cuda.device_count(), "device",
             f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    need(cfg.device != "mps" or torch.backends.mps.is_available(), "device", "MPS is not available on this machine")
    if "LOCAL_RANK" in os.environ and cfg.device in ("auto", "cuda") and torch.cuda.is_available():
        if distributed.env_int("LOCAL_RANK") >= torch.cuda.device_count():  # only the surplus ranks see it
            raise RankError(f"--device {cfg.device}: torchrun started local process {os.environ['LOCAL_RANK']}, this "
                            f"machine has {torch.cuda.device_count()} CUDA device(s): --nproc_per_node must be at most that")
    problem = distributed.torchrun_problem()  # every rank says it: a hand-set environment may differ per process
    if problem:
        raise RankError(problem)
    for name in ("out_dir", "cache_dir"):
        problem = dir_problem(getattr(cfg, name))  # once: it writes a probe file
        need(problem is None, name, problem)
    # a resume's weights (TaCL's teacher too) come from its ckpt.pt: the start weights may be gone (a node-local copy)
    need(not cfg.init_from or cfg.resume or os.path.exists(cfg.init_from), "init_from", "no such file or directory")
    if cfg.init_from and os.path.realpath(init_dir(cfg.init_from)) == os.path.realpath(cfg.out_dir):
        raise ValueError(f"--out_dir {cfg.out_dir} is where --init_from {cfg.init_from} is: the run would overwrite "
                         f"the weights it starts from; choose another --out_dir")
    if not cfg.resume and os.path.isfile(os.path.join(cfg.out_dir, "ckpt.pt")):
        raise ValueError(f"--out_dir {cfg.out_dir} already holds a run: pass --resume {cfg.out_dir} to continue "
                         f"it, or choose another --out_dir")
    held = [f for f in ("config.json", "model.safetensors", "pytorch_model.bin")
            if os.path.isfile(os.path.join(cfg.out_dir, f))]
    if not cfg.resume and held:
        raise ValueError(f"--out_dir {cfg.out_dir} holds a model ({held[0]}) but no ckpt.pt to resume: a new run "
                         f"would overwrite it; choose another --out_dir, or delete that one to train again")
    if (not cfg.resume and os.path.exists(cfg.tokenizer)
            and os.path.realpath(init_dir(cfg.tokenizer)) == os.path.realpath(cfg.out_dir)):
        raise ValueError(f"--tokenizer {cfg.tokenizer} is in --out_dir: the run writes its own tokenizer files there "
                         f"and would overwrite these; choose another --out_dir")


class Parser(argparse.ArgumentParser):
    """argparse for eval.py and bench.py, whose errors are one line on stderr and exit 2, as train.py's, and
    which takes no abbreviation (eval.py's --seed would be read as --seeds)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def init_dir(init_from):
    """The directory of --init_from (or --tokenizer): itself, or a file's folder (where a ckpt.pt's tokenizer is)."""
    return init_from if os.path.isdir(init_from) else os.path.dirname(init_from) or "."


class RankError(ValueError):
    """Bad input that one DDP rank meets and the others do not (a surplus GPU rank): train.py prints it on
    every rank that meets it; other errors on rank 0 and on each other node's first process."""


def dir_problem(path):
    """Why `path` cannot be (made) a writable directory, or None."""
    if not path.strip():
        return "must name a directory"
    if os.path.exists(path) and not os.path.isdir(path):
        return "is an existing file, not a directory"
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        if os.path.islink(parent):  # dangling: os.makedirs fails on it with "File exists"
            return f"cannot be created: {parent} is a symbolic link to {os.readlink(parent)}, which does not exist"
        parent = os.path.dirname(parent)
    try:  # a real write, not os.access: root passes that check where /sys, /proc or a read-only mount refuse
        with tempfile.TemporaryFile(dir=parent):  # nameless on Linux (O_TMPFILE): a kill leaves no probe file
            pass
    except OSError:
        return f"cannot be created or written ({parent} is not a writable directory)"
    return None
