"""
GLUE fine-tuning and scoring of a pretrained checkpoint: a run directory of this project or a
Hugging Face BERT directory (both load through model.Bert.from_pretrained).

    python eval.py --model out/small --glue_dir ../shared/data/glue           # every task found there
    python eval.py --model out/small --tasks rte,mrpc --seeds 1,2,3 --compare  # GLUE from the hub
    python eval.py --analysis --model out/mlm out/taco     # representation plots (analysis.py)
    python eval.py --plot_log out/mlm/log.jsonl out/taco/log.jsonl --out out  # training curves

GLUE writes glue.json (every metric, per seed, plus the config) and glue.md (the table) into --out
(default: the model's directory); --analysis writes analysis.json and analysis_*.png there.

Notable choices:
- Data: the original GLUE TSVs (--glue_dir) through a strict reader (quoting off, a bad row is a
  one-line error naming file and line), or the hub's nyu-mll/glue. A task without train or dev
  data is skipped and marked missing, never scored on nothing.
- Batches are padded to their longest row and grouped by length (sorted within shuffled chunks
  of 50 batches), so a GLUE epoch pays for little padding; bf16 autocast and fused AdamW on GPU.
- Hyperparameters follow TACO's official fine-tuning scripts (see RECIPES); flags override them.
- Scores are those after the last epoch (no best-epoch picking on dev); per-epoch dev scores are
  kept in glue.json.
"""
import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import analysis
from data import load_tokenizer
from model import Bert

# ----------------------------------------------------------------------------------------------
# Metrics (numpy, x100 as the papers report them)


def accuracy(labels, preds):
    return float(np.mean(np.asarray(labels) == np.asarray(preds)))


def f1_binary(labels, preds):
    labels, preds = np.asarray(labels) == 1, np.asarray(preds) == 1  # class 1 = paraphrase / duplicate
    tp, fp, fn = np.sum(labels & preds), np.sum(~labels & preds), np.sum(labels & ~preds)
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0


def matthews_corr(labels, preds):
    """Multiclass MCC from the confusion matrix (Gorodkin 2004, as sklearn); 0 when undefined."""
    classes, y = np.unique(np.concatenate([labels, preds]), return_inverse=True)
    C = np.bincount(y[:len(labels)] * len(classes) + y[len(labels):], minlength=len(classes) ** 2)
    C = C.reshape(len(classes), len(classes)).astype(np.float64)  # (true, pred)
    t, p, c, s = C.sum(1), C.sum(0), np.trace(C), C.sum()
    denom = math.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denom) if denom else 0.0


def pearson(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if np.ptp(x) == 0 or np.ptp(y) == 0:  # a constant prediction correlates with nothing
        return 0.0
    x, y = x - x.mean(), y - y.mean()
    return float(x @ y / math.sqrt((x @ x) * (y @ y)))


def average_ranks(x):
    """Ranks 1..n, ties sharing their average rank (scipy.stats.rankdata's default)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    xs = x[order]
    new_value = np.concatenate([[True], xs[1:] != xs[:-1]])
    group = np.cumsum(new_value) - 1  # tie group of each sorted element
    starts = np.concatenate([np.flatnonzero(new_value), [len(x)]])  # first sorted position of each group
    ranks = np.empty(len(x))
    ranks[order] = (starts[group] + starts[group + 1] + 1) / 2  # mean of positions start+1 .. end
    return ranks


def spearman(x, y):
    return pearson(average_ranks(x), average_ranks(y))


def score(metric, labels, preds):
    if metric == "mcc":
        out = {"mcc": matthews_corr(labels, preds)}
    elif metric == "acc":
        out = {"acc": accuracy(labels, preds)}
    elif metric == "f1_acc":
        out = {"f1": f1_binary(labels, preds), "acc": accuracy(labels, preds)}
    else:  # "corr"
        out = {"pearson": pearson(labels, preds), "spearman": spearman(labels, preds)}
    return {k: 100 * v for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Tasks and data


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
    header: tuple = None  # column names for a TSV without a header line (CoLA)

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
    Task("qqp", "QQP", "f1_acc", ("question1", "question2"), "is_duplicate", BINARY, ("question1", "question2")),
    Task("mnli", "MNLI", "acc", ("sentence1", "sentence2"), "gold_label",
         {"entailment": 0, "neutral": 1, "contradiction": 2}, ("premise", "hypothesis"),
         dev={"m": ("dev_matched", "validation_matched"), "mm": ("dev_mismatched", "validation_mismatched")}),
    Task("qnli", "QNLI", "acc", ("question", "sentence"), "label", NLI2, ("question", "sentence")),
    Task("rte", "RTE", "acc", ("sentence1", "sentence2"), "label", NLI2, ("sentence1", "sentence2")),
    Task("wnli", "WNLI", "acc", ("sentence1", "sentence2"), "label", BINARY, ("sentence1", "sentence2")),
]}


class TaskMissing(Exception):
    """A task's data is not there: it is skipped and marked missing."""


def parse_tasks(spec):
    names = [s.strip().lower().replace("-", "") for s in spec.split(",") if s.strip()]  # "SST-2" -> "sst2"
    names = list(TASKS) if names in ([], ["all"]) else names
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r} (choose from {', '.join(TASKS)})")
    return [TASKS[n] for n in names]


def read_tsv(path, task):
    """One GLUE TSV as a Dataset(text_a[, text_b], label). Quoting is off: GLUE sentences hold bare
    quotes. utf-8-sig drops MRPC's BOM. Every row must have the header's column count."""
    with open(path, encoding="utf-8-sig", newline="\n") as f:
        lines = [line.rstrip("\n").rstrip("\r") for line in f]
    header, first = (task.header, 0) if task.header else (lines[0].split("\t") if lines else [], 1)
    col = {name: i for i, name in enumerate(header)}
    lacking = [c for c in task.tsv_text + (task.tsv_label,) if c not in col]
    if lacking:
        raise ValueError(f"{path}: no column {lacking[0]!r} in the header {header}")
    rows = {"text_a": [], "text_b": [], "label": []}
    for lineno, line in enumerate(lines[first:], first + 1):
        cells = line.split("\t")
        if len(cells) != len(header):
            raise ValueError(f"{path}:{lineno}: expected {len(header)} tab-separated columns, got {len(cells)}")
        raw = cells[col[task.tsv_label]]
        try:
            label = float(raw) if task.labels is None else task.labels[raw]
        except (KeyError, ValueError):
            expected = "a number" if task.labels is None else "/".join(task.labels)
            raise ValueError(f"{path}:{lineno}: bad label {raw!r} (expected {expected})") from None
        rows["label"].append(label)
        for key, name in zip(("text_a", "text_b"), task.tsv_text):
            rows[key].append(cells[col[name]])
    if len(task.tsv_text) == 1:
        del rows["text_b"]
    return datasets.Dataset.from_dict(rows)


def load_task(task, glue_dir=None):
    """{"train": Dataset, "dev": {suffix: Dataset}} from the GLUE TSVs in glue_dir, else from the hub."""
    if glue_dir:
        files = {"train": "train", **{suffix: stem for suffix, (stem, _) in task.dev.items()}}
        paths = {k: os.path.join(glue_dir, task.dir, stem + ".tsv") for k, stem in files.items()}
        absent = [os.path.relpath(p, glue_dir) for p in paths.values() if not os.path.isfile(p)]
        if absent:
            raise TaskMissing(f"no {', '.join(absent)} in {glue_dir}")
        splits = {k: read_tsv(p, task) for k, p in paths.items()}
    else:  # needs internet (or the hub cache) and is never exercised by the tests
        try:
            hub = datasets.load_dataset("nyu-mll/glue", task.name)
        except Exception as e:
            raise TaskMissing(f"hub nyu-mll/glue/{task.name}: {type(e).__name__}: {str(e)[:200]}".splitlines()[0])
        names = dict(zip(task.hub_text, ("text_a", "text_b")))
        splits = {"train": hub["train"], **{suffix: hub[split] for suffix, (_, split) in task.dev.items()}}
        splits = {k: ds.select_columns([*names, "label"]).rename_columns(names) for k, ds in splits.items()}
    empty = [k for k, ds in splits.items() if len(ds) == 0]
    if empty:
        raise TaskMissing(f"the {empty[0]} split has no rows")
    return {"train": splits.pop("train"), "dev": splits}


# ----------------------------------------------------------------------------------------------
# Tokenization and batching


@dataclass
class Encoded:
    input_ids: list  # one int32 array per example: [CLS] a [SEP] (b [SEP])
    segment_b: np.ndarray  # where sentence B's token types (1) start; = length for single sentences
    lengths: np.ndarray
    labels: np.ndarray


def encode_task(tok, ds, max_len, cls_id, sep_id, regression=False):
    """Tokenize without the tokenizer's own template (its post-processor may be absent) and truncate
    pairs longest-first as Hugging Face's (Rust) tokenizers do: the shorter side keeps up to half the
    budget, the longer side the rest (on a tie, A counts as the shorter)."""
    a = [e.ids for e in tok.encode_batch(ds["text_a"], add_special_tokens=False)]
    pair = "text_b" in ds.column_names
    b = [e.ids for e in tok.encode_batch(ds["text_b"], add_special_tokens=False)] if pair else None
    ids, seg = [], []
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
    labels = np.asarray(ds["label"], np.float32 if regression else np.int64)
    return Encoded(ids, np.asarray(seg), np.asarray([len(r) for r in ids]), labels)


def length_grouped_batches(lengths, batch_size, rng, chunk_batches=50):
    """Shuffle, sort by length within chunks of 50 batches, shuffle the batches: rows of a batch have
    similar lengths (little padding) while the epoch order stays random."""
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
    return {k: torch.from_numpy(v).to(device) for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------
# Model and fine-tuning

# Fine-tuning recipes from TACO's official scripts (FUZHIYI/TACO finetune_small.sh and
# finetune_base.sh: lr, batch, epochs, 100 warmup steps, max_len 128; everything else is Hugging
# Face run_glue/Trainer defaults: weight decay 0, AdamW eps 1e-8, grad clip 1.0, linear decay;
# dropout 0.1 from Google's BERT configs). The same recipe serves every task. The paper's Table 7
# could not be retrieved here: check these against it. warmup < 1 means a fraction of all steps.
RECIPES = {
    "small": dict(lr=5e-5, batch_size=32, epochs=4, warmup=100, max_len=128, weight_decay=0.0, dropout=0.1),
    "base": dict(lr=3e-5, batch_size=32, epochs=6, warmup=100, max_len=128, weight_decay=0.0, dropout=0.1),
}


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


def forward(model, b):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=b["input_ids"].is_cuda):  # bf16: no loss scaling
        return model(b["input_ids"], b["attention_mask"], b["token_type_ids"]).float()


@torch.no_grad()
def predict(model, enc, pad_id, device, batch_size=128):
    model.eval()
    order, preds = np.argsort(enc.lengths, kind="stable"), []  # length-sorted: little padding
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        logits = forward(model, collate(enc, idx, pad_id, device))
        preds.append((logits.squeeze(-1) if logits.size(-1) == 1 else logits.argmax(-1)).cpu().numpy())
    out = np.empty(len(order), preds[0].dtype)
    out[order] = np.concatenate(preds)  # back to dataset order
    return out


def finetune(base, task, data, hp, seed, device, pad_id, log=print):
    """Fine-tune a copy of `base` on data["train"] (Encoded); return the dev scores after each epoch."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = GlueModel(copy.deepcopy(base), task.num_labels, hp["dropout"]).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]  # no decay on biases and LayerNorms
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=hp["weight_decay"]), dict(params=rest, weight_decay=0.0)],
                            lr=hp["lr"], eps=1e-8, fused=device.type == "cuda")
    train = data["train"]
    total = math.ceil(len(train.lengths) / hp["batch_size"]) * hp["epochs"]
    warmup = round(hp["warmup"] * total) if hp["warmup"] < 1 else int(hp["warmup"])
    if warmup >= total:
        log(f"warning: {warmup} warmup steps >= all {total} steps, so the learning rate never peaks (try --warmup 0.1)")
    schedule = lambda step: step / warmup if step < warmup else max(0.0, (total - step) / max(1, total - warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    history = []
    for epoch in range(hp["epochs"]):
        model.train()
        losses = []
        for idx in length_grouped_batches(train.lengths, hp["batch_size"], rng):
            b = collate(train, idx, pad_id, device)
            logits = forward(model, b)
            loss = (F.mse_loss(logits.squeeze(-1), b["labels"]) if task.labels is None
                    else F.cross_entropy(logits, b["labels"]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.detach())
        scores = {}
        for suffix, dev in data["dev"].items():
            got = score(task.metric, dev.labels, predict(model, dev, pad_id, device))
            scores.update({f"{k}_{suffix}" if suffix else k: v for k, v in got.items()})
        history.append(dict(epoch=epoch + 1, train_loss=torch.stack(losses).mean().item(), **scores))
        log(f"  {task.name} seed {seed} epoch {epoch + 1}/{hp['epochs']}: train loss {history[-1]['train_loss']:.4f}, "
            + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))
    return history


# ----------------------------------------------------------------------------------------------
# Reporting

# (column, [(task, metric)]) as in the papers' GLUE tables; every metric but WNLI's enters TACO's "Avg."
COLUMNS = [("MNLI m/mm", [("mnli", "acc_m"), ("mnli", "acc_mm")]), ("QQP F1", [("qqp", "f1")]),
           ("QNLI", [("qnli", "acc")]), ("SST-2", [("sst2", "acc")]), ("CoLA", [("cola", "mcc")]),
           ("STS-B", [("stsb", "spearman")]), ("MRPC F1", [("mrpc", "f1")]), ("RTE", [("rte", "acc")]),
           ("WNLI", [("wnli", "acc")])]
AVG_KEYS = [key for _, keys in COLUMNS[:-1] for key in keys]

# PAPER ROWS, not ours: dev-set scores printed in TACO (Fu et al., ACL 2022), copied from
# shared/OBJECTIVES.md, in AVG_KEYS order, then the paper's Avg. Table 3 prints one MNLI number
# for base models (its Avg. counts 8 numbers); it is shown as MNLI-m.
PAPER_ROWS = [
    ("paper: BERT-small MLM, 250k (TACO Tab. 1)", (76.9, 77.4, 85.7, 86.2, 89.0, 28.8, 85.6, 85.9, 59.6), 75.0),
    ("paper: BERT-small TACO, 50k", (76.7, 76.8, 85.2, 85.0, 87.5, 31.3, 85.6, 87.1, 59.1), 74.9),
    ("paper: BERT-small TACO, 250k", (77.9, 78.4, 86.1, 86.5, 88.9, 34.2, 86.1, 88.1, 59.5), 76.2),
    ("paper: BERT-base MLM, 500k (TACO Tab. 3)", (84.2, None, 87.9, 91.1, 92.1, 51.1, 87.9, 89.8, 63.4), 80.9),
    ("paper: BERT-base TACO, 500k", (84.6, None, 88.1, 90.8, 92.3, 53.4, 88.5, 90.7, 66.3), 81.8),
]


def table_row(label, values, avg_cell):
    cells = ["/".join(f"{values[k]:.1f}" for k in keys if values.get(k) is not None) or "–" for _, keys in COLUMNS]
    return f"| {label} | " + " | ".join(cells) + f" | {avg_cell} |"


def glue_table(report, compare=False):
    tasks, seeds = report["tasks"], report["seeds"]
    ok = {name: r for name, r in tasks.items() if r["status"] == "ok"}
    present = [k for k in AVG_KEYS if k[0] in ok]
    lines = ["| model | " + " | ".join(c for c, _ in COLUMNS) + " | Avg |", "|---" * (len(COLUMNS) + 2) + "|"]
    for stat in (["mean", "median"] if len(seeds) > 1 else ["mean"]):
        values = {(t, k): v for t, r in ok.items() for k, v in r[stat].items()}
        which = f"{stat} of {len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]}"
        avg = np.mean([values[k] for k in present]) if present else None
        lines.append(table_row(f"{report['name']} ({which})", values, "–" if avg is None else f"{avg:.1f}"))
    for label, numbers, paper_avg in PAPER_ROWS if compare else []:
        values = dict(zip(AVG_KEYS, numbers))
        same = [values[k] for k in present if values[k] is not None]  # the paper's scores on our tasks
        avg = f"{paper_avg:.1f}" if len(present) == len(AVG_KEYS) else f"{np.mean(same):.1f} (all: {paper_avg:.1f})"
        lines.append(table_row(label, values, avg))
    lines.append("")
    lines.append(f"Avg: TACO's, the mean of MNLI-m, MNLI-mm, QQP F1, QNLI, SST-2, CoLA, STS-B Spearman, MRPC F1 "
                 f"and RTE; here over the {len(present)} of those 9 numbers present.")
    for name, r in tasks.items():
        if r["status"] == "missing":
            lines.append(f"Missing: {name} ({r['reason']}).")
    lines += ["", "| task | metric | per seed | mean | median | train / dev rows | min |", "|---" * 7 + "|"]
    for name, r in ok.items():
        for key in r["mean"]:
            per_seed = ", ".join(f"{s[key]:.1f}" for s in r["seeds"].values())
            lines.append(f"| {name} | {key} | {per_seed} | {r['mean'][key]:.2f} | {r['median'][key]:.2f} "
                         f"| {r['n_train']} / {'+'.join(map(str, r['n_dev'].values()))} | {r['time_s'] / 60:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Entry point


def subset(ds, n):  # a fixed random subset, not the first rows: CoLA's are sorted by source
    return ds.shuffle(seed=0).select(range(min(n, len(ds))))


def run_glue(args, log=print):
    if isinstance(args.model, list):  # the command line's --model takes several for --analysis
        if len(args.model) != 1:
            raise ValueError("GLUE takes one --model: a run directory, a Hugging Face BERT directory or a ckpt.pt")
        args.model = args.model[0]
    tasks = parse_tasks(args.tasks)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, got {args.seeds!r}") from None
    base = Bert.from_pretrained(args.model)  # ValueError on anything that is not a checkpoint
    model_dir = args.model if os.path.isdir(args.model) else os.path.dirname(os.path.abspath(args.model))
    tok = load_tokenizer(model_dir)
    cfg = base.config
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"{model_dir}: the tokenizer has {tok.get_vocab_size()} tokens, the model {cfg.vocab_size}")
    recipe = args.recipe if args.recipe != "auto" else ("base" if cfg.hidden_size >= 768 else "small")
    hp = {**RECIPES[recipe], **{k: getattr(args, k) for k in RECIPES[recipe] if getattr(args, k) is not None}}
    if args.max_len is None:  # a model pretrained on short blocks gets its own limit
        hp["max_len"] = min(hp["max_len"], cfg.max_position_embeddings)
    if hp["max_len"] > cfg.max_position_embeddings:
        raise ValueError(f"--max_len {hp['max_len']} exceeds the model's {cfg.max_position_embeddings} positions")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log(f"{args.model}: {base.num_params() / 1e6:.1f}M parameters, recipe {recipe} {hp}, seeds {seeds}, {device}")
    results = {}
    for task in tasks:
        try:
            raw = load_task(task, args.glue_dir)
        except TaskMissing as e:
            log(f"warning: skipping {task.name}: {e}")
            results[task.name] = dict(status="missing", reason=str(e))
            continue
        if args.max_train_samples:
            raw["train"] = subset(raw["train"], args.max_train_samples)
        if args.max_eval_samples:
            raw["dev"] = {s: subset(ds, args.max_eval_samples) for s, ds in raw["dev"].items()}
        enc = lambda ds: encode_task(tok, ds, hp["max_len"], cfg.cls_token_id, cfg.sep_token_id, task.labels is None)
        data = {"train": enc(raw["train"]), "dev": {s: enc(ds) for s, ds in raw["dev"].items()}}
        t0 = time.time()
        histories = {seed: finetune(base, task, data, hp, seed, device, cfg.pad_token_id, log) for seed in seeds}
        final = {seed: {k: v for k, v in h[-1].items() if k not in ("epoch", "train_loss")}
                 for seed, h in histories.items()}
        keys = list(final[seeds[0]])
        results[task.name] = dict(
            status="ok", n_train=len(raw["train"]), n_dev={s: len(ds) for s, ds in raw["dev"].items()},
            seeds=final, mean={k: float(np.mean([f[k] for f in final.values()])) for k in keys},
            median={k: float(np.median([f[k] for f in final.values()])) for k in keys},
            history=histories, time_s=time.time() - t0)
    if not any(r["status"] == "ok" for r in results.values()):
        raise ValueError("no GLUE task could be scored: " + "; ".join(f"{n}: {r['reason']}"
                                                                      for n, r in results.items()))
    report = dict(name=os.path.basename(os.path.normpath(model_dir)), model=args.model, recipe=recipe, hparams=hp,
                  seeds=seeds, args=vars(args), device=str(device), torch=torch.__version__,
                  model_config=vars(cfg), tasks=results)
    present = [k for k in AVG_KEYS if results.get(k[0], {}).get("status") == "ok"]
    report["avg"] = {stat: float(np.mean([results[t][stat][k] for t, k in present])) if present else None
                     for stat in ("mean", "median")}
    report["missing"] = [n for n, r in results.items() if r["status"] == "missing"]
    table = glue_table(report, compare=args.compare)
    out = args.out or model_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "glue.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "glue.md"), "w") as f:
        f.write(table + "\n")
    log("\n" + table + f"\n\nwrote {os.path.join(out, 'glue.json')} and glue.md")
    return report


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", help="run directory, Hugging Face BERT directory, or ckpt.pt of this "
                   "project (--analysis compares several)")
    p.add_argument("--out", help="where the outputs go (default: the (first) model's directory)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    p.add_argument("--max_len", type=int, help="tokens per example, pairs truncated longest-first "
                   "(GLUE recipe: 128; --analysis: 128 word pieces per sentence)")
    g = p.add_argument_group("GLUE fine-tuning (the default mode)")
    g.add_argument("--tasks", default="all", help=f"comma-separated, from: {','.join(TASKS)} (default all)")
    g.add_argument("--glue_dir", help="folder of the original GLUE TSVs (CoLA/, SST-2/, ...); default: the hub")
    g.add_argument("--seeds", default="1", help="comma-separated fine-tuning seeds; several give mean and median")
    g.add_argument("--compare", action="store_true", help="print the TACO paper's rows beside ours")
    g.add_argument("--recipe", default="auto", choices=["auto", *RECIPES],
                   help="default hyperparameters (auto: base for hidden size >= 768, else small)")
    g.add_argument("--lr", type=float, help="peak learning rate (recipe: 5e-5 small, 3e-5 base)")
    g.add_argument("--batch_size", type=int, help="recipe: 32")
    g.add_argument("--epochs", type=int, help="recipe: 4 small, 6 base")
    g.add_argument("--warmup", type=float, help="linear warmup steps, or a fraction of all steps if < 1 (recipe: 100)")
    g.add_argument("--weight_decay", type=float, help="AdamW weight decay, not on biases/LayerNorms (recipe: 0)")
    g.add_argument("--dropout", type=float, help="encoder and head dropout while fine-tuning (recipe: 0.1)")
    g.add_argument("--max_train_samples", type=int, help="quick runs: a fixed random subset of each train set")
    g.add_argument("--max_eval_samples", type=int, help="quick runs: a fixed random subset of each dev set")
    a = p.add_argument_group("representation analysis and training curves (analysis.py)")
    a.add_argument("--analysis", action="store_true", help="contextual score, self-similarity, heatmaps, "
                   "sentence and word similarity of every --model, as analysis.json and PNG plots")
    a.add_argument("--text", help="held-out text for --analysis (default: the run's validation split, "
                   "else WikiText-2 test from ../shared/data)")
    a.add_argument("--num_sentences", type=int, default=1000, help="held-out sentences sampled for --analysis")
    a.add_argument("--analysis_data", default=analysis.ANALYSIS_DATA,
                   help="folder with wordsim353/, simlex999/ and glue/STS-B/")
    a.add_argument("--plot_log", nargs="+", metavar="LOG", help="plot these log.jsonl files on shared axes "
                   "(into --out, default .)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.plot_log:
            analysis.plot_logs(args.plot_log, args.out)
        if args.analysis:
            analysis.run_analysis(args)
        elif not args.plot_log:
            if not args.model:
                raise ValueError("--model is required: a run directory, a Hugging Face BERT directory or a ckpt.pt")
            run_glue(args)
    except (ValueError, FileNotFoundError) as e:  # bad checkpoint, unknown task, malformed TSV: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
