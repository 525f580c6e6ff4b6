"""reproduce.py: the toy scale end to end (pretrain, continue, GLUE, analysis, report) on a tiny
synthetic corpus and tiny synthetic GLUE TSVs; stages are skipped when done; log parsing."""
import glob
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import reproduce
from model import Bert, BertConfig

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ("the a one some every cat dog bird fish child teacher river city house road garden song book "
         "runs sees finds likes makes takes walks sings reads builds near under over with from into "
         "red small old green quiet bright happy slow and but then because while").split()


def write_corpus(path, rng, lines=1500):
    with open(path, "w") as f:
        for _ in range(lines):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".\n")


def write_glue(root, rng, rows=40):
    sentence = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))
    os.makedirs(os.path.join(root, "CoLA"))
    os.makedirs(os.path.join(root, "STS-B"))
    for split in ("train", "dev"):
        with open(os.path.join(root, "CoLA", f"{split}.tsv"), "w") as f:  # no header, 4 columns
            for _ in range(rows):
                f.write(f"src\t{rng.randint(0, 1)}\t\t{sentence()}\n")
        with open(os.path.join(root, "STS-B", f"{split}.tsv"), "w") as f:
            f.write("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n")
            for i in range(rows):
                f.write(f"{i}\tg\tf\t2012\t{i}\ts\ts\t{sentence()}\t{sentence()}\t{rng.uniform(0, 5):.2f}\n")


SETTINGS = dict(scale="toy", data="", seed=1337, steps=20, extra_steps=10, tasks="cola,stsb", seeds="1,2")


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
def test_toy_end_to_end(tmp_path):
    rng = random.Random(0)
    write_corpus(tmp_path / "corpus.txt", rng)
    write_glue(tmp_path / "glue", rng)
    out = tmp_path / "repro"
    cmd = [sys.executable, "reproduce.py", "--scale", "toy", "--objectives", "mlm,electra,tacl",
           "--data", str(tmp_path / "corpus.txt"), "--glue_dir", str(tmp_path / "glue"), "--out_dir", str(out)]
    proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    text = (out / "results.md").read_text()
    tables = [[]]
    for line in text.splitlines():
        tables[-1].append(line) if line.startswith("|") else tables.append([])
    tables = [t for t in tables if t]
    assert len(tables) == 4  # GLUE, the claims (tacl against mlm_cont: cocolm is not run), pretraining, representations
    assert [row.split(" | ")[0] for row in tables[1][2:]] == ["| tacl − mlm_cont (TaCL, Su et al. 2022: against MLM "
                                                               "continued for the same steps)"]
    for t in tables:  # header, delimiter and rows with one column count, or markdown does not render the table
        assert t[1].startswith("|---") and len({row.count("|") for row in t}) == 1, t[:2]
    runs = ["mlm", "electra", "tacl", "mlm_cont"]
    glue_rows = [line for line in text.splitlines() if line.startswith("| ") and line.split(" | ")[0][2:] in runs]
    assert sorted({row.split(" | ")[0][2:] for row in glue_rows}) == sorted(runs)
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == set(runs)
    for name in runs:
        r = results["runs"][name]
        assert r["steps"] == (20 if name in ("mlm", "electra") else 10), name
        glue = r["glue"]
        assert set(glue["tasks"]) == {"cola", "stsb"} and finite(glue["avg"]) and finite(glue["avg_std"]), name
        assert all(len(t["per_seed"]) == 2 and all(finite(v) for v in t["per_seed"].values())
                   for t in glue["tasks"].values()), name
        assert finite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and finite(r["train_wall_s"]), name
        assert finite(r["final"]["val_gen_loss" if name == "electra" else "val_mlm_loss"]), name
        assert finite(r["own_metric"]["first"]) and finite(r["own_metric"]["last"]), name
        if name == "electra":  # a detector is also judged by its AUC, in results.json and the table
            assert 0 <= r["own_metric"]["auc"] <= 1
            assert f"AUC {r['own_metric']['auc']:.3f}" in next(row for row in text.splitlines() if "disc_loss" in row)
        assert finite(r["analysis"]["contextual"]), name
        assert len(r["curves"]) >= 2
    # the continuations start from the mlm run, on the same recipe
    assert results["runs"]["tacl"]["init_from"] == results["runs"]["mlm_cont"]["init_from"] == str(out / "mlm")
    assert (out / "results_curves_steps.png").stat().st_size > 0 and (out / "analysis" / "analysis.json").exists()

    # a second call finds every stage done: nothing retrains, and the report is the same
    again = subprocess.run(cmd + ["--only", "pretrain,continue,glue,analysis"], cwd=HERE, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "train.py" not in again.stdout and "eval.py" not in again.stdout
    assert again.stdout.count("already") == 4 + 4 + 1

    # the report needs only the JSON files and logs: copied off a remote machine (where the runs and the --data
    # path are not), they give the same report, with the settings the runs were made with
    copy = tmp_path / "copy"
    for path in out.rglob("*"):
        if (path.suffix == ".json" or path.name == "log.jsonl") and "cache" not in path.parts \
                and not path.name.startswith(("tokenizer", "special_tokens")):
            (copy / path.relative_to(out)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, copy / path.relative_to(out))
    out.rename(tmp_path / "moved")
    (tmp_path / "corpus.txt").rename(tmp_path / "moved.txt")
    report = subprocess.run(cmd[:-1] + [str(copy), "--only", "report"], cwd=HERE, capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "the report uses" not in report.stdout and (copy / "results.md").read_text() == text
    report = subprocess.run([sys.executable, "reproduce.py", "--out_dir", str(copy), "--only", "report"], cwd=HERE,
                            capture_output=True, text=True, timeout=120)  # the default scale and objectives
    assert report.returncode == 0, report.stderr[-2000:]
    assert "the report uses" in report.stdout and (copy / "results.md").read_text() == text


def test_read_log_resumed_run(tmp_path):
    """A resumed run repeats the steps after its checkpoint and goes on from the checkpoint's
    elapsed_s: the last record of a step wins and the wall-clock is the last elapsed_s."""
    path = tmp_path / "log.jsonl"
    records = [{"config": {"objective": "mlm"}, "provenance": {"commit": "abc"}},
               {"step": 0, "val_mlm_loss": 9.0},
               {"step": 10, "loss": 8.0, "elapsed_s": 5.0, "tokens_per_s": 100.0},
               {"step": 20, "loss": 7.0, "elapsed_s": 10.0, "tokens_per_s": 100.0},
               {"step": 20, "loss": 7.1, "elapsed_s": 9.0, "tokens_per_s": 120.0},  # resumed from step 10 (5 s)
               {"step": 30, "loss": 6.0, "elapsed_s": 13.0, "tokens_per_s": 120.0},
               {"step": 30, "val_mlm_loss": 6.5}]
    edited = f'{{"step": 30, "val_mlm_acc": 1{"0" * 400}}}'  # an edited log: an int no float holds is a missing cell
    path.write_text("\n".join(json.dumps(r) for r in records) + f"\n{edited}" + '\n{"step": 40, "lo')  # a kill's
    header, train, evals, diverged = reproduce.read_log(str(path))
    assert header["provenance"] == {"commit": "abc"} and diverged is None
    assert [t["step"] for t in train] == [10, 20, 30] and train[1]["loss"] == 7.1
    assert [e["step"] for e in evals] == [0, 30] and evals[1] == {"step": 30}
    assert reproduce.wall_clock(train) == 13.0  # the 5 s from the checkpoint to the kill are not counted
    assert reproduce.mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))


def test_bad_only_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "reproduce.py", "--only", "pretrian", "--out_dir", str(tmp_path)],
                          cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown stage, run or recipe 'pretrian'" in proc.stderr


def reproduce_error(argv, tmp_path):
    proc = subprocess.run([sys.executable, "reproduce.py", *argv], cwd=HERE, capture_output=True, text=True,
                          timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    return lines[0]


def test_bad_input_is_refused_before_any_work(tmp_path):
    out = tmp_path / "repro"
    for argv, needle in ((["--tasks", "cola,bogus"], "unknown GLUE task 'bogus'"), (["--seeds", "1,x"], "--seeds"),
                         (["--steps", "0"], "--steps 0"), (["--glue_dir", str(tmp_path / "nowhere")], "--glue_dir"),
                         (["--objectives", "taco", "--only", "mlm"], "not one of the runs"),
                         (["--seeds", "1,\u00b2"], "--seeds"), (["--objectives", ","], "unknown objective"),
                         (["--seeds", "1," + "9" * 23], "[0, 2**31)"),  # else found only after all the pretraining
                         (["--data", str(tmp_path)], "inside --data"),  # out_dir tmp_path/repro: read as corpus
                         (["--nproc_per_node", "0"], "--nproc_per_node 0"), (["--seed", "-1"], "--seed -1"),
                         (["--cache_dir", __file__], "a file, not a directory"),
                         # an empty value (a script's unset variable) was the scale's default, silently
                         (["--tasks", ""], "unknown GLUE task ''"), (["--seeds", ""], "--seeds"),
                         (["--recipes", ""], "unknown GLUE recipe ''"),
                         # stages of no selected run: exit 0 having done nothing (found by a fuzz of the flags)
                         (["--only", "pretrain,tacl"], "nothing to do"),
                         (["--objectives", "mlm", "--only", "continue"], "nothing to do")):
        assert needle in reproduce_error([*argv, "--out_dir", str(out)], tmp_path)
    assert not (out / "mlm").exists()
    (tmp_path / "file").write_text("x")
    assert "must name a directory" in reproduce_error(["--out_dir", str(tmp_path / "file")], tmp_path)
    (tmp_path / "locked" / ".reproduce.lock").mkdir(parents=True)  # not a file: no lock can be taken
    line = reproduce_error(["--out_dir", str(tmp_path / "locked"), "--only", "pretrain"], tmp_path)
    assert "cannot be written (Is a directory" in line
    # an out_dir made with other settings is refused: its outputs would pass for this one's
    make_run(out, "mlm", 20)
    (out / "reproduce.json").write_text(json.dumps(SETTINGS))
    line = reproduce_error(["--out_dir", str(out), "--tasks", "CoLA,STS-B", "--seed", "7", "--only", "pretrain",
                            "--data", "assets/wikitext2_test.raw.xz"], tmp_path)
    # task names are compared in eval.py's spelling, and train.py's default corpus named is the default
    assert "other settings (seed 1337 -> 7)" in line
    # ...but a report alone is of the runs there, with their settings, and says so
    proc = subprocess.run([sys.executable, "reproduce.py", "--out_dir", str(out), "--seed", "7", "--only", "report"],
                          cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "the report uses" in proc.stdout and "seed 1337" in proc.stdout, proc.stderr
    assert json.loads((out / "results.json").read_text())["seed"] == 1337
    assert json.loads((out / "reproduce.json").read_text()) == SETTINGS
    # and so is one whose settings file is damaged: they are unknown, not new
    for damaged in ('{"steps":', "[1, 2]"):
        (out / "reproduce.json").write_text(damaged)
        assert "unreadable or not a JSON object" in reproduce_error(["--out_dir", str(out), "--only", "report"],
                                                                    tmp_path)
        assert (out / "reproduce.json").read_text() == damaged


def test_a_rerun_waits_for_the_killed_runs_train_py_to_save(tmp_path, monkeypatch):
    # reproduce.py SIGKILLed: its train.py gets SIGTERM, saves its step and exits. A rerun at once must wait for
    # that checkpoint and resume it, not refuse ("in use") nor start over and delete it
    run_dir = tmp_path / "mlm"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""import fcntl, time
f = open({str(run_dir / ".lock")!r}, "a"); fcntl.flock(f, fcntl.LOCK_EX); print("held", flush=True)
time.sleep(2); open({str(run_dir / "ckpt.pt")!r}, "w").write("saved")"""], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    commands = []
    monkeypatch.setattr(reproduce, "run_cmd", lambda cmd, *a: commands.append(cmd))
    args = SimpleNamespace(out_dir=str(tmp_path), python=sys.executable, nproc_per_node=1, dry_run=False, seed=0,
                           cache_dir=str(tmp_path / "cache"), data=None, tokenizer=None)
    reproduce.pretrain(args, dict(train=[], env={}), "mlm", "mlm", 20, [])
    holder.wait(timeout=30)
    assert "--resume" in commands[0] and (run_dir / "ckpt.pt").read_text() == "saved"


def test_a_finished_run_without_its_checkpoint_is_kept(tmp_path):
    # train.py writes the export, then ckpt.pt: a kill during a run's last save (a continuation's first) leaves
    # a finished export without ckpt.pt, which is all that GLUE, the analysis and --init_from read
    out = tmp_path / "repro"
    (out / "mlm").mkdir(parents=True)
    (out / "reproduce.json").write_text(json.dumps(SETTINGS))
    (out / "mlm" / "log.jsonl").write_text(json.dumps({"step": 20, "val_mlm_loss": 6.0}) + "\n")
    (out / "mlm" / "config.json").write_text(json.dumps({"training_step": 20}))
    (out / "mlm" / "glue.json").write_text("{}")
    proc = subprocess.run([sys.executable, "reproduce.py", "--out_dir", str(out), "--only", "pretrain,mlm"],
                          cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "[mlm] pretrained already" in proc.stdout, proc.stderr
    assert (out / "mlm" / "glue.json").exists()
    # an unfinished export without ckpt.pt (saved before it) lost its checkpoint: refused; with no export, it
    # never saved, so it starts again
    for export in ({"training_step": 10}, None):
        (out / "mlm" / "config.json").unlink(missing_ok=True)
        if export:
            (out / "mlm" / "config.json").write_text(json.dumps(export))
        proc = subprocess.run([sys.executable, "reproduce.py", "--out_dir", str(out), "--only", "pretrain,mlm",
                               "--dry_run"], cwd=HERE, capture_output=True, text=True, timeout=60)
        if export:
            assert proc.returncode == 1 and "no ckpt.pt file to resume" in proc.stderr, proc.stderr
        else:
            assert proc.returncode == 0 and "train.py --objective mlm" in proc.stdout, proc.stderr


def test_a_run_is_finished_when_its_export_holds_the_last_step(tmp_path):
    # train.py logs the last evaluation, then saves: a kill in between leaves ckpt.pt and the export at the
    # checkpoint before, and the run must be resumed, not taken as done
    run = tmp_path / "mlm"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"step": 20, "val_mlm_loss": 6.0}) + "\n")
    (run / "ckpt.pt").write_bytes(b"step 10")
    for exported, done in ((10, False), (None, False), ("20", False), (20, True)):
        (run / "config.json").write_text(json.dumps({"training_step": exported}))
        assert reproduce.run_finished(str(run), 20) is done, exported
    (run / "ckpt.pt").unlink()
    assert reproduce.run_finished(str(run), 20)  # the export alone decides (ckpt.pt is written before it)


def test_an_ascii_console_shows_a_non_ascii_path_escaped(tmp_path):
    # the "$ python train.py ... --out_dir .../caf\u00e9/mlm" line was a UnicodeEncodeError traceback, and so was
    # results.md printed at the end of every reproduction ("\u00b1", "\u2192")
    out = tmp_path / "caf\u00e9"
    done = subprocess.run([sys.executable, "reproduce.py", "--scale", "toy", "--objectives", "mlm", "--out_dir", str(out),
                           "--only", "pretrain", "--dry_run"], cwd=HERE, capture_output=True, text=True,
                          env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=120)
    assert done.returncode == 0 and f"--out_dir {tmp_path}/caf\\xe9/mlm" in done.stdout, done.stderr


def test_a_reader_that_has_exited_stops_no_print_of_ours(tmp_path):
    # `reproduce.py | head` after head exited: our own next print stopped the reproduction (error: Broken pipe, exit 1)
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "reproduce.py", "--scale", "toy", "--out_dir", str(tmp_path / "r"),
                               "--dry_run"], cwd=HERE, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_reader_of_our_output_that_exits_neither_blocks_a_call_nor_ends_its_log(tmp_path):
    # `reproduce.py | head`: the thread teeing a call's output died on the broken pipe, so nothing read the call's
    # pipe any more: its log ended there, and a call that printed another 64 KiB blocked on it for good (a hang)
    chatty = [sys.executable, "-c", "for i in range(3000): print('x' * 100, i, flush=True)"]
    parent = f"import sys, reproduce; reproduce.run_cmd({chatty!r}, sys.argv[1], False)"
    proc = subprocess.Popen([sys.executable, "-c", parent, str(tmp_path / "call.out")], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("$ ")
        proc.stdout.close()  # the reader exits
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert len((tmp_path / "call.out").read_text().splitlines()) == 3000


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_reproduce_takes_its_child_along(tmp_path):
    # SIGKILL cannot be passed on: the kernel sends train.py SIGTERM instead, and it saves its step and exits
    # rather than training on, orphaned, holding its out_dir's lock. It logs every step into the dead parent's
    # pipe: a print must not kill it before the save
    write_corpus(tmp_path / "corpus.txt", random.Random(0))
    out = tmp_path / "run"
    train = [sys.executable, "train.py", "--data", str(tmp_path / "corpus.txt"), "--cache_dir", str(tmp_path / "cache"),
             "--out_dir", str(out), "--vocab_size", "200", "--seq_len", "32", "--batch_size", "8",
             "--tokens_per_step", "256", "--max_steps", "100000", "--log_interval", "1", "--eval_interval", "100000",
             "--ckpt_interval", "100000"]
    parent = f"import sys, reproduce; reproduce.run_cmd({train!r}, sys.argv[1], False)"
    proc = subprocess.Popen([sys.executable, "-c", parent, str(tmp_path / "train.out")], cwd=HERE,
                            stdout=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while not ((out / "log.jsonl").exists() and '"step": 3,' in (out / "log.jsonl").read_text()):
            assert proc.poll() is None and time.time() - t0 < 120
            time.sleep(0.1)
        proc.kill()
        while not (out / "ckpt.pt").exists():
            assert time.time() - t0 < 180, "the orphaned train.py did not save"
            time.sleep(0.2)
        lock = reproduce.try_lock(str(out / ".lock"))
        while lock is None:  # released once train.py has exited
            assert time.time() - t0 < 180, "the orphaned train.py did not exit"
            time.sleep(0.2)
            lock = reproduce.try_lock(str(out / ".lock"))
        lock.close()
    finally:
        proc.kill()
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] >= 3


@pytest.mark.slow
def test_sigterm_reaches_the_training_run_and_a_rerun_goes_on(tmp_path):
    write_corpus(tmp_path / "corpus.txt", random.Random(0))
    out = tmp_path / "repro"
    cmd = [sys.executable, "reproduce.py", "--scale", "toy", "--objectives", "mlm", "--only", "pretrain",
           "--steps", "300", "--data", str(tmp_path / "corpus.txt"), "--out_dir", str(out)]
    first = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log, t0 = out / "mlm" / "log.jsonl", time.time()
        while not (log.exists() and '"step": 5,' in log.read_text()):  # training has started
            assert first.poll() is None and time.time() - t0 < 300, first.communicate()
            time.sleep(0.2)
        # a second reproduction of the same out_dir would delete the live run: refused
        second = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "in use by another reproduce.py" in second.stderr, second.stderr
        first.send_signal(signal.SIGTERM)  # passed on to train.py, which saves the step it is at
        stdout, stderr = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 143 and "stopped by SIGTERM" in stderr, stdout[-2000:] + stderr
    saved = torch.load(out / "mlm" / "ckpt.pt", weights_only=True)["step"]
    assert 5 <= saved < 300
    rerun = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0 and f"resumed from step {saved}" in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr


def test_results_json_is_strict_json_when_a_log_holds_a_nan(tmp_path):
    # found playing the scripter: a log.jsonl of an earlier train.py holds a diverged held-out loss as a bare NaN;
    # results.json copied it into `final` and `curves`, and jq, JSON.parse and strict parsers refused the file
    run = tmp_path / "mlm"
    run.mkdir()
    (run / "log.jsonl").write_text('{"config": {"objective": "mlm"}}\n{"step": 5, "val_mlm_loss": 7.0}\n'
                                   '{"step": 10, "val_mlm_loss": NaN, "val_mlm_acc": 0.0, "contextual_score": Infinity}\n'
                                   '{"step": 15, "val_mlm_loss": null, "val_mlm_acc": 0.0, "non_finite": {"val_mlm_loss": "nan"}}\n')
    args = reproduce.argparse.Namespace(scale="toy", data="", seed=1, tasks="cola", seeds="1", out_dir=str(tmp_path),
                                        steps=20, extra_steps=10)
    results = reproduce.collect(args, ["mlm"])
    assert results["runs"]["mlm"]["curves"][1:] == [{"step": 10, "val_mlm_acc": 0.0}, {"step": 15, "val_mlm_acc": 0.0}]
    reproduce.save_json({**results, "extra": [float("inf"), {"x": float("-inf")}]}, str(tmp_path / "results.json"))
    saved = json.loads((tmp_path / "results.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert saved["extra"] == [None, {"x": None}] and saved["runs"]["mlm"]["final"] == {"val_mlm_acc": 0.0}


def test_a_diverged_run_is_marked_with_its_last_held_out_numbers(tmp_path):
    # train.py's divergence line ({step, diverged}) was read as a held-out record: the run's `final` was empty, its
    # steps the divergence's, and results.md called it "(unfinished)", for which "the same command goes on"
    run = tmp_path / "mlm"
    run.mkdir()
    lines = ['{"config": {"objective": "mlm"}}', '{"step": 10, "loss": 7.0, "elapsed_s": 1.0}',
             '{"step": 10, "val_mlm_loss": 7.5}', '{"step": 15, "diverged": "non-finite loss or gradient norm ..."}']
    (run / "log.jsonl").write_text("\n".join(lines) + "\n")
    args = reproduce.argparse.Namespace(scale="toy", data="", seed=1, tasks="cola", seeds="1", out_dir=str(tmp_path),
                                        steps=20, extra_steps=10)
    r = reproduce.collect(args, ["mlm"])["runs"]["mlm"]
    assert r["diverged_at"] == 15 and r["final"] == {"val_mlm_loss": 7.5} and r["steps"] == 10
    text = reproduce.markdown(reproduce.collect(args, ["mlm"]), [])
    assert "mlm (diverged at step 15)" in text and "(unfinished)" not in text and "lower --lr" in text
    (run / "log.jsonl").write_text("\n".join(lines + ['{"step": 11, "loss": 7.0}']) + "\n")  # resumed: goes on
    assert reproduce.collect(args, ["mlm"])["runs"]["mlm"]["diverged_at"] is None


def test_corrupt_outputs_are_missing_cells_not_crashes(tmp_path):
    run = tmp_path / "mlm"
    run.mkdir()
    (run / "log.jsonl").write_bytes(b'{"config": {"objective": "mlm"}}\nnull\n[1]\n\xff\xfe x\n'
                                    b'{"step": 5, "val_mlm_loss": 7.0}\n')
    (run / "glue.json").write_text('"oops"')
    (run / "reproduce_time.json").write_text("[1]")
    args = reproduce.argparse.Namespace(scale="toy", data="", seed=1, tasks="cola", seeds="1", out_dir=str(tmp_path),
                                        steps=20, extra_steps=10)
    r = reproduce.collect(args, ["mlm"])["runs"]["mlm"]
    assert r["steps"] == 5 and r["glue"]["tasks"] == {} and r["process_s"] is None
    reproduce.note_time(str(run), "glue", 2.0)
    assert json.loads((run / "reproduce_time.json").read_text()) == {"glue": 2.0}


def test_values_of_another_type_are_missing_cells_not_crashes(tmp_path):
    # valid JSON holding a value of another type (an edited or damaged file: a step as text, a start line whose
    # config is a list, a GLUE run or an analysis part that is no object, a score or a time that is text) stopped
    # the report with a TypeError or AttributeError
    run = tmp_path / "mlm"
    run.mkdir()
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"config": {"objective": "mlm"}}, {"config": [1]}, {"step": 5, "val_mlm_loss": 7.0},
        {"step": "6", "val_mlm_loss": 1.0}, {"step": None, "val_mlm_loss": 1.0}, {"step": [7], "loss": 1.0},
        {"step": 5, "loss": "x", "tokens_per_s": [1], "elapsed_s": 2.0}, {"step": 6, "val_mlm_loss": "x"}]))
    (run / "config.json").write_text(json.dumps({"training_step": 20}))
    runs = {"a": 5, "b": {"seed": 3, "scores": {"mcc": "x"}}, "c": {"seed": 4, "scores": {"mcc": 30.0}}}
    (run / "glue.json").write_text(json.dumps({"tasks": {"cola": dict(status="ok", training_step=20, runs=runs,
                                                                      time_s="x")}}))
    (run / "glue_short.json").write_text(json.dumps({"tasks": [1]}))
    (tmp_path / "analysis").mkdir()
    analysed = {"contextual": "x", "wordsim353": [1], "isotropy_random_pair_cos": 0.5}
    (tmp_path / "analysis" / "analysis.json").write_text(json.dumps({"exports": {"mlm": "-@20"}, "models": {"mlm": analysed}}))
    args = reproduce.argparse.Namespace(scale="toy", data="", seed=1, tasks="cola", seeds="3,4", out_dir=str(tmp_path),
                                        steps=20, extra_steps=10, recipes="paper,short")
    results = reproduce.collect(args, ["mlm"])
    r = results["runs"]["mlm"]
    assert r["objective"] == "mlm" and r["steps"] == 6 and r["train_wall_s"] == 2.0 and r["tokens_per_s"] is None
    assert r["final"] == {} and r["curves"] == [{"step": 5, "val_mlm_loss": 7.0}, {"step": 6}]
    cola = r["glue"]["tasks"]["cola"]
    assert cola["per_seed"] == {"3": None, "4": 30.0} and cola["mean"] == 30.0 and r["glue"]["finetune_s"] == 0
    assert r["glue_by_recipe"]["short"]["tasks"] == {}
    assert r["analysis"]["isotropy"] == 0.5 and r["analysis"]["contextual"] is None
    assert "| mlm |" in reproduce.markdown(results, [])


@pytest.mark.parametrize("scale", list(reproduce.SCALES))
@pytest.mark.parametrize("objective", ["mlm", "taco", "cocolm", "electra", "tacl"])
def test_scale_flags_are_a_valid_run(scale, objective, tmp_path):
    """Every scale's train.py flags make a valid run for every objective on one process (mini is one
    GPU): a layout error found here costs nothing, found on the GPU it costs device time."""
    import config
    import train
    extra = ["--init_from", str(tmp_path)] if objective == "tacl" else []  # validate() checks it exists
    # a fresh --out_dir: validate() refuses one that holds a run, as ./out/smoke does after the quick start
    extra += ["--out_dir", str(tmp_path / "run")]
    cfg, _ = config.parse_args(["--objective", objective, *reproduce.SCALES[scale]["train"], *extra])
    cfg.device = "cpu"  # validate() checks the device exists; the GPU scale's flags leave it at auto
    config.validate(cfg)
    batch_size, accum = train.micro_batching(cfg, 1)
    assert batch_size * cfg.seq_len * accum == cfg.tokens_per_step
    if objective in ("taco", "cocolm") and cfg.negative_pool:
        assert batch_size % cfg.negative_pool == 0


DIAGNOSTIC = os.path.join(HERE, "results", "detector", "diagnostic.py")


@pytest.mark.slow
@pytest.mark.parametrize("encoder", ["bert", "window"])
def test_detector_diagnostic_runs(tmp_path, encoder):
    # results/detector/diagnostic.py backs docs/detectors.md ("Does each objective learn?"): it must keep running
    proc = subprocess.run([sys.executable, DIAGNOSTIC, "--encoder", encoder,
                           "--steps", "2", "--batch_size", "4", "--seq_len", "32"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == [0, 2]
    assert all(0 <= r["auc"] <= 1 and 0.3 < r["trivial"] < 0.5 and -1 <= r["cos"] <= 1 for r in rows)


def load_diagnostic():
    spec = importlib.util.spec_from_file_location("diagnostic", DIAGNOSTIC)
    diagnostic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagnostic)
    return diagnostic


def test_detector_diagnostic_attention_weights_are_the_models():
    # the weights the diagnostic reads, applied to the values, give the model's own (SDPA) attention
    diagnostic = load_diagnostic()
    torch.manual_seed(0)
    model = Bert(BertConfig(vocab_size=100, dropout=0.0, num_layers=2, hidden_size=32, num_heads=4,
                            intermediate_size=64)).eval()
    h = torch.randn(2, 9, 32)
    attn = model.encoder.layers[0].attn
    a = diagnostic.attention_weights(attn, h)
    v = attn.qkv(h).split(32, 2)[2].view(2, 9, 4, 8).transpose(1, 2)
    assert torch.allclose(attn.proj((a @ v).transpose(1, 2).reshape(2, 9, 32)), attn(h), atol=1e-6)
    rows = diagnostic.neighbour_attention(model, torch.randint(5, 100, (2, 9)))
    assert len(rows) == 2 and all(0 < r["self"] < 1 and r["uniform"] == 1 / 9 for r in rows)


def test_detector_diagnostic_blocks_draw_replacements_from_the_batch():
    diagnostic = load_diagnostic()
    stream = np.arange(10, 1010, dtype=np.uint16)  # every token distinct: a replacement is visible
    y, replaced = diagnostic.blocks(stream, 64, 32, 2, torch.Generator().manual_seed(0), 0.15)
    # unreplaced positions hold start + t: each block's start is the most common y[t] - t
    starts = torch.stack([torch.mode(row - torch.arange(32)).values for row in y])
    original = starts[:, None] + torch.arange(32)
    original[:, 0] = 2
    assert torch.equal(replaced, y != original)  # "replaced" is exactly where the token changed
    assert (y[:, 0] == 2).all() and not replaced[:, 0].any()  # [CLS] first, never replaced
    assert 0.12 < replaced.float().mean() < 0.18  # about 15%, less the draws that hit the original
    pool = set(original[:, 1:].flatten().tolist())
    assert set(y[replaced].tolist()) <= pool  # every replacement is a token of the batch (no [CLS])


def test_glue_from_an_unreachable_hub_is_refused_before_pretraining(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reproduce, "hub_reachable", lambda: False)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["--out_dir", str(tmp_path / "repro")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "unreachable and no --glue_dir" in err and "\n" not in err
    assert not (tmp_path / "repro" / "mlm").exists()
    # GLUE already done for every run: nothing to fetch, no refusal (a rerun that only rebuilds the report)
    monkeypatch.setattr(reproduce, "glue_todo", lambda *a: [])
    reproduce.main(["--out_dir", str(tmp_path / "repro"), "--only", "glue,mlm"])


# Fast checks of what reproduce.py decides, on out_dirs built by hand: --python points at FAKE, which stands
# in for train.py (writes ckpt.pt and an export at --max_steps) and eval.py (GLUE: every task ok, glue.json
# after each, FAKE_GLUE_FAIL_AFTER=N fails after N tasks; --analysis: analysis.json) and logs each call.
FAKE = r'''
import json, os, sys
argv = sys.argv[1:]
flag = lambda name: argv[argv.index(name) + 1] if name in argv else None
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(argv) + "\n")
out = flag("--resume") or flag("--out_dir") or flag("--out")
os.makedirs(out, exist_ok=True)
if argv[0] == "train.py":
    step = int(flag("--max_steps"))
    open(os.path.join(out, "ckpt.pt"), "w").write("fake")
    json.dump({"training_step": step}, open(os.path.join(out, "config.json"), "w"))
    with open(os.path.join(out, "log.jsonl"), "a") as f:
        f.write(json.dumps({"config": {"objective": flag("--objective")}}) + "\n")
        f.write(json.dumps({"step": step, "val_mlm_loss": 1.0}) + "\n")
elif "--analysis" in argv:
    models = argv[argv.index("--model") + 1:argv.index("--out")]
    stsb = flag("--glue_dir") and os.path.isfile(os.path.join(flag("--glue_dir"), "STS-B", "dev.tsv"))
    json.dump({"stsb": flag("--glue_dir") if stsb else None,
               "models": {os.path.basename(m): {"contextual": {"contextual": 0.5}} for m in models}},
              open(os.path.join(out, "analysis.json"), "w"))
else:
    seeds, tasks = [int(s) for s in flag("--seeds").split(",")], {}
    for i, task in enumerate(flag("--tasks").split(",")):
        if i == int(os.environ.get("FAKE_GLUE_FAIL_AFTER", 99)):
            sys.exit(1)
        scores = dict(mcc=50.0, spearman=60.0, acc=70.0, f1=80.0, acc_m=90.0)
        tasks[task] = {"status": "ok", "runs": {str(s): {"seed": s, "scores": scores} for s in seeds}, "time_s": 1.0}
        json.dump({"seeds": seeds, "tasks": tasks, "time_s": 1.0}, open(os.path.join(out, "glue.json"), "w"))
'''


def fake_reproduce(tmp_path, *argv, **env):
    """reproduce.py on tmp_path/repro with FAKE as its python: (process, the calls FAKE got)."""
    fake, log = tmp_path / "fake_python", tmp_path / "calls.jsonl"
    if not fake.exists():
        fake.write_text(f"#!{sys.executable}\n{FAKE}")
        fake.chmod(0o755)
    if not (tmp_path / "glue").exists():
        write_glue(tmp_path / "glue", random.Random(0), rows=4)
    log.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "reproduce.py", "--python", str(fake), "--out_dir", str(tmp_path / "repro"),
                           "--glue_dir", str(tmp_path / "glue"), *argv], cwd=HERE, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "FAKE_LOG": str(log), **env})
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def repro_dir(tmp_path):
    """tmp_path/repro as reproduce.py leaves it before any run: its settings file only."""
    out = tmp_path / "repro"
    out.mkdir()
    (out / "reproduce.json").write_text(json.dumps(SETTINGS))
    return out


def make_run(out, name, step):
    """A run's files as train.py leaves them with its checkpoint and export at `step`."""
    run = out / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps({"training_step": step}))
    (run / "ckpt.pt").write_text("fake")
    (run / "log.jsonl").write_text(json.dumps({"config": {"objective": name}}) + "\n" +
                                   json.dumps({"step": step, "val_mlm_loss": 1.0}) + "\n")
    return run


def glue_json(**tasks):
    """glue.json as reproduce.py merges it, task=the training step it scored; "missing": not in --glue_dir;
    None: eval.py's own entry, without the step (an earlier reproduce.py's glue.json)."""
    runs = {str(s): {"seed": s, "scores": {"mcc": 50.0, "spearman": 60.0}} for s in (1, 2)}
    return json.dumps({"seeds": [1, 2], "tasks": {
        t: {"status": "missing", "reason": "no"} if step == "missing" else
        {"status": "ok", "runs": runs, **({} if step is None else {"training_step": step})}
        for t, step in tasks.items()}})


def called(calls, kind):
    """The calls of one kind: train, glue or analysis."""
    return [c for c in calls if kind == {"train.py": "train"}.get(c[0], "analysis" if "--analysis" in c else "glue")]


@pytest.mark.slow
def test_glue_and_analysis_wait_for_a_run_to_finish(tmp_path):
    # a run killed at step 10 of 20: GLUE and the analysis must not score it (its export moves on when it
    # resumes), and what an earlier version scored there (GLUE at step 10, an analysis.json without the
    # steps) is redone
    out = repro_dir(tmp_path)
    make_run(out, "mlm", 20)
    taco = make_run(out, "taco", 10)
    (taco / "glue.json").write_text(glue_json(cola=None, stsb=None))
    (out / "analysis").mkdir()
    (out / "analysis" / "analysis.json").write_text(json.dumps({"models": {"mlm": {}, "taco": {}}}))
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm,taco", "--only", "glue,analysis,report")
    assert proc.returncode == 0, proc.stderr
    assert [c[c.index("--model") + 1] for c in called(calls, "glue")] == [str(out / "mlm")]
    assert "[taco] has not finished its 20 steps: no GLUE yet" in proc.stdout
    assert [c[c.index("--model") + 1:c.index("--out")] for c in called(calls, "analysis")] == [[str(out / "mlm")]]
    results = json.loads((out / "results.json").read_text())
    assert results["runs"]["taco"]["glue"]["avg"] is None and results["runs"]["taco"]["finished"] is False
    assert "| taco (unfinished) |" in (out / "results.md").read_text()
    # taco resumes to 20: now it is scored, and the analysis made without it is redone with it
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm,taco")
    assert proc.returncode == 0, proc.stderr
    assert [c[:2] for c in called(calls, "train")] == [["train.py", "--resume"]]
    assert [c[c.index("--model") + 1] for c in called(calls, "glue")] == [str(taco)]
    assert json.loads((out / "analysis" / "analysis.json").read_text())["exports"] == {"mlm": "-@20", "taco": "-@20"}
    results = json.loads((out / "results.json").read_text())
    assert results["runs"]["taco"]["glue"]["tasks"]["cola"]["status"] == "ok" and "| taco |" in proc.stdout
    # an export that moves (a run trained further by hand) makes its GLUE and analysis stale
    make_run(out, "taco", 30)
    assert reproduce.glue_todo(str(taco), ["cola", "stsb"], ["1", "2"]) == ["cola", "stsb"]
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm,taco", "--only", "analysis")
    assert len(called(calls, "analysis")) == 1


def test_an_analysis_stopped_before_its_plots_is_redone(tmp_path):
    # analysis.py writes analysis.json, then its plots: only a call that exited 0 stamps the steps
    out = repro_dir(tmp_path)
    make_run(out, "mlm", 20)
    (out / "analysis").mkdir()
    (out / "analysis" / "analysis.json").write_text(json.dumps({"models": {"mlm": {}}, "stsb": "x"}))
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "analysis")
    assert proc.returncode == 0 and len(called(calls, "analysis")) == 1, proc.stdout + proc.stderr
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "analysis")
    assert not calls and "analysis done already" in proc.stdout
    # STS-B was skipped (no STS-B/dev.tsv) and is there now: redone once
    analysis = json.loads((out / "analysis" / "analysis.json").read_text())
    (out / "analysis" / "analysis.json").write_text(json.dumps({**analysis, "stsb": None, "stsb_tsv": None}))
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "analysis")
    assert len(called(calls, "analysis")) == 1


def test_continuations_start_from_the_finished_mlm_run(tmp_path):
    out = repro_dir(tmp_path)
    make_run(out, "mlm", 10)  # killed at step 10 of 20
    proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--only", "continue")
    assert proc.returncode == 1 and "has not finished its 20 steps" in proc.stderr and not calls, proc.stderr
    make_run(out, "mlm", 20)
    proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--only", "continue,tacl")
    assert proc.returncode == 0 and [c[c.index("--init_from") + 1] for c in calls] == [str(out / "mlm")]
    init = json.loads((out / "tacl" / "reproduce_init.json").read_text())
    assert init["mlm_export"] == "-@20" and len(init["run_id"]) == 12
    # a continuation begun from another mlm step (an earlier version's, from a killed mlm run) is refused,
    # whether it is still running or has finished
    for step in (5, 10):
        make_run(out, "tacl", step)
        for init in ({"mlm_export": "-@15"}, {"mlm_step": 15}):  # the latter: an earlier reproduce.py's record
            (out / "tacl" / "reproduce_init.json").write_text(json.dumps(init))
            proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--only", "continue,tacl")
            assert proc.returncode == 1 and "continued from another mlm run or step" in proc.stderr and not calls


def test_glue_needs_every_task_and_a_stopped_glue_keeps_its_tasks(tmp_path):
    out = repro_dir(tmp_path)
    run = make_run(out, "mlm", 20)
    # STS-B is missing from --glue_dir: GLUE is not done (and says so), and is finished once STS-B is there
    (run / "glue.json").write_text(glue_json(cola=20, stsb="missing"))
    write_glue(tmp_path / "glue", random.Random(0), rows=4)
    os.rename(tmp_path / "glue" / "STS-B", tmp_path / "STS-B")
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "glue")
    assert proc.returncode == 0 and not calls and "stsb not in --glue_dir" in proc.stdout, proc.stderr
    os.rename(tmp_path / "STS-B", tmp_path / "glue" / "STS-B")
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "glue")
    assert [c[c.index("--tasks") + 1] for c in calls] == ["stsb"], proc.stdout + proc.stderr
    assert reproduce.glue_todo(str(run), ["cola", "stsb"], ["1", "2"]) == []
    # while it is missing, the Avg says it is over 1 task of 2
    (run / "glue.json").write_text(glue_json(cola=20, stsb="missing"))
    args = reproduce.argparse.Namespace(scale="toy", data="", seed=1, tasks="cola,stsb", seeds="1,2",
                                        out_dir=str(out), steps=20, extra_steps=10)
    results = reproduce.collect(args, ["mlm"])
    assert results["runs"]["mlm"]["glue"]["avg_over"] == ["cola"]
    assert "| 50.0 ± 0.0 (1/2 tasks) |" in reproduce.markdown(results, [])
    # a GLUE call stopped after its first task: the next call fine-tunes the rest only
    (run / "glue.json").unlink()
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "glue", FAKE_GLUE_FAIL_AFTER="1")
    assert proc.returncode == 1
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "glue")
    assert proc.returncode == 0 and [c[c.index("--tasks") + 1] for c in calls] == ["stsb"], proc.stderr
    report = json.loads((run / "glue.json").read_text())
    assert {t: r["training_step"] for t, r in report["tasks"].items()} == {"cola": 20, "stsb": 20}
    assert not (run / "glue.part").exists()
    times = json.loads((run / "reproduce_time.json").read_text())
    assert times["glue"] > 0  # the failed call's time too


def test_settings_are_normalised_and_may_change_until_a_run_has_saved(tmp_path):
    out = tmp_path / "repro"
    proc, _ = fake_reproduce(tmp_path, "--seeds", " 1, 02", "--only", "analysis")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "reproduce.json").read_text())["seeds"] == "1,2"
    # a mistyped --data is refused before anything is saved...
    settings = (out / "reproduce.json").read_text()
    assert "data path not found: ./nowhere.txt" in reproduce_error(["--out_dir", str(out), "--data", "./nowhere.txt"], tmp_path)
    (tmp_path / "empty.txt").write_text("")
    line = reproduce_error(["--out_dir", str(out), "--data", str(tmp_path / "empty.txt")], tmp_path)
    assert "empty data file: " in line
    assert (out / "reproduce.json").read_text() == settings
    # ...and a --data that only train.py can refuse (a mistyped hub name) locks nothing: no run has saved yet,
    # so the next call's settings replace it
    (out / "reproduce.json").write_text(json.dumps({**SETTINGS, "data": "wikitxet"}))
    proc, _ = fake_reproduce(tmp_path, "--seed", "7", "--only", "analysis")
    assert proc.returncode == 0 and json.loads((out / "reproduce.json").read_text())["seed"] == 7, proc.stderr
    make_run(out, "mlm", 3)
    line = reproduce_error(["--out_dir", str(out), "--glue_dir", str(tmp_path / "glue"), "--only", "analysis"],
                           tmp_path)
    assert "other settings (seed 7 -> 1337)" in line


def test_a_glue_dir_without_the_tasks_is_refused_before_pretraining(tmp_path):
    (tmp_path / "glue").mkdir()
    line = reproduce_error(["--out_dir", str(tmp_path / "repro"), "--glue_dir", str(tmp_path / "glue")], tmp_path)
    assert "holds none of the tasks cola,stsb (no CoLA/train.tsv)" in line and not (tmp_path / "repro").exists()
    import glue_tasks
    assert reproduce.GLUE_DIRS == {name: task.dir for name, task in glue_tasks.TASKS.items()}
    assert all(reproduce.glue_absent(str(tmp_path), t) == [os.path.join(task.dir, stem + ".tsv") for stem in
                                                           ["train"] + [s for s, _ in task.dev.values()]]
               for t, task in glue_tasks.TASKS.items())


def test_the_report_is_of_every_run_in_out_dir(tmp_path, monkeypatch):
    # a call with --objectives taco on an out_dir whose mlm an earlier call made: results.md dropped mlm (and
    # with it the taco - mlm claim) without a word
    out = tmp_path / "repro"
    for name in ("mlm", "taco"):
        make_run(out, name, SETTINGS["steps"])
    (out / "reproduce.json").write_text(json.dumps(SETTINGS))
    monkeypatch.setattr(reproduce, "plot", lambda results, out_dir: [])
    reproduce.main(["--out_dir", str(out), "--scale", "toy", "--seed", "1337", "--steps", "20", "--extra_steps", "10",
                    "--tasks", "cola,stsb", "--seeds", "1,2", "--objectives", "taco", "--only", "report"])
    assert list(json.loads((out / "results.json").read_text())["runs"]) == ["mlm", "taco"]


def test_a_full_disk_is_one_error_line_and_leaves_no_temporary_file(tmp_path, capsys):
    # reproduce.py's own files (reproduce.json, reproduce_time.json, results.json and .md, plots): a write the
    # disk refused was a traceback, and left its NAME.tmp behind
    from test_reliability import file_size_limit
    out = tmp_path / "repro"
    write_glue(tmp_path / "glue", random.Random(0), rows=4)
    with file_size_limit(0), pytest.raises(SystemExit) as exit_info:
        reproduce.main(["--out_dir", str(out), "--glue_dir", str(tmp_path / "glue"), "--only", "report"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "File too large" in err and str(out / "reproduce.json") in err, err
    assert sorted(os.listdir(out)) == [".reproduce.lock"]


def test_a_call_whose_log_the_disk_refuses_is_still_read_to_its_end(tmp_path):
    # the thread that copies a call's output into its log died at the first write the disk refused: nobody read
    # the pipe any more, and once it was full the call and reproduce.py waited on each other forever
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full, where every write fails with ENOSPC")
    noisy = [sys.executable, "-c", "for i in range(2000): print('x' * 100)"]  # 200 KB: more than a pipe holds
    proc = subprocess.run([sys.executable, "-c", "import sys, reproduce; reproduce.run_parallel([(sys.argv[1:], "
                           "'/dev/full', None, lambda: None)], 1, None)", *noisy], cwd=HERE, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout.count("x" * 100) == 2000
    assert proc.stderr.strip().splitlines() == [f"error: cannot write /dev/full (No space left on device): the output "
                                                f"of `{' '.join(noisy)}` went to the console only"]


def test_a_dry_run_writes_nothing_and_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys):
    proc = subprocess.run([sys.executable, "reproduce.py", "--dry_run", "--out_dir", str(tmp_path / "repro")],
                          cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "eval.py --analysis" in proc.stdout and not (tmp_path / "repro").exists()

    def interrupt(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(reproduce, "check_glue_source", interrupt)
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["--out_dir", str(tmp_path / "repro")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 130 and "interrupted" in err and "\n" not in err


def test_a_dry_run_merges_no_glue_part_and_a_part_absorbed_twice_counts_once(tmp_path):
    out = repro_dir(tmp_path)
    run = make_run(out, "mlm", 20)
    (run / "glue.part").mkdir()
    part = {"seeds": [1, 2], "tasks": {"cola": {"status": "ok", "runs": {}, "time_s": 5.0}}}
    (run / "glue.part" / "glue.json").write_text(json.dumps(part))
    (run / "glue.part" / "stamp.json").write_text(json.dumps({"training_step": 20}))
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "glue", "--dry_run")
    assert proc.returncode == 0 and not calls and not (run / "glue.json").exists() and (run / "glue.part").exists()
    reproduce.absorb_glue(str(run))
    (run / "glue.part").mkdir()  # killed after the merge, before glue.part was removed: merged again
    (run / "glue.part" / "glue.json").write_text(json.dumps(part))
    (run / "glue.part" / "stamp.json").write_text(json.dumps({"training_step": 20}))
    reproduce.absorb_glue(str(run))
    args = reproduce.argparse.Namespace(scale="toy", data="", seed=1, tasks="cola,stsb", seeds="1,2",
                                        out_dir=str(out), steps=20, extra_steps=10)
    assert reproduce.collect(args, ["mlm"])["runs"]["mlm"]["glue"]["finetune_s"] == 5.0


@pytest.mark.slow
def test_a_run_trained_again_makes_what_was_built_on_it_stale(tmp_path):
    # mlm deleted and pretrained again ends at the same step: its analysis and the continuations made from the
    # old one must not pass for the new one's
    out = tmp_path / "repro"
    proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--tasks", "cola")
    assert proc.returncode == 0 and len(called(calls, "train")) == 3, proc.stderr
    shutil.rmtree(out / "mlm")
    proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--tasks", "cola")
    assert proc.returncode == 1 and "tacl was continued from another mlm run" in proc.stderr, proc.stderr
    shutil.rmtree(out / "tacl")
    shutil.rmtree(out / "mlm_cont")
    proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--tasks", "cola")
    assert proc.returncode == 0 and len(called(calls, "train")) == 2 and len(called(calls, "analysis")) == 1
    results = json.loads((out / "results.json").read_text())
    assert results["runs"]["mlm"]["analysis"]["contextual"] == 0.5  # the new analysis is the one reported


@pytest.mark.slow
def test_relative_data_globs_and_torchrun(tmp_path, monkeypatch):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.txt").write_text("Some text.\n")
    monkeypatch.chdir(tmp_path)
    args = reproduce.parse(["--data", "shards/*.txt", "--out_dir", "o"])
    assert args.data == os.path.join(str(tmp_path), "shards/*.txt")  # train.py runs in the repo's folder
    proc = subprocess.run([sys.executable, "reproduce.py", "--dry_run", "--nproc_per_node", "2", "--only", "mlm",
                           "--out_dir", str(tmp_path / "o")], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "-m torch.distributed.run --standalone --nproc_per_node=2 train.py --objective " \
        "mlm" in proc.stdout, proc.stderr
    # a killed run resumes under torchrun too
    (tmp_path / "o" / "reproduce.json").parent.mkdir()
    (tmp_path / "o" / "reproduce.json").write_text(json.dumps(SETTINGS))
    make_run(tmp_path / "o", "mlm", 10)
    proc = subprocess.run([sys.executable, "reproduce.py", "--dry_run", "--nproc_per_node", "2", "--only", "mlm",
                           "--out_dir", str(tmp_path / "o")], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "-m torch.distributed.run --standalone --nproc_per_node=2 train.py --resume " \
        in proc.stdout, proc.stdout + proc.stderr
    # a glob relative to a folder whose name holds glob characters: the folder is matched literally
    (tmp_path / "in[1]").mkdir()
    (tmp_path / "in[1]" / "b.txt").write_text("Some text.\n")
    monkeypatch.chdir(tmp_path / "in[1]")
    args = reproduce.parse(["--data", "*.txt", "--out_dir", str(tmp_path / "o2")])
    assert glob.glob(args.data) == [str(tmp_path / "in[1]" / "b.txt")], args.data
    # a split train.py would refuse (here COCO-LM's pool of 64 in 256 / 8 sequences) is refused before any run
    line = reproduce_error(["--scale", "mini", "--nproc_per_node", "8", "--out_dir", str(tmp_path / "o8")], tmp_path)
    assert "--nproc_per_node 8: cocolm: --negative_pool 64" in line and not (tmp_path / "o8").exists()
    monkeypatch.setenv("RANK", "0")  # started by torchrun: each rank would run the whole reproduction
    assert "not torchrun" in reproduce_error(["--out_dir", str(tmp_path / "o")], tmp_path)


def test_a_tilde_in_a_path_flag_is_home_as_in_train_py(tmp_path, monkeypatch):
    # bash leaves `--out_dir=~/x` alone: results.md went to a folder named ~, --glue_dir=~/g was "not a directory"
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("glue", "text"):
        (tmp_path / name).mkdir()
    (tmp_path / "text" / "a.txt").write_text("Some text.\n")
    args = reproduce.parse(["--out_dir=~/o", "--glue_dir=~/glue", "--data=~/text", "--cache_dir=~/c"])
    assert (args.out_dir, args.glue_dir, args.data, args.cache_dir) == tuple(
        str(tmp_path / name) for name in ("o", "glue", "text", "c"))


def test_a_task_named_twice_is_fine_tuned_once(tmp_path):
    args = reproduce.parse(["--tasks", "cola,CoLA,stsb,STS-B", "--out_dir", str(tmp_path / "o")])
    assert args.tasks == "cola,stsb"


def test_a_finished_continuation_without_its_checkpoint_is_checked_against_the_mlm_run(tmp_path):
    # a finished run whose ckpt.pt is gone (deleted to save space): its export was still made from another mlm export
    out = repro_dir(tmp_path)
    make_run(out, "mlm", 20)
    make_run(out, "tacl", 10)
    (out / "tacl" / "ckpt.pt").unlink()
    (out / "tacl" / "reproduce_init.json").write_text(json.dumps({"mlm_export": "-@15"}))
    proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--only", "continue,tacl")
    assert proc.returncode == 1 and "continued from another mlm run or step" in proc.stderr and not calls, \
        proc.stdout + proc.stderr


def test_the_report_leaves_out_an_analysis_of_another_export(tmp_path):
    # --only report after mlm was trained again: the old run's analysis.json must not pass for the new one's
    out = tmp_path / "repro"
    out.mkdir()
    run = make_run(out, "mlm", 20)
    (run / "reproduce_init.json").write_text(json.dumps({"run_id": "new"}))
    (out / "analysis").mkdir()
    args = reproduce.argparse.Namespace(scale="toy", data="", seed=1, tasks="cola,stsb", seeds="1,2",
                                        out_dir=str(out), steps=20, extra_steps=10)
    for stamp, contextual in (("old@20", None), ("new@10", None), ("new@20", 0.5)):
        (out / "analysis" / "analysis.json").write_text(json.dumps({
            "exports": {"mlm": stamp}, "models": {"mlm": {"contextual": {"contextual": 0.5}}}}))
        assert reproduce.collect(args, ["mlm"])["runs"]["mlm"]["analysis"]["contextual"] == contextual, stamp


@pytest.mark.slow
def test_a_stop_names_the_script_that_ran_under_torchrun_too(tmp_path, capsys):
    # cmd[1] is "-m" under torchrun: the line names the .py script
    child = "import os, signal, time; time.sleep(1); os.kill(os.getppid(), signal.SIGTERM); time.sleep(30)"
    with pytest.raises(SystemExit) as exit_info:
        reproduce.run_cmd([sys.executable, "-c", child, "train.py"], str(tmp_path / "out.log"), False)
    err = capsys.readouterr().err
    assert exit_info.value.code == 128 + signal.SIGTERM and "stopped by SIGTERM (train.py exited" in err, err


def test_a_failed_or_stopped_call_counts_its_time(tmp_path):
    with pytest.raises(SystemExit):
        reproduce.run_cmd([sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"],
                          str(tmp_path / "out.log"), False, None, (str(tmp_path), "glue"))
    assert json.loads((tmp_path / "reproduce_time.json").read_text())["glue"] >= 0.3


def test_results_md_names_each_tasks_metric():
    results = dict(scale="toy", data="", seed=1, seeds=["1"], tasks=["cola", "qqp", "mnli"], runs={})
    text = reproduce.markdown(results, [])
    assert "CoLA MCC, QQP F1, MNLI matched accuracy" in text


def test_results_md_says_which_contextual_score_each_table_shows():
    # train.py's per packed block (the pretraining table: cpu TACO 0.091) and the analysis' per sentence (the
    # representations table and the README: 0.103) are two numbers under one name
    results = dict(scale="cpu", data="", seed=1, seeds=["1"], tasks=["cola"], runs={})
    text = reproduce.markdown(results, [])
    assert "Contextual score: train.py's, with a packed validation block as the context" in text


def test_claims_table_marks_only_differences_the_seeds_separate():
    def run(sst2, cola):
        tasks = {"sst2": dict(status="ok", per_seed=dict(zip("123", sst2))),
                 "cola": dict(status="ok", per_seed=dict(zip("123", cola)))}
        avg = [(a + b) / 2 for a, b in zip(sst2, cola)]
        return dict(glue_by_recipe={"short": dict(tasks=tasks, avg_per_seed=avg, avg_over=["sst2", "cola"])})
    runs = {"mlm": run([70, 71, 72], [1, 5, 3]), "taco": run([73, 74, 75], [2, 0, 4]),
            "electra": run([60, 61, 62], [0, 0, 0])}  # no cocolm: that claim has no row
    rows = reproduce.claim_rows(runs, ["sst2", "cola"], "short")
    assert rows == ["| taco − mlm (TACO, Fu et al. 2022) | +3.0 > | -1.0 ~ | +1.0 ~ |"]
    runs["taco"]["glue_by_recipe"]["short"]["tasks"]["cola"] = dict(status="failed")  # no scores: no verdict
    runs["taco"]["glue_by_recipe"]["short"]["avg_over"] = ["sst2"]  # an Avg over other tasks: not comparable
    assert reproduce.claim_rows(runs, ["sst2", "cola"], "short")[0].endswith("| +3.0 > | – | – |")
    assert reproduce.claim_cell([1, 2], [3, 4]) == "-2.0 <"


def test_claims_table_says_which_cells_a_collapse_made_and_how_often_noise_separates():
    # a difference against a run that predicted one class is the collapse's, not the pretraining's: the cell and
    # the Avg over that task say so; both runs' CoLA collapsed read "+0.0 ~" as if the seeds overlapped
    def run(sst2, cola, collapsed):
        task = lambda scores, c: dict(status="ok", per_seed=dict(zip("12", scores)), collapsed=c, mean=scores[0], std=0)
        avg = [(a + b) / 2 for a, b in zip(sst2, cola)]
        glue = dict(tasks={"sst2": task(sst2, collapsed), "cola": task(cola, 2)}, avg_per_seed=avg, avg=avg[0],
                    avg_std=0, avg_over=["sst2", "cola"])
        return dict(glue=glue, glue_by_recipe={"paper": glue})
    runs = {"cocolm": run([54, 55], [0, 0], 0), "electra": run([50.9, 50.9], [0, 0], 2),
            "taco": run([70, 71], [0, 0], 0), "mlm": run([72, 73], [0, 0], 0)}
    rows = reproduce.claim_rows(runs, ["sst2", "cola"], "paper")
    assert rows[0] == "| taco − mlm (TACO, Fu et al. 2022) | -2.0 < | +0.0 ~ c | -1.0 < c |"
    assert rows[1] == "| cocolm − electra (COCO-LM, Meng et al. 2021) | +3.6 > c | +0.0 ~ c | +1.8 > c |"
    # 2 seeds a run: 2 of the 6 splits of 4 scores separate them; 3 seeds: 2 of 20
    assert "by chance 1 time in 3." in reproduce.chance_note(2) and "1 time in 10." in reproduce.chance_note(3)
    analysis = dict.fromkeys(["intra", "inter", "contextual", "l1_ratio", "l2_ratio", "cos_ratio", "isotropy",
                              "self_similarity_last", "wordsim_cooc", "wordsim353_spearman", "simlex999_spearman",
                              "cls_gap", "mean_gap"])
    for r in runs.values():
        r.update(steps=20, final={}, own_metric=dict(name=None), tokens_per_s=None, step_time_vs_mlm=None,
                 train_wall_s=None, analysis=analysis)
    text = reproduce.markdown(dict(scale="toy", data="", seed=1, seeds=["1", "2"], tasks=["sst2", "cola"],
                                   recipes=["paper"], runs=runs), [])
    assert "1 time in 3" in text and '"c": a run of the pair has collapsed' in text
    assert "The toy scale checks the pipeline end to end; its numbers say nothing about the papers' claims." in text
    # a word-similarity ρ says over how many pairs: the toy vocabulary covers 2 of WordSim353's 353 (ρ = -1)
    runs["taco"]["analysis"] = dict(analysis, wordsim353_spearman=-1.0, wordsim353_pairs=2, simlex999_spearman=0.25,
                                    simlex999_pairs=895)
    text = reproduce.markdown(dict(scale="toy", data="", seed=1, seeds=["1", "2"], tasks=["sst2", "cola"],
                                   recipes=["paper"], runs=runs), [])
    row = next(line for line in text.splitlines() if line.startswith("| taco |") and "(2)" in line)
    assert f"| {reproduce.fmt(-1.0)} (2) | {reproduce.fmt(0.25)} (895) |" in row and "WordSim353 ρ (pairs)" in text


def test_data_is_checked_before_anything_is_saved(tmp_path, monkeypatch):
    # reproduce.py refuses what train.py would (corpus.resolve_files) before reproduce.json and the first run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "empty.txt").write_text("")
    (tmp_path / "configs").mkdir()  # a folder with no corpus file: train.py refused it, reproduce.py did not
    (tmp_path / "configs" / "a.json").write_text("{}")
    for value in ("sub/empty.txt", "sub", "configs", "*.nope", "./missing.txt", "sub/missing.txt.xz", "missing.raw",
                  str(tmp_path / "missing")):
        assert reproduce.data_problem(value), value
    for value in ("a.txt", "*.txt", "wikitext:wikitext-103-raw-v1", "user/corpus"):
        assert reproduce.data_problem(value) is None, value
    assert "no .txt/.raw/.jsonl/.parquet/.arrow files" in reproduce.data_problem("configs")
    assert subprocess.run([sys.executable, "-c", "import sys, reproduce; sys.exit('torch' in sys.modules)"],
                          cwd=HERE).returncode == 0  # it runs before device_run.py installs the wheels


def test_nproc_per_node_is_checked_with_train_pys_own_batch_rule():
    # mini: 256 sequences per step, whole pools of 64 for TACO: 3 processes do not divide it, 2 and 4 do
    args = lambda n: SimpleNamespace(scale="mini", nproc_per_node=n, selected=["mlm", "taco", "tacl"])
    assert reproduce.nproc_problem(args(2)) is None and reproduce.nproc_problem(args(4)) is None
    problem = reproduce.nproc_problem(args(3))
    assert problem and problem.startswith(("mlm:", "taco:", "tacl:")) and "Traceback" not in problem, problem


def test_recipes_are_eval_pys_and_each_has_its_own_glue(tmp_path):
    import eval
    assert list(reproduce.RECIPES) == next(a for a in eval.build_parser()._actions if a.dest == "recipe").choices
    out = repro_dir(tmp_path)  # made before --recipes existed: the paper recipe's
    make_run(out, "mlm", 20)
    make_run(out, "taco", 20)
    # a recipe added to finished runs: its own file, the paper recipe's untouched; two eval.py at a time
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm,taco", "--recipes", "paper,short", "--only",
                                 "glue,short", "--glue_jobs", "2")
    assert proc.returncode == 0 and "note: new GLUE recipes" in proc.stdout, proc.stderr
    assert sorted((c[c.index("--model") + 1], c[c.index("--recipe") + 1]) for c in calls) == [
        (str(out / "mlm"), "short"), (str(out / "taco"), "short")]
    assert (out / "mlm.glue_short.out").exists() and not (out / "mlm" / "glue.json").exists()
    assert json.loads((out / "taco" / "glue_short.json").read_text())["recipe"] == "short"
    assert reproduce.glue_todo(str(out / "mlm"), ["cola", "stsb"], ["1", "2"], "short") == []
    assert reproduce.glue_todo(str(out / "mlm"), ["cola", "stsb"], ["1", "2"], "paper") == ["cola", "stsb"]
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm,taco", "--recipes", "paper,short", "--glue_jobs", "2")
    assert proc.returncode == 0 and [c[c.index("--recipe") + 1] for c in called(calls, "glue")] == ["paper"] * 2
    text = (out / "results.md").read_text()
    assert "## GLUE, recipe `paper`" in text and "## GLUE, recipe `short`" in text
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]["mlm"]["glue_by_recipe"]) == {"paper", "short"}
    # a GLUE call that fails lets the others finish, then the command fails
    (out / "mlm" / "glue_short.json").unlink()
    (out / "taco" / "glue_short.json").unlink()
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm,taco", "--recipes", "paper,short", "--glue_jobs", "2",
                                 FAKE_GLUE_FAIL_AFTER="1")
    assert proc.returncode == 1 and proc.stderr.count("failed with exit code 1") == 2, proc.stderr
    for run in ("mlm", "taco"):  # each kept the task it finished
        assert json.loads((out / run / "glue_short.json").read_text())["tasks"].keys() == {"cola"}
    for argv, message in ((["--recipes", "paper,long"], "unknown GLUE recipe 'long'"),
                          (["--only", "glue,uniform"], "--only uniform: not one of --recipes paper")):
        assert message in reproduce_error(["--out_dir", str(tmp_path / "other"), *argv], tmp_path)


def test_tacl_and_its_control_continue_from_the_mlm_run_pretrained_first_and_glue_waits_for_all(tmp_path):
    (tmp_path / "tok").mkdir()
    proc, calls = fake_reproduce(tmp_path, "--objectives", "tacl", "--tasks", "cola", "--tokenizer",
                                 str(tmp_path / "tok"))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "repro"
    flag = lambda call, name: call[call.index(name) + 1] if name in call else None
    kinds = [("train", flag(c, "--objective"), flag(c, "--out_dir")) if c[0] == "train.py" else
             ("analysis", *c[c.index("--model") + 1:c.index("--out")]) if "--analysis" in c else
             ("glue", flag(c, "--model")) for c in calls]
    runs = [str(out / r) for r in ("mlm", "tacl", "mlm_cont")]
    assert kinds == [("train", "mlm", runs[0]), ("train", "tacl", runs[1]), ("train", "mlm", runs[2]),
                     *(("glue", r) for r in runs), ("analysis", *runs)]
    mlm, tacl, control = calls[:3]
    assert flag(mlm, "--init_from") is None and flag(mlm, "--max_steps") == "20" and flag(mlm, "--tokenizer")
    for run in (tacl, control):  # the same recipe for both: from the mlm run, its tokenizer, their own steps and lr
        assert flag(run, "--init_from") == str(out / "mlm") and "--tokenizer" not in run
        assert (flag(run, "--max_steps"), flag(run, "--warmup_steps"), flag(run, "--lr")) == (
            "10", "1", str(reproduce.SCALES["toy"]["continue_lr"]))


def test_the_analysis_and_the_report_cover_every_finished_run_when_only_one_is_named(tmp_path):
    out = repro_dir(tmp_path)
    make_run(out, "mlm", 20)
    make_run(out, "taco", 20)
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm,taco", "--only", "taco")
    assert proc.returncode == 0, proc.stderr
    assert [c[c.index("--model") + 1] for c in called(calls, "glue")] == [str(out / "taco")]  # GLUE: the run named
    assert [c[c.index("--model") + 1:c.index("--out")] for c in called(calls, "analysis")] == [
        [str(out / "mlm"), str(out / "taco")]]  # the analysis compares them all
    assert set(json.loads((out / "results.json").read_text())["runs"]) == {"mlm", "taco"}


def test_glue_scored_with_other_seeds_or_on_another_export_is_not_done(tmp_path):
    run = make_run(tmp_path, "mlm", 20)
    (run / "glue.json").write_text(glue_json(cola=20, stsb=20))
    assert reproduce.glue_todo(str(run), ["cola", "stsb"], ["1", "2"]) == []
    assert reproduce.glue_todo(str(run), ["cola", "stsb"], ["1", "3"]) == ["cola", "stsb"]
    (run / "glue.json").write_text(glue_json(cola=20, stsb=10))
    assert reproduce.glue_todo(str(run), ["cola", "stsb"], ["1", "2"]) == ["stsb"]


def test_a_run_killed_before_its_first_checkpoint_starts_over_in_an_empty_folder(tmp_path):
    # nothing to resume: what it left (its log, its tokenizer) goes, or the new run's log would carry the old
    # one's records
    out = repro_dir(tmp_path)
    run = out / "mlm"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"config": {"objective": "mlm"}}) + "\n" +
                                   json.dumps({"step": 5, "loss": 9.0, "elapsed_s": 1.0}) + "\n")
    (run / "tokenizer.json").write_text("{}")
    proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "pretrain")
    assert proc.returncode == 0 and "--resume" not in calls[0], proc.stderr
    assert len((run / "log.jsonl").read_text().splitlines()) == 2  # the new run's header and step only


def test_an_unfinished_run_that_lost_its_checkpoint_is_refused_not_deleted(tmp_path):
    # train.py saves ckpt.pt before its export, so an export without a ckpt.pt file is a checkpoint deleted or
    # damaged (here, made a directory), not a run killed before its first save: its folder, export, log and
    # GLUE results with it, used to be deleted and the run trained again from step 0
    out = repro_dir(tmp_path)
    run = make_run(out, "mlm", 10)  # of SETTINGS' 20 steps
    (run / "glue.json").write_text("{}")
    for damage in ("deleted", "a directory"):
        (run / "ckpt.pt").unlink() if damage == "deleted" else (run / "ckpt.pt").mkdir()
        kept = sorted(p.name for p in run.iterdir())
        proc, calls = fake_reproduce(tmp_path, "--objectives", "mlm", "--only", "pretrain")
        err = proc.stderr.strip()
        assert proc.returncode == 1 and not calls and err.startswith("error: ") and "\n" not in err, (damage, err)
        assert f"{run} holds " in err and "no ckpt.pt file to resume" in err, err
        assert sorted(p.name for p in run.iterdir()) == kept, damage


def test_glue_jobs_is_the_most_calls_running_at_once(tmp_path):
    # each call counts the calls alive beside it (a file each, while it sleeps)
    child = ("import os, sys, time\n"
             "mine = os.path.join(sys.argv[1], str(os.getpid())); open(mine, 'w').close(); time.sleep(0.6)\n"
             "print(len(os.listdir(sys.argv[1])), flush=True); os.remove(mine)")
    (tmp_path / "alive").mkdir()
    calls = [([sys.executable, "-c", child, str(tmp_path / "alive")], str(tmp_path / f"{i}.out"), None, lambda: None)
             for i in range(3)]
    reproduce.run_parallel(calls, 2, None)
    assert max(int((tmp_path / f"{i}.out").read_text()) for i in range(3)) == 2


def test_a_sigterm_to_reproduce_reaches_the_running_call_which_saves_its_step(tmp_path, capsys):
    # the device tool's deadline (device_run.py's SIGTERM): passed on to train.py, which saves before it exits
    child = ("import os, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(143)))\n"
             "time.sleep(0.5); os.kill(os.getppid(), signal.SIGTERM); time.sleep(30)")  # once run_cmd holds it
    t0 = time.time()
    with pytest.raises(SystemExit) as exit_info:
        reproduce.run_cmd([sys.executable, "-c", child, "train.py"], str(tmp_path / "out.log"), False)
    assert exit_info.value.code == 128 + signal.SIGTERM and time.time() - t0 < 10
    assert (tmp_path / "out.log").read_text() == "saved\n" and "train.py exited 143" in capsys.readouterr().err


def test_a_sigterm_before_a_call_is_recorded_still_reaches_it(tmp_path, monkeypatch, capsys):
    # a signal between the call's start and run_parallel's record of it was passed on to no one: reproduce.py
    # then waited for the whole call (a training run) to end by itself (seen in CI, on a loaded machine)
    spawn = reproduce.spawn

    def spawn_then_sigterm(cmd, env):
        proc = spawn(cmd, env)
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, before run_parallel records proc
        return proc
    monkeypatch.setattr(reproduce, "spawn", spawn_then_sigterm)
    t0 = time.time()
    with pytest.raises(SystemExit) as exit_info:
        reproduce.run_cmd([sys.executable, "-c", "import time; time.sleep(20)", "train.py"], str(tmp_path / "log"), False)
    assert exit_info.value.code == 128 + signal.SIGTERM and time.time() - t0 < 10
    assert "stopped by SIGTERM" in capsys.readouterr().err
