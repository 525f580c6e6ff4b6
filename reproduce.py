"""
Compare the objectives on equal terms, in one command: pretrain each on the same data, seed
and recipe; continue TaCL and an MLM control from the MLM checkpoint for the same extra steps;
fine-tune every run on GLUE with several seeds; run the representation analyses; write
results.md, results.json and plots.

    python reproduce.py --scale toy  --data corpus.txt --glue_dir GLUE --out_dir out/repro_toy   # CPU, ~1 min
    python reproduce.py --scale mini --data WIKI_DIR   --glue_dir GLUE --out_dir out/repro_mini  # one GPU, ~25 min
    python reproduce.py --scale mini ... --only mlm,taco,tacl,mlm_cont   # these runs' training and GLUE; then
                                                                         # the analysis and report of every run
    python reproduce.py --scale mini ... --only glue,analysis,report     # some stages, every run
    python reproduce.py --scale mini ... --nproc_per_node 4              # pretraining on 4 GPUs (torchrun)
    python reproduce.py --scale mini ... --only glue,short --glue_jobs 4 # one GLUE recipe, 4 eval.py at a time

Every step is a subprocess (`python train.py ...`, `python eval.py ...`), and every stage is
skipped when its outputs are already there (a killed pretraining run is resumed), so a long
reproduction can be split over several calls and rerun safely. GLUE, the analyses and the
continuations read a run's final export only: each records the training step it read, and a
result made from another step counts as not done. Runs, in out_dir/:

    mlm, taco, cocolm, electra   pretrained from scratch, --steps steps each
    tacl, mlm_cont               continued from mlm for --extra_steps: TaCL, and MLM as its control

Stages (--only takes stage names, run names and/or GLUE recipe names): pretrain, continue, glue, analysis,
report. GLUE runs once per --recipes entry (eval.py --recipe): RUN/glue.json holds the paper recipe's
scores, RUN/glue_RECIPE.json the others'. What the scales mean is in SCALES below, with the reasons for
the numbers; device_run.py splits the mini scale into commands that each fit one GPU session.
"""
import argparse
import errno
import glob
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import corpus  # standard library only at import: this file runs before the wheels are installed
from atomic import replace_atomic, strict_json, write_atomic
from console import Console

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ["pretrain", "continue", "glue", "analysis", "report"]
SCRATCH = ["mlm", "taco", "cocolm", "electra"]  # pretrained from scratch
CONTINUED = {"tacl": "tacl", "mlm_cont": "mlm"}  # run name -> objective, both --init_from the mlm run
# eval.py --recipe's choices (test_reproduce.py checks they agree), and what each is, for results.md
RECIPES = {"paper": "TACO's Table 7: lr 5e-5; per-task batch, epochs (4, MNLI/QQP 6) and warm-up",
           "uniform": "TACO's scripts: one recipe for every task, lr 5e-5, batch 32, 4 epochs",
           "short": "ours, for briefly pretrained models: one higher lr for every task (eval.py's SHORT)"}

SCALES = {
    # CPU, seconds: a tiny model, a few dozen steps, GLUE on a few hundred rows, one epoch.
    # It checks the pipeline end to end (test_reproduce.py runs it); its numbers mean nothing.
    "toy": dict(
        train=["--preset", "smoke", "--vocab_size", "1000", "--seq_len", "64", "--batch_size", "8",
               "--tokens_per_step", "512", "--log_interval", "5", "--eval_interval", "10",
               "--eval_batches", "1", "--ckpt_interval", "10", "--val_fraction", "0.05"],
        steps=20, extra_steps=10, continue_lr=1e-3,
        glue=["--max_eval_samples", "64", "--epochs", "1", "--max_len", "64"], glue_train_rows=64,
        recipes="paper", tasks="cola,stsb", seeds="1,2", analysis=["--num_sentences", "50"],
        shows="The toy scale checks the pipeline end to end; its numbers say nothing about the papers' claims.",
        # one thread: a tiny model gains nothing from more, and on a busy CPU torch's thread pool made a
        # 20-step toy run take 25 s of CPU instead of 3.5 (measured)
        env={"OMP_NUM_THREADS": "1"}),
    # A 2-core CPU, about 2 hours (114 minutes measured, docs/reproduction.md): the smoke model (2 x 128) for 5,000 steps
    # of 2,048 tokens (10M) on real text (pass --data, e.g. a Wikipedia shard: the bundled sample is 0.3M
    # tokens), TaCL and its control for 1,000 more, GLUE as mini on 3,000 train rows. Every objective end to end
    # on real data; at this size the detectors do not beat their trivial baseline (docs/detectors.md) and GLUE
    # differences are mostly noise.
    "cpu": dict(
        train=["--preset", "smoke", "--log_interval", "100", "--eval_interval", "500", "--eval_batches", "8",
               "--ckpt_interval", "1000"],
        steps=5000, extra_steps=1000, continue_lr=1e-4,
        glue=[], glue_train_rows=3000, recipes="paper", tasks="cola,sst2,mrpc,stsb,rte", seeds="1,2", analysis=[],
        env={}, shows="The cpu scale trains a 2 x 128 model for 10M tokens; the papers' claims are for BERT-small or "
        "larger over billions: a GLUE difference here neither confirms nor refutes them."),
    # One H100, ~25 minutes in all (estimates from bench.py's step times, not yet measured end to end):
    # BERT-small (4 x 512), seq 128, batch 256 (32,768 tokens a step). 3,000 steps (98M tokens) at
    # MLM's 2.4M tokens/s is ~45 s of MLM (TACO 1.5x, ELECTRA 1.7x, COCO-LM 2.6x): ~5 minutes of steps
    # for the four, plus start-up, compile and evaluations (~1 minute a run) and one tokenization.
    # A short schedule wants a higher peak lr than TACO's 1e-4 at 250k steps: 5e-4 (ELECTRA-small's)
    # with 10% warm-up. TaCL and its MLM control continue for 1,000 steps at TaCL's lr 1e-4. Held-out
    # numbers every 250 steps: 13 points on each curve.
    # GLUE: the five small tasks, 2 seeds, Table 7's recipe (below: why not the short one), train sets capped
    # at CoLA's 8,551 rows: CoLA, MRPC, STS-B and RTE whole, SST-2's 67k cut to as many. device_run.py's
    # budget says what it costs.
    "mini": dict(
        train=["--preset", "small", "--seq_len", "128", "--batch_size", "256", "--tokens_per_step", "32768",
               "--lr", "5e-4", "--log_interval", "50", "--eval_interval", "250",
               "--eval_batches", "20", "--ckpt_interval", "1000",
               # TACO's and COCO-LM's negatives: the paper's 80 per GPU does not divide 256; 64 is the divisor nearest it
               "--negative_pool", "64"],
        # GLUE with Table 7's recipe only: on a BERT-small pretrained briefly on a CPU it does not collapse and
        # `short` (lr 1e-3, chosen on the 2 x 128 model) does (results/cpu/short_recipe.md); --recipes adds it
        steps=3000, extra_steps=1000, continue_lr=1e-4, glue=[], glue_train_rows=8551, recipes="paper",
        tasks="cola,sst2,mrpc,stsb,rte", seeds="1,2", analysis=[], env={},
        shows="The mini scale trains TACO's BERT-small for 98M tokens, against the papers' 82B: an early look at "
        "the claims, not their replication."),
}

# the number each GLUE task is reported by (TACO's Avg uses these), then the other metrics
PRIMARY = {"cola": "mcc", "sst2": "acc", "mrpc": "f1", "stsb": "spearman", "rte": "acc", "qnli": "acc",
           "qqp": "f1", "mnli": "acc_m", "wnli": "acc"}
METRIC_NAMES = {"mcc": "MCC", "acc": "accuracy", "f1": "F1", "spearman": "Spearman", "acc_m": "matched accuracy"}
# each task's folder of TSVs in --glue_dir (glue_tasks.py's Task.dir; test_reproduce.py checks they agree)
GLUE_DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "rte": "RTE", "qnli": "QNLI",
             "qqp": "QQP", "mnli": "MNLI", "wnli": "WNLI"}
# the papers' GLUE claims at equal pretraining steps, as (better run, baseline run, who claims it)
CLAIMS = [("taco", "mlm", "TACO, Fu et al. 2022"), ("cocolm", "electra", "COCO-LM, Meng et al. 2021"),
          ("tacl", "mlm_cont", "TaCL, Su et al. 2022: against MLM continued for the same steps")]
# the held-out metric that shows each objective learning on its own terms, and what it beats
OWN_METRIC = {"mlm": "val_mlm_acc", "taco": "val_tc_loss", "tacl": "val_tacl_acc", "mlm_cont": "val_mlm_acc",
              "cocolm": "val_copy_loss", "electra": "val_disc_loss"}
# a detector's loss is judged against a constant predictor of the replaced rate (losses.binary_entropy)
OWN_BASELINE = {"cocolm": "val_copy_trivial", "electra": "val_disc_trivial"}
# ...and by its ranking of replaced over original tokens: ROC AUC, 0.5 = chance (losses.auc)
OWN_AUC = {"cocolm": "val_copy_auc", "electra": "val_disc_auc"}


# ---------------------------------------------------------------------------------------------
# reading what the runs wrote (defensively: a missing key or a value of another type is a missing cell, never a crash)


def read_log(path):
    """log.jsonl -> (header, train records, eval records, the step it diverged at or None). A resumed run
    repeats the steps after its last checkpoint and a restarted one repeats the header: the last record of a step
    wins. A divergence line (train.py's last, {step, diverged}) is no eval record; a line after it, a resume."""
    header, train, evals, diverged = {}, {}, {}, None
    if not os.path.isfile(path):
        return header, [], [], None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if not isinstance(rec, dict):
                continue  # not a record of ours (an edited or corrupt log)
            diverged = None  # this line follows any divergence: a resume went on
            if isinstance(rec.get("config"), dict):
                header = rec
            elif type(rec.get("step")) is int and "diverged" in rec:
                diverged = rec["step"]
            elif type(rec.get("step")) is int:  # train.py logs numbers: a value of another type is a missing cell,
                # and so is a non-finite one (null since train.py writes strict JSON; a bare NaN before)
                numbers = {k: v for k, v in rec.items()  # an int no float holds (an edited log): missing too
                           if type(v) in (int, float) and abs(v) < 2 ** 1024 and math.isfinite(v)}
                (train if "loss" in rec else evals)[rec["step"]] = numbers
    return header, [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)], diverged


def wall_clock(train_records):
    """Seconds in the training loop: the last elapsed_s (ckpt.pt carries it across a resume; the
    time between the checkpoint and a kill is not counted, those steps were done again). A run resumed
    from a checkpoint written before train.py saved elapsed_s counts from that resume only."""
    times = [rec["elapsed_s"] for rec in train_records if rec.get("elapsed_s") is not None]
    return times[-1] if times else 0.0


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


def export_step(run_dir):
    """The training step of a run's export (config.json: what GLUE, the analyses and --init_from read), or
    None. train.py rewrites the export at each checkpoint, so every result made from it records this step."""
    step = (read_json(os.path.join(run_dir, "config.json")) or {}).get("training_step")
    return step if type(step) is int else None


def export_id(run_dir):
    """Which weights a result was made from: the run's id (reproduce_init.json, new each time the run starts
    from scratch, so a run deleted and trained again is another run) and its export's step; None before an
    export. A run started by an earlier reproduce.py has no id: "-"."""
    step, run = export_step(run_dir), read_json(os.path.join(run_dir, "reproduce_init.json")) or {}
    return None if step is None else f"{run.get('run_id', '-')}@{step}"


def run_finished(run_dir, steps):
    """A pretraining run is done when its export holds its last step. Not the log: train.py logs the last
    evaluation before it saves, and a kill in between leaves the weights of the checkpoint before (config.json
    is written after the weights). Not ckpt.pt: train.py writes it before the export, and nothing here reads it."""
    step = export_step(run_dir)
    return step is not None and step >= steps


def steps_of(args, name):
    return args.steps if name in SCRATCH else args.extra_steps


def glue_files(recipe):
    """A recipe's GLUE report and eval.py's part folder in a run directory: the paper recipe's keep the names
    they had before there were several recipes."""
    stem = "glue" if recipe == "paper" else f"glue_{recipe}"
    return stem + ".json", stem + ".part"


def glue_todo(run_dir, tasks, seeds, recipe="paper"):
    """The tasks that the recipe's report does not hold as scored ("ok") on the run's current export, with these
    seeds and this recipe."""
    report, step = read_json(os.path.join(run_dir, glue_files(recipe)[0])) or {}, export_step(run_dir)
    done = report.get("tasks") if isinstance(report.get("tasks"), dict) and step is not None and \
        report.get("seeds") == [int(s) for s in seeds] and report.get("recipe", "paper") == recipe else {}
    return [t for t in tasks if not (isinstance(done.get(t), dict) and done[t].get("status") == "ok"
                                     and done[t].get("training_step") == step)]


def glue_absent(glue_dir, task):
    """The TSVs of `task` that eval.py would not find in glue_dir (glue_tasks.load_task's paths), empty ones too."""
    stems = ["train"] + (["dev_matched", "dev_mismatched"] if task == "mnli" else ["dev"])
    paths = [os.path.join(GLUE_DIRS[task], stem + ".tsv") for stem in stems]
    return [p for p in paths if not os.path.isfile(os.path.join(glue_dir, p)) or
            not os.path.getsize(os.path.join(glue_dir, p))]


def data_problem(data):
    """Why train.py would refuse a local --data, said before reproduce.json is saved (corpus.resolve_files: the
    standard library only at import), or None: a usable path, or a hub name ("wikitext:wikitext-103-raw-v1")."""
    try:
        corpus.resolve_files(data)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# stages


def run_cmd(cmd, log_path, dry_run, env=None, timed=None):
    """One subprocess (run_parallel with one call), its output teed into log_path; exits with its code if it
    fails. timed=(run_dir, stage): its wall-clock is added to the run's reproduce_time.json."""
    if dry_run:
        print("$ " + " ".join(cmd), flush=True)
        return
    run_parallel([(cmd, log_path, timed, lambda: None)], 1, env)


def spawn(cmd, env):
    return subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            encoding="utf-8", errors="replace",  # the child writes UTF-8 whatever the locale
                            env={**(env or {}), **os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"},
                            start_new_session=True,  # a terminal's Ctrl-C reaches it once, through us
                            preexec_fn=die_with_parent if sys.platform == "linux" else None)


def run_parallel(calls, jobs, env):
    """Subprocesses, at most `jobs` at a time: calls are (cmd, log_path, timed, then), then() runs when its call
    ends, whatever its exit code; timed=(run_dir, stage) or None: the call's wall-clock is added to the run's
    reproduce_time.json, a stopped or failed call's too. Each line is teed into its call's log and printed
    (with the log's name in front when several calls run). Ctrl-C and SIGTERM are passed on to every running
    call (train.py then saves its step), no new one starts, and this process waits for them before it exits:
    dying first would break their output pipes and kill them before they saved. A failed call lets the others
    finish, then this process exits with an error."""
    import threading
    pending, running, failed, stop, lock = list(calls), {}, [], [], threading.Lock()
    tag = len(calls) > 1

    def tee(proc, log_path, prefix):
        # the pipe is read to its end whatever cannot be written (a full disk under the log, a `| head` that
        # exited): a call whose output nobody read any more blocked for good once its pipe was full
        log = problem = None
        try:
            log = open(log_path, "a", encoding="utf-8")
        except OSError as e:
            problem = e
        for line in proc.stdout:
            if not problem:
                try:
                    log.write(line)
                except OSError as e:
                    problem = e
            with lock:
                try:
                    sys.stdout.write(f"[{prefix}] {line}" if tag else line)
                    sys.stdout.flush()
                except OSError:  # our reader is gone: the log still gets every line
                    pass
        try:
            if log:
                log.close()
        except OSError as e:
            problem = problem or e
        if problem:
            failed.append(f"cannot write {log_path} ({problem.strerror}): the output of `{' '.join(proc.args)}` "
                          f"went to the console only")

    def forward(signum, frame):
        stop.append(signum)
        for proc in running:
            proc.send_signal(signum)
    # POSIX only: Windows cannot send SIGINT to a child, and its SIGTERM is a kill that saves nothing
    handlers = {} if os.name == "nt" else {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    ended = []
    try:
        while running or pending and not stop:
            while pending and len(running) < jobs and not stop:
                cmd, log_path, timed, then = pending.pop(0)
                print("$ " + " ".join(cmd), flush=True)
                proc = spawn(cmd, env)
                reader = threading.Thread(target=tee, args=(proc, log_path, os.path.basename(log_path)[:-4]))
                reader.start()
                running[proc] = (cmd, log_path, timed, then, reader, time.time())
                if stop:  # a signal since the loop's check found no one to pass it on to: this call gets it now
                    proc.send_signal(stop[0])
            time.sleep(0.05)
            for proc in [p for p in running if p.poll() is not None]:
                cmd, log_path, timed, then, reader, t0 = running.pop(proc)
                reader.join()
                if timed:
                    note_time(*timed, time.time() - t0)
                then()
                ended.append((cmd, proc.returncode))
                if proc.returncode and not stop:
                    failed.append(f"`{' '.join(cmd)}` failed with exit code {proc.returncode} (output in {log_path})")
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    if stop:
        codes = ", ".join(f"{next((c for c in cmd if c.endswith('.py')), cmd[0])} exited {code}" for cmd, code in ended)
        print(f"reproduce.py: stopped by {signal.Signals(stop[0]).name} ({codes}); rerun the same command to go on",
              file=sys.stderr)
        sys.exit(128 + stop[0])
    if failed:
        sys.exit("error: " + "\nerror: ".join(failed))


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
    f = open(path, "a", encoding="utf-8")
    try:
        import fcntl
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # Windows: no flock, no check
        pass
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):  # any other: a file system without locks (none held)
            f.close()
            return None
    return f


def save_json(obj, path):  # strict: a NaN (a log.jsonl of an earlier version held bare NaN) is written as null
    write_atomic(path, strict_json(obj, indent=2))


def note_time(run_dir, stage, seconds):
    """Subprocess wall-clock per stage (start-up, tokenization and compile included), summed over calls."""
    path = os.path.join(run_dir, "reproduce_time.json")
    times = {k: v for k, v in (read_json(path) or {}).items() if isinstance(v, (int, float))}
    times[stage] = times.get(stage, 0.0) + seconds
    save_json(times, path)


def wait_for_train_py(run_dir, seconds=60):
    """A train.py whose reproduce.py was killed gets SIGTERM, saves its step and exits: wait for it to let go of
    the run's lock (a minute at most) rather than refuse the rerun, or remove a checkpoint it is writing."""
    path = os.path.join(run_dir, ".lock")
    deadline = time.time() + seconds
    while os.path.isfile(path):
        lock = try_lock(path)
        if lock is not None:
            lock.close()
            return
        if time.time() > deadline:
            sys.exit(f"error: {run_dir} is in use by another train.py")
        time.sleep(0.5)


def pretrain(args, scale, name, objective, steps, extra, start=None):
    """Train a run to `steps`, resuming a killed one. A fresh run gets a new id in reproduce_init.json, with
    `start`: a continuation's record of the mlm export it starts from."""
    run_dir = os.path.join(args.out_dir, name)
    if run_finished(run_dir, steps):
        print(f"[{name}] pretrained already ({run_dir})")
        return
    train = [args.python, "train.py"] if args.nproc_per_node == 1 else [  # DDP on this node's GPUs
        args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc_per_node}", "train.py"]
    if not args.dry_run:
        wait_for_train_py(run_dir)  # before choosing: a checkpoint may still be on its way
    if os.path.isfile(os.path.join(run_dir, "ckpt.pt")):
        cmd = [*train, "--resume", run_dir, "--max_steps", str(steps)]  # a killed run goes on
    else:
        # train.py saves ckpt.pt before its export: an unfinished run with an export, or with a ckpt.pt that is no
        # file, lost its checkpoint (deleted, damaged), and deleting the folder would take its export and log along
        saved = [f for f in ("ckpt.pt", "config.json", "model.safetensors")
                 if os.path.lexists(os.path.join(run_dir, f))]
        if saved:
            sys.exit(f"error: {run_dir} holds {', '.join(saved)} of an unfinished run but no ckpt.pt file to resume "
                     f"(deleted or damaged): put the run's ckpt.pt back, or delete {run_dir} to train it again")
        if os.path.isdir(run_dir) and not args.dry_run:  # killed before its first ckpt.pt: nothing to resume
            shutil.rmtree(run_dir)
        # 10% warm-up, then linear decay to 0 (continuations too: `steps` is theirs)
        cmd = [*train, "--objective", objective, *scale["train"], "--max_steps", str(steps),
               "--warmup_steps", str(max(1, steps // 10)), "--seed", str(args.seed), "--cache_dir", args.cache_dir,
               "--out_dir", run_dir, *extra]
        if args.data:
            cmd += ["--data", args.data]
        if args.tokenizer and not start:  # a continuation takes its init_from's
            cmd += ["--tokenizer", args.tokenizer]
        if not args.dry_run:
            os.makedirs(run_dir, exist_ok=True)
            save_json(dict(run_id=uuid.uuid4().hex[:12], **(start or {})), os.path.join(run_dir, "reproduce_init.json"))
    if not args.dry_run:
        os.makedirs(run_dir, exist_ok=True)
    run_cmd(cmd, os.path.join(args.out_dir, f"{name}.train.out"), args.dry_run, scale["env"], (run_dir, "pretrain"))


def continue_run(args, scale, name):
    """TaCL or its MLM control from the finished mlm run, on one recipe: fresh optimizer, lr, 10% warm-up."""
    mlm, run_dir = os.path.join(args.out_dir, "mlm"), os.path.join(args.out_dir, name)
    if not run_finished(mlm, args.steps) and not args.dry_run:
        sys.exit(f"error: {name} continues from the mlm run, which has not finished its {args.steps} steps: "
                 f"pretrain it first (--only pretrain,mlm)")
    init = read_json(os.path.join(run_dir, "reproduce_init.json")) or {}
    began, now = init.get("mlm_export"), export_id(mlm)
    if began is None and "mlm_step" in init:  # written by an earlier reproduce.py: the step alone
        began, now = init["mlm_step"], export_step(mlm)
    saved = any(os.path.isfile(os.path.join(run_dir, f)) for f in ("ckpt.pt", "config.json"))
    if saved and began is not None and began != now:
        sys.exit(f"error: {run_dir} was continued from another mlm run or step (export {began}, now "
                 f"{now}): delete {run_dir} to continue it again from the mlm run")
    extra = ["--init_from", mlm, "--lr", str(scale["continue_lr"])]
    pretrain(args, scale, name, CONTINUED[name], args.extra_steps, extra, dict(mlm_export=export_id(mlm)))


def glue_call(args, scale, name, recipe):
    """The eval.py call that fine-tunes the tasks not yet scored on the run's final export with `recipe`, as
    (cmd, log path, timed, then), or None. eval.py writes into the recipe's part folder, which absorb_glue
    merges into its report task by task, each stamped with the step it scored: a killed call keeps the
    tasks it finished (eval.py rewrites its glue.json after each)."""
    run_dir = os.path.join(args.out_dir, name)
    if not run_finished(run_dir, steps_of(args, name)) and not args.dry_run:
        print(f"[{name}] has not finished its {steps_of(args, name)} steps: no GLUE yet")
        return None
    if not args.dry_run:
        absorb_glue(run_dir, recipe)
    report, part = (os.path.join(run_dir, f) for f in glue_files(recipe))
    todo = glue_todo(run_dir, args.tasks.split(","), args.seeds.split(","), recipe)
    if not todo:
        print(f"[{name}] GLUE ({recipe} recipe) done already ({report})")
        return None
    absent = [t for t in todo if args.glue_dir and glue_absent(args.glue_dir, t)]
    if absent:  # not done, and checked again by the next call
        print(f"[{name}] GLUE: {', '.join(absent)} not in --glue_dir {args.glue_dir}: skipped (the Avg leaves it out)")
        todo = [t for t in todo if t not in absent]
        if not todo:
            return None
    if not args.dry_run:
        os.makedirs(part, exist_ok=True)
        save_json(dict(training_step=export_step(run_dir), glue_dir=args.glue_dir, recipe=recipe),
                  os.path.join(part, "stamp.json"))
    cmd = [args.python, "eval.py", "--model", run_dir, "--out", part, "--tasks", ",".join(todo),
           "--seeds", args.seeds, "--recipe", recipe, "--max_train_samples", str(args.glue_train_rows), *scale["glue"]]
    if args.glue_dir:
        cmd += ["--glue_dir", args.glue_dir]
    log = os.path.join(args.out_dir, f"{name}.{glue_files(recipe)[0][:-len('.json')]}.out")
    return cmd, log, (run_dir, "glue"), lambda: None if args.dry_run else absorb_glue(run_dir, recipe)


def glue(args, scale):
    """GLUE of the selected runs with each selected recipe, recipe by recipe (so that a stop leaves every run
    scored by the first), --glue_jobs calls at a time."""
    calls = [call for recipe in args.glue_recipes for name in args.selected
             if (call := glue_call(args, scale, name, recipe))]
    if args.glue_jobs > 1 and len(calls) > 1 and not args.dry_run:
        run_parallel(calls, args.glue_jobs, scale["env"])
        return
    for cmd, log, timed, then in calls:
        run_cmd(cmd, log, args.dry_run, scale["env"], timed)
        then()


def absorb_glue(run_dir, recipe="paper"):
    """The recipe's part folder's glue.json tasks into its report, stamped with the step (and recipe) its
    stamp.json names."""
    report, part = (os.path.join(run_dir, f) for f in glue_files(recipe))
    new, stamp = read_json(os.path.join(part, "glue.json")), read_json(os.path.join(part, "stamp.json"))
    if new and stamp and isinstance(new.get("tasks"), dict):
        old = read_json(report) or {}
        tasks = old["tasks"] if isinstance(old.get("tasks"), dict) else {}
        tasks.update({t: {**r, "training_step": stamp.get("training_step")} for t, r in new["tasks"].items()
                      if isinstance(r, dict)})
        # eval.py's averages, lists and time covered that call's tasks alone: results.md uses the merged
        # tasks (and their time_s: a part absorbed twice after a kill must not count twice)
        keep = {k: v for k, v in new.items() if k not in ("avg8", "avg9", "missing", "not_run", "time_s")}
        save_json({**keep, "tasks": tasks, "glue_dir": stamp.get("glue_dir"),
                   "recipe": stamp.get("recipe", "paper")}, report)
    shutil.rmtree(part, ignore_errors=True)  # absorbed, or unusable (no stamp: killed before eval.py began)


def analyse(args, scale, runs):
    """eval.py --analysis on every finished run, all in one call (its plots compare them). analysis.json is
    stamped with each run's export_id once the call has succeeded."""
    out, path = os.path.join(args.out_dir, "analysis"), os.path.join(args.out_dir, "analysis", "analysis.json")
    exports = {}
    for name in runs:
        if args.dry_run or run_finished(os.path.join(args.out_dir, name), steps_of(args, name)):
            exports[name] = export_id(os.path.join(args.out_dir, name))
        elif os.path.isdir(os.path.join(args.out_dir, name)):
            print(f"[{name}] has not finished its {steps_of(args, name)} steps: not analysed yet")
    if not exports:
        return
    done = read_json(path) or {}
    stamped = done.get("exports") if isinstance(done.get("exports"), dict) else {}
    # STS-B was skipped (no --glue_dir, or no STS-B in it) and is there now: its sentence similarity is due
    stsb = os.path.join(args.glue_dir, "STS-B", "dev.tsv") if args.glue_dir else None
    stsb = stsb if stsb and os.path.isfile(stsb) else None
    stsb_new = not done.get("stsb") and stsb and done.get("stsb_tsv") != stsb
    if all(made is not None and stamped.get(name) == made for name, made in exports.items()) and not stsb_new:
        print(f"analysis done already ({out})")
        return
    cmd = [args.python, "eval.py", "--analysis", "--model", *[os.path.join(args.out_dir, r) for r in exports],
           "--out", out, *scale["analysis"]]
    if args.glue_dir:  # STS-B dev pairs for COCO-LM's sentence-similarity analysis
        cmd += ["--glue_dir", args.glue_dir]
    run_cmd(cmd, os.path.join(args.out_dir, "analysis.out"), args.dry_run, scale["env"])
    if read_json(path) and not args.dry_run:
        save_json({**read_json(path), "exports": exports, "stsb_tsv": stsb}, path)


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


def glue_summary(run_dir, recipe, asked, step):
    """One recipe's GLUE of a run for results.md: per task (of those asked) the primary metric per seed, its mean
    and spread, and the average per seed; a task scored on another export than `step` is stale."""
    scored = (read_json(os.path.join(run_dir, glue_files(recipe)[0])) or {}).get("tasks")
    scored, tasks = scored if isinstance(scored, dict) else {}, {}
    for task, t in scored.items():
        if task not in asked or not isinstance(t, dict):  # the Avg is over the tasks asked for
            continue
        if t.get("status") != "ok":
            tasks[task] = dict(status=t.get("status"), reason=t.get("reason"))
            continue
        if step is None or t.get("training_step") != step:
            tasks[task] = dict(status="stale", reason=f"scored at step {t.get('training_step')}, the export "
                                                      f"is at step {step}")
            continue
        per_seed, collapsed = {}, 0
        for label, run in (t.get("runs") if isinstance(t.get("runs"), dict) else {}).items():
            if not isinstance(run, dict):  # an edited or corrupt entry: a missing cell
                continue
            seed, scores = str(run.get("seed", label)), run.get("scores")  # {label: {seed, scores, collapsed}}
            per_seed[label if seed in per_seed else seed] = scores if isinstance(scores, dict) else {}
            collapsed += bool(run.get("collapsed"))  # fine-tuning predicted one class only
        key = PRIMARY.get(task) if all(PRIMARY.get(task) in v for v in per_seed.values()) else \
            next(iter(next(iter(per_seed.values()), {})), None)
        values = {s: v[key] if type(v.get(key)) in (int, float) else None for s, v in per_seed.items()}
        m, s = mean_std(list(values.values()))
        tasks[task] = dict(status="ok", metric=key, per_seed=values, mean=m, std=s, collapsed=collapsed,
                           all_metrics=per_seed)
    ok = [t for t in tasks.values() if t["status"] == "ok"]
    seeds = sorted({s for t in ok for s in t["per_seed"]})
    per_seed_avg = [sum(t["per_seed"][s] for t in ok) / len(ok) for s in seeds
                    if ok and all(t["per_seed"].get(s) is not None for t in ok)]
    m, s = mean_std(per_seed_avg)
    return dict(tasks=tasks, avg=m, avg_std=s, avg_per_seed=per_seed_avg,
                avg_over=[t for t in asked if tasks.get(t, {}).get("status") == "ok"],
                finetune_s=sum(t["time_s"] for t in scored.values() if isinstance(t, dict) and type(t.get("time_s")) in
                               (int, float)))


def collect(args, runs):
    """Everything results.md shows, as one JSON-ready dict."""
    recipes = getattr(args, "recipes", "paper").split(",")  # (a Namespace made by hand may lack the newer settings)
    results = dict(scale=args.scale, data=args.data, seed=args.seed, tasks=args.tasks.split(","),
                   seeds=args.seeds.split(","), recipes=recipes, glue_train_rows=getattr(args, "glue_train_rows", None),
                   runs={})
    analysis = read_json(os.path.join(args.out_dir, "analysis", "analysis.json")) or {}
    for name in runs:
        run_dir = os.path.join(args.out_dir, name)
        header, train, evals, diverged = read_log(os.path.join(run_dir, "log.jsonl"))
        if not header and not evals:
            continue
        config = header.get("config", {})
        r = dict(objective=config.get("objective"), steps=evals[-1]["step"] if evals else None,
                 tokens_per_step=config.get("tokens_per_step"), init_from=config.get("init_from") or None,
                 provenance=header.get("provenance"))
        # GLUE and the analysis count only if made from the export at hand, and wait for the run to finish
        step = r["exported_step"] = export_step(run_dir)
        r["finished"] = run_finished(run_dir, steps_of(args, name))
        r["diverged_at"] = diverged  # the step train.py stopped at on a non-finite loss, until a resume goes on
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
        # GLUE, per recipe: per task the primary metric per seed, mean and spread; the average per seed
        r["glue_by_recipe"] = {recipe: glue_summary(run_dir, recipe, results["tasks"], step) for recipe in recipes}
        r["glue"] = r["glue_by_recipe"][recipes[0]]
        # representation statistics from analysis.json (keys read with .get: the format may grow)
        stamped = analysis.get("exports") if isinstance(analysis.get("exports"), dict) else {}
        made_from = export_id(run_dir)
        part = lambda d, key: d.get(key) if isinstance(d.get(key), dict) else {}  # another type: missing cells
        a = part(part(analysis, "models"), name) if made_from is not None and stamped.get(name) == made_from else {}
        ctx, sent, wordsim = part(a, "contextual"), part(a, "sentence_similarity"), part(a, "wordsim353")
        sims = a.get("self_similarity_per_layer")
        r["analysis"] = dict(intra=ctx.get("intra"), inter=ctx.get("inter"), contextual=ctx.get("contextual"),
                             l1_ratio=ctx.get("l1_ratio"), l2_ratio=ctx.get("l2_ratio"),
                             cos_ratio=ctx.get("cos_ratio"), wordsim_cooc=wordsim.get("cooc_cos"),
                             isotropy=a.get("isotropy_random_pair_cos"),
                             self_similarity_last=sims[-1] if isinstance(sims, list) and sims else None,
                             wordsim353_spearman=wordsim.get("spearman"), wordsim353_pairs=wordsim.get("covered"),
                             simlex999_spearman=part(a, "simlex999").get("spearman"),
                             simlex999_pairs=part(a, "simlex999").get("covered"),
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
        try:
            replace_atomic(os.path.join(out_dir, fname), lambda tmp: fig.savefig(tmp, dpi=110),
                           tmp=os.path.join(out_dir, fname + ".tmp.png"))  # .png: savefig's format
        finally:
            plt.close(fig)
        written.append(fname)
    return written


def glue_rows(runs, label, tasks, recipe):
    """The GLUE table's rows of one recipe: mean ± std per task, then the Avg."""
    rows = []
    for name, r in runs.items():
        glue = r.get("glue_by_recipe", {recipe: r["glue"]}).get(recipe) or dict(tasks={}, avg=None, avg_over=[])
        g, over = glue["tasks"], glue["avg_over"]
        cells = [pm(g[t]["mean"], g[t]["std"]) + " c" * bool(g[t].get("collapsed"))
                 if g.get(t, {}).get("status") == "ok" else "–" for t in tasks]
        avg = pm(glue["avg"], glue.get("avg_std")) + \
            (f" ({len(over)}/{len(tasks)} tasks)" if glue["avg"] is not None and len(over) < len(tasks) else "")
        rows.append(f"| {label[name]} | {r['steps']} | " + " | ".join(cells) + f" | {avg} |")
    return rows


def claim_cell(better, base):
    """One task's (or the Avg's) difference of means, better minus base, ×100 as the tables, marked by whether
    the seeds separate the runs: ">" every seed of `better` above every seed of `base`, "<" every one below,
    "~" the ranges overlap (within seed noise). Fine-tuning seeds are not paired across runs: ranges, not
    paired differences."""
    if not better or not base:
        return "–"
    diff = sum(better) / len(better) - sum(base) / len(base)
    mark = ">" if min(better) > max(base) else "<" if max(better) < min(base) else "~"
    return f"{diff:+.1f} {mark}"


def chance_note(n):
    """How often a claims cell separates two runs by chance, with n fine-tuning seeds each and no real
    difference: the 2n scores' orderings are equally likely, and 2 of the C(2n, n) splits put one run's
    seeds all above the other's."""
    if n < 2:
        return "With one seed a run, every cell reads \">\" or \"<\": none is evidence."
    return (f"With {n} seeds a run and no real difference, a cell reads \">\" or \"<\" by chance 1 time in "
            f"{math.comb(2 * n, n) // 2}.")


def claim_rows(runs, tasks, recipe):
    """The rows of the claims table for one recipe: one per claimed pair whose runs are both in `runs`."""
    glue = {name: r.get("glue_by_recipe", {}).get(recipe) or {} for name, r in runs.items()}

    def seeds(name, task):
        if task == "Avg":  # per seed, over the same tasks in both runs, or none
            return glue[name].get("avg_per_seed") or []
        t = (glue[name].get("tasks") or {}).get(task) or {}
        return [v for v in (t.get("per_seed") or {}).values() if v is not None] if t.get("status") == "ok" else []

    def collapsed(name, task):  # some fine-tuning run predicted one class: the difference may measure that
        scored = glue[name].get("tasks") or {}
        return any((scored.get(t) or {}).get("collapsed") for t in (
            glue[name].get("avg_over") or [] if task == "Avg" else [task]))

    def cell(task):
        text = claim_cell(seeds(better, task), seeds(base, task))
        return text + " c" * (text != "–" and (collapsed(better, task) or collapsed(base, task)))
    rows = []
    for better, base, who in CLAIMS:
        if better in runs and base in runs:
            same_avg = glue[better].get("avg_over") == glue[base].get("avg_over")
            cells = [cell(t) for t in tasks]
            cells.append(cell("Avg") if same_avg else "–")
            rows.append(f"| {better} − {base} ({who}) | " + " | ".join(cells) + " |")
    return rows


def markdown(results, pngs, level=1, folder=""):
    """results.md from collect()'s results; level 2 and more nest its headings in a larger document, whose
    links to the plots then go through `folder`."""
    runs = results["runs"]
    tasks = results["tasks"]
    recipes = results.get("recipes") or ["paper"]
    h = lambda depth: "#" * (level + depth - 1) + " "
    label = {name: name + (f" (diverged at step {r['diverged_at']})" if r.get("diverged_at") is not None else
                           " (unfinished)" * (not r.get("finished", True))) for name, r in runs.items()}
    metrics = ", ".join(f"{GLUE_DIRS[t]} {METRIC_NAMES[PRIMARY[t]]}" for t in tasks)
    capped = f", train sets capped at {results['glue_train_rows']:,} rows" if results.get("glue_train_rows") else ""
    shows = SCALES.get(results["scale"], {}).get("shows")
    lines = [f"{h(1)}Results: scale {results['scale']}", "", *([shows, ""] if shows else []),
             f"Data `{results['data'] or 'train.py default'}`, pretraining seed {results['seed']}; GLUE dev sets, "
             f"fine-tuning seeds {', '.join(results['seeds'])}{capped}: mean ± standard deviation over seeds "
             f"(×100; {metrics}). Avg = the mean over these tasks, per seed, then mean ± std; \"(k/n tasks)\": "
             f"over the k tasks scored only. \"c\": some fine-tuning runs predicted one class only "
             f"(eval.py's \"collapsed\"; results.json counts them).", "",
             *(["\"(unfinished)\": the run has not reached its steps (the same command goes on); its GLUE and "
                "analysis wait for it.", ""] if any("(unfinished)" in v for v in label.values()) else []),
             *(["\"(diverged at step N)\": train.py stopped it on a non-finite loss (its log.jsonl's last line says "
                "why; its numbers are those before): retry it with a lower --lr, as that line says.", ""]
               if any("(diverged" in v for v in label.values()) else [])]
    for recipe in recipes:
        title = "GLUE" if recipes == ["paper"] else f"GLUE, recipe `{recipe}` ({RECIPES.get(recipe, '')})"
        lines += [f"{h(2)}{title}", "", *table_head("run", "steps", *tasks, "Avg"),
                  *glue_rows(runs, label, tasks, recipe), ""]
        claims = claim_rows(runs, tasks, recipe)
        if claims:
            lines += ["The papers' claims with this recipe: difference of means (×100), \">\": every seed of the "
                      "first run above every seed of the second, \"<\": every one below, \"~\": the seeds' ranges "
                      "overlap (within seed noise). " + chance_note(len(results["seeds"])) + " \"c\": a run of the "
                      "pair has collapsed fine-tuning runs on the task (for the Avg, on one of its tasks), so the "
                      "difference may measure the collapse, not the pretraining. Each objective is one pretraining run "
                      f"(seed {results['seed']}): the seeds vary the fine-tuning only.", "",
                      *table_head("claim", *tasks, "Avg"), *claims, ""]
    lines += [f"{h(2)}Pretraining: held-out numbers at the last step, and cost", "",
              "MLM loss: the main model's (MLM, TACO, TaCL); ELECTRA and COCO-LM train no MLM head on the main "
              "model, so theirs is the generator's, not comparable. \"Own metric\" is the objective's own "
              "held-out number at step 0 → the last step (ELECTRA's disc and COCO-LM's copy loss must end below "
              "the trivial BCE of predicting the replaced rate, shown in brackets, and their AUC of replaced over "
              "original tokens must exceed chance, 0.5; TaCL accuracy must rise; "
              "TACO's tc_loss must fall). Contextual score: train.py's, with a packed validation block as the "
              "context, on another scale than the representations table's per-sentence one (fidelity note 38). "
              "Seconds: the training loop's "
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
        lines.append(f"| {label[name]} | {r['steps']} | {fmt(f.get('val_mlm_loss'))} | {fmt(f.get('val_gen_loss'))} | "
                     f"{own_cell} | {fmt(f.get('contextual_score'))} | {fmt(r['tokens_per_s'], 0)} | "
                     f"{fmt(r['step_time_vs_mlm'], 2)} | {fmt(r['train_wall_s'], 0)} | {fmt(proc.get('pretrain'), 0)} "
                     f"| {fmt(proc.get('glue'), 0)} |")
    lines += ["", f"{h(2)}Representations (eval.py --analysis, held-out sentences)", "",
              *table_head("run", "intra", "inter", "contextual", "L1 intra/inter (<1: contextual)", "L2 intra/inter",
                          "cosine intra/inter (>1: contextual)", "isotropy", "self-sim (last layer)",
                          "WordSim353 20 pairs cos (A.3)", "WordSim353 ρ (pairs)", "SimLex-999 ρ (pairs)",
                          "[CLS] gap", "mean-pool gap")]
    for name, r in runs.items():
        a = r["analysis"]
        # a ρ over the pairs whose words are single tokens of this vocabulary: how many, beside it
        rho = lambda k: fmt(a[k + "_spearman"]) + (f" ({a[k + '_pairs']})" if isinstance(a.get(k + "_pairs"), int)
                                                    and a[k + "_spearman"] is not None else "")
        lines.append(f"| {label[name]} | " + " | ".join([fmt(a[k]) for k in (
            "intra", "inter", "contextual", "l1_ratio", "l2_ratio", "cos_ratio", "isotropy", "self_similarity_last",
            "wordsim_cooc")] + [rho("wordsim353"), rho("simlex999"), fmt(a["cls_gap"]), fmt(a["mean_gap"])]) + " |")
    lines += ["", "Plots: " + ", ".join(f"[`{p}`]({folder}{p})" for p in pngs) +
              f"; the analysis plots are in [`{folder}analysis/`]({folder}analysis/).", ""]
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
    write_atomic(os.path.join(args.out_dir, "results.md"), text)
    print(text)
    print(f"wrote {os.path.join(args.out_dir, 'results.md')}, results.json and {len(pngs)} plots")


# ---------------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):  # no abbreviations: a mistyped flag is an error, not another flag
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):  # one line and exit 2, as config.Parser (not imported: reproduce.py never loads torch)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_recipes(text):
    """(the comma list of GLUE recipes, deduplicated, or None; the error line or None): "" is an error."""
    recipes = ",".join(dict.fromkeys(r.strip() for r in text.split(",") if r.strip()))
    unknown = [r for r in recipes.split(",") if r not in RECIPES]
    if unknown or not recipes:
        return None, f"--recipes: unknown GLUE recipe {(unknown or [''])[0]!r} (choose from {', '.join(RECIPES)})"
    return recipes, None


PATH = os.path.expanduser  # ~ is home in every path flag, as in train.py (bash leaves `--out_dir=~/x` alone)


def parse(argv):
    """The flags, checked (one error line and exit 2 for anything wrong) and resolved into args."""
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", default="toy", choices=list(SCALES),
                   help="toy: CPU, a minute; cpu: CPU, about 2 hours; mini: one GPU, ~25 min")
    p.add_argument("--objectives", default="mlm,taco,cocolm,electra,tacl",
                   help="comma list from mlm,taco,cocolm,electra,tacl; tacl adds mlm (its start) and mlm_cont")
    p.add_argument("--data", default="", type=PATH, help="pretraining text for train.py --data (default: train.py's)")
    p.add_argument("--glue_dir", default="", type=PATH, help="the GLUE TSVs for eval.py --glue_dir (default: the hub)")
    p.add_argument("--out_dir", default="out/reproduce", type=PATH)
    p.add_argument("--cache_dir", default="", type=PATH, help="tokenizer/token cache shared by the runs (default "
                   "out_dir/cache)")
    p.add_argument("--steps", type=int, help="pretraining steps (default: the scale's)")
    p.add_argument("--extra_steps", type=int, help="TaCL / MLM-control continuation steps (default: the scale's)")
    p.add_argument("--tasks", help="GLUE tasks (default: the scale's)")
    p.add_argument("--seeds", help="GLUE fine-tuning seeds (default: the scale's)")
    p.add_argument("--seed", type=int, default=1337, help="pretraining seed, the same for every run")
    p.add_argument("--recipes", help=f"GLUE fine-tuning recipes, eval.py --recipe, comma list from "
                   f"{','.join(RECIPES)} (default: the scale's)")
    p.add_argument("--glue_train_rows", type=int, help="GLUE train rows kept per task, eval.py --max_train_samples "
                   "(default: the scale's)")
    p.add_argument("--tokenizer", default="", type=PATH, help="train.py --tokenizer for the runs from scratch "
                   "(default: one trained on --data, cached in --cache_dir)")
    p.add_argument("--only", default="", help=f"comma list of stages ({','.join(STAGES)}), runs "
                   f"({','.join(SCRATCH + list(CONTINUED))}) and/or recipes ({','.join(RECIPES)}); default "
                   f"everything. Runs narrow pretraining, continuation and GLUE, recipes GLUE; the analysis and the "
                   f"report cover every finished run")
    p.add_argument("--glue_jobs", type=int, default=1, help="eval.py processes at once in the GLUE stage, one per "
                   "run and recipe (a small model's fine-tuning leaves a GPU mostly idle)")
    p.add_argument("--nproc_per_node", type=int, default=1, help="processes per pretraining run, through torchrun "
                   "(one per GPU of this node); the tokens per step stay the scale's")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing, write nothing")
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.p, scale = p, SCALES[args.scale]
    if "RANK" in os.environ:
        p.error("reproduce.py starts its own processes: run it with python, not torchrun, and pass "
                "--nproc_per_node N to pretrain on N GPUs")
    for flag in ("steps", "extra_steps", "nproc_per_node", "glue_train_rows", "glue_jobs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: must be >= 1")
    args.steps = args.steps or scale["steps"]
    args.extra_steps = args.extra_steps or scale["extra_steps"]
    args.glue_train_rows = args.glue_train_rows or scale["glue_train_rows"]
    args.recipes, problem = parse_recipes(scale["recipes"] if args.recipes is None else args.recipes)
    if problem:
        p.error(problem)
    # eval.py's spelling ("STS-B" -> "stsb"), checked here: a bad name must not cost the pretraining first
    tasks = scale["tasks"] if args.tasks is None else args.tasks  # "" (an unset variable) is an error, not the default
    args.tasks = ",".join(dict.fromkeys(t.strip().lower().replace("-", "") for t in tasks.split(",") if t.strip()))
    unknown = [t for t in args.tasks.split(",") if t not in PRIMARY]
    if unknown or not args.tasks:
        p.error(f"--tasks: unknown GLUE task {(unknown or [''])[0]!r} (choose from {', '.join(PRIMARY)})")
    seeds = [x.strip() for x in (scale["seeds"] if args.seeds is None else args.seeds).split(",")]
    if (not all(x.isascii() and x.isdigit() and int(x) < 2 ** 31 for x in seeds)
            or len({int(x) for x in seeds}) != len(seeds)):  # eval.py's range, checked before any pretraining
        p.error(f"--seeds {args.seeds}: expected distinct comma-separated integers in [0, 2**31), e.g. 1,2")
    args.seeds = ",".join(str(int(x)) for x in seeds)  # as eval.py writes them: "1, 02" is "1,2"
    if args.glue_dir and not os.path.isdir(args.glue_dir):
        p.error(f"--glue_dir {args.glue_dir}: not a directory")
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    report_only = [o for o in only if o in STAGES] == ["report"]  # its settings are reproduce.json's (check_settings)
    if not args.out_dir.strip() or os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        p.error(f"--out_dir {args.out_dir!r}: must name a directory")
    args.cache_dir = args.cache_dir or os.path.join(args.out_dir, "cache")
    if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        p.error(f"--cache_dir {args.cache_dir}: a file, not a directory")
    for name in ("out_dir", "cache_dir") if args.data and os.path.isdir(args.data) else ():
        rel = os.path.relpath(os.path.realpath(getattr(args, name)), os.path.realpath(args.data))
        if rel.split(os.sep)[0] != "..":  # train.py refuses it too (config.reads_into), but only at the first run
            p.error(f"--{name} {getattr(args, name)}: inside --data {args.data}, whose files would be read as corpus")
    problem = data_problem(args.data) if args.data and not report_only else None  # walks a folder: once
    if problem:
        p.error(f"--data: {problem}")  # it names the path
    if not 0 <= args.seed < 2 ** 64:  # train.py's --seed range, asked before any run starts
        p.error(f"--seed {args.seed}: must be an integer in [0, 2**64)")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        p.error(f"--tokenizer {args.tokenizer}: no such file or directory")
    for name in ("data", "glue_dir", "out_dir", "cache_dir", "tokenizer"):  # subprocesses run in this file's folder
        value = getattr(args, name)
        if value and (os.path.exists(value) or name in ("out_dir", "cache_dir")):
            setattr(args, name, os.path.abspath(value))
    if any(c in args.data for c in "*?[") and not os.path.isabs(args.data):  # a local glob
        args.data = os.path.join(glob.escape(os.getcwd()), args.data)  # (config.data_path's rule)
    if args.data and os.path.exists(args.data) and os.path.exists(corpus.SAMPLE_CORPUS) and os.path.samefile(
            args.data, corpus.SAMPLE_CORPUS):
        args.data = ""  # train.py's default named: the same settings as leaving --data out

    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = [o for o in objectives if o not in SCRATCH + ["tacl"]] or ([] if objectives else [args.objectives])
    if unknown:
        p.error(f"unknown objective {unknown[0]!r} (choose from {', '.join(SCRATCH + ['tacl'])})")
    args.runs = [o for o in SCRATCH if o in objectives or (o == "mlm" and "tacl" in objectives)]
    if "tacl" in objectives:
        args.runs += list(CONTINUED)
    bad = [o for o in only if o not in STAGES + SCRATCH + list(CONTINUED) + list(RECIPES)]
    if bad:
        p.error(f"--only: unknown stage, run or recipe {bad[0]!r}")
    outside = [o for o in only if o in SCRATCH + list(CONTINUED) and o not in args.runs]
    if outside:
        p.error(f"--only {outside[0]}: not one of the runs of --objectives {args.objectives} ({', '.join(args.runs)})")
    outside = [o for o in only if o in RECIPES and o not in args.recipes.split(",")]
    if outside:
        p.error(f"--only {outside[0]}: not one of --recipes {args.recipes}")
    args.stages = [s for s in only if s in STAGES] or STAGES
    args.selected = [r for r in args.runs if r in only] or args.runs
    args.glue_recipes = [r for r in args.recipes.split(",") if r in only] or args.recipes.split(",")
    # --only pretrain,tacl (tacl is continued, not pretrained), or --only continue without tacl, ran nothing, exit 0
    if all(s in ("pretrain", "continue") and all((r in SCRATCH) != (s == "pretrain") for r in args.selected)
           for s in args.stages):
        p.error(f"--only {args.only}: nothing to do ({', '.join(args.stages)} of {', '.join(args.selected)}): "
                f"pretrain makes {', '.join(SCRATCH)}, continue makes {', '.join(CONTINUED)} (--objectives tacl)")
    return args


def nproc_problem(args):
    """Why train.py would refuse the scale's batch split over --nproc_per_node processes (config.micro_batching:
    whole micro-batches per process, whole negative pools), asked of train.py's own code before any
    pretraining; None when every run of this call fits."""
    check = ("import json, sys, config\n"
             "for objective in sys.argv[3:]:\n"
             "    cfg = config.parse_args(['--objective', objective, *json.loads(sys.argv[1])])[0]\n"
             "    try:\n"
             "        config.micro_batching(cfg, int(sys.argv[2]))\n"
             "    except ValueError as e:\n"
             "        sys.exit(f'{objective}: {e}')\n")
    objectives = sorted({CONTINUED.get(r, r) for r in args.selected})
    done = subprocess.run([sys.executable, "-c", check, json.dumps(SCALES[args.scale]["train"]),
                           str(args.nproc_per_node), *objectives], cwd=HERE, capture_output=True, text=True,
                          encoding="utf-8", errors="replace")
    return done.stderr.strip().splitlines()[-1] if done.returncode else None


def check_glue_source(args):
    """GLUE's data, looked for before any pretraining: the hub must answer, or --glue_dir hold some task."""
    tasks = args.tasks.split(",")
    if "glue" not in args.stages or not any(glue_todo(os.path.join(args.out_dir, r), tasks, args.seeds.split(","),
                                                      recipe) for r in args.selected for recipe in args.glue_recipes):
        return
    if args.glue_dir:
        absent = {t: glue_absent(args.glue_dir, t) for t in tasks}
        if all(absent.values()):
            args.p.error(f"--glue_dir {args.glue_dir} holds none of the tasks {args.tasks} (no "
                         f"{absent[tasks[0]][0]}): pass the folder holding CoLA/, SST-2/, ... (eval.py --glue_dir)")
        for t in (t for t in tasks if absent[t]):
            print(f"note: --glue_dir has no {absent[t][0]}: {t} is skipped, and each GLUE Avg is over fewer tasks")
        return
    offline = any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if not offline and not args.dry_run and not hub_reachable():
        args.p.error("huggingface.co is unreachable and no --glue_dir was given: GLUE would fail after the pretraining "
                     "(pass --glue_dir DIR, or set HF_HUB_OFFLINE=1 to read the hub cache)")


def check_settings(args):
    """Every call on an out_dir must mean the same runs: a skipped stage must not pass off another setting's
    output. Settings may change while no run has saved anything (a mistyped --data, say)."""
    settings = dict(scale=args.scale, data=args.data, seed=args.seed, steps=args.steps,
                    extra_steps=args.extra_steps, tasks=args.tasks, seeds=args.seeds, recipes=args.recipes,
                    glue_train_rows=args.glue_train_rows, tokenizer=args.tokenizer)
    path = os.path.join(args.out_dir, "reproduce.json")
    before = read_json(path)
    if before is not None:  # written before these settings existed: what the runs were made with then
        old_rows = {"toy": 64, "cpu": 3000, "mini": 3000}.get(before.get("scale"))
        before = {"recipes": "paper", "glue_train_rows": old_rows, "tokenizer": "", **before}
    if before is None and os.path.exists(path):  # not a guard to drop: refuse, as for other settings
        args.p.error(f"{path} is unreadable or not a JSON object, so the settings of the runs in --out_dir "
                     f"{args.out_dir} are unknown: restore it, or use another --out_dir")
    if before == settings:
        return
    if before is not None and args.stages == ["report"]:  # the report is of the runs there, made with these
        changed = {k: before.get(k) for k in settings if before.get(k) != settings[k]}
        if changed:  # e.g. run files copied off a remote machine, where --data was a path that is not here
            print(f"note: the report uses {args.out_dir}'s settings: "
                  + ", ".join(f"{k} {v!r}" for k, v in changed.items()))
        for k, v in changed.items():
            setattr(args, k, v)
        return
    if before is not None:
        changed = ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in settings.items() if before.get(k) != v)
        # each recipe's GLUE has its own file, stamped with it: another --recipes passes nothing off
        only_recipes = all(before.get(k) == v for k, v in settings.items() if k != "recipes")
        if not only_recipes and any(os.path.exists(os.path.join(args.out_dir, r, f)) for r in SCRATCH + list(CONTINUED)
                                    for f in ("ckpt.pt", "config.json")):
            args.p.error(f"--out_dir {args.out_dir} holds a reproduction made with other settings ({changed}): use "
                         f"another --out_dir, or the same flags")
        print(f"note: new GLUE recipes ({changed})" if only_recipes else
              f"note: no run in {args.out_dir} has saved a checkpoint yet: new settings ({changed})")
    if not args.dry_run:
        save_json(settings, path)


def main(argv=None):
    try:
        reproduce(parse(argv))
    except KeyboardInterrupt:  # between subprocesses (run_cmd passes it to one while it runs): every write is atomic
        print("reproduce.py: interrupted; rerun the same command to go on", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # a write the disk refused (a full disk): the file it names keeps its last whole version
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def reproduce(args):
    if args.nproc_per_node > 1 and {"pretrain", "continue"} & set(args.stages):
        problem = nproc_problem(args)
        if problem:
            args.p.error(f"--nproc_per_node {args.nproc_per_node}: {problem}")
    check_glue_source(args)
    if not args.dry_run:
        try:
            os.makedirs(args.out_dir, exist_ok=True)
            lock = try_lock(os.path.join(args.out_dir, ".reproduce.lock"))  # held to the end
        except OSError as e:  # read-only, or .reproduce.lock is not a file
            args.p.error(f"--out_dir {args.out_dir}: cannot be written ({e.strerror}: {e.filename})")
        if lock is None:
            sys.exit(f"error: --out_dir {args.out_dir} is in use by another reproduce.py")
    check_settings(args)
    t0, stages, scale = time.time(), args.stages, SCALES[args.scale]
    for name in args.selected:
        if "pretrain" in stages and name in SCRATCH:
            pretrain(args, scale, name, name, args.steps, [])
    for name in args.selected:
        if "continue" in stages and name in CONTINUED:
            continue_run(args, scale, name)
    if "glue" in stages:
        glue(args, scale)
    # the analysis and the report are of the whole out_dir: runs of an earlier call's --objectives too
    present = [r for r in SCRATCH + list(CONTINUED) if r in args.runs or os.path.isdir(os.path.join(args.out_dir, r))]
    if "analysis" in stages:
        analyse(args, scale, present)
    if "report" in stages and not args.dry_run:
        report(args, present)
    print(f"reproduce.py: {time.time() - t0:.0f}s")


if __name__ == "__main__":
    # a `| head` that exits, an ascii console (results.md's "±", a path's "é" as \xe9): no print stops the runs
    sys.stdout, sys.stderr = Console(sys.stdout), Console(sys.stderr)
    main()
