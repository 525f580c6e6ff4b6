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
import threading
import time
import types

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


# a stage that prints, then sleeps until a SIGTERM makes it "save" and exit 143, as a training run does; once its
# handler is set it makes the file sys.argv[1] (stage_clock's ready)
SAVES_ON_SIGTERM = ("import signal, sys, time\n"
                    "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(143)))\n"
                    "open(sys.argv[1], 'w').close(); print('started', flush=True); time.sleep(60)")


@pytest.fixture
def stage_clock(tmp_path, monkeypatch):
    """run_stage's clock stopped from a stage's start until the stage has made the file `ready` (its signal
    handling set): the deadlines and PACK_EVERY below, a second or less, count from there, as `now()` does. From
    the call, a Python start slowed past them (a loaded machine; 0.6 s was enough) got the signal before the stage's
    handler and died of it (-15), neither saving (143) nor ignoring it (SIGKILL after GRACE)."""
    ready, lag = tmp_path / "ready", [0.0]

    def popen_until_ready(*args, **kwargs):
        t0 = time.time()
        proc = subprocess.Popen(*args, **kwargs)
        while not ready.exists() and proc.poll() is None:
            time.sleep(0.01)
        ready.unlink(missing_ok=True)
        lag[0] += time.time() - t0
        return proc

    def now():
        return time.time() - lag[0]
    monkeypatch.setattr(device_run, "subprocess", types.SimpleNamespace(**{**vars(subprocess),
                                                                            "Popen": popen_until_ready}))
    monkeypatch.setattr(device_run, "time", types.SimpleNamespace(time=now, sleep=time.sleep))
    return types.SimpleNamespace(ready=str(ready), now=now)


def test_a_stage_gets_sigterm_at_the_deadline_then_sigkill(tmp_path, monkeypatch, stage_clock):
    monkeypatch.setattr(device_run, "GRACE", 1.0)
    lines, packs = [], []
    t0 = time.time()
    code, stopped = device_run.run_stage([sys.executable, "-c", SAVES_ON_SIGTERM, stage_clock.ready], dict(os.environ),
                                         lines.append, str(tmp_path / "a.out"), stage_clock.now() + 1.5,
                                         lambda: packs.append(1))
    assert stopped and code == 143 and time.time() - t0 < 10
    assert "saved\n" in lines and (tmp_path / "a.out").read_text() == "started\nsaved\n"
    deaf = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "open(sys.argv[1], 'w').close(); time.sleep(60)")
    code, stopped = device_run.run_stage([sys.executable, "-c", deaf, stage_clock.ready], dict(os.environ),
                                         lines.append, None, stage_clock.now() + 0.5, lambda: None)
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
                 "cache/tokens-x.uint16.json", "mlm/.lock", "mlm/log.jsonl.tmp", "results_curves_steps.png.tmp.png"):
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


def test_prepare_refuses_a_cut_or_empty_shard_before_copying_it(tmp_path):
    # was: the shard was copied over the checkout's good one, then the tokenizer's training failed with a
    # traceback (found by a fuzz of prepare's inputs)
    repo, shared = tmp_path / "repo", tmp_path / "shared"
    git_repo(repo)
    fake_shared(shared, 2000)
    argv = ["prepare", "--shared", str(shared), "--root", str(repo), "--vocab_size", "200"]
    assert device_run.main(argv) == 0
    copy = repo / device_run.DATA_DIR / "corpus" / "AA.txt.xz"
    good = copy.read_bytes()
    shard = shared / device_run.CORPUS / "AA.txt.xz"
    for cut in (good[:100], b"", lzma.compress(b"")):
        shard.write_bytes(cut)
        with pytest.raises(SystemExit) as stop:
            device_run.main(argv)
        assert str(stop.value.code).startswith(f"error: --shared {shared}: {shard} is not a readable .xz")
        assert copy.read_bytes() == good  # the earlier copy stays


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
                         # was: merged over the chunk's earlier folder, then refused (found by a fuzz of merge)
                         (["merge", str(tmp_path / "whole.tar.gz")], "mlm-taco/chunk.json is missing"),
                         (["merge", str(tmp_path / "whole.tar.gz"), "--into", str(tmp_path / "FILE")], "not a folder"),
                         (["run", "mlm-taco", "--toy", "--out", str(tmp_path / "FILE")], "not a folder"),
                         (["merge"], "no chunk in")]:  # no archive, nothing merged before
        with pytest.raises(SystemExit) as stop:
            device_run.main(argv + (["--into", str(into)] if argv[0] == "merge" and "--into" not in argv else []))
        message = str(stop.value.code)
        assert message.startswith("error: ") and needle in message and "\n" not in message, (argv, message)
    assert not into.exists()  # nothing was merged, not even an empty folder
    (into / "mlm-taco").mkdir(parents=True)  # a merged chunk whose chunk.json was damaged since: named, not "no chunk"
    (into / "mlm-taco" / "chunk.json").write_text('{"chunk": "mlm-ta')
    with pytest.raises(SystemExit) as stop:
        device_run.main(["merge", "--into", str(into)])
    assert str(stop.value.code) == f"error: {into / 'mlm-taco' / 'chunk.json'}: missing or damaged; merge mlm-taco.tar.gz again"


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


def test_run_flags_that_reproduce_py_would_refuse_are_refused_before_the_run(tmp_path, capsys, monkeypatch):
    # was: --steps 0 ran the default steps; --steps -5 or an unknown recipe failed every stage on the GPU machine
    monkeypatch.setattr(device_run, "run", lambda args: pytest.fail(f"ran with {args}"))
    for argv, needle in ((["--steps", "0"], "--steps 0: must be >= 1"), (["--extra_steps", "-5"], "--extra_steps -5"),
                         (["--glue_train_rows", "0"], "--glue_train_rows 0"),
                         (["--recipes", "paper,best"], "unknown GLUE recipe 'best'"), (["--recipes", ","], "unknown GLUE recipe ''"),
                         # were: the wheels and the CUDA check, then every stage failed (found by a fuzz of the flags)
                         (["--data", str(tmp_path / "nowhere.txt")], "--data"),
                         (["--tokenizer", str(tmp_path / "nowhere")], "--tokenizer")):
        with pytest.raises(SystemExit) as stop:
            device_run.main(["run", "mlm-taco", "--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# run()'s schedule, on a clock moved by hand: each stage a stand-in that takes the seconds it is given, at once


class Clock:
    """device_run's `time`, moved by hand: a stage of 300 s takes none of the test's."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


@pytest.fixture
def fake_chunk(tmp_path, monkeypatch):
    """run(CHUNK) at mini scale with its stages replaced by stand-ins ({name: seconds, (seconds, exit code), or a
    function of the call returning the seconds}; absent: 1 s) and the device check by a working GPU. Returns
    run(chunk, stages, *flags) -> (exit code, chunk.json as packed, the stages' calls, what each pack saw); each call
    packs into its own run.out. A stand-in running into its deadline stops there (exit 143), as run_stage does."""
    clock, calls, packs, runs = Clock(), [], [], []
    monkeypatch.setattr(device_run, "time", clock)
    monkeypatch.setattr(device_run, "WHEEL_DIR", str(tmp_path / "no_wheels"))
    check_device = device_run.check_device
    real_pack = device_run.pack

    def pack(chunk, work, out_dir, record):
        packs.append([(s["name"], s.get("status")) for s in record["stages"]])
        return real_pack(chunk, work, out_dir, record)
    monkeypatch.setattr(device_run, "pack", pack)
    (tmp_path / "glue").mkdir()
    (tmp_path / "corpus.txt").write_text("text\n")
    handler = signal.getsignal(signal.SIGTERM)  # run() makes SIGTERM a KeyboardInterrupt: not for the rest

    def run(chunk, stages, *flags):
        def run_stage(argv, env, log, out_path, deadline, pack, stop_signal=signal.SIGTERM):
            spec = stages.get(argv[-1], 1)
            seconds, code = spec if isinstance(spec, tuple) else (spec, 0)
            calls.append(dict(name=argv[-1], start=clock.now, deadline=deadline, signal=stop_signal))
            if callable(seconds):  # a stand-in with something to do
                seconds = seconds(calls[-1])
            if clock.now + seconds >= deadline:
                clock.now = max(clock.now, deadline)
                return 128 + stop_signal, True
            clock.now += seconds
            return code, False
        monkeypatch.setattr(device_run, "run_stage", run_stage)
        monkeypatch.setattr(device_run, "check_device", check_device if run.check_device else
                            lambda env, toy: dict(gpu="H100", torch="2", cuda="12"))
        monkeypatch.setattr(device_run, "stage_commands", lambda chunk, args, work: [
            (name, ["stage", name], bool(optional)) for name, _, *optional in device_run.CHUNKS[chunk]["stages"]])
        calls.clear()
        packs.clear()
        out = run.out = tmp_path / "out" / str(len(runs))
        runs.append(chunk)
        try:
            code = device_run.main(["run", chunk, "--out", str(out), "--work", str(out / "work"), "--data",
                                    str(tmp_path / "corpus.txt"), "--glue_dir", str(tmp_path / "glue"), *flags])
        finally:
            signal.signal(signal.SIGTERM, handler)
        with tarfile.open(out / f"{chunk}.tar.gz") as tar:
            record = json.load(tar.extractfile(f"{chunk}/chunk.json"))
        return code, record, list(calls), list(packs)
    run.clock, run.check_device = clock, False  # True: the real device check (of device_run.CHECK)
    return run


def test_a_stage_still_running_at_the_budget_less_the_pack_reserve_is_stopped_and_the_rest_skipped(fake_chunk):
    t0 = fake_chunk.clock.now
    code, record, calls, _ = fake_chunk("mlm-taco", {"pretrain mlm": 100, "pretrain taco": 1000}, "--budget", "420")
    deadline = t0 + 420 - device_run.PACK_RESERVE
    assert [c["deadline"] for c in calls] == [deadline] * 2 and calls[1]["start"] == t0 + 100
    assert code == 1 and record["finished"] is False
    assert [(s["name"], s["status"].split(",")[0]) for s in record["stages"]] == [
        ("pretrain mlm", "done"), ("pretrain taco", "stopped at the deadline"),
        ("analysis", "skipped: 0 s left"), ("glue", "skipped: 0 s left")]
    assert record["stages"][1]["wall_s"] == deadline - t0 - 100
    # under 5 s left: the next stage is not started, and a stage that fails is said to have
    code, record, calls, _ = fake_chunk("mlm-taco", {"pretrain mlm": (100, 3), "pretrain taco": 301}, "--budget", "420")
    assert [(s["name"], s["status"].split(",")[0]) for s in record["stages"]] == [
        ("pretrain mlm", "failed (exit 3)"), ("pretrain taco", "done"),
        ("analysis", "skipped: 4 s left"), ("glue", "skipped: 4 s left")]
    assert code == 1 and record["finished"] is False
    # every stage done in time: exit 0
    code, record, calls, _ = fake_chunk("mlm-taco", {}, "--budget", "420")
    assert code == 0 and record["finished"] is True and [s["status"] for s in record["stages"]] == ["done"] * 4


def test_an_optional_stage_starts_only_if_its_estimate_fits_and_its_skip_leaves_the_chunk_finished(fake_chunk):
    expected = device_run.estimate("tacl")["glue mlm"]
    assert expected > 30
    # the required stages leave 30 s of the budget: less than the optional stage's estimate
    required = 420 - device_run.PACK_RESERVE - 30
    code, record, calls, _ = fake_chunk("tacl", {"pretrain mlm": required - 3}, "--budget", "420")
    assert [c["name"] for c in calls] == ["pretrain mlm", "continue", "analysis", "glue"]
    assert record["stages"][-1]["status"] == f"skipped: 30 s left, {expected:.0f} s expected"
    assert code == 0 and record["finished"] is True
    # ...and it runs when its estimate fits
    code, record, calls, _ = fake_chunk("tacl", {"pretrain mlm": required - 3 - 2 * expected, "glue mlm": 20},
                                        "--budget", "420")
    assert code == 0 and [s["status"] for s in record["stages"]] == ["done"] * 5


def test_test_cuda_gets_sigint_and_at_most_its_cap(fake_chunk):
    # pytest prints its summary on SIGINT (SIGTERM ends it without one), and the check is capped at H100's seconds
    code, record, calls, _ = fake_chunk("speed", {"bench small": 100, "bench base": 100, "test_cuda": 1000},
                                        "--budget", "420")
    assert [c["signal"] for c in calls] == [signal.SIGTERM, signal.SIGTERM, signal.SIGINT]
    assert calls[2]["deadline"] == calls[2]["start"] + device_run.H100["test_cuda_s"] < calls[1]["deadline"]
    assert record["stages"][2]["status"] == "stopped at the deadline" and code == 1
    # with less of the budget left than the cap, the budget's deadline
    code, record, calls, _ = fake_chunk("speed", {"bench small": 300, "bench base": 70, "test_cuda": 1000},
                                        "--budget", "420")
    assert calls[2]["deadline"] == calls[0]["deadline"] < calls[2]["start"] + device_run.H100["test_cuda_s"]


def test_the_archive_is_rewritten_after_setup_and_after_each_stage(fake_chunk):
    code, record, calls, packs = fake_chunk("mlm-taco", {}, "--budget", "420")
    done = lambda n: [(name, "done") for name, _ in device_run.CHUNKS["mlm-taco"]["stages"][:n]]
    assert packs[0] == [] and all(done(n) in packs for n in range(1, 5)), packs
    assert packs[-1] == done(4) and record["total_s"] is not None


def test_a_stopped_glue_stages_finished_tasks_are_in_the_archive(fake_chunk):
    # eval.py writes each task it finishes into RUN/glue.part/: a GLUE stage stopped at the deadline leaves them
    # there, and the archive carries them merged into RUN/glue.json, stamped with the export's step
    def glue(call):
        part = fake_chunk.out / "work" / "mlm" / "glue.part"
        part.mkdir(parents=True)
        (part / "glue.json").write_text(json.dumps({"seeds": [1, 2], "tasks": {"cola": {"status": "ok"}}}))
        (part / "stamp.json").write_text(json.dumps({"training_step": 3000}))
        return 1000
    code, record, calls, _ = fake_chunk("mlm-taco", {"glue": glue}, "--budget", "420")
    assert record["stages"][-1]["status"] == "stopped at the deadline"
    with tarfile.open(fake_chunk.out / "mlm-taco.tar.gz") as tar:
        report = json.load(tar.extractfile("mlm-taco/mlm/glue.json"))
    assert report["tasks"]["cola"]["training_step"] == 3000


def test_no_working_cuda_gpu_stops_the_chunk_before_any_stage(fake_chunk, monkeypatch):
    fake_chunk.check_device = True
    check = lambda **info: f"import json; print('CHECK ' + json.dumps({dict(torch='2', cuda='12', **info)!r}))"
    for info in (dict(cuda_available=False), dict(cuda_available=True, matmul_finite=False)):
        monkeypatch.setattr(device_run, "CHECK", check(**info))
        code, record, calls, _ = fake_chunk("mlm-taco", {})
        assert code == 1 and not calls and record["stages"] == [] and not record["finished"], info
        assert record["error"].startswith("no working CUDA GPU (torch 2, CUDA 12)"), record["error"]
    monkeypatch.setattr(device_run, "CHECK", "import no_such_module_here")  # the check itself fails
    code, record, calls, _ = fake_chunk("mlm-taco", {})
    assert code == 1 and not calls and "the device check failed" in record["error"] and "no_such_module_here" in \
        record["error"]
    monkeypatch.setattr(device_run, "CHECK", check(cuda_available=True, matmul_finite=True) + "; raise SystemExit(3)")
    code, record, calls, _ = fake_chunk("mlm-taco", {})  # a check that ends badly after its line
    assert code == 1 and not calls and "the device check failed" in record["error"]
    monkeypatch.setattr(device_run, "CHECK", check(cuda_available=True, matmul_finite=True))
    code, record, calls, _ = fake_chunk("mlm-taco", {})
    assert code == 0 and len(calls) == 4 and record["device"]["matmul_finite"] is True
    monkeypatch.setattr(device_run, "CHECK", check(cuda_available=False))  # the toy scale runs on the CPU
    assert fake_chunk("mlm-taco", {}, "--toy")[0] == 0


def test_a_sigterm_to_the_command_ends_it_with_what_is_done_packed(fake_chunk):
    # the device tool's kill at its limit (or a Ctrl-C): the stage in flight ends (run_stage passes the signal on),
    # the archive says so, and the command exits 1
    signal.signal(signal.SIGTERM, lambda *a: None)  # run() must make SIGTERM a KeyboardInterrupt itself

    def killed(call):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)  # the signal interrupts this
        return 1
    code, record, calls, packs = fake_chunk("mlm-taco", {"pretrain taco": killed})
    assert code == 1 and record["error"] == "interrupted" and not record["finished"]
    assert [(s["name"], s.get("status")) for s in record["stages"]] == [("pretrain mlm", "done"),
                                                                       ("pretrain taco", None)]


# ---------------------------------------------------------------------------------------------
# run_stage: real processes


def test_a_stage_is_stopped_at_its_deadline_and_packed_while_it_runs(tmp_path, monkeypatch, stage_clock):
    monkeypatch.setattr(device_run, "GRACE", 5.0)
    monkeypatch.setattr(device_run, "PACK_EVERY", 0.3)
    lines, packs = [], []
    t0 = stage_clock.now()
    code, stopped = device_run.run_stage([sys.executable, "-c", SAVES_ON_SIGTERM, stage_clock.ready], dict(os.environ),
                                         lines.append, None, t0 + 1.2, lambda: packs.append(stage_clock.now()))
    assert stopped and code == 143 and "saved\n" in lines
    assert stage_clock.now() - t0 < 4  # at the deadline, not a grace period after it
    assert len(packs) >= 2 and all(t0 + 0.3 < t < t0 + 4 for t in packs), [t - t0 for t in packs]


def test_an_interrupt_as_the_stage_starts_reaches_the_stage(tmp_path, monkeypatch):
    # Ctrl-C (or the device tool's SIGTERM) right after the Popen: the stage, in a session of its own, hears
    # nothing of it unless run_stage passes it on, and would go on training on the device after the command
    ready, saved = tmp_path / "ready", tmp_path / "saved"

    class InterruptedAtStart(threading.Thread):
        def start(self):  # the interrupt lands once the stage is up (as a training run's handlers are)
            while not ready.exists():
                time.sleep(0.05)
            raise KeyboardInterrupt
    monkeypatch.setattr(device_run, "threading", types.SimpleNamespace(Thread=InterruptedAtStart))
    monkeypatch.setattr(device_run, "GRACE", 10.0)
    stage = ("import signal, sys, time\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (open({str(saved)!r}, 'w').close(), sys.exit(143)))\n"
             f"open({str(ready)!r}, 'w').close(); time.sleep(60)")
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        device_run.run_stage([sys.executable, "-c", stage], dict(os.environ), lambda line: None, None,
                             time.time() + 60, lambda: None)
    assert saved.exists() and time.time() - t0 < 10


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_stage_deaf_to_sigterm_is_killed_with_its_children(tmp_path, monkeypatch, stage_clock):
    # the stage is reproduce.py, whose eval.py and train.py run in its process group: SIGKILL reaches them all, or
    # a GPU job outlives the command and the next call on the warm machine runs beside it
    monkeypatch.setattr(device_run, "GRACE", 0.5)
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    stage = (f"import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             f"child = subprocess.Popen([sys.executable, '-c', {deaf!r}])\n"
             f"print(child.pid, flush=True); open(sys.argv[1], 'w').close(); time.sleep(60)")
    lines = []
    code, stopped = device_run.run_stage([sys.executable, "-c", stage, stage_clock.ready], dict(os.environ),
                                         lines.append, None, stage_clock.now() + 1.0, lambda: None)
    child = int(next(line for line in lines if line.strip().isdigit()))

    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        t0 = time.time()
        while alive(child) and time.time() - t0 < 5:
            time.sleep(0.1)
        assert stopped and code == -signal.SIGKILL and not alive(child)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_interrupted_command_passes_the_stop_to_its_stage(monkeypatch, stage_clock):
    # SIGTERM to device_run (a KeyboardInterrupt in run()) while a stage runs: the stage gets its stop signal and
    # saves before device_run packs and exits
    monkeypatch.setattr(device_run, "PACK_EVERY", 0.3)
    monkeypatch.setattr(device_run, "GRACE", 5.0)

    def interrupt():
        raise KeyboardInterrupt
    lines = []
    t0 = stage_clock.now()
    with pytest.raises(KeyboardInterrupt):
        device_run.run_stage([sys.executable, "-c", SAVES_ON_SIGTERM, stage_clock.ready], dict(os.environ),
                             lines.append, None, t0 + 60, interrupt)
    assert "saved\n" in lines and stage_clock.now() - t0 < 4


def make_wheel(folder, name, version, body="VALUE = 1\n"):
    """A pure-Python wheel of one module, as pip takes it."""
    import zipfile
    info = f"{name}-{version}.dist-info"
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", body)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def test_missing_wheels_are_installed_where_every_stage_imports_them(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # install_wheels puts the site first
    monkeypatch.delenv("PYTHONPATH", raising=False)
    wheels, site, lines = tmp_path / "wheels", str(tmp_path / "site"), []
    wheels.mkdir()
    make_wheel(str(wheels), "bertcl_fake_wheel", "1.0")
    env, installed = device_run.install_wheels(str(wheels), site, lines.append)
    assert installed == ["bertcl_fake_wheel-1.0-py3-none-any.whl"] and env["PYTHONPATH"].split(os.pathsep)[0] == site
    child = subprocess.run([sys.executable, "-c", "import bertcl_fake_wheel as m; print(m.VALUE)"], env=env,
                           capture_output=True, text=True, cwd=tmp_path)
    assert child.stdout.strip() == "1", child.stderr  # each stage (and the device check) is such a child
    # the same call on the warm machine: installed already, nothing to do
    env, installed = device_run.install_wheels(str(wheels), site, lines.append)
    assert installed == [] and lines[-1].startswith("wheels: installed none")
    # a wheel pip refuses: the command stops there, saying which
    (wheels / "bertcl_broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(RuntimeError, match="pip could not install bertcl_broken-1.0-py3-none-any.whl"):
        device_run.install_wheels(str(wheels), site, lines.append)


def test_each_chunks_stages_are_reproduce_calls_at_mini_scale_in_their_order(tmp_path):
    (tmp_path / "glue").mkdir()
    (tmp_path / "tok").mkdir()
    (tmp_path / "corpus.txt").write_text("text\n")
    args = reproduce.argparse.Namespace(toy=False, steps=None, extra_steps=None, recipes="paper", glue_train_rows=None,
                                        tokenizer=str(tmp_path / "tok"), data=str(tmp_path / "corpus.txt"),
                                        glue_dir=str(tmp_path / "glue"))
    for chunk in ("mlm-taco", "electra-cocolm", "tacl"):
        stages = device_run.stage_commands(chunk, args, str(tmp_path / "work"))
        assert [(name, optional) for name, _, optional in stages] == [
            (name, bool(optional)) for name, _, *optional in device_run.CHUNKS[chunk]["stages"]]
        for name, argv, _ in stages:
            assert argv[1] == "reproduce.py", argv
            parsed = reproduce.parse(argv[2:])  # what reproduce.py makes of it
            assert (parsed.scale, parsed.steps, parsed.extra_steps, parsed.glue_train_rows) == (
                "mini", 3000, 1000, 3000 if chunk == "electra-cocolm" else 8551), (chunk, name)
            assert (parsed.tokenizer, parsed.data, parsed.glue_dir, parsed.out_dir) == (
                args.tokenizer, args.data, args.glue_dir, str(tmp_path / "work"))
    by_name = {name: reproduce.parse(argv[2:]) for name, argv, _ in device_run.stage_commands("tacl", args, "w")}
    assert by_name["pretrain mlm"].runs == ["mlm", "tacl", "mlm_cont"]  # tacl's objectives: its start, its control
    assert [(a.stages, a.selected) for a in by_name.values()] == [
        (["pretrain"], ["mlm"]), (["continue"], ["mlm", "tacl", "mlm_cont"]),
        (["analysis"], ["mlm", "tacl", "mlm_cont"]), (["glue"], ["tacl", "mlm_cont"]), (["glue"], ["mlm"])]



def test_toy_chunks_pass_the_glue_rows_and_tokenizer_they_are_given(tmp_path):
    # was: --toy dropped --glue_train_rows and --tokenizer from reproduce.py's calls, silently (found by a fuzz)
    (tmp_path / "glue").mkdir()
    (tmp_path / "tok").mkdir()
    args = reproduce.argparse.Namespace(toy=True, steps=None, extra_steps=None, recipes="paper", glue_train_rows=7,
                                        tokenizer=str(tmp_path / "tok"), data="", glue_dir=str(tmp_path / "glue"))
    for name, argv, _ in device_run.stage_commands("tacl", args, str(tmp_path / "work")):
        parsed = reproduce.parse(argv[2:])
        assert (parsed.scale, parsed.glue_train_rows, parsed.tokenizer) == ("toy", 7, args.tokenizer), name
    args.glue_train_rows, args.tokenizer = None, ""  # not given: the toy scale's 64, a tokenizer trained on --data
    assert {reproduce.parse(argv[2:]).glue_train_rows for _, argv, _ in device_run.stage_commands("tacl", args, "w")} \
        == {64}


# ---------------------------------------------------------------------------------------------
# merge: archives packed here by pack() from hand-made work folders (the speed chunk: no reproduce.py runs)


def speed_archive(tmp_path, name, sizes=("small", "base"), test_cuda="stopped at the deadline"):
    """The speed chunk's archive as run() packs it: bench.py's JSON per size (small's MLM at 1,000,000 tokens/s,
    base's at 300,000), a profiler trace, test_cuda.py's output."""
    work = tmp_path / name / "work"
    (work / "bench" / "profile").mkdir(parents=True)
    for size in sizes:
        rows = [dict(model_size=size, objective=o, params_m=29.1 if size == "small" else 110.1, step_ms=10.0,
                     tokens_per_s=(1_000_000 if size == "small" else 300_000) // (1 + (o != "mlm")), vs_mlm=1.0)
                for o in ("mlm", "hf-mlm")]
        (work / "bench" / f"bench_{size}.json").write_text(json.dumps(dict(info=dict(command=f"bench {size}"),
                                                                            results=rows, hf_ratios=[])))
    with open(work / "bench" / "profile" / "trace.json.gz", "wb") as f:
        f.write(b"trace")
    (work / "test_cuda.out").write_text("....\n4 passed in 50.0s\n")
    stages = [dict(name="bench small", status="done", wall_s=150.0, optional=False),
              dict(name="bench base", status="done", wall_s=140.0, optional=False),
              dict(name="test_cuda", status=test_cuda, wall_s=61.0, optional=False)]
    record = dict(chunk="speed", title=device_run.CHUNKS["speed"]["title"], scale="mini", command="python x",
                  device=dict(gpu="H100", torch="2.5", cuda="12.4"), source=dict(commit="a" * 40, dirty=False),
                  estimate_s=device_run.estimate("speed"), setup_s=7.0, stages=stages,
                  finished=test_cuda == "done", total_s=370.0)
    (tmp_path / name / "out").mkdir()
    return device_run.pack("speed", str(work), str(tmp_path / name / "out"), record)


def test_a_merged_speed_chunk_is_reported_from_its_own_files_and_replaced_whole_when_merged_again(tmp_path):
    into = tmp_path / "mini"
    assert device_run.main(["merge", speed_archive(tmp_path, "first"), "--into", str(into)]) == 0
    text = (into / "results.md").read_text()
    assert "| `speed` | Speed like for like against Hugging Face | partial: 2/3 stages | H100 | 2.5 / 12.4 |" in text
    assert "| `mlm-taco` | MLM against TACO at equal steps | **not run yet** |" in text
    # each size's table from its own bench_SIZE.json
    small, base = text.index("`bench small`"), text.index("`bench base`")
    assert small < text.index("| small | mlm | 29.1 | 1,000,000 |") < base
    assert base < text.index("| base | mlm | 110.1 | 300,000 |")
    # each stage's estimate beside what it took
    assert f"| `speed` | bench small | {device_run.estimate('speed')['bench small']:.0f} s | 150 s | done |" in text
    assert "| `speed` | setup | 8 s | 7 s | |" in text
    assert "test_cuda.py (in-process checks, at most 60 s): stopped at the deadline; pytest: 4 passed in 50.0s" in text
    assert not (into / "speed" / "bench" / "profile" / "trace.json.gz").exists()  # traces stay in the archive
    # merged again, from a run that measured small only: the chunk's folder is the new archive's, whole
    again = speed_archive(tmp_path, "second", sizes=("small",), test_cuda="done")
    assert device_run.main(["merge", again, "--into", str(into)]) == 0
    assert not (into / "speed" / "bench" / "bench_base.json").exists()
    text = (into / "results.md").read_text()
    assert "bench base: not run." in text
    assert "| `speed` | Speed like for like against Hugging Face | finished |" in text
    # no archives: the report is rebuilt from every chunk already in the folder
    (into / "results.md").unlink()
    assert device_run.main(["merge", "--into", str(into)]) == 0
    assert (into / "results.md").read_text() == text


def mlm_results(loss, tokens_per_s, glue_avg, steps=3000):
    """(reproduce.collect's results, plots) of a chunk whose MLM run has these numbers."""
    mlm = dict(steps=steps, tokens_per_step=32768, tokens_per_s=tokens_per_s,
               final=dict(val_mlm_loss=loss, val_mlm_acc=0.5, contextual_score=0.25),
               glue_by_recipe={"paper": dict(avg=glue_avg)})
    return dict(scale="mini", seed=1337, recipes=["paper"], runs={"mlm": mlm}), []


def test_the_mlm_run_of_two_chunks_is_compared_only_on_the_same_corpus_and_tokenizer():
    data = dict(corpus={"AA.txt.xz": 100, "AB.txt.xz": 200}, tokenizer_sha256="t" * 64)
    records = {"mlm-taco": dict(data=data, device=dict(gpu="H100")), "tacl": dict(data=data, device=dict(gpu="H200"))}
    results = {"mlm-taco": mlm_results(2.0, 1.0e6, 70.0), "tacl": mlm_results(2.5, 1.2e6, 71.5)}
    text = "\n".join(device_run.reproducibility(records, results))
    assert "machines: H100 and H200" in text and "| MLM run | `mlm-taco` | `tacl` | difference |" in text
    # the first chunk's number, the second's, the second less the first
    assert "| held-out MLM loss | 2.0000 | 2.5000 | 0.5000 |" in text
    assert "| tokens/s | 1000000 | 1200000 | 200000 |" in text
    assert "| GLUE Avg, paper recipe | 70.00 | 71.50 | 1.50 |" in text
    for key, other, needle in (("corpus", {"AA.txt.xz": 100}, "its corpus"),
                               ("tokenizer_sha256", "u" * 64, "its tokenizer_sha256")):
        for changed in ("mlm-taco", "tacl"):
            diverged = {c: dict(r, data=dict(data, **{key: other}) if c == changed else data)
                        for c, r in records.items()}
            text = "\n".join(device_run.reproducibility(diverged, results))
            assert f"Not comparable: the two MLM runs differ in {needle}." in text and "| held-out" not in text
    shorter = {**results, "tacl": mlm_results(2.5, 1.2e6, 71.5, steps=2000)}
    text = "\n".join(device_run.reproducibility(records, shorter))
    assert "Not comparable: the two MLM runs differ in steps." in text
    assert device_run.reproducibility({"tacl": records["tacl"]}, {"tacl": results["tacl"]}) == []


def test_a_copy_is_made_again_only_when_its_source_changed(tmp_path):
    src, dst = tmp_path / "src.txt", tmp_path / "copy" / "dst.txt"
    src.write_text("abc")
    device_run.copy_if_changed(str(src), str(dst))
    assert dst.read_text() == "abc"
    stamp = dst.stat().st_ino, dst.stat().st_mtime_ns
    device_run.copy_if_changed(str(src), str(dst))
    assert (dst.stat().st_ino, dst.stat().st_mtime_ns) == stamp  # unchanged: not copied again
    src.write_text("xyz")  # the same size, written later
    os.utime(src, ns=(dst.stat().st_mtime_ns + 10**9,) * 2)
    device_run.copy_if_changed(str(src), str(dst))
    assert dst.read_text() == "xyz"
    src.write_text("longer")
    os.utime(src, ns=(dst.stat().st_mtime_ns - 10**9,) * 2)  # older, but another size
    device_run.copy_if_changed(str(src), str(dst))
    assert dst.read_text() == "longer"


def test_the_tree_that_travels_counts_shared_and_the_carried_folder_once_whatever_git_says(tmp_path):
    # the device tool copies shared/ even where git ignores it, and the carried folders though git ignores them
    repo = tmp_path / "repo"
    git_repo(repo)
    (repo / "shared").mkdir()
    (repo / "shared" / "data.bin").write_bytes(b"x" * 1000)
    (repo / ".repro_data").mkdir()
    (repo / ".repro_data" / "c.txt").write_bytes(b"y" * 300)
    (repo / "untracked.py").write_bytes(b"z" * 50)
    files = sum(os.path.getsize(repo / f) for f in ("a.py", ".gitignore"))
    assert device_run.TRAVEL_LIMIT == 64 * 2**20  # the device tool's limit: MiB, not MB
    sizes = device_run.tree_size(str(repo), [device_run.DATA_DIR])
    assert sizes == {"tracked and untracked files": files + 50, "shared/": 1000, ".repro_data/": 300}
    (repo / ".gitignore").write_text(".repro_data/\n.whl/\nshared/\n")
    assert device_run.tree_size(str(repo), [device_run.DATA_DIR])["shared/"] == 1000


def test_without_git_code_changed_since_prepare_is_reported_as_uncommitted_changes(tmp_path, monkeypatch):
    (tmp_path / "source.json").write_text(json.dumps(dict(commit="abc123", dirty=False, files=["model.py"],
                                                          sha256="0" * 64)))  # not model.py's bytes now
    monkeypatch.setattr(device_run, "DATA_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    record = device_run.source_provenance()
    assert record["commit"] == "abc123" and record["dirty"] is True and record["read_from"] == "prepare's source.json"


def test_prepare_refuses_a_tree_over_the_limit_once_the_tokenizer_is_trained(tmp_path, monkeypatch):
    # prepare counts the tokenizer as 2 MiB before it trains it: a larger one is caught by the tree measured after
    repo, shared = tmp_path / "repo", tmp_path / "shared"
    git_repo(repo)
    fake_shared(shared, 2000)

    def tokenizer(corpus_dir, out, vocab_size):
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tokenizer.json"), "wb") as f:
            f.write(b"t" * (3 * 2**20))
    monkeypatch.setattr(device_run, "train_tokenizer", tokenizer)
    files = [*(shared / device_run.CORPUS).iterdir(), *(shared / device_run.GLUE).rglob("*.tsv"),
             *(shared / "wheels").iterdir()]
    before = sum(device_run.tree_size(str(repo), [device_run.DATA_DIR]).values()) + sum(f.stat().st_size for f in files)
    monkeypatch.setattr(device_run, "TRAVEL_LIMIT", before + int(2.5 * 2**20))  # fits with 2 MiB, not with 3
    with pytest.raises(SystemExit, match=r"error: the tree that travels is \d+\.\d MiB, over the device tool's"):
        device_run.main(["prepare", "--shared", str(shared), "--root", str(repo)])
