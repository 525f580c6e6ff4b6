"""
GLUE fine-tuning and scoring of a pretrained checkpoint: a run directory of this project or a
Hugging Face BERT directory (both load through model.Bert.from_pretrained).

    python eval.py --model out/small --tasks rte,mrpc,stsb --seeds 1,2,3,4 --compare  # GLUE from the hub
    python eval.py --model out/small --glue_dir glue_data   # the original TSVs (download_glue_data.py)
    python eval.py --model out/small --glue_dir glue_data --predict   # + leaderboard files RTE.tsv ...
    python eval.py --analysis --model out/mlm out/taco     # representation plots (analysis.py)
    python eval.py --plot_log out/mlm/log.jsonl out/taco/log.jsonl --out out  # training curves

GLUE writes glue.json (every metric of every run, each run's hyper-parameters, the config) and
glue.md (the table) into --out (default: the model's directory), where an earlier glue.json's other tasks
join the table if it was made from the same export with the same settings (else it moves aside to
glue.K.json, with its leaderboard files and models/: never overwritten); --predict adds one GLUE
submission file per test set there, --save_model a fine-tuned Hugging Face directory per task
under models/. --analysis writes analysis.json and analysis_*.png (an earlier one of another
measurement moves aside to analysis.K.json).

Notable choices:
- Protocol (--recipe paper, the default) as TACO's Appendix A: shared values from Table 6;
  small models (hidden size < 768) fine-tune with Table 7's fixed per-task values once per seed;
  base models run 6 combinations drawn per task from Table 8's grid (a fixed, seeded draw) and
  report the mean of the runs. --recipe uniform: one recipe for every task (TACO's scripts).
  --recipe short (ours): one recipe for briefly pretrained models, whose classifier Table 7's lr barely moves.
- Batches come in random order, as Hugging Face's run_glue (the papers' code); --group_by_length
  batches similar lengths together: less padding, faster (its effect on scores: docs/glue.md).
- Data: the original GLUE TSVs (--glue_dir) through a strict reader (quoting off, a bad row is a
  one-line error naming file and line), or the hub's nyu-mll/glue. A task without train or dev
  data is skipped and marked missing, never scored on nothing.
- Scores are those after the last epoch (no best-epoch picking on dev); per-epoch dev scores are
  kept in glue.json.
"""
import argparse
import copy
import itertools
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import analysis
from atomic import strict_json, write_atomic
from config import Parser, dir_problem
from console import Console
from data import load_tokenizer, special_token_ids
from glue_scores import AVG8, AVG9, MAIN, glue_table, like_for_like, score
from glue_tasks import SUBMISSIONS, TASKS, TaskMissing, load_task
from hf_io import config_to_hf, still_training, write_hf_dir
from model import Bert
from rundir import locked, memory_error, move_aside

# ----------------------------------------------------------------------------------------------
# Tasks and data


def parse_tasks(spec):
    names = [s.strip().lower().replace("-", "") for s in spec.split(",") if s.strip()]  # "SST-2" -> "sst2"
    if not names:  # an empty --tasks (a script's unset variable?) is not "all"
        raise ValueError(f"--tasks {spec!r}: name at least one task (choose from all, {', '.join(TASKS)})")
    names = [n for name in names for n in (TASKS if name == "all" else [name])]  # "all,rte": all (was: unknown 'all')
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"--tasks {spec}: unknown task {unknown[0]!r} (choose from all, {', '.join(TASKS)})")
    return [TASKS[n] for n in dict.fromkeys(names)]


def parse_seeds(spec):
    try:
        seeds = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0 or max(seeds) >= 2 ** 31:
        raise ValueError(f"--seeds {spec!r}: expected distinct comma-separated integers in [0, 2**31), e.g. 1,2,3")
    return seeds


def write_submission(path, task, index, preds):
    """A GLUE leaderboard file: header index<TAB>prediction, the test file's index and order, GLUE's
    label names (entailment/..., 0/1) and STS-B scores clipped to [0, 5]."""
    if task.labels is None:
        values = [f"{min(5.0, max(0.0, float(p))):.3f}" for p in preds]  # fidelity note 36
    else:
        names = {i: name for name, i in task.labels.items()}
        values = [names[int(p)] for p in preds]
    write_atomic(path, "index\tprediction\n" + "".join(f"{i}\t{v}\n" for i, v in zip(index, values)))


# ----------------------------------------------------------------------------------------------
# Tokenization and batching


@dataclass
class Encoded:
    input_ids: list  # one int32 array per example: [CLS] a [SEP] (b [SEP])
    segment_b: np.ndarray  # where sentence B's token types (1) start; = length for single sentences
    lengths: np.ndarray
    labels: np.ndarray


ENCODE_ROWS = 10_000  # rows tokenized at a time by encode_task


def encode_task(tok, ds, max_len, cls_id, sep_id, regression=False):
    """Tokenize without the tokenizer's own template (its post-processor may be absent) and truncate
    pairs longest-first as Hugging Face's (Rust) tokenizers do: the shorter side keeps up to half the
    budget, the longer side the rest (on a tie, A counts as the shorter). ENCODE_ROWS rows at a time: a
    task's whole train set as Encodings and lists of Python ints took ~120 bytes a token (MNLI: ~2 GB),
    its int32 rows take 4."""
    ids, seg = [], []
    for start in range(0, len(ds), ENCODE_ROWS):
        rows = ds[start:start + ENCODE_ROWS]
        a = [e.ids for e in tok.encode_batch_fast(rows["text_a"], add_special_tokens=False)]
        b = [e.ids for e in tok.encode_batch_fast(rows["text_b"], add_special_tokens=False)] if "text_b" in rows else None
        for i, ids_a in enumerate(a):
            if b is None:
                row = [cls_id] + ids_a[:max_len - 2] + [sep_id]
                seg.append(len(row))
            else:
                budget, ids_b = max_len - 3, b[i]
                if len(ids_a) + len(ids_b) > budget:
                    short = min(len(ids_a), len(ids_b), budget // 2)
                    keep_a = short if len(ids_a) <= len(ids_b) else budget - short
                    ids_a, ids_b = ids_a[:keep_a], ids_b[:budget - keep_a]
                row = [cls_id] + ids_a + [sep_id] + ids_b + [sep_id]
                seg.append(len(ids_a) + 2)
            ids.append(np.asarray(row, np.int32))
    dtype = np.float32 if regression else np.int64
    labels = np.asarray(ds["label"], dtype) if "label" in ds.column_names else np.zeros(len(ids), dtype)  # test
    return Encoded(ids, np.asarray(seg), np.asarray([len(r) for r in ids]), labels)


def random_batches(n, batch_size, rng):
    """The papers' batching (Hugging Face run_glue: a random permutation, cut into batches)."""
    order = rng.permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def length_grouped_batches(lengths, batch_size, rng, chunk_batches=50):
    """--group_by_length: shuffle, sort by length within chunks of 50 batches, shuffle the batches.
    Rows of a batch have similar lengths (little padding) while the epoch order stays random."""
    order, chunk, batches = rng.permutation(len(lengths)), batch_size * chunk_batches, []
    for start in range(0, len(order), chunk):
        part = order[start:start + chunk]
        part = part[np.argsort(-lengths[part], kind="stable")]
        batches += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(enc, idx, pad_id, device):
    T = int(enc.lengths[idx].max())
    input_ids = np.full((len(idx), T), pad_id, np.int64)  # (B, T)
    positions = np.arange(T)[None, :]
    for row, i in enumerate(idx):
        input_ids[row, :enc.lengths[i]] = enc.input_ids[i]
    mask = positions < enc.lengths[idx][:, None]  # (B, T) True = real token
    types = (positions >= enc.segment_b[idx][:, None]) & mask  # 1 on sentence B and its [SEP]
    batch = dict(input_ids=input_ids, attention_mask=mask, token_type_ids=types.astype(np.int64),
                 labels=enc.labels[idx])
    pin = torch.device(device).type == "cuda"  # a pageable copy would wait for the GPU's queue to drain
    return {k: (torch.from_numpy(v).pin_memory() if pin else torch.from_numpy(v)).to(device, non_blocking=pin)
            for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------
# Recipes (TACO, Fu et al. ACL 2022, Appendix A)

# Table 6, shared by every task and both sizes; linear decay, max grad norm 1.0, Adam eps 1e-8 and
# betas 0.9/0.999 are fixed in finetune(). fp32 as the paper (FP16 False); --precision bf16 is faster.
SHARED = dict(max_len=128, dropout=0.1, weight_decay=0.0, precision="fp32")
# Table 7: small models, one fixed recipe per task. WNLI, which the paper leaves out, gets RTE's (fidelity note 21).
SMALL = {
    **dict.fromkeys(("mnli", "qqp"), dict(lr=5e-5, batch_size=64, epochs=6, warmup=2000)),
    **dict.fromkeys(("qnli", "sst2"), dict(lr=5e-5, batch_size=64, epochs=4, warmup=200)),
    **dict.fromkeys(("cola", "stsb", "mrpc", "rte", "wnli"), dict(lr=5e-5, batch_size=32, epochs=4, warmup=100)),
}
# Table 8: base models draw NUM_COMBOS combinations per task from its grid and report the mean dev
# score of those runs (WNLI, left out by the paper, gets RTE's grid; fidelity note 21).
LRS = (1e-5, 2e-5, 3e-5, 5e-5)
BASE_GRID = {
    **dict.fromkeys(("mnli", "qqp"), dict(lr=LRS, batch_size=(32, 64, 128), epochs=(4, 6, 8), warmup=(1000, 2000))),
    "qnli": dict(lr=LRS, batch_size=(32, 64), epochs=(4, 6), warmup=(100, 200, 1000)),
    "sst2": dict(lr=LRS, batch_size=(16, 32, 64), epochs=(4, 6), warmup=(200,)),
    **dict.fromkeys(("cola", "stsb", "mrpc"), dict(lr=LRS, batch_size=(16, 32, 64), epochs=(4, 6), warmup=(100,))),
    **dict.fromkeys(("rte", "wnli"), dict(lr=LRS, batch_size=(16, 32, 64), epochs=(4, 6, 8), warmup=(100,))),
}
NUM_COMBOS = 6
# --recipe uniform: one recipe for every task, from TACO's official scripts (FUZHIYI/TACO
# finetune_small.sh, finetune_base.sh), fp32 as they run (no --fp16 flag).
UNIFORM = {"small": dict(lr=5e-5, batch_size=32, epochs=4, warmup=100),
           "base": dict(lr=3e-5, batch_size=32, epochs=6, warmup=100)}
# --recipe short (ours; fidelity note 35): for briefly pretrained models (the cpu and mini scales), one recipe
# for every task. Table 7's 5e-5 for 4 epochs was tuned for BERT-small after 250k steps; a model pretrained
# for a few thousand steps barely moves under it and predicts one class (docs/glue.md). The lr was chosen on
# the cpu-scale MLM baseline alone (3e-4 / 1e-3 / 3e-3: the best average with no collapsed task;
# results/cpu/short_recipe.md), before any other objective was fine-tuned with it; epochs not swept; warm-up
# 10% of all steps.
SHORT = dict(lr=1e-3, batch_size=32, epochs=4, warmup=0.1)
HPARAMS = ("lr", "batch_size", "epochs", "warmup", "max_len", "dropout", "weight_decay", "precision")  # flags


def sample_grid(grid, k, seed):
    """k distinct combinations of the grid's values (all of them if the grid has fewer), drawn without
    replacement by a generator seeded with `seed`: the same draw on every machine and run."""
    combos = list(itertools.product(*grid.values()))
    picks = np.random.default_rng(seed).choice(len(combos), size=min(k, len(combos)), replace=False)
    return [dict(zip(grid, combos[i])) for i in picks]


def recipe_runs(task, recipe, size, overrides=None, num_combos=NUM_COMBOS, grid_seed=0):
    """The hyper-parameters of each fine-tuning run of `task` (each then runs once per seed).
    paper + small: Table 7's one recipe; paper + base: num_combos draws from Table 8's grid, seeded
    by (grid_seed, task name); uniform: UNIFORM[size]; short: SHORT. Flags given (overrides) win in every run."""
    if recipe == "uniform":
        runs = [UNIFORM[size]]
    elif recipe == "short":
        runs = [SHORT]
    elif size == "small":
        runs = [SMALL[task.name]]
    else:
        runs = sample_grid(BASE_GRID[task.name], num_combos, [grid_seed, zlib.crc32(task.name.encode())])
    return [{**SHARED, **run, **(overrides or {})} for run in runs]


def schedule_steps(hp, n_train, n_full, warmup_flag=False):
    """(all optimizer steps, warm-up steps, a note or None). A recipe's warm-up is set in steps for the
    full train set, so with --max_train_samples it shrinks in proportion to the rows kept (the schedule
    keeps its shape: RTE 100 of 312 steps -> 8 of 28 on 200 rows); --warmup N is taken as given;
    --warmup < 1 is a fraction of all steps. A warm-up still >= all steps (WNLI: 100 of 80) is cut to
    10% of them, with a note."""
    total = math.ceil(n_train / hp["batch_size"]) * hp["epochs"]
    warmup, note = hp["warmup"], None
    if warmup < 1:
        warmup = round(warmup * total)
    elif n_train < n_full and not warmup_flag:  # fidelity note 34
        warmup = max(1, round(warmup * n_train / n_full))
    warmup = int(warmup)
    if warmup >= total:  # fidelity note 33
        note = f"warm-up {warmup} >= all {total} steps, cut to {total // 10} (10%)"
        warmup = total // 10
    return total, warmup, note


# ----------------------------------------------------------------------------------------------
# Model and fine-tuning


class GlueModel(nn.Module):
    """BERT for sequence classification: pooler (dense + tanh on [CLS]) -> dropout -> linear.
    A pooler in the checkpoint is kept; otherwise a fresh one is initialised as BERT's."""

    def __init__(self, bert, num_labels, dropout):
        super().__init__()
        D = bert.config.hidden_size
        if bert.pooler is None:
            bert.pooler = nn.Linear(D, D)
            Bert._init_weights(bert.pooler)
        set_dropout(bert, dropout)
        self.bert = bert
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(D, num_labels)
        Bert._init_weights(self.classifier)

    def forward(self, input_ids, attention_mask, token_type_ids):
        h = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)  # (B, T, D)
        pooled = torch.tanh(self.bert.pooler(h[:, 0]))  # (B, D)
        return self.classifier(self.drop(pooled))  # (B, num_labels)


def set_dropout(module, p):
    # pretraining may run without dropout and save that in its config; BERT fine-tunes with 0.1
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
        elif isinstance(getattr(m, "dropout", None), float):  # attention-probability dropout given to SDPA
            m.dropout = p
    if hasattr(module, "config"):
        module.config.dropout = p


def forward(model, b, bf16=False):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and b["input_ids"].is_cuda):  # no loss scaling
        return model(b["input_ids"], b["attention_mask"], b["token_type_ids"]).float()


@torch.no_grad()
def predict(model, enc, pad_id, device, batch_size=128, bf16=False):
    model.eval()
    order, preds = np.argsort(enc.lengths, kind="stable"), []  # length-sorted: little padding
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        logits = forward(model, collate(enc, idx, pad_id, device), bf16)
        preds.append((logits.squeeze(-1) if logits.size(-1) == 1 else logits.argmax(-1)).cpu().numpy())
    out = np.empty(len(order), preds[0].dtype)
    out[order] = np.concatenate(preds)  # back to dataset order
    return out


ANALYSIS_FLAGS = ("analysis", "text", "num_sentences", "seed", "plot_log")  # build_parser's analysis group
PROGRESS_S = 60  # a progress line within an epoch after this many seconds without one


def finetune(base, task, data, hp, seed, device, pad_id, total, warmup, group_by_length=False, log=print):
    """Fine-tune a copy of `base` on data["train"] (Encoded) for hp's epochs: `total` steps, the first
    `warmup` (< total, schedule_steps) a linear warm-up, then linear decay to 0 (Table 6). Returns the
    model and the dev scores after each epoch (with "collapsed": the dev predictions were one constant
    or not finite, so correlations are undefined)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = GlueModel(copy.deepcopy(base), task.num_labels, hp["dropout"]).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]  # no decay on biases and LayerNorms
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=hp["weight_decay"]), dict(params=rest, weight_decay=0.0)],
                            lr=hp["lr"], betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")
    train, bf16 = data["train"], hp["precision"] == "bf16"
    schedule = lambda step: step / warmup if step < warmup else (total - step) / (total - warmup)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    history = []
    for epoch in range(hp["epochs"]):
        model.train()
        losses = []
        batches = (length_grouped_batches(train.lengths, hp["batch_size"], rng) if group_by_length
                   else random_batches(len(train.lengths), hp["batch_size"], rng))
        last_note = time.time()
        for i, idx in enumerate(batches):
            if losses and time.time() - last_note > PROGRESS_S:  # a long epoch (MNLI, QQP on a CPU) shows it is alive
                log(f"  epoch {epoch + 1}/{hp['epochs']}: step {i}/{len(batches)}, train loss "
                    f"{torch.stack(losses[-100:]).mean().item():.4f} (last 100 steps)")
                last_note = time.time()
            b = collate(train, idx, pad_id, device)
            logits = forward(model, b, bf16)
            loss = (F.mse_loss(logits.squeeze(-1), b["labels"]) if task.labels is None
                    else F.cross_entropy(logits, b["labels"]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.detach())
        scores, collapsed = {}, False
        for suffix, dev in data["dev"].items():
            preds = predict(model, dev, pad_id, device, bf16=bf16)
            collapsed |= bool(not np.isfinite(preds).all() or len(preds) > 1 and np.ptp(preds) == 0)
            got = score(task.metric, dev.labels, preds)
            scores.update({f"{k}_{suffix}" if suffix else k: v for k, v in got.items()})
        history.append(dict(epoch=epoch + 1, train_loss=torch.stack(losses).mean().item(), scores=scores,
                            collapsed=collapsed))
        log(f"epoch {epoch + 1}/{hp['epochs']}: train loss {history[-1]['train_loss']:.4f}, "
            + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()) + (" (constant or non-finite prediction)" if collapsed else ""))
    return model, history


def save_classifier(model, task, out_dir, tokenizer_dir):
    """A fine-tuned model as a directory transformers' BertForSequenceClassification loads (safetensors),
    tokenizer files copied; every file written atomically. The MLM head is left out: never fine-tuned."""
    state = {k: v for k, v in model.bert.hf_state_dict().items() if k.startswith("bert.")}
    state.update({f"classifier.{k}": v.detach().cpu().contiguous() for k, v in model.classifier.state_dict().items()})
    config = dict(config_to_hf(model.bert.config), architectures=["BertForSequenceClassification"],
                  num_labels=task.num_labels, finetuning_task=task.name)
    if task.labels is None:
        config["problem_type"] = "regression"
    else:
        config["id2label"] = {str(i): name for name, i in task.labels.items()}
        config["label2id"] = dict(task.labels)
    write_hf_dir(out_dir, state, config, {"format": "pt"}, tokenizer_dir)


# ----------------------------------------------------------------------------------------------
# Flags and entry point


def validate_args(args):
    """Every flag, checked before anything is loaded or written: a ValueError naming the flag, the
    value and what is allowed (main() prints it as one error: line and exits with status 2)."""
    checks = [  # (flag, allowed?, what is allowed)
        ("epochs", lambda v: v >= 1, "an integer >= 1"),
        ("batch_size", lambda v: v >= 1, "an integer >= 1"),
        ("max_len", lambda v: v >= 5, "an integer >= 5 (room for [CLS] A [SEP] B [SEP], a token of each)"),
        ("lr", lambda v: math.isfinite(v) and v > 0, "a number > 0"),
        ("warmup", lambda v: math.isfinite(v) and v >= 0, "steps >= 0, or a fraction of all steps if < 1"),
        ("weight_decay", lambda v: math.isfinite(v) and v >= 0, "a number >= 0"),
        ("dropout", lambda v: 0 <= v < 1, "a probability in [0, 1)"),
        ("max_train_samples", lambda v: v >= 1, "an integer >= 1"),
        ("max_eval_samples", lambda v: v >= 1, "an integer >= 1"),
        ("num_combos", lambda v: v >= 1, "an integer >= 1"),
        ("grid_seed", lambda v: v >= 0, "an integer >= 0"),
        ("num_sentences", lambda v: v >= 2, "an integer >= 2"),
    ]
    for flag, allowed, what in checks:
        value = getattr(args, flag, None)
        if value is not None and not allowed(value):
            raise ValueError(f"--{flag} {value}: must be {what}")
    if not 0 <= getattr(args, "seed", 0) < 2 ** 32:
        raise ValueError(f"--analysis_seed {args.seed}: must be an integer in [0, 2**32)")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {args.device}: unknown device (cpu, cuda or cuda:N)")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--device {args.device}: not available here ({torch.cuda.device_count()} CUDA devices)")
    parse_tasks(args.tasks)
    seeds = parse_seeds(args.seeds)
    if args.predict_seed is not None and args.predict_seed not in seeds:
        raise ValueError(f"--predict_seed {args.predict_seed}: must be one of --seeds {args.seeds}")
    for flag in ("model", "plot_log", "glue_dir", "text"):
        paths = getattr(args, flag)
        for path in [paths] if isinstance(paths, str) else paths or []:  # "" (an unset variable) is no path
            if not os.path.exists(path):
                raise ValueError(f"--{flag} {path}: no such file or directory")
    for i, path in enumerate(args.plot_log or []):  # a run directory stands for its log.jsonl
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "log.jsonl")):
            raise ValueError(f"--plot_log {path}: a directory without a log.jsonl; pass a run directory or a log file")
        args.plot_log[i] = os.path.join(path, "log.jsonl") if os.path.isdir(path) else path
    if args.glue_dir is not None and not os.path.isdir(args.glue_dir):
        raise ValueError(f"--glue_dir {args.glue_dir}: not a directory (the folder holding CoLA/, SST-2/, ...)")
    if args.out is not None:
        png = args.plot_log and args.out.lower().endswith(".png")  # plot_logs takes a file
        if png and (args.model or args.analysis):  # the plot was written, then --analysis refused the file as --out
            what = "--analysis" if args.analysis else "GLUE (--model without --analysis)"
            raise ValueError(f"--out {args.out}: {what} writes into a directory; "
                             f"plot into it (--out DIR) or run --plot_log alone")
        if args.plot_log and os.path.splitext(args.out)[1].lower() in (".pdf", ".svg", ".jpg", ".jpeg"):
            raise ValueError(f"--out {args.out}: --plot_log writes a .png (name one, or a directory)")
        checked = (os.path.dirname(args.out) or ".") if png else args.out
        problem = dir_problem(checked)
        if problem:
            raise ValueError(f"--out {args.out}: " + (f"{checked} {problem}" if checked != args.out else problem))


def subset(ds, n):  # a fixed random subset, not the first rows: CoLA's are sorted by source
    return ds.shuffle(seed=0).select(range(min(n, len(ds))))


def glue_task(task, raw, args, base, tok, size, overrides, seeds, device, out, model_dir, log=print):
    """Every fine-tuning run of one task (each recipe run x each seed) on raw = load_task()'s splits.
    Returns (its entry of glue.json, {submission stem: what was written}); with --predict the best run
    on dev writes the task's leaderboard files, with --save_model its model, as soon as it is known."""
    cfg, predictions = base.config, {}
    n_full = len(raw["train"])
    if args.max_train_samples:
        raw["train"] = subset(raw["train"], args.max_train_samples)
    if args.max_eval_samples:
        raw["dev"] = {s: subset(ds, args.max_eval_samples) for s, ds in raw["dev"].items()}
    hps = recipe_runs(task, args.recipe, size, overrides, args.num_combos, args.grid_seed)
    enc = lambda ds: encode_task(tok, ds, hps[0]["max_len"], cfg.cls_token_id, cfg.sep_token_id, task.labels is None)
    data = {"train": enc(raw["train"]), "dev": {s: enc(ds) for s, ds in raw["dev"].items()}}
    tests = {}
    for stem, ds in raw.get("test", {}).items():
        if isinstance(ds, str):  # load_task's reason why this test set is absent
            log(f"warning: no {stem}.tsv: {ds}")
            predictions[stem] = f"missing: {ds}"
        else:
            tests[stem] = (ds["index"], enc(ds))
    t0, runs, best_score, best_label, best_preds, best_model = time.time(), {}, None, None, None, None
    for k, hp in enumerate(hps):
        total, warmup, note = schedule_steps(hp, len(raw["train"]), n_full, args.warmup is not None)
        if note:
            log(f"note: {task.name}: {note}")
        for seed in seeds:
            run_seed = seed + 1000 * k  # Table 3: the combinations differ in seed too ("including random seeds")
            label = f"seed {seed}" if len(hps) == 1 else f"combo {k + 1} seed {run_seed}"
            model, history = finetune(base, task, data, hp, run_seed, device, cfg.pad_token_id, total, warmup,
                                      args.group_by_length, lambda line: log(f"  {task.name} {label}: {line}"))
            runs[label] = dict(label=label, seed=run_seed, combo=k + 1, scores=history[-1]["scores"],
                               collapsed=history[-1]["collapsed"],
                               hparams=dict(hp, warmup_steps=warmup, total_steps=total), history=history)
            dev_score = float(np.mean([history[-1]["scores"][key] for key in MAIN[task.name]]))
            # the model that predicts the test sets: the best run on dev (TACO Tables 1 and 4), of --predict_seed's
            chosen = args.predict_seed in (None, seed)
            if (args.predict or args.save_model) and chosen and (best_score is None or dev_score > best_score):
                bf16 = hp["precision"] == "bf16"
                best_score, best_label = dev_score, label
                best_preds = {stem: predict(model, test, cfg.pad_token_id, device, bf16=bf16)
                              for stem, (_, test) in tests.items()}
                if args.save_model:  # kept on the CPU and written once the task is done, not at each new best
                    best_model = model.cpu()
            del model
    keys = list(next(iter(runs.values()))["scores"])
    result = dict(
        status="ok", n_train=len(raw["train"]), n_train_full=n_full,
        n_dev={s: len(ds) for s, ds in raw["dev"].items()}, runs=runs,
        mean={key: float(np.mean([r["scores"][key] for r in runs.values()])) for key in keys},
        median={key: float(np.median([r["scores"][key] for r in runs.values()])) for key in keys},
        collapsed=[label for label, r in runs.items() if r["collapsed"]], time_s=time.time() - t0,
        **({"grid": BASE_GRID[task.name], "num_combos": len(hps)}
           if args.recipe == "paper" and size == "base" else {}))
    if best_label is not None:
        result["predicted_by"] = best_label
    if best_model is not None:
        save_classifier(best_model, task, os.path.join(out, "models", task.dir), model_dir)
    for stem, (index, _) in tests.items():  # submission files, as soon as the task is done
        os.makedirs(out, exist_ok=True)
        write_submission(os.path.join(out, stem + ".tsv"), task, index, best_preds[stem])
        predictions[stem] = dict(rows=len(index), model=f"{task.name} {best_label}")
        if runs[best_label]["collapsed"]:  # (MRPC's all-positive F1 can beat a real run's; STS-B's NaN is 0.000)
            predictions[stem]["collapsed"] = True
            log(f"note: {stem}.tsv is from {best_label}, the best on dev, which predicted one value there, or a "
                f"non-finite one (collapsed): not a submission to make")
    return result, predictions


def export_identity(path):
    """The model's real path and its weight files' sizes and times: another model, or the same run directory
    retrained, is another export."""
    path = os.path.realpath(path)
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in sorted(os.listdir(path))
                                                 if f.endswith((".safetensors", ".bin", ".pt"))]
    return [path] + [[os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files]


def earlier_results(out, settings, tasks, log):
    """(results, predictions) of an earlier glue.json in `out` for the tasks this call does not redo, when it was
    made with the same settings: `--tasks rte` then `--tasks mrpc` give one table. Made otherwise (another
    step, recipe, seeds...), it and its glue.md, leaderboard files and models/ move aside to glue.K.json /
    glue.K.md / NAME.K.tsv / models.K: never overwritten."""
    path = os.path.join(out, "glue.json")
    if not os.path.exists(path):
        return {}, {}
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = None
    kept = None
    if isinstance(old, dict) and old.get("settings") == settings and isinstance(old.get("tasks"), dict):
        kept = {t: r for t, r in old["tasks"].items() if t not in tasks and isinstance(r, dict) and r.get("status") == "ok"}
        try:  # the table must show them (a key renamed or a value of another type broke it after the next task)
            glue_table(dict(tasks=kept, runs_per_task=2, args={}, runs_label="", name="", protocol=""))
        except (KeyError, TypeError, AttributeError, ValueError, IndexError):
            kept = old = None  # an edited or damaged file: it moves aside, as below
    if kept is not None:
        if kept:
            log(f"note: {path} holds {', '.join(kept)} from the same export and settings: kept in the table")
        predicted = old.get("predictions") if isinstance(old.get("predictions"), dict) else {}
        return kept, {stem: p for stem, p in predicted.items() if SUBMISSIONS.get(stem, ("",))[0] in kept}
    # its leaderboard files and fine-tuned models go with it, to the first K free for all of them; glue.md first and
    # glue.json last: a kill in between leaves a glue.K.md without its glue.K.json, and the next call moves the rest
    # to that K
    moves = lambda k: ([("glue.md", f"glue.{k}.md")] + [(f"{stem}.tsv", f"{stem}.{k}.tsv") for stem in SUBMISSIONS]
                       + [("models", f"models.{k}"), ("glue.json", f"glue.{k}.json")])
    k = move_aside(out, moves)
    why = "is unreadable or damaged"
    if isinstance(old, dict):  # say what differs: a changed cap or seed list, or another model, is then plain
        before = old.get("settings") if isinstance(old.get("settings"), dict) else {}
        differ = [key for key in settings if before.get(key) != settings[key]] if isinstance(settings, dict) else []
        names = dict(fixed="hyper-parameter flags", data="data", training_step="training step", protocol="protocol")
        named = [names.get(key, f"--{key}") for key in differ if key != "model"]
        parts = ["from another export"] * ("model" in differ) + [f"with other {', '.join(named)}"] * bool(named)
        why = "was made " + (" and ".join(parts) or "with other settings")
    log(f"note: {path} {why}: moved to glue.{k}.json (with its leaderboard files and models, if any)")
    return {}, {}


def glue_args(args):
    """The flags glue.json records: all but --analysis's own (its --analysis_seed is not a fine-tuning seed)."""
    return {k: v for k, v in vars(args).items() if k not in ANALYSIS_FLAGS}


def run_glue(args, log=print):
    validate_args(args)
    if isinstance(args.model, str):  # a caller's one path; the command line gives a list
        args.model = [args.model]
    if not args.model:
        raise ValueError("--model is required: a run directory, a Hugging Face BERT directory or a ckpt.pt")
    if len(args.model) != 1:  # the command line's --model takes several for --analysis
        raise ValueError("GLUE takes one --model: a run directory, a Hugging Face BERT directory or a ckpt.pt")
    args.model = args.model[0]
    tasks, seeds = parse_tasks(args.tasks), parse_seeds(args.seeds)
    base = Bert.from_pretrained(args.model, mlm_head=False)  # the encoder; ValueError if not a checkpoint
    model_dir = args.model if os.path.isdir(args.model) else os.path.dirname(os.path.abspath(args.model))
    tok = load_tokenizer(model_dir)
    cfg = base.config
    problem = analysis.tokenizer_problem(base, tok, model_dir)
    if problem:
        raise ValueError(problem)
    ids, mine = special_token_ids(tok), (cfg.pad_token_id, cfg.cls_token_id, cfg.sep_token_id)
    if (ids["pad"], ids["cls"], ids["sep"]) != mine:  # config.json's ids, or a guess where it has none
        raise ValueError(f"{model_dir}: the tokenizer's [PAD], [CLS], [SEP] are {ids['pad']}, {ids['cls']}, "
                         f"{ids['sep']}; the model's config says {', '.join(map(str, mine))}")
    if cfg.type_vocab_size < 2 and any(len(t.tsv_text) > 1 for t in tasks):
        raise ValueError(f"{model_dir}: type_vocab_size {cfg.type_vocab_size}: no second segment for sentence-pair tasks")
    size = args.model_size if args.model_size != "auto" else ("base" if cfg.hidden_size >= 768 else "small")
    overrides = {k: getattr(args, k) for k in HPARAMS if getattr(args, k) is not None}
    if args.max_len is not None and args.max_len > cfg.max_position_embeddings:
        raise ValueError(f"--max_len {args.max_len}: exceeds the model's {cfg.max_position_embeddings} positions")
    protocol = ("uniform recipe (TACO's scripts)" if args.recipe == "uniform" else
                "short recipe (ours, for briefly pretrained models)" if args.recipe == "short" else
                "TACO Table 7, fixed per task" if size == "small" else
                f"TACO Table 8, {args.num_combos} combinations per task drawn with --grid_seed {args.grid_seed}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fixed = dict(overrides)
    if args.max_len is None:  # a model pretrained on short blocks gets its own limit
        fixed["max_len"] = min(SHARED["max_len"], cfg.max_position_embeddings)
    if device.type != "cuda":  # bf16 autocast is CUDA-only here: glue.json records what ran
        fixed["precision"] = "fp32"
    out = args.out or model_dir
    problem = dir_problem(out)
    if problem:  # before any fine-tuning: the default --out is the model's own directory
        raise ValueError(f"cannot write GLUE results into {out}: it {problem}; pass --out DIR")
    names = [t.name for t in tasks]  # what each task writes once fine-tuned, checked before any fine-tuning
    files = [f"{stem}.tsv" for stem, spec in SUBMISSIONS.items() if spec[0] in names] if args.predict else []
    for path in (os.path.join(out, f) for f in files):
        if os.path.isdir(path):
            raise ValueError(f"--predict: {path} is a directory, where the leaderboard file goes; pass another --out")
    for task in tasks if args.save_model else ():
        problem = dir_problem(os.path.join(out, "models", task.dir))
        if problem:
            raise ValueError(f"--save_model: {os.path.join(out, 'models', task.dir)} {problem}; pass another --out")
    log(f"{args.model}: {base.num_params() / 1e6:.1f}M parameters, {size}-model recipe ({protocol}), seeds {seeds}, "
        f"{device}" + (f"; flags override {overrides}" if overrides else ""))
    if overrides.get("precision") == "bf16" and device.type != "cuda":  # the line above named it: say what runs
        log(f"note: --precision bf16 is CUDA-only here: on {device} every run fine-tunes in fp32, as glue.json records")
    if still_training(args.model):
        log(f"note: {model_dir} is still training (a train.py holds its .lock): this scores its step "
            f"{base.training_step} export, and glue.json records that step")
    if args.max_train_samples:
        log("note: with --max_train_samples, each recipe's warm-up steps shrink in proportion to the train rows kept")
    loaded, missing = {}, {}
    for task in tasks:  # every TSV read and checked first: a bad row in the last task costs no fine-tuning
        try:
            loaded[task.name] = load_task(task, args.glue_dir, test=args.predict)
        except TaskMissing as e:
            log(f"warning: skipping {task.name}: {e}")
            missing[task.name] = dict(status="missing", reason=str(e))
    if not loaded:
        raise ValueError("no GLUE task could be scored: " + "; ".join(f"{n}: {r['reason']}" for n, r in missing.items()))
    settings = json.loads(json.dumps(dict(  # what makes two calls' scores one table (JSON types, as read back)
        model=export_identity(args.model), model_size=size, training_step=base.training_step, recipe=args.recipe,
        protocol=protocol, seeds=seeds, fixed=fixed,
        max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples,
        group_by_length=args.group_by_length, data=os.path.abspath(args.glue_dir) if args.glue_dir else "hub")))
    # one eval.py at a time writes GLUE results here: a second one read the same glue.json, and the last to write
    # it dropped the other's tasks (or moved its files aside while it wrote them)
    with locked(out, ".glue.lock", f"GLUE's output directory {out}"):
        redone = [t.name for t in tasks if t.name not in missing]  # a task missing now keeps its earlier scores
        results, earlier_predictions = earlier_results(out, settings, redone, log)
        predictions = {}  # this call's leaderboard files
        t_all = time.time()

        def write_report(not_run=()):
            """glue.json and glue.md of the tasks done so far, rewritten after each task: a run stopped
            later keeps them. not_run: the tasks still to come."""
            counts = {len(r["runs"]) for r in results.values() if r["status"] == "ok"}
            n_runs = max(counts)
            combos = n_runs // len(seeds)
            runs_label = (f"seed {seeds[0]}" if n_runs == 1 else f"{len(seeds)} seeds" if combos == 1 else
                          f"{combos} combinations x {len(seeds)} seed{'s' * (len(seeds) > 1)}")
            if len(counts) > 1:  # --num_combos beyond a task's grid: that task runs its whole grid
                runs_label += " (fewer on tasks whose grid is smaller)"
            report = dict(name=os.path.basename(os.path.normpath(model_dir)), model=args.model,
                          training_step=base.training_step, recipe=args.recipe,
                          model_size=size, protocol=protocol, seeds=seeds, runs_per_task=n_runs,
                          runs_label=runs_label, group_by_length=args.group_by_length, args=glue_args(args),
                          device=str(device), torch=torch.__version__, model_config=vars(cfg),
                          time_s=time.time() - t_all, settings=settings, tasks=results)
            values = {stat: {(t, k): v for t, r in results.items() if r["status"] == "ok" for k, v in r[stat].items()}
                      for stat in ("mean", "median")}
            report["avg9"] = {stat: like_for_like(v, AVG9, present=v) for stat, v in values.items()}
            report["avg8"] = {stat: like_for_like(v, AVG8, present=v) for stat, v in values.items()}
            report["missing"] = [n for n, r in results.items() if r["status"] == "missing"]
            report["not_run"] = list(not_run)
            if predictions or earlier_predictions:
                report["predictions"] = {**earlier_predictions, **predictions}
            table = glue_table(report, compare=args.compare)
            os.makedirs(out, exist_ok=True)
            # strict JSON: a diverged run's train loss is NaN, which json.dumps writes bare and other readers refuse
            write_atomic(os.path.join(out, "glue.json"), strict_json(report, indent=2))
            write_atomic(os.path.join(out, "glue.md"), table + "\n")
            return report, table

        try:
            for i, task in enumerate(tasks):
                if task.name in missing:
                    results.setdefault(task.name, missing[task.name])
                    continue
                results[task.name], task_predictions = glue_task(task, loaded.pop(task.name), args, base, tok, size,
                                                                 fixed, seeds, device, out, model_dir, log)
                predictions.update(task_predictions)
                write_report([t.name for t in tasks[i + 1:] if t.name not in missing])
        except KeyboardInterrupt:  # main() prints it as one line
            done = [name for name, r in results.items() if r["status"] == "ok"]
            # the same command again redoes every task: the rest alone, into the same --out, joins this table
            rest = [t.name for t in tasks if t.name not in missing and t.name not in results]
            raise KeyboardInterrupt(f"glue.json and glue.md in {out} hold {', '.join(done)}; to finish, run the same "
                                    f"command with --tasks {','.join(rest)} (it adds them to this table)" if done else
                                    "no task was finished, nothing was written") from None
        report, table = write_report()
        written = [f"{stem}.tsv" for stem, p in predictions.items() if isinstance(p, dict)]
        log("\n" + table + f"\n\nwrote {os.path.join(out, 'glue.json')}, glue.md" + "".join(f", {w}" for w in written))
        return report


PATH = os.path.expanduser  # as train.py: the shell leaves `--out=~/x` alone, which made a folder named ~


def build_parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", type=PATH, help="run directory, Hugging Face BERT directory, or ckpt.pt of "
                   "this project (--analysis compares several)")
    p.add_argument("--out", type=PATH, help="output directory (default: the (first) model's directory)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    p.add_argument("--max_len", type=int, help="tokens per example, pairs truncated longest-first "
                   "(GLUE: 128, Table 6; --analysis: 128 tokens per sentence, [CLS] and [SEP] included)")
    g = p.add_argument_group("GLUE fine-tuning (the default mode)")
    g.add_argument("--tasks", default="all", help=f"comma-separated, from: {','.join(TASKS)} (default all)")
    g.add_argument("--glue_dir", type=PATH, help="folder of the original GLUE TSVs (CoLA/, SST-2/, ... as "
                   "download_glue_data.py writes them); default: nyu-mll/glue from the Hugging Face hub")
    # ours: one seed by default, a quarter of the paper's small-model cost (fidelity note 21)
    g.add_argument("--seeds", default="1", help="comma-separated fine-tuning seeds; several give mean and median "
                   "(TACO's small rows: 4 seeds, --seeds 1,2,3,4; base combination k runs with seed + 1000*(k-1))")
    g.add_argument("--compare", action="store_true", help="print the TACO paper's rows beside ours")
    g.add_argument("--recipe", default="paper", choices=["paper", "uniform", "short"],
                   help="paper: TACO App. A (Table 7 per task for small models, Table 8's 6 sampled combinations "
                   "for base); uniform: one recipe for every task (TACO's scripts: 5e-5/32/4 epochs small, "
                   f"3e-5/32/6 base, warm-up 100, fp32); short (ours): for briefly pretrained models, "
                   f"{SHORT['lr']:g}/{SHORT['batch_size']}/{SHORT['epochs']} epochs, warm-up 10%%, every task")
    g.add_argument("--model_size", default="auto", choices=["auto", "small", "base"],
                   help="which recipe applies (auto: base for hidden size >= 768)")
    g.add_argument("--num_combos", type=int, default=NUM_COMBOS, help="base models: combinations drawn per task "
                   "from Table 8's grid (paper: 6)")
    g.add_argument("--grid_seed", type=int, default=0, help="seeds the draw of Table 8 combinations")
    g.add_argument("--lr", type=float, help="peak learning rate; overrides the recipe in every run (paper: 5e-5 "
                   "small, Table 8's grid base)")
    g.add_argument("--batch_size", type=int, help="overrides the recipe (paper: 32 or 64 per task)")
    g.add_argument("--epochs", type=int, help="overrides the recipe (paper: 4 or 6 per task)")
    g.add_argument("--warmup", type=float, help="linear warm-up steps, or a fraction of all steps if < 1; overrides "
                   "the recipe (paper: 100, 200 or 2000 per task, shrunk with --max_train_samples)")
    g.add_argument("--weight_decay", type=float, help="AdamW weight decay, not on biases/LayerNorms (paper: 0)")
    g.add_argument("--dropout", type=float, help="encoder and head dropout while fine-tuning (paper: 0.1)")
    g.add_argument("--precision", choices=["fp32", "bf16"], help="bf16: autocast on GPU, faster (paper: fp32)")
    g.add_argument("--group_by_length", action="store_true", help="batch rows of similar length (less padding, "
                   "faster) instead of the papers' random batches")
    g.add_argument("--max_train_samples", type=int, help="quick runs: a fixed random subset of each train set")
    g.add_argument("--max_eval_samples", type=int, help="quick runs: a fixed random subset of each dev set")
    g.add_argument("--predict", action="store_true", help="also write GLUE leaderboard files (CoLA.tsv ... "
                   "MNLI-m.tsv, MNLI-mm.tsv, AX.tsv) for every scored task's test set into --out")
    g.add_argument("--predict_seed", type=int, help="only this --seeds entry's runs may predict the test sets "
                   "(default: any; the best run on dev predicts, as TACO's test rows)")
    g.add_argument("--save_model", action="store_true", help="keep that fine-tuned model of each task as a Hugging "
                   "Face BertForSequenceClassification directory, --out/models/TASK")
    a = p.add_argument_group("representation analysis and training curves (analysis.py)")  # ANALYSIS_FLAGS
    a.add_argument("--analysis", action="store_true", help="contextual score, self-similarity, heatmaps, "
                   "sentence and word similarity of every --model, as analysis.json and PNG plots "
                   "(STS-B pairs from --glue_dir)")
    a.add_argument("--text", type=PATH, help="held-out text for --analysis (default: the run's validation split)")
    a.add_argument("--num_sentences", type=int, default=1000, help="held-out sentences sampled for --analysis")
    a.add_argument("--analysis_seed", dest="seed", type=int, default=0, help="draws the sentences and the "
                   "partners of --analysis (another seed measures their noise)")
    a.add_argument("--plot_log", nargs="+", metavar="LOG", type=PATH, help="plot these log.jsonl files (or run "
                   "directories) on shared axes (into --out, a directory or a .png, default .)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)  # an unknown flag or a bad type: one "error: ..." line, exit 2
    try:
        validate_args(args)
        if args.plot_log:
            analysis.plot_logs(args.plot_log, args.out)
        if args.analysis:
            analysis.run_analysis(args)  # reads args.glue_dir for its STS-B pairs
        elif args.model or not args.plot_log:  # --plot_log alone only plots
            run_glue(args)
    except (ValueError, FileNotFoundError) as e:  # bad flag, bad checkpoint, malformed TSV: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a write the system refused (a full disk): the file it names keeps its last whole version
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (RuntimeError, MemoryError) as e:  # out of memory: one line and what to lower; other errors: a traceback
        if not (said := memory_error(e)):
            raise
        print(f"error: out of memory ({said}): lower --batch_size (it overrides the recipe's 32 or 64) or --max_len; "
              f"glue.json keeps what an earlier call wrote", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        print("interrupted" + (f": {e}" if str(e) else ""), file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.stdout, sys.stderr = Console(sys.stdout), Console(sys.stderr)  # a closed `| head` does not stop fine-tuning
    main()
