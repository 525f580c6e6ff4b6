"""
GLUE's scores and the results table, for eval.py (and reproduce.py's and device_run.py's reports through
its glue.json): the metrics (numpy, x100 as the papers print them), TACO's column order and averages, and
the paper's rows printed beside ours. No torch: a report can be rebuilt where nothing is installed but numpy.

What it guarantees:
- each metric matches its reference (sklearn's accuracy, F1, MCC; scipy's Pearson and Spearman with tied
  ranks averaged) on the cases test_eval.py checks; a constant prediction scores 0 correlation, and a
  non-finite one is scored as a constant (never NaN in a table);
- an average covers the same tasks on our rows and the paper's (like for like), and says over how many;
- a collapsed run (one constant prediction on dev) is marked in the table, never hidden in an average.
"""
import math

import numpy as np

from glue_tasks import TASKS

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
    if not np.isfinite(np.asarray(preds, np.float64)).all():  # a diverged run: scored as a constant prediction
        preds = np.zeros(len(preds))
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
# Reporting

# (column header, [(task, metric)]) in the papers' column order
COLUMNS = [("MNLI-m/mm acc", [("mnli", "acc_m"), ("mnli", "acc_mm")]), ("QQP F1", [("qqp", "f1")]),
           ("QNLI acc", [("qnli", "acc")]), ("SST-2 acc", [("sst2", "acc")]), ("CoLA MCC", [("cola", "mcc")]),
           ("STS-B Spearman", [("stsb", "spearman")]), ("MRPC F1", [("mrpc", "f1")]), ("RTE acc", [("rte", "acc")]),
           ("WNLI acc", [("wnli", "acc")])]
# TACO's "Avg." of its small-model tables (Tab. 1): 9 numbers, WNLI left out. Its base-model table
# (Tab. 3) prints one MNLI number (matched), so its Avg. is over 8.
AVG9 = [key for _, keys in COLUMNS[:-1] for key in keys]
AVG8 = [key for key in AVG9 if key != ("mnli", "acc_mm")]
MAIN = {name: [k for _, keys in COLUMNS for t, k in keys if t == name] for name in TASKS}  # picks a task's best run

# PAPER ROWS, not ours: dev-set scores printed in TACO (Fu et al., ACL 2022), in AVG9 order (None:
# not printed), then the paper's Avg.; small rows: mean of 4 seeds at Table 7's values; base rows:
# mean of 6 combinations drawn from Table 8's grid.
PAPER_ROWS = [
    ("paper: BERT-small MLM, 250k (TACO Tab. 1)", (76.9, 77.4, 85.7, 86.2, 89.0, 28.8, 85.6, 85.9, 59.6), 75.0),
    ("paper: BERT-small TACO, 50k", (76.7, 76.8, 85.2, 85.0, 87.5, 31.3, 85.6, 87.1, 59.1), 74.9),
    ("paper: BERT-small TACO, 250k", (77.9, 78.4, 86.1, 86.5, 88.9, 34.2, 86.1, 88.1, 59.5), 76.2),
    ("paper: BERT-base MLM, 500k (TACO Tab. 3)", (84.2, None, 87.9, 91.1, 92.1, 51.1, 87.9, 89.8, 63.4), 80.9),
    ("paper: BERT-base TACO, 500k", (84.6, None, 88.1, 90.8, 92.3, 53.4, 88.5, 90.7, 66.3), 81.8),
]


def like_for_like(values, keys, present):
    """Mean of values over the keys we scored, or None when there are none."""
    same = [values[k] for k in keys if k in present and values.get(k) is not None]
    return float(np.mean(same)) if same else None


def table_row(label, values, avgs, marks=()):
    cells = ["/".join(f"{values[k]:.1f}" + ("†" if k in marks else "") for k in keys if values.get(k) is not None)
             or "–" for _, keys in COLUMNS]
    return f"| {label} | " + " | ".join(cells + avgs) + " |"


def glue_table(report, compare=False):
    tasks, n_runs = report["tasks"], report["runs_per_task"]
    ok = {name: r for name, r in tasks.items() if r["status"] == "ok"}
    present = {(t, k) for t, r in ok.items() for k in r["mean"]}
    n9, n8 = sum(k in present for k in AVG9), sum(k in present for k in AVG8)
    lines = ["| model | " + " | ".join(c for c, _ in COLUMNS) + f" | Avg of {n9} (Tab. 1 way) | Avg of {n8} (Tab. 3 way) |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    marks = {(t, k) for t, r in ok.items() if r["collapsed"] for k in r["mean"]}
    cut = any(r.get("n_train", 0) < r.get("n_train_full", math.inf) for r in ok.values())  # unknown: as cut
    sub = report["args"].get("max_train_samples") if cut else None, report["args"].get("max_eval_samples")
    flag = "".join([f"; TRAIN SUBSAMPLED to {sub[0]} rows/task" if sub[0] else "",
                    f"; DEV SUBSAMPLED to {sub[1]} rows" if sub[1] else ""])
    for stat in (["mean", "median"] if n_runs > 1 else ["mean"]):
        values = {(t, k): v for t, r in ok.items() for k, v in r[stat].items()}
        avgs = [like_for_like(values, keys, present) for keys in (AVG9, AVG8)]
        which = report["runs_label"] if n_runs == 1 else f"{stat} of {report['runs_label']}"
        lines.append(table_row(f"{report['name']} ({which}{flag})", values,
                               ["–" if a is None else f"{a:.1f}" for a in avgs], marks))
    for label, numbers, paper_avg in PAPER_ROWS if compare else []:
        values = dict(zip(AVG9, numbers))
        tab3 = values[("mnli", "acc_mm")] is None  # Tab. 3 prints MNLI-m only: its Avg. is over 8
        keys = AVG8 if tab3 else AVG9
        avg = like_for_like(values, keys, present)
        cell = ("–" if avg is None else f"{paper_avg:.1f}" if all(k in present for k in keys)
                else f"{avg:.1f} (all: {paper_avg:.1f})")
        lines.append(table_row(label, values, ["–", cell] if tab3 else [cell, "–"]))
    lines += ["", "Avg of 9 (Tab. 1 way): TACO's small-model Avg., the mean of MNLI-m, MNLI-mm, QQP F1, QNLI, SST-2, "
              "CoLA, STS-B Spearman, MRPC F1 and RTE (WNLI left out). Avg of 8 (Tab. 3 way): its base-model Avg., "
              "MNLI-m only. Each average covers only the tasks scored here, on our rows and the paper's alike; "
              "'all' is the paper's own average over all its tasks."]
    if compare:
        lines.append("Paper rows: dev sets; small models the mean of 4 seeds at Table 7's values, base models the "
                     "mean of 6 combinations drawn from Table 8's grid.")
    if marks:
        lines.append("† collapsed: a run predicted one constant value for all of dev (one class, or one score: "
                     "Pearson/Spearman undefined, counted as 0; accuracy/F1/MCC as scored), or a non-finite one "
                     "(scored as a constant). The count per task is below.")
    if flag:
        lines.append(f"{flag[2:]}: a quick run, not comparable with the papers' numbers.")
    for name, r in tasks.items():
        if r["status"] == "missing":
            lines.append(f"Missing: {name} ({r['reason']}).")
    if report.get("not_run"):
        lines.append(f"Not run: {', '.join(report['not_run'])} (the run stopped before them).")
    lines += ["", "| task | metric | per run | mean | median | runs collapsed | train / dev rows | minutes |",
              "|---" * 8 + "|"]
    for name, r in ok.items():
        for key in r["mean"]:
            per_run = ", ".join(f"{run['scores'][key]:.1f}" for run in r["runs"].values())
            n_dev = "+".join(map(str, r["n_dev"].values()))
            lines.append(f"| {name} | {key} | {per_run} | {r['mean'][key]:.2f} | {r['median'][key]:.2f} | "
                         f"{len(r['collapsed'])} | {r['n_train']} / {n_dev} | {r['time_s'] / 60:.2f} |")
    lines += ["", f"Hyper-parameters ({report['protocol']}):", "",
              "| task | runs | lr | batch size | epochs | warm-up steps / all steps |", "|---" * 6 + "|"]
    for name, r in ok.items():
        combos = {}
        for run in r["runs"].values():
            hp = run["hparams"]
            combos.setdefault((hp["lr"], hp["batch_size"], hp["epochs"], hp["warmup_steps"], hp["total_steps"]),
                              []).append(run["label"])
        for (lr, bs, epochs, warmup, total), labels in combos.items():
            lines.append(f"| {name} | {', '.join(labels)} | {lr:g} | {bs} | {epochs} | {warmup} / {total} |")
    return "\n".join(lines)
