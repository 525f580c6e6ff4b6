"""device_run.py: each chunk's command end to end at toy scale on the CPU (the same stages a GPU machine runs),
the merge of their archives into one results.md, prepare on a fake shared folder, the deadline, the archive's
contents and size, and the budget (every chunk under 7 minutes, on eval.py's recipes)."""
import json
import lzma
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

import device_run
import reproduce
from test_reproduce import write_corpus, write_glue

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS = (".pt", ".safetensors", ".bin", "tokenizer.json", "vocab.txt")


def test_every_chunk_fits_its_command_and_trains_long_enough():
    mini = reproduce.SCALES["mini"]["train"]
    assert mini[mini.index("--eval_interval") + 1] == "250"  # held-out curves: a point every 250 steps
    assert device_run.STEPS >= 3000 and mini[mini.index("--tokens_per_step") + 1] == "32768"
    for chunk, spec in device_run.CHUNKS.items():
        est = device_run.estimate(chunk)
        optional = {s[0] for s in spec["stages"] if s[2:] == ("optional",)}
        assert sum(v for k, v in est.items() if k not in optional) < 7 * 60, (chunk, est)
        assert set(est) - {"setup", "pack"} == {s[0] for s in spec["stages"]}, chunk
    assert "| `electra-cocolm` |" in device_run.budget_table()


def test_the_budget_reads_eval_pys_recipes():
    import eval
    assert device_run.RECIPE_BATCHES["paper"] == {t: (eval.SMALL[t]["batch_size"], eval.SMALL[t]["epochs"])
                                                  for t in device_run.GLUE_TASKS}
    assert device_run.RECIPE_BATCHES["short"] == dict.fromkeys(device_run.GLUE_TASKS, (eval.SHORT["batch_size"],
                                                                                      eval.SHORT["epochs"]))
    assert reproduce.SCALES["mini"]["recipes"] == "paper"  # short collapses on a briefly pretrained BERT-small
    # the steps of one model: RTE's 2,490 rows at batch 32 for 4 epochs = 78 x 4 steps, 2 seeds
    steps, _ = device_run.glue_steps("paper", 4000, 2)
    assert steps == 2 * 4 * (125 + 63 + 115 + 125 + 78)


def test_only_missing_wheels_are_installed(tmp_path):
    from importlib import metadata
    have = f"pytest-{metadata.version('pytest')}-py3-none-any.whl"
    for name in (have, "pytest-0.0.1-py3-none-any.whl", "no_such_package-1.0-py3-none-any.whl", "README.md"):
        (tmp_path / name).write_text("")
    assert device_run.missing_wheels(str(tmp_path)) == ["no_such_package-1.0-py3-none-any.whl",
                                                        "pytest-0.0.1-py3-none-any.whl"]
    assert device_run.missing_wheels(str(tmp_path / "absent")) == []


def test_a_stage_gets_sigterm_at_the_deadline_then_sigkill(tmp_path, monkeypatch):
    monkeypatch.setattr(device_run, "GRACE", 1.0)
    lines, packs = [], []
    saves = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(143)))\n"
             "print('started', flush=True); time.sleep(60)")
    t0 = time.time()
    code, stopped = device_run.run_stage([sys.executable, "-c", saves], dict(os.environ), lines.append,
                                         str(tmp_path / "a.out"), time.time() + 1.5, lambda: packs.append(1))
    assert stopped and code == 143 and time.time() - t0 < 10
    assert "saved\n" in lines and (tmp_path / "a.out").read_text() == "started\nsaved\n"
    deaf = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    code, stopped = device_run.run_stage([sys.executable, "-c", deaf], dict(os.environ), lines.append, None,
                                         time.time() + 0.5, lambda: None)
    assert stopped and code == -signal.SIGKILL and any("SIGKILL" in line for line in lines)
    code, stopped = device_run.run_stage([sys.executable, "-c", "pass"], dict(os.environ), lines.append, None,
                                         time.time() + 30, lambda: None)
    assert (code, stopped) == (0, False)


def test_the_archive_holds_no_weights_and_stays_under_its_limit(tmp_path, monkeypatch):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "mlm" / "glue.part").mkdir(parents=True)
    (work / "cache").mkdir()
    out.mkdir()
    for name in ("mlm/log.jsonl", "mlm/config.json", "mlm/glue.part/glue.json", "reproduce.json", "mlm.train.out"):
        (work / name).write_text("{}\n")
    for name in ("mlm/ckpt.pt", "mlm/model.safetensors", "mlm/tokenizer.json", "mlm/vocab.txt", "cache/tokens-x.bin",
                 "mlm/.lock", "mlm/log.jsonl.tmp"):
        (work / name).write_text("weights")
    (work / "small.png").write_bytes(os.urandom(1000))
    (work / "big.png").write_bytes(os.urandom(30000))  # random bytes: gzip cannot shrink them
    monkeypatch.setattr(device_run, "ARCHIVE_LIMIT", 20000)
    record = {}
    path = device_run.pack("mlm-taco", str(work), str(out), record)
    with tarfile.open(path) as tar:
        names = sorted(tar.getnames())
    assert names == ["mlm-taco/chunk.json", "mlm-taco/mlm.train.out", "mlm-taco/mlm/config.json",
                     "mlm-taco/mlm/glue.part/glue.json", "mlm-taco/mlm/log.jsonl", "mlm-taco/reproduce.json",
                     "mlm-taco/small.png"]
    assert record["left_out"] == ["big.png"] and os.listdir(out) == ["mlm-taco.tar.gz"]


def test_a_file_removed_while_the_archive_is_packed_is_left_out(tmp_path, monkeypatch):
    # the periodic pack runs beside the stage: reproduce.py merges a finished eval.py's RUN/glue.part/ into
    # RUN/glue.json and removes the part folder, maybe between collect_files's listing and tar.add. A pack that
    # raised there would end the command in the middle of its GLUE stage, that stage left running
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "mlm" / "glue.part").mkdir(parents=True)
    out.mkdir()
    for name in ("mlm/log.jsonl", "mlm/glue.part/glue.json", "mlm/glue.part/stamp.json"):
        (work / name).write_text("{}\n")
    listed = device_run.collect_files

    def absorbed_meanwhile(folder):
        files = listed(folder)
        shutil.rmtree(work / "mlm" / "glue.part")
        return files
    monkeypatch.setattr(device_run, "collect_files", absorbed_meanwhile)
    with tarfile.open(device_run.pack("mlm-taco", str(work), str(out), {})) as tar:
        assert sorted(tar.getnames()) == ["mlm-taco/chunk.json", "mlm-taco/mlm/log.jsonl"]


def git_repo(path):
    path.mkdir()
    (path / "a.py").write_text("print(1)\n")
    (path / ".gitignore").write_text(".repro_data/\n.whl/\n")
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=path, check=True)


def fake_shared(path, shard_bytes):
    """A shared folder as ../shared: two corpus shards (xz), the five GLUE tasks, one wheel."""
    rng = random.Random(0)
    corpus = path / device_run.CORPUS
    corpus.mkdir(parents=True)
    for shard in device_run.SHARDS:
        write_corpus(path / "text.txt", rng, lines=300)
        data = (path / "text.txt").read_bytes()
        (corpus / shard).write_bytes(lzma.compress(data + os.urandom(shard_bytes).hex().encode()))
    write_glue(path / "glue_tmp", rng, rows=8)
    for task in device_run.GLUE_TASKS.values():
        os.makedirs(path / device_run.GLUE / task)
        for split in ("train", "dev"):
            (path / device_run.GLUE / task / f"{split}.tsv").write_text((path / "glue_tmp" / "CoLA" / f"{split}.tsv")
                                                                       .read_text())
    (path / "wheels").mkdir()
    (path / "wheels" / "somepkg-1.0-py3-none-any.whl").write_bytes(b"wheel")


def test_prepare_copies_what_travels_and_drops_ab_when_it_does_not_fit(tmp_path, monkeypatch):
    repo, shared = tmp_path / "repo", tmp_path / "shared"
    git_repo(repo)
    fake_shared(shared, 20000)
    argv = ["prepare", "--shared", str(shared), "--root", str(repo), "--vocab_size", "200"]
    assert device_run.main(argv) == 0
    data = repo / device_run.DATA_DIR
    assert sorted(os.listdir(data / "corpus")) == list(device_run.SHARDS)
    assert sorted(os.listdir(data / "glue")) == sorted(device_run.GLUE_TASKS.values())
    assert (repo / ".repro_data" / "wheels" / "somepkg-1.0-py3-none-any.whl").is_file() and (data / "tokenizer" / "vocab.txt").is_file()
    source = json.loads((data / "source.json").read_text())
    assert source["files"] == ["a.py"] and len(source["commit"]) == 40 and source["dirty"] is False
    # a second prepare with a limit that both shards do not fit under: AB goes, the tokenizer is trained again
    both = sum(device_run.tree_size(str(repo), [device_run.DATA_DIR]).values()) \
        - device_run.folder_size(str(data / "tokenizer")) + 2 * 2**20  # what prepare counts before copying
    monkeypatch.setattr(device_run, "TRAVEL_LIMIT", both - (data / "corpus" / "AB.txt.xz").stat().st_size // 2)
    stamp = (data / "tokenizer" / "corpus.json").read_text()
    assert device_run.main(argv) == 0
    assert os.listdir(data / "corpus") == [device_run.SHARDS[0]]
    assert (data / "tokenizer" / "corpus.json").read_text() != stamp
    monkeypatch.setattr(device_run, "TRAVEL_LIMIT", 1000)
    with pytest.raises(SystemExit, match="over the device tool's"):
        device_run.main(argv)


def test_prepare_again_on_the_same_data_keeps_ab_and_the_tokenizer(tmp_path, monkeypatch, capsys):
    # the first prepare counts the tokenizer it is about to train as 2 MiB; a second one must count the trained
    # one in its place, not both: else a tree that fitted with AB loses AB on the rerun (and the corpus, the
    # tokenizer and every later chunk change with it)
    repo, shared = tmp_path / "repo", tmp_path / "shared"
    git_repo(repo)
    fake_shared(shared, 20000)
    data = repo / device_run.DATA_DIR
    argv = ["prepare", "--shared", str(shared), "--root", str(repo), "--vocab_size", "200"]
    assert device_run.main(argv) == 0
    first = sum(device_run.tree_size(str(repo), [device_run.DATA_DIR]).values()) \
        - device_run.folder_size(str(data / "tokenizer")) + 2 * 2**20  # what the first prepare counted, source.json too
    monkeypatch.setattr(device_run, "TRAVEL_LIMIT", first)  # the tree fits with AB, with nothing to spare
    copied = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in data.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert device_run.main(argv) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(data / "corpus")) == list(device_run.SHARDS) and "does not fit" not in out, out
    assert "trained the" not in out  # the same corpus: the same tokenizer, not trained again
    # and nothing that was copied is copied again
    assert {p: v for p, v in copied.items() if p.name != "source.json"} == {
        p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in data.rglob("*") if p.is_file() and p.name != "source.json"}


# ---------------------------------------------------------------------------------------------
# every chunk end to end at toy scale, then merged


def test_a_machine_without_git_or_nvidia_smi_still_runs_the_chunk(tmp_path, monkeypatch):
    # a bare GPU machine may lack git: the provenance comes from prepare's source.json instead of a crash
    (tmp_path / "source.json").write_text(json.dumps(dict(commit="abc123", dirty=False, files=["model.py"],
                                                          sha256=device_run.source_hash(["model.py"]))))
    monkeypatch.setattr(device_run, "DATA_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert device_run.git("rev-parse", "HEAD") is None
    record = device_run.source_provenance()
    assert record["commit"] == "abc123" and record["read_from"] == "prepare's source.json" and record["dirty"] is False
    # and the device check's nvidia-smi call is guarded the same way (it runs on CUDA only: checked as text here)
    assert 'except OSError:  # no nvidia-smi' in device_run.CHECK


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Each chunk's command at toy scale, once for the module: {chunk: (exit code, output)}, and the folders."""
    root = tmp_path_factory.mktemp("device")
    rng = random.Random(0)
    write_corpus(root / "corpus.txt", rng)
    write_glue(root / "glue", rng)
    done = {}
    for chunk in device_run.CHUNKS:
        proc = subprocess.run([sys.executable, "device_run.py", "run", chunk, "--toy", "--out", str(root / "out"),
                               "--work", str(root / "work" / chunk), "--data", str(root / "corpus.txt"),
                               "--glue_dir", str(root / "glue"), "--recipes", "paper,short"],  # two: the merge's path
                              cwd=HERE, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "OUT": ""})
        done[chunk] = proc.returncode, proc.stdout + proc.stderr
    return root, done


@pytest.mark.slow
@pytest.mark.parametrize("chunk", list(device_run.CHUNKS))
def test_each_chunk_runs_end_to_end_at_toy_scale(toy, chunk):
    root, done = toy
    code, output = done[chunk]
    assert code == 0, output[-4000:]
    archive = root / "out" / f"{chunk}.tar.gz"
    assert archive.stat().st_size < device_run.ARCHIVE_LIMIT
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        record = json.load(tar.extractfile(f"{chunk}/chunk.json"))
    assert not [n for n in names if n.endswith(WEIGHTS) or "/cache/" in n]
    assert record["finished"] and record["device"]["torch"] and record["source"]["sha256"]
    assert all(s["status"] == "done" and s["wall_s"] > 0 for s in record["stages"])
    if chunk == "speed":
        assert {"speed/bench/bench_small.json", "speed/bench/bench_base.json", "speed/test_cuda.out"} <= names
        small = json.loads(open(root / "work" / chunk / "bench" / "bench_small.json").read())
        assert [r["objective"] for r in small["results"]][:2] == ["mlm", "hf-mlm"] and small["hf_ratios"]
        assert "profile" in small["results"][0] and all("profile" not in r for r in small["results"][1:])
        return
    runs = reproduce.parse(["--objectives", device_run.CHUNKS[chunk]["objectives"]]).runs
    for run in runs:  # the logs and both recipes' GLUE of every run
        assert {f"{chunk}/{run}/log.jsonl", f"{chunk}/{run}/glue.json", f"{chunk}/{run}/glue_short.json"} <= names, run
    assert f"{chunk}/analysis/analysis.json" in names


@pytest.mark.slow
def test_merging_any_subset_of_toy_archives_gives_one_coherent_report(toy, tmp_path):
    root, done = toy
    assert all(code == 0 for code, _ in done.values())
    into = tmp_path / "mini"
    archives = lambda *chunks: [str(root / "out" / f"{c}.tar.gz") for c in chunks]
    assert device_run.main(["merge", *archives("tacl"), "--into", str(into)]) == 0
    text = (into / "results.md").read_text()
    assert "| `mlm-taco` | MLM against TACO at equal steps | **not run yet** |" in text
    assert "## `tacl`" in text and "Reproducibility" not in text
    # mlm-taco merged beside it: the MLM run both made, side by side (the same on one CPU)
    assert device_run.main(["merge", *archives("mlm-taco"), "--into", str(into)]) == 0
    text = (into / "results.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| held-out MLM loss |"))
    assert row.split(" | ")[1] == row.split(" | ")[2] and row.endswith("| 0.0000 |"), row
    for chunk in ("mlm-taco", "tacl"):  # each chunk's own report and plots, and a section in the merged one
        assert (into / chunk / "results.md").is_file() and (into / chunk / "results_curves_steps.png").is_file()
        assert f"## `{chunk}`" in text
    assert "GLUE, recipe `short`" in text and "GLUE, recipe `paper`" in text
    # every table renders: one column count per table
    tables = [[]]
    for line in text.splitlines():
        tables[-1].append(line) if line.startswith("|") else tables.append([])
    for t in [t for t in tables if t]:
        assert t[1].startswith("|---") and len({row.count("|") for row in t}) == 1, t[:2]
    # all four, then an archive cut short: a run that never started is named, the chunk is partial
    assert device_run.main(["merge", *archives("electra-cocolm", "speed"), "--into", str(into)]) == 0
    text = (into / "results.md").read_text()
    assert "not run yet" not in text and "| hf-mlm |" in text and "our MLM runs" in text
    assert "| peak GB | spread |" in text and re.search(r"\| tiny \| mlm \|.*\| \d+\.\d% \|", text)  # 2 windows
    cut = tmp_path / "cut"
    with tarfile.open(root / "out" / "electra-cocolm.tar.gz") as tar:
        tar.extractall(cut, filter="data")
    record = json.loads((cut / "electra-cocolm" / "chunk.json").read_text())
    record["stages"][1]["status"], record["finished"] = "stopped at the deadline", False
    (cut / "electra-cocolm" / "chunk.json").write_text(json.dumps(record))
    for path in sorted((cut / "electra-cocolm" / "cocolm").iterdir()):
        path.unlink()
    (cut / "electra-cocolm" / "cocolm").rmdir()
    with tarfile.open(tmp_path / "electra-cocolm.tar.gz", "w:gz") as tar:
        tar.add(cut / "electra-cocolm", arcname="electra-cocolm")
    assert device_run.main(["merge", str(tmp_path / "electra-cocolm.tar.gz"), "--into", str(into)]) == 0
    text = (into / "results.md").read_text()
    assert "partial: 3/4 stages" in text and "**Not run** (the command ended first): cocolm." in text


@pytest.mark.slow
def test_a_chunk_cut_by_its_deadline_keeps_what_finished(tmp_path):
    rng = random.Random(0)
    write_corpus(tmp_path / "corpus.txt", rng)
    write_glue(tmp_path / "glue", rng)
    proc = subprocess.run([sys.executable, "device_run.py", "run", "mlm-taco", "--toy", "--budget", "40",
                           "--steps", "2000", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                           "--data", str(tmp_path / "corpus.txt"), "--glue_dir", str(tmp_path / "glue")],
                          cwd=HERE, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    with tarfile.open(tmp_path / "out" / "mlm-taco.tar.gz") as tar:
        record = json.load(tar.extractfile("mlm-taco/chunk.json"))
        log = tar.extractfile("mlm-taco/mlm/log.jsonl").read().decode()
    statuses = [s["status"] for s in record["stages"]]
    assert statuses[0] == "stopped at the deadline" and all(s.startswith("skipped") for s in statuses[1:]), statuses
    assert not record["finished"] and record["total_s"] < 40 + device_run.GRACE
    step = reproduce.export_step(str(tmp_path / "work" / "mlm"))  # train.py saved its step on the way out
    # the archive holds the log up to the stop (a SIGTERM's save between two log steps logs no line of its own)
    logged = [json.loads(line)["step"] for line in log.splitlines()[1:] if line.startswith('{"step"')]
    assert step is not None and 0 < step < 2000 and logged and step - 5 <= max(logged) <= step, (step, logged)


def test_bad_archives_and_folders_are_one_error_line_and_merge_nothing(tmp_path, capsys):
    into = tmp_path / "mini"
    (tmp_path / "random.tar.gz").write_bytes(random.Random(0).randbytes(5000))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.txt").write_text("not a chunk")
    with tarfile.open(tmp_path / "foreign.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "x", arcname="x")
    (tmp_path / "mlm-taco").mkdir()
    (tmp_path / "mlm-taco" / "big.txt").write_bytes(random.Random(1).randbytes(200_000))
    with tarfile.open(tmp_path / "whole.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "mlm-taco", arcname="mlm-taco")
    whole = (tmp_path / "whole.tar.gz").read_bytes()
    (tmp_path / "truncated.tar.gz").write_bytes(whole[:len(whole) // 2])
    damaged = bytearray(whole)
    damaged[len(whole) // 2] ^= 0xFF  # inside a stored deflate block: the tar headers still read, the CRC does not
    (tmp_path / "damaged.tar.gz").write_bytes(bytes(damaged))
    (tmp_path / "FILE").write_text("a file")
    for argv, needle in [(["merge", str(tmp_path / "missing.tar.gz")], "not a readable archive"),
                         (["merge", str(tmp_path / "random.tar.gz")], "not a readable archive"),
                         (["merge", str(tmp_path / "truncated.tar.gz")], "not a readable archive"),
                         (["merge", str(tmp_path / "damaged.tar.gz")], "not a readable archive"),
                         (["merge", str(tmp_path / "foreign.tar.gz")], "not an archive of device_run.py"),
                         (["merge", str(tmp_path / "whole.tar.gz"), "--into", str(tmp_path / "FILE")], "not a folder"),
                         (["run", "mlm-taco", "--toy", "--out", str(tmp_path / "FILE")], "not a folder")]:
        with pytest.raises(SystemExit) as stop:
            device_run.main(argv + (["--into", str(into)] if argv[0] == "merge" and "--into" not in argv else []))
        message = str(stop.value.code)
        assert message.startswith("error: ") and needle in message and "\n" not in message, (argv, message)
    assert not into.exists()  # nothing was merged, not even an empty folder


def test_a_flag_before_the_command_is_named(capsys):
    with pytest.raises(SystemExit) as stop:
        device_run.main(["--bogus"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: --bogus: the first word is the command") and err.count("\n") == 1


def test_run_flags_that_would_schedule_nothing_are_refused(tmp_path, capsys):
    for argv, needle in ((["--budget", "-5"], "--budget -5.0"), (["--budget", "nan"], "--budget nan"),
                         (["--glue_dir", str(tmp_path / "nowhere")], "not a directory")):
        with pytest.raises(SystemExit) as stop:
            device_run.main(["run", "mlm-taco", "--toy", "--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
