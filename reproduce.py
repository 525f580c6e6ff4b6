"""
Compare the objectives on equal terms, in one command: pretrain each on the same data, seed
and recipe; continue TaCL and an MLM control from the MLM checkpoint for the same extra steps;
fine-tune every run on GLUE with several seeds; run the representation analyses; write
results.md, results.json and plots.

    python reproduce.py --scale toy  --data corpus.txt --glue_dir GLUE --out_dir out/repro_toy   # CPU, ~1 min
    python reproduce.py --scale mini --data WIKI_DIR   --glue_dir GLUE --out_dir out/repro_mini  # one GPU, ~25 min
    python reproduce.py --scale mini ... --only mlm,taco,tacl,mlm_cont                          # some runs, every stage
    python reproduce.py --scale mini ... --only glue,analysis,report                            # some stages, every run

Every step is a subprocess (`python train.py ...`, `python eval.py ...`), and every stage is
skipped when its outputs are already there (a killed pretraining run is resumed), so a long
reproduction can be split over several calls and rerun safely. Runs, in out_dir/:

    mlm, taco, cocolm, electra   pretrained from scratch, --steps steps each
    tacl, mlm_cont               continued from mlm for --extra_steps: TaCL, and MLM as its control

Stages (--only takes stage names and/or run names): pretrain, continue, glue, analysis, report.
What the scales mean is in SCALES below, with the reasons for the numbers.
"""
import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ["pretrain", "continue", "glue", "analysis", "report"]
SCRATCH = ["mlm", "taco", "cocolm", "electra"]  # pretrained from scratch
CONTINUED = {"tacl": "tacl", "mlm_cont": "mlm"}  # run name -> objective, both --init_from the mlm run

SCALES = {
    # CPU, seconds: a tiny model, a few dozen steps, GLUE on a few hundred rows, one epoch.
    # It checks the pipeline end to end (test_reproduce.py runs it); its numbers mean nothing.
    "toy": dict(
        train=["--preset", "smoke", "--vocab_size", "1000", "--seq_len", "64", "--batch_size", "8",
               "--tokens_per_step", "512", "--log_interval", "5", "--eval_interval", "10",
               "--eval_batches", "1", "--ckpt_interval", "10", "--val_fraction", "0.05"],
        steps=20, extra_steps=10, continue_lr=1e-3,
        glue=["--max_train_samples", "64", "--max_eval_samples", "64", "--epochs", "1", "--max_len", "64"],
        tasks="cola,stsb", seeds="1,2", analysis=["--num_sentences", "50"],
        # one thread: a tiny model gains nothing from more, and on a busy CPU torch's thread pool made a
        # 20-step toy run take 25 s of CPU instead of 3.5 (measured)
        env={"OMP_NUM_THREADS": "1"}),
    # A 2-core CPU, about an hour: the smoke model (2 x 128) for 5,000 steps of 2,048 tokens (10M) on real
    # text (pass --data, e.g. a Wikipedia shard: the bundled sample is 0.3M tokens), TaCL and its control
    # for 1,000 more, GLUE as mini. Every objective end to end on real data; at this size the detectors
    # do not beat their trivial baseline (README) and GLUE differences are mostly noise.
    "cpu": dict(
        train=["--preset", "smoke", "--log_interval", "100", "--eval_interval", "500", "--eval_batches", "8",
               "--ckpt_interval", "1000"],
        steps=5000, extra_steps=1000, continue_lr=1e-4,
        glue=["--max_train_samples", "3000"], tasks="cola,sst2,mrpc,stsb,rte", seeds="1,2", analysis=[], env={}),
    # One H100, ~25 minutes in all (estimates from bench.py's step times, not yet measured end to end):
    # BERT-small (4 x 512), seq 128, batch 256 (32,768 tokens a step). 3,000 steps (98M tokens) at
    # MLM's 2.4M tokens/s is ~45 s of MLM (TACO 1.5x, ELECTRA 1.7x, COCO-LM 2.6x): ~5 minutes of steps
    # for the four, plus start-up, compile and evaluations (~1 minute a run) and one tokenization.
    # A short schedule wants a higher peak lr than TACO's 1e-4 at 250k steps: 5e-4 (ELECTRA-small's)
    # with 10% warm-up. TaCL and its MLM control continue for 1,000 steps at TaCL's lr 1e-4.
    # GLUE: the five small tasks, 2 seeds, train sets capped at 3,000 rows (SST-2's 67k alone would
    # cost 2.5 minutes a seed): ~40 s per seed per model, ~8 minutes for the 6 runs.
    "mini": dict(
        train=["--preset", "small", "--seq_len", "128", "--batch_size", "256", "--tokens_per_step", "32768",
               "--lr", "5e-4", "--log_interval", "50", "--eval_interval", "500",
               "--eval_batches", "20", "--ckpt_interval", "1000",
               # TACO's and COCO-LM's negatives: the paper's 80 per GPU does not divide 256; 64 is the divisor nearest it
               "--negative_pool", "64"],
        steps=3000, extra_steps=1000, continue_lr=1e-4,
        glue=["--max_train_samples", "3000"],
        tasks="cola,sst2,mrpc,stsb,rte", seeds="1,2", analysis=[], env={}),
}

# the number each GLUE task is reported by (TACO's Avg uses these), then the other metrics
PRIMARY = {"cola": "mcc", "sst2": "acc", "mrpc": "f1", "stsb": "spearman", "rte": "acc", "qnli": "acc",
           "qqp": "f1", "mnli": "acc_m", "wnli": "acc"}
# the held-out metric that shows each objective learning on its own terms, and what it beats
OWN_METRIC = {"mlm": "val_mlm_acc", "taco": "val_tc_loss", "tacl": "val_tacl_acc", "mlm_cont": "val_mlm_acc",
              "cocolm": "val_copy_loss", "electra": "val_disc_loss"}
# a detector's loss is judged against a constant predictor of the replaced rate (losses.binary_entropy)
OWN_BASELINE = {"cocolm": "val_copy_trivial", "electra": "val_disc_trivial"}
# ...and by its ranking of replaced over original tokens: ROC AUC, 0.5 = chance (losses.auc)
OWN_AUC = {"cocolm": "val_copy_auc", "electra": "val_disc_auc"}


# ---------------------------------------------------------------------------------------------
# reading what the runs wrote (defensively: a missing key is a missing cell, never a crash)


def read_log(path):
    """log.jsonl -> (header, train records, eval records). A resumed run repeats the steps after
    its last checkpoint and a restarted one repeats the header: the last record of a step wins."""
    header, train, evals = {}, {}, {}
    if not os.path.isfile(path):
        return header, [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if not isinstance(rec, dict):
                continue  # not a record of ours (an edited or corrupt log)
            if "config" in rec:
                header = rec
            elif "step" in rec:
                (train if "loss" in rec else evals)[rec["step"]] = rec
    return header, [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def wall_clock(train_records):
    """Seconds in the training loop: elapsed_s restarts at 0 after a resume, so sum the segments."""
    total, last = 0.0, 0.0
    for rec in train_records:
        t = rec.get("elapsed_s")
        if t is None:
            continue
        if t < last:
            total += last
        last = t
    return total + last


def median(values):
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def mean_std(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    m = sum(values) / len(values)
    std = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, std


def read_json(path):
    """A JSON object this script or eval.py wrote, or None when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def run_finished(run_dir, steps):
    """A pretraining run is done when its export (what GLUE, the analyses and --init_from read) holds its
    last step and ckpt.pt exists. Not the log: train.py logs the last evaluation before it saves, and a
    kill in between leaves the weights of the checkpoint before (config.json is written after the weights)."""
    exported = (read_json(os.path.join(run_dir, "config.json")) or {}).get("training_step")
    return os.path.isfile(os.path.join(run_dir, "ckpt.pt")) and type(exported) is int and exported >= steps


def glue_done(path, tasks, seeds):
    report = read_json(path)
    if not report or not isinstance(report.get("tasks"), dict):
        return False
    return [str(s) for s in report.get("seeds", [])] == [str(s) for s in seeds] and all(
        t in report["tasks"] for t in tasks)


# ---------------------------------------------------------------------------------------------
# stages


def run_cmd(cmd, log_path, dry_run, env=None):
    """One subprocess, its output teed into log_path; exits with its code if it fails. Ctrl-C and
    SIGTERM are passed on to it (train.py then saves its step) and this process waits for it: dying
    first would break its output pipe and kill it before it saved."""
    print("$ " + " ".join(cmd), flush=True)
    if dry_run:
        return 0.0
    t0, stop = time.time(), []
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**(env or {}), **os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True,  # a terminal's Ctrl-C reaches it once, through us
                                preexec_fn=die_with_parent if sys.platform == "linux" else None)

        def forward(signum, frame):
            stop.append(signum)
            proc.send_signal(signum)
        # POSIX only: Windows cannot send SIGINT to a child, and its SIGTERM is a kill that saves nothing
        handlers = {} if os.name == "nt" else {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            code = proc.wait()
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
    if stop:
        print(f"reproduce.py: stopped by {signal.Signals(stop[0]).name} ({cmd[1]} exited {code}); rerun the "
              f"same command to go on", file=sys.stderr)
        sys.exit(128 + stop[0])
    if code:
        sys.exit(f"error: `{' '.join(cmd)}` failed with exit code {code} (output in {log_path})")
    return time.time() - t0


def die_with_parent():
    """In the child, Linux only: SIGTERM it (it saves its step and exits) if this process dies, even by SIGKILL,
    which nothing can pass on; otherwise it trains on, holding its out_dir's lock and the GPU."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def hub_reachable(host="huggingface.co", timeout=3.0):
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def try_lock(path):
    """An OS lock on `path` (released however its holder dies), or None when another process holds it."""
    f = open(path, "a")
    try:
        import fcntl
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # Windows: no flock, no check
        pass
    except OSError:
        f.close()
        return None
    return f


def save_json(obj, path):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def note_time(run_dir, stage, seconds):
    """Subprocess wall-clock per stage (start-up, tokenization and compile included), summed over calls."""
    path = os.path.join(run_dir, "reproduce_time.json")
    times = {k: v for k, v in (read_json(path) or {}).items() if isinstance(v, (int, float))}
    times[stage] = times.get(stage, 0.0) + seconds
    save_json(times, path)


def pretrain(args, scale, name, objective, steps, extra):
    run_dir = os.path.join(args.out_dir, name)
    if run_finished(run_dir, steps):
        print(f"[{name}] pretrained already ({run_dir})")
        return
    if os.path.isfile(os.path.join(run_dir, "ckpt.pt")):
        cmd = [args.python, "train.py", "--resume", run_dir, "--max_steps", str(steps)]  # a killed run goes on
    else:
        _, _, evals = read_log(os.path.join(run_dir, "log.jsonl"))
        if any(e["step"] >= steps for e in evals):  # finished, then its ckpt.pt went: its outputs stay
            sys.exit(f"error: {run_dir} finished its {steps} steps but its ckpt.pt is gone: put it back, or delete "
                     f"the directory to pretrain {name} again")
        if os.path.isdir(run_dir) and not args.dry_run:  # killed before its first ckpt.pt: nothing to resume
            if os.path.isfile(os.path.join(run_dir, ".lock")):
                lock = try_lock(os.path.join(run_dir, ".lock"))
                if lock is None:
                    sys.exit(f"error: {run_dir} is in use by another train.py")
                lock.close()  # ours now, and closed: Windows deletes no open file
            shutil.rmtree(run_dir)
        # 10% warm-up, then linear decay to 0 (continuations too: `steps` is theirs)
        cmd = [args.python, "train.py", "--objective", objective, *scale["train"], "--max_steps", str(steps),
               "--warmup_steps", str(max(1, steps // 10)), "--seed", str(args.seed), "--cache_dir", args.cache_dir,
               "--out_dir", run_dir, *extra]
        if args.data:
            cmd += ["--data", args.data]
    if not args.dry_run:
        os.makedirs(run_dir, exist_ok=True)
    seconds = run_cmd(cmd, os.path.join(args.out_dir, f"{name}.train.out"), args.dry_run, scale["env"])
    if not args.dry_run:
        note_time(run_dir, "pretrain", seconds)


def glue(args, scale, name):
    run_dir = os.path.join(args.out_dir, name)
    path = os.path.join(run_dir, "glue.json")
    if glue_done(path, args.tasks.split(","), args.seeds.split(",")):
        print(f"[{name}] GLUE done already ({path})")
        return
    if not os.path.isfile(os.path.join(run_dir, "config.json")) and not args.dry_run:
        print(f"[{name}] not pretrained: no GLUE")
        return
    cmd = [args.python, "eval.py", "--model", run_dir, "--out", run_dir, "--tasks", args.tasks,
           "--seeds", args.seeds, *scale["glue"]]
    if args.glue_dir:
        cmd += ["--glue_dir", args.glue_dir]
    seconds = run_cmd(cmd, os.path.join(args.out_dir, f"{name}.glue.out"), args.dry_run, scale["env"])
    if not args.dry_run:
        note_time(run_dir, "glue", seconds)


def analyse(args, scale, runs):
    out = os.path.join(args.out_dir, "analysis")
    done = read_json(os.path.join(out, "analysis.json"))
    if done and set(runs) <= set((done.get("models") or {}).keys()):
        print(f"analysis done already ({out})")
        return
    cmd = [args.python, "eval.py", "--analysis", "--model", *[os.path.join(args.out_dir, r) for r in runs],
           "--out", out, *scale["analysis"]]
    if args.glue_dir:  # STS-B dev pairs for COCO-LM's sentence-similarity analysis
        cmd += ["--glue_dir", args.glue_dir]
    run_cmd(cmd, os.path.join(args.out_dir, "analysis.out"), args.dry_run, scale["env"])


# ---------------------------------------------------------------------------------------------
# the report


def fmt(value, digits=3):
    return "–" if value is None or not isinstance(value, (int, float)) or not math.isfinite(value) else \
        f"{value:.{digits}f}"


def table_head(*cells):
    """A markdown table's header and delimiter rows: the same number of columns, or it does not render."""
    return ["| " + " | ".join(cells) + " |", "|---" * len(cells) + "|"]


def pm(m, s, digits=1):
    return "–" if m is None else f"{m:.{digits}f} ± {s:.{digits}f}"


def collect(args, runs):
    """Everything results.md shows, as one JSON-ready dict."""
    results = dict(scale=args.scale, data=args.data, seed=args.seed, tasks=args.tasks.split(","),
                   seeds=args.seeds.split(","), runs={})
    analysis = read_json(os.path.join(args.out_dir, "analysis", "analysis.json")) or {}
    for name in runs:
        run_dir = os.path.join(args.out_dir, name)
        header, train, evals = read_log(os.path.join(run_dir, "log.jsonl"))
        if not header and not evals:
            continue
        config = header.get("config", {})
        r = dict(objective=config.get("objective"), steps=evals[-1]["step"] if evals else None,
                 tokens_per_step=config.get("tokens_per_step"), init_from=config.get("init_from") or None,
                 provenance=header.get("provenance"))
        r["train_wall_s"] = wall_clock(train)
        r["tokens_per_s"] = median([t.get("tokens_per_s") for t in train[1:] or train])  # first interval compiles
        r["process_s"] = read_json(os.path.join(run_dir, "reproduce_time.json"))
        # held-out curves: every eval record's val_* numbers and the contextual score
        r["curves"] = [{k: v for k, v in e.items() if k == "step" or k.startswith("val_") or k in (
            "contextual_score", "wordsim_cooc_sim")} for e in evals]
        first, last = (evals[0], evals[-1]) if evals else ({}, {})
        r["final"] = {k: v for k, v in last.items() if k != "step"}
        own = OWN_METRIC.get(name)
        r["own_metric"] = dict(name=own, first=first.get(own), last=last.get(own),
                               baseline=last.get(OWN_BASELINE.get(name)), auc=last.get(OWN_AUC.get(name)))
        # GLUE: per task the primary metric per seed, mean and spread; the average per seed
        report = read_json(os.path.join(run_dir, "glue.json")) or {}
        tasks = {}
        for task, t in (report.get("tasks") or {}).items():
            if task not in results["tasks"] or not isinstance(t, dict):  # the Avg is over the tasks asked for
                continue
            if t.get("status") != "ok":
                tasks[task] = dict(status=t.get("status"), reason=t.get("reason"))
                continue
            per_seed, collapsed = {}, 0
            if isinstance(t.get("runs"), dict):  # {label: {seed, scores, collapsed}}
                for label, run in t["runs"].items():
                    seed = str(run.get("seed", label))
                    per_seed[label if seed in per_seed else seed] = run.get("scores") or {}
                    collapsed += bool(run.get("collapsed"))  # fine-tuning predicted one class only
            else:  # the earlier format: {seed: {metric: value}}
                per_seed = {str(s): v for s, v in (t.get("seeds") or {}).items()}
            key = PRIMARY.get(task) if all(PRIMARY.get(task) in v for v in per_seed.values()) else \
                next(iter(next(iter(per_seed.values()), {})), None)
            values = {s: v.get(key) for s, v in per_seed.items()}
            m, s = mean_std(list(values.values()))
            tasks[task] = dict(status="ok", metric=key, per_seed=values, mean=m, std=s, collapsed=collapsed,
                               all_metrics=per_seed)
        ok = [t for t in tasks.values() if t["status"] == "ok"]
        seeds = sorted({s for t in ok for s in t["per_seed"]})
        per_seed_avg = [sum(t["per_seed"][s] for t in ok) / len(ok) for s in seeds
                        if ok and all(t["per_seed"].get(s) is not None for t in ok)]
        m, s = mean_std(per_seed_avg)
        r["glue"] = dict(tasks=tasks, avg=m, avg_std=s, avg_per_seed=per_seed_avg,
                         finetune_s=report.get("time_s") or sum(t.get("time_s", 0) for t in
                                                                 (report.get("tasks") or {}).values()))
        # representation statistics from analysis.json (keys read with .get: the format may grow)
        a = (analysis.get("models") or {}).get(name) or {}
        ctx = a.get("contextual") or {}
        sims = a.get("self_similarity_per_layer")
        sent = a.get("sentence_similarity") or {}
        r["analysis"] = dict(intra=ctx.get("intra"), inter=ctx.get("inter"), contextual=ctx.get("contextual"),
                             l1_ratio=ctx.get("l1_ratio"), l2_ratio=ctx.get("l2_ratio"),
                             cos_ratio=ctx.get("cos_ratio"), wordsim_cooc=(a.get("wordsim353") or {}).get("cooc_cos"),
                             isotropy=a.get("isotropy_random_pair_cos"),
                             self_similarity_last=sims[-1] if isinstance(sims, list) and sims else None,
                             wordsim353_spearman=(a.get("wordsim353") or {}).get("spearman"),
                             simlex999_spearman=(a.get("simlex999") or {}).get("spearman"),
                             cls_gap=sent.get("cls_gap"), mean_gap=sent.get("mean_gap"))
        results["runs"][name] = r
    mlm = results["runs"].get("mlm", {})
    for r in results["runs"].values():  # the equal-compute view: step time relative to MLM's
        r["step_time_vs_mlm"] = (mlm["tokens_per_s"] / r["tokens_per_s"]) if mlm.get("tokens_per_s") and \
            r.get("tokens_per_s") else None
    return results


def plot(results, out_dir):
    """Held-out loss and contextual score against steps and against training seconds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    written = []
    colors = {name: f"C{i}" for i, name in enumerate(results["runs"])}  # one colour per run in every panel
    base = results["runs"].get("mlm", {})
    panels = [("val_mlm_loss", "held-out MLM loss (main model)"), ("val_gen_loss", "held-out generator MLM loss"),
              ("contextual_score", "contextual score (one block = one context)")]
    for x_axis, fname in (("step", "results_curves_steps.png"), ("seconds", "results_curves_time.png")):
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
        for ax, (key, title) in zip(axes, panels):
            for name, r in results["runs"].items():
                pts = [(c["step"], c[key]) for c in r["curves"] if c.get(key) is not None]
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                if x_axis == "seconds":  # equal compute: the run's seconds per step, spread evenly
                    if not r.get("steps") or not r.get("train_wall_s"):
                        continue
                    xs = [x * r["train_wall_s"] / r["steps"] for x in xs]
                if name in CONTINUED:  # continued runs carry on from the end of the mlm run
                    xs = [x + (base.get("steps" if x_axis == "step" else "train_wall_s") or 0) for x in xs]
                ax.plot(xs, [p[1] for p in pts], marker="o", ms=3, label=name, color=colors[name],
                        linestyle="--" if name in CONTINUED else "-")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step" if x_axis == "step" else "training seconds (loop wall-clock)")
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname + ".tmp.png"), dpi=110)
        plt.close(fig)
        os.replace(os.path.join(out_dir, fname + ".tmp.png"), os.path.join(out_dir, fname))
        written.append(fname)
    return written


def markdown(results, pngs):
    runs = results["runs"]
    tasks = results["tasks"]
    lines = [f"# Results: scale {results['scale']}", "",
             f"Data `{results['data'] or 'train.py default'}`, pretraining seed {results['seed']}; GLUE dev sets, "
             f"fine-tuning seeds {', '.join(results['seeds'])}: mean ± standard deviation over seeds "
             f"(×100; CoLA MCC, STS-B Spearman, MRPC F1, others accuracy). Avg = the mean over these tasks, "
             f"per seed, then mean ± std. \"c\": some fine-tuning runs predicted one class only "
             f"(eval.py's \"collapsed\"; results.json counts them).", "",
             "## GLUE", "",
             *table_head("run", "steps", *tasks, "Avg")]
    for name, r in runs.items():
        g = r["glue"]["tasks"]
        cells = [pm(g[t]["mean"], g[t]["std"]) + " c" * bool(g[t].get("collapsed"))
                 if g.get(t, {}).get("status") == "ok" else "–" for t in tasks]
        lines.append(f"| {name} | {r['steps']} | " + " | ".join(cells) + f" | {pm(r['glue']['avg'], r['glue']['avg_std'])} |")
    lines += ["", "## Pretraining: held-out numbers at the last step, and cost", "",
              "MLM loss: the main model's (MLM, TACO, TaCL); ELECTRA and COCO-LM train no MLM head on the main "
              "model, so theirs is the generator's, not comparable. \"Own metric\" is the objective's own "
              "held-out number at step 0 → the last step (ELECTRA's disc and COCO-LM's copy loss must end below "
              "the trivial BCE of predicting the replaced rate, shown in brackets, and their AUC of replaced over "
              "original tokens must exceed chance, 0.5; TaCL accuracy must rise; "
              "TACO's tc_loss must fall). Seconds: the training loop's "
              "wall-clock (evaluations included); step time relative to MLM's tokens/s gives the equal-compute "
              "view.", "",
              *table_head("run", "steps", "val MLM loss", "val gen loss", "own metric: first → last",
                          "contextual score", "tokens/s", "step time vs MLM", "train s", "pretrain process s",
                          "GLUE s")]
    for name, r in runs.items():
        f, own, proc = r["final"], r["own_metric"], r.get("process_s") or {}
        own_cell = f"{own['name']}: {fmt(own['first'])} → {fmt(own['last'])}" if own["name"] else "–"
        if own.get("baseline") is not None:
            own_cell += f" (trivial {fmt(own['baseline'])})"
        if own.get("auc") is not None:
            own_cell += f", AUC {fmt(own['auc'])}"
        lines.append(f"| {name} | {r['steps']} | {fmt(f.get('val_mlm_loss'))} | {fmt(f.get('val_gen_loss'))} | "
                     f"{own_cell} | {fmt(f.get('contextual_score'))} | {fmt(r['tokens_per_s'], 0)} | "
                     f"{fmt(r['step_time_vs_mlm'], 2)} | {fmt(r['train_wall_s'], 0)} | {fmt(proc.get('pretrain'), 0)} "
                     f"| {fmt(proc.get('glue'), 0)} |")
    lines += ["", "## Representations (eval.py --analysis, held-out sentences)", "",
              *table_head("run", "intra", "inter", "contextual", "L1 intra/inter (<1: contextual)", "L2 intra/inter",
                          "cosine intra/inter (>1: contextual)", "isotropy", "self-sim (last layer)",
                          "WordSim353 20 pairs cos (A.3)", "WordSim353 ρ", "SimLex-999 ρ", "[CLS] gap",
                          "mean-pool gap")]
    for name, r in runs.items():
        a = r["analysis"]
        lines.append(f"| {name} | " + " | ".join(fmt(a[k]) for k in (
            "intra", "inter", "contextual", "l1_ratio", "l2_ratio", "cos_ratio", "isotropy", "self_similarity_last",
            "wordsim_cooc", "wordsim353_spearman", "simlex999_spearman", "cls_gap", "mean_gap")) + " |")
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in pngs) + "; the analysis plots are in `analysis/`.", ""]
    prov = {name: r["provenance"] for name, r in runs.items() if r.get("provenance")}
    if prov:
        lines += ["Provenance (from each log.jsonl): see results.json, `runs.NAME.provenance`.", ""]
    return "\n".join(lines)


def report(args, runs):
    results = collect(args, runs)
    if not results["runs"]:
        sys.exit(f"error: no runs in {args.out_dir} to report on")
    pngs = plot(results, args.out_dir)
    save_json(results, os.path.join(args.out_dir, "results.json"))
    text = markdown(results, pngs)
    with open(os.path.join(args.out_dir, "results.md.tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(args.out_dir, "results.md.tmp"), os.path.join(args.out_dir, "results.md"))
    print(text)
    print(f"wrote {os.path.join(args.out_dir, 'results.md')}, results.json and {len(pngs)} plots")


# ---------------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as config.Parser (not imported: reproduce.py never loads torch)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", default="toy", choices=list(SCALES), help="toy: CPU, a minute; cpu: CPU, about an hour; mini: one GPU, ~25 min")
    p.add_argument("--objectives", default="mlm,taco,cocolm,electra,tacl",
                   help="comma list from mlm,taco,cocolm,electra,tacl; tacl adds mlm (its start) and mlm_cont")
    p.add_argument("--data", default="", help="pretraining text for train.py --data (default: train.py's)")
    p.add_argument("--glue_dir", default="", help="the GLUE TSVs for eval.py --glue_dir (default: the hub)")
    p.add_argument("--out_dir", default="out/reproduce")
    p.add_argument("--cache_dir", default="", help="tokenizer/token cache shared by the runs (default out_dir/cache)")
    p.add_argument("--steps", type=int, help="pretraining steps (default: the scale's)")
    p.add_argument("--extra_steps", type=int, help="TaCL / MLM-control continuation steps (default: the scale's)")
    p.add_argument("--tasks", help="GLUE tasks (default: the scale's)")
    p.add_argument("--seeds", help="GLUE fine-tuning seeds (default: the scale's)")
    p.add_argument("--seed", type=int, default=1337, help="pretraining seed, the same for every run")
    p.add_argument("--only", default="", help=f"comma list of stages ({','.join(STAGES)}) and/or runs "
                   f"({','.join(SCRATCH + list(CONTINUED))}); default everything")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    scale = SCALES[args.scale]
    for flag in ("steps", "extra_steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: must be >= 1")
    steps = args.steps or scale["steps"]
    extra_steps = args.extra_steps or scale["extra_steps"]
    # eval.py's spelling ("STS-B" -> "stsb"), checked here: a bad name must not cost the pretraining first
    args.tasks = ",".join(t.strip().lower().replace("-", "") for t in (args.tasks or scale["tasks"]).split(",")
                          if t.strip())
    unknown = [t for t in args.tasks.split(",") if t not in PRIMARY]
    if unknown or not args.tasks:
        p.error(f"--tasks: unknown GLUE task {(unknown or [''])[0]!r} (choose from {', '.join(PRIMARY)})")
    args.seeds = args.seeds or scale["seeds"]
    seeds = args.seeds.split(",")
    if not all(x.strip().isdigit() for x in seeds) or len(set(seeds)) != len(seeds):
        p.error(f"--seeds {args.seeds}: expected distinct comma-separated integers >= 0, e.g. 1,2")
    if args.glue_dir and not os.path.isdir(args.glue_dir):
        p.error(f"--glue_dir {args.glue_dir}: not a directory")
    if not args.out_dir.strip() or os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        p.error(f"--out_dir {args.out_dir!r}: must name a directory")
    args.cache_dir = args.cache_dir or os.path.join(args.out_dir, "cache")
    for name in ("data", "glue_dir", "out_dir", "cache_dir"):  # subprocesses run in this file's folder
        value = getattr(args, name)
        if value and (os.path.exists(value) or name in ("out_dir", "cache_dir")):
            setattr(args, name, os.path.abspath(value))

    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = [o for o in objectives if o not in SCRATCH + ["tacl"]]
    if unknown:
        p.error(f"unknown objective {unknown[0]!r} (choose from {', '.join(SCRATCH + ['tacl'])})")
    runs = [o for o in SCRATCH if o in objectives or (o == "mlm" and "tacl" in objectives)]
    if "tacl" in objectives:
        runs += list(CONTINUED)
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    bad = [o for o in only if o not in STAGES + SCRATCH + list(CONTINUED)]
    if bad:
        p.error(f"--only: unknown stage or run {bad[0]!r}")
    outside = [o for o in only if o not in STAGES and o not in runs]
    if outside:
        p.error(f"--only {outside[0]}: not one of the runs of --objectives {args.objectives} ({', '.join(runs)})")
    stages = [s for s in only if s in STAGES] or STAGES
    selected = [r for r in runs if r in only] or runs
    offline = any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    glue_to_do = "glue" in stages and any(not glue_done(os.path.join(args.out_dir, r, "glue.json"),
                                                        args.tasks.split(","), args.seeds.split(",")) for r in selected)
    if glue_to_do and not args.glue_dir and not offline and not args.dry_run and not hub_reachable():
        p.error("huggingface.co is unreachable and no --glue_dir was given: GLUE would fail after the pretraining "
                "(pass --glue_dir DIR, or set HF_HUB_OFFLINE=1 to read the hub cache)")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        lock = None if args.dry_run else try_lock(os.path.join(args.out_dir, ".reproduce.lock"))  # held to the end
    except OSError as e:  # read-only, or .reproduce.lock is not a file
        p.error(f"--out_dir {args.out_dir}: cannot be written ({e.strerror}: {e.filename})")
    if lock is None and not args.dry_run:
        sys.exit(f"error: --out_dir {args.out_dir} is in use by another reproduce.py")
    # every call on an out_dir must mean the same runs: a skipped stage must not pass off another setting's output
    settings = dict(scale=args.scale, data=args.data, seed=args.seed, steps=steps, extra_steps=extra_steps,
                    tasks=args.tasks, seeds=args.seeds)
    path = os.path.join(args.out_dir, "reproduce.json")
    before = read_json(path)
    if before is None and os.path.exists(path):  # not a guard to drop: refuse, as for other settings
        p.error(f"{path} is unreadable or not a JSON object, so the settings of the runs in --out_dir "
                f"{args.out_dir} are unknown: restore it, or use another --out_dir")
    if before is None and not args.dry_run:
        save_json(settings, path)
    elif before is not None and before != settings:
        changed = ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in settings.items() if before.get(k) != v)
        p.error(f"--out_dir {args.out_dir} holds a reproduction made with other settings ({changed}): use another "
                f"--out_dir, or the same flags")

    t0 = time.time()
    if "pretrain" in stages:
        for name in selected:
            if name in SCRATCH:
                pretrain(args, scale, name, name, steps, [])
    if "continue" in stages:
        for name in selected:
            if name in CONTINUED:
                if not os.path.isfile(os.path.join(args.out_dir, "mlm", "config.json")) and not args.dry_run:
                    sys.exit(f"error: {name} continues from the mlm run, which is not there: pretrain it first")
                # the same continuation recipe for TaCL and its control: fresh optimizer, lr, 10% warm-up (pretrain's)
                extra = ["--init_from", os.path.join(args.out_dir, "mlm"), "--lr", str(scale["continue_lr"])]
                pretrain(args, scale, name, CONTINUED[name], extra_steps, extra)
    if "glue" in stages:
        for name in selected:
            glue(args, scale, name)
    present = [r for r in runs if os.path.isfile(os.path.join(args.out_dir, r, "config.json"))]
    if "analysis" in stages and present:
        analyse(args, scale, present)
    if "report" in stages and not args.dry_run:
        report(args, runs)
    print(f"reproduce.py: {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
