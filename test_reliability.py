"""train.py's guarantees (issue 10): every flag validated in one place, a diverging run stopped before
it saves NaN, checkpoints loaded without running code, a run directory that stays one consistent
unit (own tokenizer, export agrees with ckpt.pt, lock, exact data position across layouts,
repaired log, SIGTERM), and the provenance in log.jsonl. Most runs call train.main() in-process."""
import ast
import copy
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import atomic
import config
import data
import hf_io
import losses
import model
import rundir
import token_files
import train
from console import Console
from test_train import write_corpus, read_log

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "toy.txt", n_sentences=3000)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # one tokenizer for every run of this file


def flags(corpus, cache, out, **over):
    values = dict(data=corpus, cache_dir=cache, out_dir=out, vocab_size=200, seq_len=32, batch_size=8,
                  tokens_per_step=256, max_steps=20, lr=2e-3, warmup_steps=2, log_interval=5, eval_interval=1000,
                  eval_batches=1, ckpt_interval=10)
    values.update(over)
    return [x for k, v in values.items() for x in (f"--{k}", str(v))]


def run_main(argv, capsys):
    """train.main(argv) in this process: (exit code, stdout, stderr)."""
    try:
        train.main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error(err, *needles):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---- 1. one validation of the whole config

BAD_VALUES = [
    ("log_interval", "0"), ("eval_interval", "0"), ("ckpt_interval", "0"), ("eval_batches", "0"),
    ("batch_size", "0"), ("seq_len", "0"), ("seq_len", "2"), ("tokens_per_step", "0"),
    ("mask_prob", "1.5"), ("mask_prob", "-0.1"), ("mask_prob", "0"), ("taco_window", "0"), ("taco_window", "1"),
    ("taco_window", "4"), ("taco_window", "10001"), ("taco_window", "65"),  # 65: not < 2 x seq_len 32
    ("cocolm_crop_fraction", "2"), ("cocolm_crop_fraction", "0"), ("dtype", "fp8"), ("device", "tpu"),
    ("device", "cuda:x"), ("max_steps", "-5"), ("max_steps", "0"), ("lr", "0"), ("lr", "nan"), ("lr", "inf"),
    ("warmup_steps", "50"), ("warmup_steps", "-1"), ("weight_decay", "-0.1"), ("grad_clip", "-1"),
    ("gen_layers", "-1"), ("vocab_size", "0"), ("vocab_size", "10"), ("taco_negatives", "0"),
    ("taco_temperature", "0"), ("tacl_temperature", "-1"), ("cocolm_scl_temperature", "0"), ("adam_eps", "0"),
    ("beta2", "1"), ("dropout", "1"), ("val_fraction", "0.9"), ("val_fraction", "-0.1"), ("negative_pool", "-1"),
    ("negative_pool", "1"),  # under MLM too: the held-out batch's rows, and its contextual score was NaN
    ("taco_anchors", "some"), ("gen_shape", "bart"), ("model_size", "huge"), ("objective", "bogus"),
    ("taco_weight", "-1"), ("out_dir", ""), ("out_dir", "FILE"), ("out_dir", "FILE/run"), ("cache_dir", "FILE"),
    ("seed", "-1"), ("seed", str(2 ** 64)), ("data", ""), ("data", " "), ("init_from", "FILE/missing"),
    ("vocab_size", str(10 ** 20)), ("mask_prob", "0.01"), ("tokens_per_step", str(2 ** 71)),  # 0.01 x 30 tokens rounds to no masked token a row
    ("mask_prob", "0.016666667"),  # x 30 tokens: 0.50000001 in Python, but 0.5 -> 0 masked in mask_tokens' float32
    ("limit_alphabet", "-1"), ("cased", "maybe"),
]
if not torch.cuda.is_available():
    BAD_VALUES.append(("device", "cuda"))


def test_every_bad_flag_is_one_error_line(corpus, cache, tmp_path, capsys):
    (tmp_path / "FILE").write_text("a file, not a directory")
    for name, value in BAD_VALUES:
        value = value.replace("FILE", str(tmp_path / "FILE"))
        code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=40) + [f"--{name}", value], capsys)
        assert code == 2, (name, value, code, err)
        one_error(err, f"--{name}")
    assert not (tmp_path / "run").exists()  # validation comes before anything is written
    # TACO's K beyond its pool's tokens: refused, not an out-of-memory kill with no message
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", objective="taco", taco_negatives=100000), capsys)
    assert code == 2
    one_error(err, "--taco_negatives", f"<= {7 * 32}")
    # a pool of 1 set by --negative_pool is refused under that flag, not under --batch_size (found by a flag fuzz)
    for objective in ("taco", "cocolm"):
        code, out, err = run_main(flags(corpus, cache, tmp_path / "run", objective=objective, negative_pool=1), capsys)
        assert code == 2 and one_error(err, "--negative_pool 1:", ">= 2 sequences")


def test_the_lowest_value_each_flag_allows_is_accepted(tmp_path):
    # the other side of BAD_VALUES: 0 is "off" for warm-up, clipping, decay, dropout, the pool and gen_layers
    cfg = config.TrainConfig(warmup_steps=0, grad_clip=0.0, weight_decay=0.0, dropout=0.0, negative_pool=0,
                             gen_layers=0, taco_weight=0.0, beta2=0.0, seed=0, seq_len=32, taco_window=63,
                             out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"))
    config.validate(cfg)  # taco_window 63: the widest below 2 x seq_len


def test_a_lock_that_cannot_be_opened_is_one_error_line(corpus, cache, tmp_path, capsys):
    (tmp_path / "run" / ".lock").mkdir(parents=True)
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run"), capsys)
    assert code == 2
    one_error(err, "cannot open the lock file")


def test_a_dangling_symlink_as_out_dir_or_cache_dir_is_one_error_line(corpus, cache, tmp_path, capsys):
    # os.makedirs fails on it with "[Errno 17] File exists" (train.py: exit 1; eval.py --out: a traceback)
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for argv, name in ((flags(corpus, cache, tmp_path / "link"), "--out_dir"),
                       (flags(corpus, cache, tmp_path / "link" / "run"), "--out_dir"),
                       (flags(corpus, tmp_path / "link", tmp_path / "run"), "--cache_dir")):
        code, _, err = run_main(argv, capsys)
        assert code == 2 and not (tmp_path / "gone").exists() and not (tmp_path / "run").exists()
        one_error(err, name, f"{tmp_path / 'link'} is a symbolic link to {tmp_path / 'gone'}, which does not exist")


def test_a_tilde_in_out_dir_is_home_as_in_data_and_cache_dir(corpus, cache, tmp_path, capsys, monkeypatch):
    # bash expands ~ in `--out_dir ~/run` but not in `--out_dir=~/run`: train.py expanded --data's and --cache_dir's,
    # and made a folder named ~ in the working directory for --out_dir's
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir((tmp_path / "cwd").mkdir() or tmp_path / "cwd")
    argv = flags(corpus, cache, "~/run", max_steps=2, ckpt_interval=2)
    code, _, err = run_main(argv, capsys)
    assert code == 0 and (tmp_path / "home" / "run" / "ckpt.pt").exists() and not os.listdir(tmp_path / "cwd"), err
    code, out, err = run_main(["--resume=~/run", "--max_steps", "3"], capsys)
    assert code == 0 and torch.load(tmp_path / "home" / "run" / "ckpt.pt", weights_only=True)["step"] == 3, err


def test_more_torchrun_processes_than_gpus_is_one_error_line(corpus, cache, tmp_path, capsys, monkeypatch):
    # torchrun --nproc_per_node=2 on a 1-GPU machine: rank 1 would die in cuda.set_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")  # only the surplus rank meets it, so that rank says it (rank 0 trains on)
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run"), capsys)
    assert code == 2
    assert err.startswith("error (rank 1): ") and len(err.strip().splitlines()) == 1, err
    for needle in ("--device", "local process 1", "1 CUDA device(s)", "--nproc_per_node"):
        assert needle in err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("LOCAL_RANK", "2")  # flags every rank shares: rank 0 alone says what is wrong
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run") + ["--objective", "bogus"], capsys)
    assert code == 2 and err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")  # another node's first process: its disk may differ, so it says too
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run") + ["--objective", "bogus"], capsys)
    assert code == 2 and err.startswith("error (rank 1): --objective 'bogus'")


def test_a_missing_data_path_leaves_no_run_directory(cache, tmp_path, capsys):
    # found only when the corpus is read, after the lock made --out_dir: the empty directory goes again
    code, _, err = run_main(flags(tmp_path / "nowhere.txt", cache, tmp_path / "run"), capsys)
    assert code == 2 and not (tmp_path / "run").exists()
    one_error(err, "nowhere.txt")


def test_a_run_stopped_before_its_first_checkpoint_starts_again_and_says_so(corpus, cache, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.jsonl").write_text('{"config": {}}\n{"step": 5, "loss": 9.0}\n')
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=2), capsys)
    assert code == 0 and "holds a run stopped before its first checkpoint: it starts again from step 0" in out, err
    # a finished export whose ckpt.pt is gone (or any model directory) is not trained over
    os.remove(tmp_path / "run" / "ckpt.pt")
    export = (tmp_path / "run" / "model.safetensors").read_bytes()
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=2), capsys)
    assert code == 2 and (tmp_path / "run" / "model.safetensors").read_bytes() == export
    one_error(err, "holds a model (config.json) but no ckpt.pt")
    os.remove(tmp_path / "run" / "config.json")  # the weights alone are a model too
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=2), capsys)
    assert code == 2 and (tmp_path / "run" / "model.safetensors").read_bytes() == export
    one_error(err, "holds a model (model.safetensors) but no ckpt.pt")
    # a tokenizer of the user's own in --out_dir: the run's tokenizer files would overwrite it
    os.remove(tmp_path / "run" / "model.safetensors")
    config_before = (tmp_path / "run" / "tokenizer_config.json").read_bytes()
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=2, tokenizer=tmp_path / "run"), capsys)
    assert code == 2 and (tmp_path / "run" / "tokenizer_config.json").read_bytes() == config_before
    one_error(err, "--tokenizer", "is in --out_dir")


def test_a_fixed_cuda_device_under_torchrun_is_refused(corpus, cache, tmp_path, capsys, monkeypatch):
    """Every torchrun process would train on the same GPU: refused before anything starts."""
    monkeypatch.setenv("RANK", "0")
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run") + ["--device", "cuda:1"], capsys)
    assert code == 2 and not (tmp_path / "run").exists()
    one_error(err, "--device", "cuda:LOCAL_RANK")


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),  # a stray `export RANK=0`: a KeyError traceback before
    ({"RANK": "0", "WORLD_SIZE": "1"}, "RANK is set but LOCAL_RANK is not"),
    ({"RANK": "abc", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "RANK='abc'"),  # a ValueError traceback, outside the try
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc'"),  # "invalid literal for int()"
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, "RANK must be below WORLD_SIZE")])
def test_a_half_set_torchrun_environment_is_one_error_line(corpus, cache, tmp_path, capsys, monkeypatch, env, needle):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run"), capsys)
    assert code == 2 and not (tmp_path / "run").exists()
    one_error(err, needle)


@pytest.mark.slow
def test_a_torchrun_process_that_never_joins_is_one_error_line(corpus, cache, tmp_path):
    # WORLD_SIZE=2 and no second process (it never started, stopped on bad input, or has another MASTER_PORT): the
    # rendezvous times out after DDP_TIMEOUT (here 3 s), which was torch's DistStoreError traceback; after JOIN_NOTE
    # (here 1 s) it says it waits, where it was silent for the whole 15 minutes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import datetime, sys, distributed; distributed.DDP_TIMEOUT = datetime.timedelta(seconds=3); "
              "distributed.JOIN_NOTE = datetime.timedelta(seconds=1); "
              "import train; train.main(sys.argv[1:])")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-c", script, *map(str, flags(corpus, cache, tmp_path / "run"))], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), proc.stderr
    note, rest = proc.stderr.split("\n", 1)
    assert note == (f"rank 0: waiting for all WORLD_SIZE=2 processes to join torchrun's rendezvous at 127.0.0.1:{port} "
                    f"(one that stopped on an error says why on its own node); giving up after 0:00:03"), proc.stderr
    one_error(rest, f"torchrun's rendezvous at 127.0.0.1:{port} failed", "1/2 clients joined",
              "all WORLD_SIZE=2 processes must start", "one that stopped on an error before joining says why")


WORKER = ("import datetime, os, sys, types, torch, torch.distributed as dist, distributed; "
          "distributed.DDP_TIMEOUT = distributed.DATA_TIMEOUT = datetime.timedelta(seconds=20); "
          "layout = distributed.setup(types.SimpleNamespace(device='cpu')); "
          "[dist.all_reduce(torch.ones(1), group=g) for g in (None, layout.data_group, layout.stop_group)]; "
          "print('joined', flush=True); os._exit(0)")  # dies as a killed worker does: its keys stay in the store


@pytest.mark.slow
def test_a_torchrun_restart_meets_on_its_own_attempts_keys(tmp_path):
    # torchrun's c10d rendezvous (--standalone) hands its workers its own TCPStore, which outlives a --max_restarts
    # restart: a restarted worker read a dead one's gloo address there and failed ("Connection refused", a restart used
    # up) or hung connecting, up to the data group's 6 hours; found by kill -9 of a worker under --max_restarts=2
    from torch.distributed import TCPStore
    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's store: it outlives both
    env = lambda rank, attempt: {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                 "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port),
                                 "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1",
                                 "TORCHELASTIC_RESTART_COUNT": str(attempt), "OMP_NUM_THREADS": "1"}
    for attempt in (0, 1):
        workers = []
        for rank in (0, 1):  # in attempt 1 rank 0 comes first and meets rank 1's entry of attempt 0 (a dead process)
            workers.append(subprocess.Popen([sys.executable, "-c", WORKER], cwd=HERE, env=env(rank, attempt),
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            time.sleep(3 if attempt else 0)
        for rank, proc in enumerate(workers):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 and out == "joined\n", f"attempt {attempt}, rank {rank}: {err[-2000:]}"


def test_a_restarted_worker_group_does_not_see_the_dead_groups_keys(monkeypatch):
    # the slow test above catches the stale keys only when gloo's random ports make the early rank connect: this one
    # looks at the store itself
    import distributed
    from torch.distributed import TCPStore
    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # torchrun's, outliving its workers
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    distributed.restart_store(2).set("rank_1_address", "a dead worker's")
    assert distributed.restart_store(2).check(["rank_1_address"])  # the same attempt sees it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not distributed.restart_store(2).check(["rank_1_address"])  # the restarted group does not
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert distributed.restart_store(2) is None  # torchrun's own env:// rendezvous


def test_torchrun_restarts_across_nodes_on_the_shared_store_get_a_note(capsys, monkeypatch):
    # across nodes each torchrun counts its own restarts, so the attempt's keys can differ between nodes: rank 0 says
    # so, and what gives each restart a store of its own; one node, or no --max_restarts, says nothing
    import types
    import distributed
    import torch.distributed as dist
    seen = {}
    monkeypatch.setattr(distributed, "restart_store", lambda world: seen.setdefault("store", world) and None)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: None)
    monkeypatch.setattr(distributed.sys, "platform", "elsewhere")  # not this test process's parent-death signal
    for local_world, restarts, said in (("1", "3", True), ("2", "3", False), ("1", "0", False)):
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": local_world,
                            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": restarts}.items():
            monkeypatch.setenv(name, value)
        distributed.setup(types.SimpleNamespace(device="cpu"))
        out = capsys.readouterr().out
        assert ("note: torchrun --max_restarts 3 across nodes" in out and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on "
                "every node" in out) is said, out
    assert seen["store"] == 2


def test_setup_meets_in_the_attempts_store_and_says_it_waits_only_while_it_waits(capsys, monkeypatch):
    # restart_store's prefix (tested above alone) keeps a restart off the dead workers' keys only if setup hands that
    # store to init_process_group; the join note comes after JOIN_NOTE of waiting, and never once the group has met
    import datetime
    import types
    import distributed
    import torch.distributed as dist
    attempt, seen = object(), {}
    monkeypatch.setattr(distributed, "restart_store", lambda world: attempt)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: None)
    monkeypatch.setattr(distributed.sys, "platform", "elsewhere")  # not this test process's parent-death signal
    monkeypatch.setattr(distributed, "JOIN_NOTE", datetime.timedelta(seconds=0.1))  # wide margins: a loaded CI box
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    for join_s, said in ((0.8, True), (0, False)):
        monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.update(k) or time.sleep(join_s))
        distributed.setup(types.SimpleNamespace(device="cpu"))
        time.sleep(0.4)  # past JOIN_NOTE: a note left running would print now, in a run that has started
        err = capsys.readouterr().err
        assert ("rank 0: waiting for all WORLD_SIZE=2 processes to join torchrun's rendezvous at 127.0.0.1:29500"
                in err) is said, err
        assert seen.pop("store") is attempt and seen.pop("rank") == 0 and seen.pop("world_size") == 2


def test_strict_json_writes_every_non_finite_float_as_null():
    import atomic  # in dicts, lists and tuples (json.dumps writes a tuple as a list, and a NaN in it bare)
    obj = {"a": [1.0, float("nan")], "b": (float("inf"), {"c": -float("inf")}), "d": 2, "e": "nan"}
    assert atomic.strict_json(obj) == '{"a": [1.0, null], "b": [null, {"c": null}], "d": 2, "e": "nan"}'


def test_help_shows_the_chosen_preset(capsys):
    code, out, _ = run_main(["--preset", "small", "--help"], capsys)
    row = next(line for line in out.splitlines() if line.strip().startswith("--preset "))
    assert code == 0 and "'small'" in row, row


def test_help_lists_an_objective_added_to_losses(capsys, monkeypatch):
    monkeypatch.setitem(losses.LOSSES, "taco2", losses.TACO)  # an ablation's copy, registered in LOSSES
    code, out, _ = run_main(["--help"], capsys)
    row = next(line for line in out.splitlines() if line.strip().startswith("--objective "))
    # every name in LOSSES, whatever else an ablation registered there (a fixed list of the five failed on one)
    assert code == 0 and row.endswith(" | ".join(losses.LOSSES) + " (losses.LOSSES)") and "| taco2 (" in row, row


# ---- 2. divergence: stop before a NaN is saved

class NaNAfter(losses.MLM):
    """MLM whose training loss turns NaN from the `after`-th training forward on."""
    after, calls = 0, 0

    def forward(self, model, batch, rng):
        loss, metrics = super().forward(model, batch, rng)
        if self.training:
            NaNAfter.calls += 1
            if NaNAfter.calls > NaNAfter.after:
                loss = loss * float("nan")
        return loss, metrics


def diverge_after(monkeypatch, after):
    """The mlm objective becomes NaNAfter(after), its count of training forwards at 0."""
    monkeypatch.setitem(losses.LOSSES, "mlm", NaNAfter)
    monkeypatch.setattr(NaNAfter, "after", after)
    monkeypatch.setattr(NaNAfter, "calls", 0)


@pytest.mark.parametrize("after, log_interval, message, grad_clip", [
    (12, 5, "at step 13", 1.0),  # seen at the step-15 log line: ckpt.pt keeps step 10
    (12, 5, "at step 13", 0.0),  # clipping off: no gradient norm is computed, the loss alone shows it
    (8, 100, "at step 9", 1.0),  # no log line before the step-10 save: the save itself refuses
])
def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(corpus, cache, tmp_path, capsys, monkeypatch,
                                                               after, log_interval, message, grad_clip):
    diverge_after(monkeypatch, after)
    out_dir = tmp_path / "run"
    code, out, err = run_main(flags(corpus, cache, out_dir, max_steps=30, log_interval=log_interval,
                                    grad_clip=grad_clip), capsys)
    assert code == 1, err
    line = one_error(err, "non-finite loss", message, "mlm_loss", "lower learning rate")
    if after >= 10:
        assert f"--resume {out_dir} --lr 0.001" in line
        ckpt = hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))
        assert ckpt["step"] == 10 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
        assert rundir.export_step(str(out_dir)) == 10
        assert all(torch.isfinite(v).all() for v in model.Bert.from_pretrained(str(out_dir)).state_dict().values())
        assert [r["step"] for r in read_log(out_dir)[1] if "loss" in r] == [5, 10]  # step 15's NaN is never logged
    else:
        assert "nothing was saved" in line and not (out_dir / "ckpt.pt").exists()
    assert not (out_dir / ".lock").exists()
    # no flag that scales the loss or the update moved off the preset, but clipping turned off
    assert line.endswith("or undo --grad_clip 0 (off the preset's value)") if grad_clip == 0 else "undo" not in line


def test_a_diverged_run_says_so_in_its_log_and_in_the_comparison(corpus, cache, tmp_path, capsys, monkeypatch):
    # found playing the ablation user: a diverged run's log.jsonl just stopped, so --plot_log showed it as a run
    # that ended early; its last line now holds the error, until a resume goes on
    import analysis
    diverge_after(monkeypatch, 12)
    out_dir = tmp_path / "run"
    code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=30, eval_interval=5), capsys)
    assert code == 1
    last = read_log(out_dir)[1][-1]
    assert last["step"] == 15 and err == f"error: {last['diverged']}\n" and "at step 13" in last["diverged"]
    log = str(out_dir / "log.jsonl")
    assert analysis.diverged_at(log) == 15
    analysis.plot_logs([log], str(tmp_path / "plots"))
    assert "| run (diverged at step 15) | 10 | " in (tmp_path / "plots" / "training_curves.md").read_text()
    monkeypatch.setattr(NaNAfter, "after", 10 ** 9)  # resumed with the cause gone: the run goes on, and is no
    code, _, err = run_main(["--resume", out_dir, "--max_steps", 20], capsys)  # longer a diverged one
    assert code == 0, err
    assert analysis.diverged_at(log) is None


def strict_loads(text):
    """json.loads as jq, JavaScript's JSON.parse and RFC 8259 read: a bare NaN or Infinity is an error."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c} in {text[:200]}"))


def test_a_non_finite_held_out_value_is_strict_json_in_log_jsonl(corpus, cache, tmp_path, capsys, monkeypatch):
    # found playing the scripter: the held-out evaluation at step 3 ran on the NaN weights of a run that diverged at
    # step 3 (the check comes at the step-5 log line), and log.jsonl got "val_mlm_loss": NaN, which Python's json
    # writes bare and jq (1.6 reads it as null, Infinity as 1.8e308), JSON.parse and pandas' strict readers refuse
    import analysis
    diverge_after(monkeypatch, 2)
    out_dir = tmp_path / "run"
    code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=30, eval_interval=3), capsys)
    assert code == 1 and "non-finite loss" in err
    records = [strict_loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    held_out = [r for r in records if r.get("step") == 3][0]
    assert held_out["val_mlm_loss"] is None and held_out["non_finite"]["val_mlm_loss"] == "nan"
    assert "non_finite" not in records[1] and records[-1]["step"] == 5 and "diverged" in records[-1]
    analysis.plot_logs([str(out_dir / "log.jsonl")], str(tmp_path / "plots"))  # the table still says nan, not "–"
    assert "| run (diverged at step 5) | 3 | nan |" in (tmp_path / "plots" / "training_curves.md").read_text()


def test_a_divergence_names_the_loss_scaling_flags_that_moved(corpus, cache, tmp_path, capsys):
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", objective="taco", taco_negatives=8,
                                  taco_temperature=1e-30, log_interval=1), capsys)
    assert code == 1
    one_error(err, "non-finite loss", "lower learning rate", "or undo --taco_temperature 1e-30")
    import monitor  # a flag of another objective is not named: it did nothing to this run
    cfg = config.TrainConfig(objective="mlm", taco_temperature=1e-30, adam_eps=1e-300)
    assert monitor.scale_flags_hint(cfg) == "; or undo --adam_eps 1e-300 (off the preset's value)"
    cfg = config.TrainConfig(weight_decay=1e30)  # decoupled decay multiplies the weights by 1 - lr x wd each step
    assert monitor.scale_flags_hint(cfg) == "; or undo --weight_decay 1e+30 (off the preset's value)"


def test_a_divergence_on_edited_code_names_its_diff(corpus, cache, tmp_path, capsys, monkeypatch):
    # an ablation that edits losses.py (a naive logsumexp) diverged with "Try a lower learning rate" alone, though
    # the run's code.diff held the likelier cause; a clean checkout's message is unchanged
    monkeypatch.setitem(losses.LOSSES, "mlm", NaNAfter)
    real = rundir.provenance
    for dirty in (True, False):
        monkeypatch.setattr(NaNAfter, "calls", 0)
        monkeypatch.setattr(rundir, "provenance", lambda out_dir=None, diff_name="code.diff": {
            **real(), "dirty": dirty, "diff_sha1": "abc" if dirty else None})
        out_dir = tmp_path / f"run{dirty}"
        code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=10), capsys)
        assert code == 1
        line = one_error(err, "non-finite loss", "lower learning rate")
        hint = f"or check the code's local changes ({out_dir / 'code.diff'}: python -m pytest -q test_losses.py"
        assert (hint in line) == dirty, line


class Negated(losses.MLM):
    """MLM with its sign flipped: the edit of an ablation gone wrong (a loss that trains to be worse)."""
    def forward(self, model, batch, rng):
        loss, metrics = super().forward(model, batch, rng)
        return -loss, metrics


def test_a_negative_loss_is_said_once_and_the_run_goes_on(corpus, cache, tmp_path, capsys, monkeypatch):
    # a sign flipped in losses.py trained on, its loss logged below zero, with nothing said
    monkeypatch.setitem(losses.LOSSES, "mlm", Negated)
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=10), capsys)
    assert code == 0, err
    notes = [line for line in out.splitlines() if "< 0" in line]
    assert len(notes) == 1 and notes[0].startswith("note: loss -") and "at step 5:" in notes[0], out
    assert "a sign in losses.py flipped (python -m pytest -q test_losses.py" in notes[0]
    monkeypatch.setitem(losses.LOSSES, "mlm", losses.MLM)  # the real loss: no note
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run2", max_steps=10), capsys)
    assert code == 0 and "< 0" not in out, (err, out)


def test_a_divergence_of_an_added_objective_names_every_flag_that_moved():
    import monitor  # a copy of TACO registered as taco2 reads taco_*: which flags it reads is unknown, so all
    cfg = config.TrainConfig(objective="taco2", taco_temperature=1e-30, cocolm_copy_weight=1e30)
    assert monitor.scale_flags_hint(cfg) == ("; or undo --taco_temperature 1e-30, --cocolm_copy_weight 1e+30 (off the "
                                             "preset's value)")


class InfGrad(torch.autograd.Function):
    """Identity forward (a finite loss), infinite gradient backward: what an fp16 overflow looks like."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class InfGradAt(losses.MLM):
    calls = 0

    def forward(self, model, batch, rng):
        loss, metrics = super().forward(model, batch, rng)
        if self.training:
            InfGradAt.calls += 1
            if InfGradAt.calls in (3, 4):
                loss = InfGrad.apply(loss)
        return loss, metrics


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_inf_gradients_are_a_skipped_step_under_fp16_and_a_stop_otherwise(corpus, cache, tmp_path, capsys,
                                                                           monkeypatch, dtype):
    monkeypatch.setitem(losses.LOSSES, "mlm", InfGradAt)
    monkeypatch.setattr(InfGradAt, "calls", 0)
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=10, dtype=dtype), capsys)
    if dtype == "fp16":  # the GradScaler skips steps 3 and 4 and lowers its scale: normal, the run goes on
        assert code == 0, err
        ckpt = hf_io.load_checkpoint_file(str(tmp_path / "run" / "ckpt.pt"))
        assert ckpt["step"] == 10 and ckpt["scaler"]["scale"] < 2.0 ** 16
        logged = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl") if '"loss"' in line]
        assert logged[-1]["loss_scale"] == ckpt["scaler"]["scale"]  # the log says what the scaler did
        assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
        assert out.count("note: --dtype fp16 on a CPU") == 1  # slower than fp32 without native support: said once
    else:
        assert code == 1 and "note: --dtype" not in out
        one_error(err, "non-finite loss or gradient norm at step 3", "nothing was saved")


# ---- 3. safe loading: a pickle that would run code is refused, never executed

class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this creates the marker file
        return open, (self.marker, "w")


class ShellPayload(Payload):
    def __reduce__(self):  # the classic exploit: a shell command (torch words its refusal differently)
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_payload_is_refused_and_never_runs(corpus, cache, tmp_path, capsys):
    marker = tmp_path / "payload_ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"model": Payload(str(marker)), "model_config": {}, "config": {}}, evil / "ckpt.pt")
    for extra in (["--resume", evil], ["--init_from", evil], ["--init_from", evil / "ckpt.pt"]):
        code, _, err = run_main(flags(corpus, cache, tmp_path / "run") + extra, capsys)
        assert code == 2, err
        one_error(err, "refused", "io.open")
    for path in (evil, evil / "ckpt.pt"):  # eval.py and analysis.py load through Bert.from_pretrained
        with pytest.raises(ValueError, match="refused"):
            model.Bert.from_pretrained(str(path))
    # pytorch_model.bin (Hugging Face's old format) goes through the same safe loader
    hf = tmp_path / "hf"
    model.Bert(model.BertConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=2,
                                intermediate_size=64)).save_pretrained(str(hf))
    os.remove(hf / "model.safetensors")
    for payload in (Payload, ShellPayload):
        torch.save({"bert.embeddings.word_embeddings.weight": payload(str(marker))}, hf / "pytorch_model.bin")
        with pytest.raises(ValueError, match="refused"):
            model.Bert.from_pretrained(str(hf))
        torch.save({"model": payload(str(marker)), "model_config": {}}, evil / "ckpt.pt")
        with pytest.raises(ValueError, match="refused"):
            model.Bert.from_pretrained(str(evil))
    assert not marker.exists()


def test_checkpoint_holds_only_safe_types(corpus, cache, tmp_path, capsys):
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=5, ckpt_interval=5), capsys)
    assert code == 0, err
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)  # raises on anything unsafe
    assert ckpt["loader"] == {"sequences": 5 * 8} and "rng" not in ckpt
    assert all(isinstance(v, (str, int, float, bool)) for v in ckpt["config"].values())


# ---- 4. the run directory is one consistent unit

def test_a_lowered_batch_size_says_why(corpus, cache, tmp_path, capsys):
    # 6 sequences fit tokens_per_step 256 at seq 32; whole pools of 4 lower them to 4, with 2 micro-steps
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", objective="taco", batch_size=6, negative_pool=4,
                                    taco_negatives=8, max_steps=2), capsys)
    assert code == 0, err
    assert "batch_size 6 -> 4 per process: whole pools of --negative_pool 4\n" in out
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run2", batch_size=16, max_steps=2), capsys)
    assert code == 0 and "batch_size 16 -> 8 per process: 1 process(es) x 16 sequences would exceed " \
        "tokens_per_step 256\n" in out, err


def test_resume_keeps_the_runs_own_tokenizer_when_the_cache_is_gone(corpus, tmp_path, capsys):
    own_cache, out_dir = tmp_path / "cache", tmp_path / "run"
    code, _, err = run_main(flags(corpus, own_cache, out_dir, max_steps=10), capsys)
    assert code == 0, err
    files = {f: (out_dir / f).read_bytes() for f in ("vocab.txt", "tokenizer.json")}
    mtimes = {f: (out_dir / f).stat().st_mtime_ns for f in files}
    ids = data.load_tokenizer(out_dir).encode("the quiet teacher carries a letter").ids
    shutil.rmtree(own_cache)  # (a new tokenizer trained on this text would still differ in general)
    code, out, err = run_main(["--resume", out_dir, "--max_steps", 20], capsys)
    assert code == 0, err
    assert "resumed from step 10 (of 20)" in out
    assert {f: (out_dir / f).read_bytes() for f in files} == files
    assert {f: (out_dir / f).stat().st_mtime_ns for f in files} == mtimes  # written once per run dir
    assert data.load_tokenizer(out_dir).encode("the quiet teacher carries a letter").ids == ids
    assert not [p for p in own_cache.iterdir() if p.name.startswith("tokenizer-")]  # no tokenizer trained


def test_a_vocab_txt_that_disagrees_with_the_runs_tokenizer_json_is_refused_on_resume(corpus, cache, tmp_path,
                                                                                       capsys):
    # the run reads tokenizer.json; a damaged vocab.txt beside it went unnoticed, and transformers' BertTokenizer
    # (which reads vocab.txt) would get another vocabulary from the export
    out_dir = tmp_path / "run"
    code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=10), capsys)
    assert code == 0, err
    good = (out_dir / "vocab.txt").read_bytes()
    for damaged in (good.replace(b"\nthe\n", b"\nteh\n", 1), good[:len(good) // 2], b"\xff\xfe" + good):
        (out_dir / "vocab.txt").write_bytes(damaged)
        code, _, err = run_main(["--resume", out_dir, "--max_steps", 20], capsys)
        assert code == 2 and "its vocab.txt disagrees with its tokenizer.json" in one_error(err)
    (out_dir / "vocab.txt").write_bytes(good)
    code, _, err = run_main(["--resume", out_dir, "--max_steps", 20], capsys)
    assert code == 0, err


def test_a_kill_inside_the_first_checkpoint_leaves_a_run_that_starts_again(corpus, cache, tmp_path, capsys,
                                                                           monkeypatch):
    # ckpt.pt is written before the export: a run stopped inside its first ckpt.pt has no export either, so its
    # own command starts it again (export first, it refused: "holds a model but no ckpt.pt", and --resume had
    # no checkpoint: a dead end, found by SIGKILLing runs at random moments)
    out_dir = tmp_path / "run"

    def dies(obj, path):
        Path(path + ".tmp").write_bytes(b"half a checkpoint")
        raise RuntimeError("killed")
    monkeypatch.setattr(rundir, "atomic_save", dies)
    code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=20), capsys)
    monkeypatch.undo()
    assert code == 1 and not (out_dir / "ckpt.pt").exists() and not (out_dir / "config.json").exists(), err
    code, out, err = run_main(flags(corpus, cache, out_dir, max_steps=20), capsys)
    assert code == 0 and "stopped before its first checkpoint" in out, err
    assert hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))["step"] == 20 and rundir.export_step(str(out_dir)) == 20

    # the export fails just after step 30's ckpt.pt: the line says what ckpt.pt holds, and --resume rewrites it
    monkeypatch.setattr(model.Bert, "save_pretrained", lambda *a, **k: no_space())
    code, _, err = run_main(["--resume", out_dir, "--max_steps", 30], capsys)
    monkeypatch.undo()
    assert code == 1 and rundir.export_step(str(out_dir)) == 20
    one_error(err, "cannot save step 30", "ckpt.pt keeps step 30")
    code, out, err = run_main(["--resume", out_dir, "--max_steps", 30], capsys)
    assert code == 0 and "rewrote the Hugging Face export" in out and rundir.export_step(str(out_dir)) == 30, err


def test_kill_between_checkpoint_and_export_leaves_a_loadable_run(corpus, cache, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "run"
    saves = []

    def dies_on_second_save(obj, path):  # the disk fills inside step 20's ckpt.pt, before its export
        saves.append(obj["step"])
        if len(saves) == 2:
            Path(path + ".tmp").write_bytes(b"half a checkpoint")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1024 vs 998")
        real_save(obj, path)
    real_save = rundir.atomic_save
    monkeypatch.setattr(rundir, "atomic_save", dies_on_second_save)
    code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=30), capsys)
    monkeypatch.undo()
    assert code == 1  # one line, not torch.save's traceback; its partial file is removed
    one_error(err, "cannot save step 20", "unexpected pos", "ckpt.pt keeps step 10")
    assert not [p for p in out_dir.iterdir() if ".tmp" in p.name]
    assert hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))["step"] == 10
    assert rundir.export_step(str(out_dir)) == 10  # the export was not reached
    model.Bert.from_pretrained(str(out_dir))  # both load
    assert not (out_dir / ".lock").exists()

    # killed between the export's two files: weights of step 20, config.json of step 10
    real_write = hf_io.write_atomic
    monkeypatch.setattr(hf_io, "write_atomic", lambda path, text: (_ for _ in ()).throw(RuntimeError("killed"))
                        if path.endswith("config.json") else real_write(path, text))
    ckpt = hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))
    m = model.Bert(model.BertConfig(**ckpt["model_config"]))
    m.load_state_dict(ckpt["model"])
    (out_dir / "config.json").write_text(json.dumps({**json.loads((out_dir / "config.json").read_text()),
                                                     "training_step": 10}))
    with pytest.raises(RuntimeError):
        m.save_pretrained(str(out_dir), step=20)
    monkeypatch.undo()
    assert rundir.export_step(str(out_dir)) is None  # the two files disagree: --resume must repair
    model.Bert.from_pretrained(str(out_dir))

    # --resume trusts ckpt.pt and rewrites the export from it before going on
    code, out, err = run_main(["--resume", out_dir, "--max_steps", 10], capsys)
    assert code == 0, err
    assert "rewrote the Hugging Face export" in out and rundir.export_step(str(out_dir)) == 10
    exported, trained = model.Bert.from_pretrained(str(out_dir)).hf_state_dict(), m.hf_state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], v) for k, v in trained.items())


def test_bytes_flipped_in_the_export_are_refused_and_resume_rewrites_it(corpus, cache, tmp_path, capsys):
    """safetensors has no checksum of its own: eval.py scored a model with garbled weights without a word."""
    out_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, out_dir, max_steps=10), capsys)[0] == 0
    good = model.Bert.from_pretrained(str(out_dir)).hf_state_dict()
    data = bytearray((out_dir / "model.safetensors").read_bytes())
    middle = len(data) // 2  # inside a tensor: the header is at the start
    data[middle:middle + 16] = bytes(b ^ 0x5A for b in data[middle:middle + 16])
    (out_dir / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt weights file .*weights_sha1.*--resume .* rewrites it from ckpt.pt"):
        model.Bert.from_pretrained(str(out_dir))
    assert rundir.export_step(str(out_dir)) is None
    code, out, err = run_main(["--resume", out_dir], capsys)  # the run is finished: the resume only mends
    assert code == 0, err
    assert "rewrote the Hugging Face export" in out
    exported = model.Bert.from_pretrained(str(out_dir)).hf_state_dict()
    assert all(torch.equal(exported[k], v) for k, v in good.items())


def test_a_ckpt_pt_copied_in_from_another_run_is_refused(corpus, cache, tmp_path, capsys):
    """It resumed as the other run (its objective, its step) and rewrote this run's export from it."""
    run, other = tmp_path / "run", tmp_path / "other"
    assert run_main(flags(corpus, cache, run, max_steps=10), capsys)[0] == 0
    assert run_main(flags(corpus, cache, other, max_steps=5) + ["--objective", "taco"], capsys)[0] == 0
    export = (run / "model.safetensors").read_bytes()
    shutil.copy(other / "ckpt.pt", run / "ckpt.pt")
    code, _, err = run_main(["--resume", run], capsys)
    assert code == 2
    one_error(err, "its checkpoint has objective 'taco'", "last started with objective 'mlm'", "or an edited log.jsonl")
    assert (run / "model.safetensors").read_bytes() == export  # the export is untouched


@contextmanager
def no_hang(seconds=20):
    """A FIFO's open waits for a writer forever: a hang fails the test instead of stalling the suite."""
    class Hung(BaseException):  # not an Exception: no `except Exception` on the way swallows it
        pass

    def hung(*_):
        raise Hung(f"hung for {seconds} s")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_handed_run_directory_writes_through_no_link_and_hangs_on_no_fifo(corpus, cache, tmp_path, capsys):
    """A run directory from someone else (a tarball, a git clone) may hold symbolic links or FIFOs under the names
    of the run's files. Before: a .lock linked to a file outside was truncated and overwritten with "pid host" (by
    train.py, and by eval.py's .glue.lock / .analysis.lock in the model's directory), a linked log.jsonl lost its
    last line and had the run's log appended, a linked NAME.tmp was overwritten by the atomic write; a FIFO .lock
    hung --init_from and eval.py (still_training), a FIFO log.jsonl hung --resume and eval.py --analysis."""
    import analysis
    run = tmp_path / "run"
    assert run_main(flags(corpus, cache, run, max_steps=10), capsys)[0] == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\nno newline at the end")
    for name, needle in ((".lock", "a symbolic link: a lock file is one this project makes"),
                         ("log.jsonl", "log.jsonl is a symbolic link: a run appends to its own log.jsonl only")):
        handed = tmp_path / f"handed{name}"
        shutil.copytree(run, handed)
        (handed / name).unlink(missing_ok=True)
        (handed / name).symlink_to(victim)
        code, _, err = run_main(["--resume", handed, "--max_steps", 20], capsys)
        assert code == 2 and one_error(err, needle)
        assert victim.read_text() == "precious\nno newline at the end"
    for name in (".glue.lock", ".analysis.lock"):  # eval.py's, in the model's directory by default
        (run / name).symlink_to(victim)
        with pytest.raises(ValueError, match="a symbolic link"):
            rundir.take_lock(str(run), name)
        (run / name).unlink()
    assert victim.read_text() == "precious\nno newline at the end"
    (tmp_path / "results.json.tmp").symlink_to(victim)  # an atomic write's temporary name, linked out
    atomic.write_atomic(str(tmp_path / "results.json"), "{}")
    assert victim.read_text() == "precious\nno newline at the end" and (tmp_path / "results.json").read_text() == "{}"
    fifo = tmp_path / "fifo"
    shutil.copytree(run, fifo)
    os.mkfifo(fifo / ".lock")
    with no_hang():
        assert not hf_io.still_training(str(fifo))
        with pytest.raises(ValueError, match="not a regular file"):
            rundir.take_lock(str(fifo))
    os.remove(fifo / ".lock")
    os.remove(fifo / "log.jsonl")
    os.mkfifo(fifo / "log.jsonl")
    with no_hang():
        code, _, err = run_main(["--resume", fifo, "--max_steps", 20], capsys)
        assert code == 2 and one_error(err, "log.jsonl is not a regular file")
        assert "sample corpus" in analysis.held_out_documents(None, str(fifo))[1]


RELEASE_FIFOS = """
import os, sys, time
time.sleep(float(sys.argv[1]))
open(sys.argv[2], "w").close()  # the test waited: it fails
while True:  # a writer waits for a reader, a reader for a writer: open the other end
    for fifo in sys.argv[3:]:
        for mode in (os.O_RDONLY, os.O_WRONLY):
            try:
                os.close(os.open(fifo, mode | os.O_NONBLOCK))
            except OSError:  # no reader yet (ENXIO), or the FIFO is gone
                pass
    time.sleep(0.2)
"""


@contextmanager
def fifos_released(tmp_path, *fifos, seconds=20):
    """Fails the test when something waits on one of these FIFOs for `seconds`, then ends the wait by opening its
    other end, from another process: an open in Rust (safetensors') holds the GIL and retries past a signal."""
    marker = tmp_path / "waited_on_a_fifo"
    helper = subprocess.Popen([sys.executable, "-c", RELEASE_FIFOS, str(seconds), marker, *fifos])
    try:
        yield
    finally:
        helper.kill()
        helper.wait()
    assert not marker.exists(), f"waited {seconds} s on {', '.join(map(str, fifos))}"


def test_fifos_under_the_other_run_file_names_hang_nothing(corpus, cache, tmp_path, capsys, monkeypatch):
    """The handed-directory test's FIFOs under the names it did not cover: an atomic write's NAME.tmp (eval.py's
    glue.json.tmp in the model's directory), the export a --resume checks (model.safetensors, config.json) and the
    tokenizer_config.json that every read of the run's tokenizer opens: each hung the run or eval.py. And a .lock
    linked out where the OS has no O_NOFOLLOW (Windows) is refused as on Linux, not truncated."""
    run = tmp_path / "run"
    assert run_main(flags(corpus, cache, run, max_steps=10), capsys)[0] == 0
    os.mkfifo(tmp_path / "glue.json.tmp")
    with fifos_released(tmp_path, tmp_path / "glue.json.tmp"):
        atomic.write_atomic(str(tmp_path / "glue.json"), "{}")
    assert (tmp_path / "glue.json").read_text() == "{}" and not (tmp_path / "glue.json.tmp").exists()
    for name, steps in (("model.safetensors", 11), ("config.json", 12)):  # rewritten from ckpt.pt, as a missing one
        os.remove(run / name)
        os.mkfifo(run / name)
        with fifos_released(tmp_path, run / name):
            code, out, err = run_main(["--resume", run, "--max_steps", steps], capsys)
        assert code == 0, err
        assert (run / name).is_file() and "rewrote the Hugging Face export" in out
    os.remove(run / "tokenizer_config.json")
    os.mkfifo(run / "tokenizer_config.json")
    with fifos_released(tmp_path, run / "tokenizer_config.json"):
        code, _, err = run_main(["--resume", run, "--max_steps", 13], capsys)
        with pytest.raises(ValueError, match="not a regular file"):
            data.load_tokenizer(run)
    assert code == 2 and one_error(err, "tokenizer_config.json: not a regular file")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "windows").mkdir()
    (tmp_path / "windows" / ".lock").symlink_to(victim)
    monkeypatch.setattr(rundir, "NOFOLLOW", 0)
    with pytest.raises(ValueError, match="a symbolic link: a lock file is one this project makes"):
        rundir.take_lock(str(tmp_path / "windows"))
    assert victim.read_text() == "precious"


def test_a_resume_checkpoint_whose_model_config_its_weights_do_not_have_is_one_error_line(corpus, cache, tmp_path,
                                                                                          capsys):
    # the model was built from model_config after tokenizing: a vocab_size of 10**10 was a failed allocation of 5 TB, a
    # traceback (a million layers grew until the OOM killer: test_hf_io.py checks that one, through the same function)
    run = tmp_path / "run"
    assert run_main(flags(corpus, cache, run, max_steps=10), capsys)[0] == 0
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    for key, value, needle in (("vocab_size", 10 ** 10, "vocab_size, pad_vocab_to, hidden_size = (10000000000, "),
                               ("intermediate_size", 10 ** 9, "intermediate_size = (1000000000, 128), but")):
        torch.save({**ckpt, "model_config": {**ckpt["model_config"], key: value}}, run / "ckpt.pt")
        code, _, err = run_main(["--resume", run, "--max_steps", 20], capsys)
        assert code == 2 and one_error(err, f"--resume {run / 'ckpt.pt'}: {needle}")


def no_space(*_):
    raise OSError(errno.ENOSPC, "No space left on device")


def compressed_text(tmp_path):
    import lzma
    lzma.open(tmp_path / "corpus.txt.xz", "wt").write("some text\n")
    return str(tmp_path / "corpus.txt.xz")


@pytest.mark.parametrize("writer", [
    lambda tmp: atomic.write_atomic(str(tmp / "config.json"), "{}"),
    lambda tmp: __import__("reproduce").save_json({}, str(tmp / "results.json")),
    lambda tmp: __import__("bench").write_json(str(tmp / "bench.json"), {}),
    lambda tmp: __import__("corpus")._decompressed(compressed_text(tmp), str(tmp / "hf")),
], ids=["atomic", "reproduce", "bench", "decompressed-corpus"])
def test_an_atomic_write_is_on_disk_before_its_rename(tmp_path, monkeypatch, writer):
    # fsync before os.replace: after a power cut the old file or the new one, never an empty new one
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b)))
    writer(tmp_path)
    assert [e[0] for e in events] == ["fsync", "replace"] and events[0][1] == events[1][1]
    assert not os.path.exists(events[1][1])  # renamed into place


def test_an_atomic_write_stopped_by_ctrl_c_leaves_no_temporary_file(tmp_path):
    # a second Ctrl-C lands inside torch.save (KeyboardInterrupt): the last checkpoint stands, and half a GB of
    # ckpt.pt.tmp does not wait for the next run to remove it
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"good")

    def interrupted(tmp):
        Path(tmp).write_bytes(b"half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        atomic.replace_atomic(str(target), interrupted)
    assert target.read_bytes() == b"good" and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_a_full_disk_anywhere_is_one_error_line_and_keeps_the_last_checkpoint(corpus, cache, tmp_path, capsys,
                                                                               monkeypatch):
    # a temporary file the disk could not hold is removed, and the file it was to replace is untouched
    target = tmp_path / "config.json"
    target.write_text("good")

    def half_written(tmp):
        Path(tmp).write_text("ha")
        no_space()
    with pytest.raises(OSError):
        atomic.replace_atomic(str(target), half_written)
    assert target.read_text() == "good" and [p.name for p in tmp_path.iterdir()] == ["config.json"]

    # the disk is full before the first save: the tokenizer cannot be written
    monkeypatch.setattr(data, "save_tokenizer", no_space)
    code, _, err = run_main(flags(corpus, cache, tmp_path / "early"), capsys)
    monkeypatch.undo()
    assert code == 1
    one_error(err, "No space left on device")

    # the disk fills after step 10's checkpoint, at a log.jsonl line
    out_dir = tmp_path / "run"
    real_start = rundir.Run.start

    class FullAfter:  # log.jsonl's file: its writes fail once the disk is full
        def __init__(self, f, writes):
            self.f, self.writes = f, writes

        def write(self, text):
            self.writes -= 1
            return no_space() if self.writes < 0 else self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def start(self, tok, step):
        real_start(self, tok, step)
        self.log_file = FullAfter(self.log_file, writes=3)  # step 0's evaluation, steps 5 and 10
    monkeypatch.setattr(rundir.Run, "start", start)
    code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=20), capsys)
    monkeypatch.undo()
    assert code == 1
    one_error(err, "cannot write", "log.jsonl", "No space left", "ckpt.pt keeps step 10")
    assert hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))["step"] == 10

    # a resume must rewrite an export of another step, and the disk is full
    (out_dir / "config.json").write_text(json.dumps({**json.loads((out_dir / "config.json").read_text()),
                                                     "training_step": 15}))
    weights = (out_dir / "model.safetensors").read_bytes()
    monkeypatch.setattr(hf_io, "write_hf_dir", no_space)
    code, _, err = run_main(["--resume", out_dir], capsys)
    monkeypatch.undo()
    assert code == 1
    one_error(err, "cannot rewrite the Hugging Face export", "ckpt.pt keeps step 10")
    assert (out_dir / "model.safetensors").read_bytes() == weights
    assert hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))["step"] == 10
    code, _, err = run_main(["--resume", out_dir], capsys)  # room again: it goes on from step 10
    assert code == 0, err


@contextmanager
def file_size_limit(size):
    """Writes past `size` bytes fail (EFBIG) in this process, as they would on a full disk: a write the OS
    refuses, rather than a patched function (Python ignores SIGXFSZ, so it is an OSError)."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_run_started_on_a_full_disk_is_one_error_line(corpus, cache, tmp_path, capsys):
    # the .lock's "pid host" cannot be written either: it stayed in the file's buffer, and closing the lock at
    # the end tried to write it again, a traceback after the error line
    data.prepare_data(str(corpus), str(cache), vocab_size=200)  # the cache is made: the run's first write fails
    with file_size_limit(0):
        code, _, err = run_main(flags(corpus, cache, tmp_path / "run"), capsys)
    assert code == 1
    one_error(err, "File too large", str(tmp_path / "run" / "tokenizer.json"))  # which file: not only "[Errno 27]"

    def refused(tmp):
        raise OSError("encoder error -2 when writing image file")  # PIL's, with no errno: left as it is
    with pytest.raises(OSError, match="^encoder error -2 when writing image file$"):
        atomic.replace_atomic(str(tmp_path / "plot.png"), refused)


def test_a_checkpoint_the_disk_cuts_short_names_the_file_and_the_likely_cause(corpus, cache, tmp_path, capsys):
    # torch.save says "unexpected pos 15296 vs 15190" or "basic_ios::clear: iostream error": the reason was lost
    data.prepare_data(str(corpus), str(cache), vocab_size=200)
    out_dir = tmp_path / "run"
    with file_size_limit(100_000):  # the tokenizer files and log.jsonl fit, ckpt.pt does not
        code, _, err = run_main(flags(corpus, cache, out_dir, max_steps=10), capsys)
    assert code == 1
    one_error(err, "cannot save step 10", "could not write ckpt.pt: is the disk full", "no ckpt.pt yet")
    assert sorted(p.name for p in out_dir.iterdir() if "ckpt" in p.name or "safetensors" in p.name) == []


def test_a_full_disk_inside_the_safetensors_export_is_one_error_line(corpus, cache, tmp_path, capsys, monkeypatch):
    # safetensors reports a failed write as its own SafetensorError, not an OSError
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No "
                              "space left on device\" })")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=5, ckpt_interval=5), capsys)
    assert code == 1
    one_error(err, "cannot save step 5", "StorageFull", "ckpt.pt keeps step 5")
    assert not [p for p in (tmp_path / "run").iterdir() if ".tmp" in p.name]


def test_train_main_called_from_python_twice_after_a_ctrl_c_from_a_thread_and_from_a_notebook(corpus, cache, tmp_path,
                                                                                                capsys, monkeypatch):
    # a notebook's stop button (SIGINT) mid-run: the run saved and exited 130, but left its own handlers installed,
    # so the kernel ignored SIGTERM and SIGHUP from then on, and a later run in the same process took no SIGHUP
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    lr_at = train.lr_at

    def stop_button(step, cfg):  # at the start of step 3: the run stops after it
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return lr_at(step, cfg)
    monkeypatch.setattr(train, "lr_at", stop_button)
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run"), capsys)
    assert code == 130 and "SIGINT: stopped after step 4" in out, err
    assert {s: signal.getsignal(s) for s in before} == before and not (tmp_path / "run" / ".lock").exists()
    monkeypatch.setattr(train, "lr_at", lr_at)
    code, out, err = run_main(["--resume", tmp_path / "run", "--max_steps", 8], capsys)
    assert code == 0 and "steps 4 -> 8" in out and {s: signal.getsignal(s) for s in before} == before, err
    # from a thread (a notebook's background run), where Python sets no signal handler: it was an `error: signal
    # only works in main thread` exit 2, after the run had written its tokenizer and log.jsonl into out_dir
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=run_main(flags(corpus, cache, tmp_path / "t", max_steps=2),
                                                                      capsys)))
    thread.start()
    thread.join()
    assert result["r"][0] == 0 and hf_io.load_checkpoint_file(str(tmp_path / "t" / "ckpt.pt"))["step"] == 2, result
    # main() without flags in Jupyter reads the kernel's command line: the error says whose, and what to do instead
    monkeypatch.setattr(sys, "argv", ["/venv/site-packages/ipykernel_launcher.py", "-f", "/k/kernel.json"])
    with pytest.raises(SystemExit) as stopped:
        train.main()
    assert stopped.value.code == 2
    one_error(capsys.readouterr().err, "unexpected argument '-f'", "command line of ipykernel_launcher.py",
              "train.main(['--objective'")


def test_the_console_outlives_a_stream_it_cannot_write_and_escapes_what_its_encoding_lacks():
    class Full(io.StringIO):  # `> /dev/full`, a lost terminal: an OSError on every write (a BrokenPipeError is one)
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")
    console = Console(Full())
    assert console.write("step 5\n") == 7 and console.flush() is None  # the run goes on; log.jsonl has the line
    assert Console(None).write("started with >&-\n") == 17 and Console(None).isatty() is False
    ascii_console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")  # PYTHONIOENCODING=ascii, a C locale
    console = Console(ascii_console)
    console.write("In out/caf\u00e9: TACO \u00a75.2 \u00d7 2\n")  # a path; --help's \u00a7: a UnicodeEncodeError
    console.flush()
    assert ascii_console.buffer.getvalue() == b"In out/caf\\xe9: TACO \\xa75.2 \\xd7 2\n"
    # `%run train.py` twice in one notebook wraps sys.stdout twice: one layer, not one more per %run
    assert Console(Console(Console(ascii_console))).stream is ascii_console


@pytest.mark.slow
def test_a_console_that_cannot_take_the_output_stops_no_script(corpus, cache, tmp_path):
    # each used to end in a traceback or an `error:` exit 2, train.py's before its first checkpoint, bench.py's
    # before writing --json: stdout on a full disk, and an ascii console shown a non-ASCII path or --help's \u00a7
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    run = lambda *cmd: subprocess.run([sys.executable, *map(str, cmd)], cwd=HERE, env=env, stdout=full,
                                      stderr=subprocess.PIPE, text=True, timeout=300)
    with open("/dev/full", "w") as full:
        done = run("train.py", *flags(corpus, cache, tmp_path / "caf\u00e9", max_steps=10, log_interval=1))
        assert done.returncode == 0 and torch.load(tmp_path / "caf\u00e9" / "ckpt.pt", weights_only=True)["step"] == 10, \
            done.stderr
        for cmd in (["train.py", "--help"], ["eval.py", "--plot_log", tmp_path / "caf\u00e9" / "log.jsonl", "--out",
                                             tmp_path / "curves"],
                    ["bench.py", "--model_size", "tiny", "--device", "cpu", "--objectives", "mlm", "--batch_size", "2",
                     "--seq_len", "16", "--steps", "1", "--warmup", "0", "--json", tmp_path / "bench.json"]):
            done = run(*cmd)
            assert done.returncode == 0 and done.stderr == "", (cmd, done.stderr)
    assert (tmp_path / "curves" / "training_curves.md").exists() and (tmp_path / "bench.json").exists()


def test_resume_of_a_missing_path_and_of_a_run_with_no_checkpoint_say_which(tmp_path, capsys):
    code, _, err = run_main(["--resume", tmp_path / "typo"], capsys)
    assert code == 2 and not (tmp_path / "typo").exists()
    one_error(err, "no such run directory")
    (tmp_path / "early").mkdir()  # a run killed before its first save leaves a directory with no ckpt.pt
    code, _, err = run_main(["--resume", tmp_path / "early"], capsys)
    assert code == 2
    one_error(err, "no checkpoint there", "run its original command again")
    (tmp_path / "early" / "config.json").write_text("{}")  # an export kept without its ckpt.pt: start from it
    code, _, err = run_main(["--resume", tmp_path / "early"], capsys)
    assert code == 2
    one_error(err, "no ckpt.pt to resume", f"--init_from {tmp_path / 'early'}")


def test_resume_auto_is_one_command_that_starts_a_run_and_goes_on_after_a_kill(corpus, cache, tmp_path, capsys,
                                                                              monkeypatch):
    # a requeued cluster job (or torchrun --max_restarts) repeats its command: without --resume the repeat was refused
    # ("already holds a run"), with --resume DIR the first start was ("no such run directory")
    code, _, err = run_main(flags(corpus, cache, tmp_path / "whole"), capsys)
    assert code == 0, err
    command = flags(corpus, cache, tmp_path / "auto") + ["--resume", "auto"]
    real_save = rundir.Run.save

    def killed_after_step_10(self, step, elapsed_s):
        real_save(self, step, elapsed_s)
        if step == 10:
            raise KeyboardInterrupt  # the job is preempted here
    with monkeypatch.context() as mp:
        mp.setattr(rundir.Run, "save", killed_after_step_10)
        code, out, err = run_main(command, capsys)
    assert code == 130 and f"--resume auto: no ckpt.pt in {tmp_path / 'auto'}, so a new run" in out, err
    code, out, err = run_main(command, capsys)  # the same command again
    assert code == 0 and "resumed from step 10 (of 20)" in out and "a new run" not in out, err
    a, b = (hf_io.load_checkpoint_file(str(tmp_path / d / "ckpt.pt")) for d in ("whole", "auto"))
    assert a["step"] == b["step"] == 20 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    code, out, err = run_main(command, capsys)  # and again, once finished: nothing left to do
    assert code == 0 and "resumed from step 20 (of 20)" in out, err
    (tmp_path / "auto" / "ckpt.pt").unlink()  # an export without its ckpt.pt is never trained over
    code, _, err = run_main(command, capsys)
    assert code == 2
    one_error(err, "holds a model (config.json) but no ckpt.pt")


def test_resume_auto_goes_on_without_the_init_from_weights(corpus, cache, tmp_path, capsys):
    # a requeued TaCL job repeats --init_from, whose weights (staged on a node's local disk, or cleaned up since) a
    # resume never reads: its model and teacher come from ckpt.pt. The repeat was "--init_from ...: no such file"
    assert run_main(flags(corpus, cache, tmp_path / "mlm", max_steps=4, ckpt_interval=4), capsys)[0] == 0
    shutil.copytree(tmp_path / "mlm", tmp_path / "local")
    command = flags(corpus, cache, tmp_path / "tacl", max_steps=8, ckpt_interval=4) + [
        "--objective", "tacl", "--init_from", tmp_path / "local", "--resume", "auto"]
    assert run_main(command + ["--max_steps", 4], capsys)[0] == 0
    shutil.rmtree(tmp_path / "local")  # the job comes back on another node
    code, out, err = run_main(command, capsys)
    assert code == 0 and "resumed from step 4 (of 8)" in out, err
    code, _, err = run_main(flags(corpus, cache, tmp_path / "new") + ["--objective", "tacl", "--init_from",
                                                                      tmp_path / "local"], capsys)
    assert code == 2  # a new run still needs them
    one_error(err, "--init_from", "no such file or directory")


def test_resume_from_an_older_checkpoint_file_does_not_save_over_the_runs_own(corpus, cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, run_dir, max_steps=5, ckpt_interval=5), capsys)[0] == 0
    shutil.copy(run_dir / "ckpt.pt", run_dir / "step5.pt")
    assert run_main(["--resume", run_dir, "--max_steps", 10], capsys)[0] == 0
    newer = (run_dir / "ckpt.pt").read_bytes()
    code, _, err = run_main(["--resume", run_dir / "step5.pt", "--max_steps", 8], capsys)
    assert code == 2 and (run_dir / "ckpt.pt").read_bytes() == newer
    one_error(err, "save over its ckpt.pt", "copy the directory")
    code, _, err = run_main(["--resume", run_dir / "model.safetensors", "--max_steps", 8], capsys)  # meant: the dir
    assert code == 2
    one_error(err, "one file of a model directory: pass the directory")
    bad = torch.load(run_dir / "step5.pt", weights_only=True)
    for model_state in (torch.zeros(3), 5):  # an edited checkpoint whose model is not a state dict
        torch.save({**bad, "model": model_state}, tmp_path / "bad.pt")
        code, _, err = run_main(["--resume", tmp_path / "bad.pt", "--max_steps", 8], capsys)
        assert code == 2
        one_error(err, "not a checkpoint of this project")
    shutil.copytree(run_dir, tmp_path / "old")  # as it says: a copy with step5.pt as its ckpt.pt resumes from step 5
    shutil.copy(run_dir / "step5.pt", tmp_path / "old" / "ckpt.pt")
    code, out, err = run_main(["--resume", tmp_path / "old", "--max_steps", 8], capsys)
    assert code == 0, err
    assert torch.load(tmp_path / "old" / "ckpt.pt", weights_only=True)["step"] == 8


def test_run_files_inside_the_data_directory_are_refused(corpus, cache, tmp_path, capsys, monkeypatch):
    # a directory (or a ** glob) is read whole: a run's log.jsonl or the cache's vocab.txt there would become corpus
    (tmp_path / "texts").mkdir()
    shutil.copy(corpus, tmp_path / "texts" / "toy.txt")
    for data in (tmp_path / "texts", f"{tmp_path}/texts/**/*.txt"):
        for name in ("out_dir", "cache_dir"):
            argv = flags(data, cache, tmp_path / "run") + [f"--{name}", tmp_path / "texts" / "sub"]
            code, _, err = run_main(argv, capsys)
            assert code == 2
            one_error(err, f"--{name}", "inside --data", "read as corpus")
    assert not (tmp_path / "texts" / "sub").exists() and not (tmp_path / "run").exists()
    # a flat glob reads only its own level: a run in the folder itself is refused, one a folder down is not
    flat = f"{tmp_path}/texts/*.txt"
    code, _, err = run_main(flags(flat, cache, tmp_path / "texts", max_steps=2), capsys)
    assert code == 2
    one_error(err, "--out_dir", "inside --data")
    code, _, err = run_main(flags(flat, cache, tmp_path / "texts" / "run", max_steps=2), capsys)
    assert code == 0, err
    # a working directory whose name has brackets: its escaped form in --data is not a pattern
    (tmp_path / "proj[1]" / "texts").mkdir(parents=True)
    shutil.copy(corpus, tmp_path / "proj[1]" / "texts" / "toy.txt")
    monkeypatch.chdir(tmp_path / "proj[1]")
    code, _, err = run_main(flags("texts/**/*.txt", cache, tmp_path / "elsewhere", max_steps=2), capsys)
    assert code == 0, err


def test_resume_into_another_out_dir_and_a_busy_out_dir_are_refused(corpus, cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, run_dir, max_steps=5, ckpt_interval=5), capsys)[0] == 0
    code, _, err = run_main(["--resume", run_dir, "--out_dir", tmp_path / "other", "--max_steps", 10], capsys)
    assert code == 2 and not (tmp_path / "other").exists()
    one_error(err, "another directory", "--init_from")
    # flags a resume would ignore are refused, not dropped in silence
    for flag, value in (("--preset", "small"), ("--init_from", tmp_path)):
        code, _, err = run_main(["--resume", run_dir, flag, value, "--max_steps", 10], capsys)
        assert code == 2
        one_error(err, f"{flag} {value}", "a resume goes on with its own")
    code, _, err = run_main(["--resume", run_dir, "--preset", "smoke", "--max_steps", 5], capsys)  # its own: fine
    assert code == 0, err

    (tmp_path / "busy").mkdir()
    # another process holds the OS lock on each .lock, as a running train.py does
    holder = ("import fcntl, os, socket, sys, time\n"
              "files = [open(os.path.join(d, '.lock'), 'a+') for d in sys.argv[1:]]\n"
              "for f in files:\n"
              "    fcntl.flock(f, fcntl.LOCK_EX); f.write(f'{os.getpid()} {socket.gethostname()}'); f.flush()\n"
              "print('locked', flush=True); time.sleep(60)\n")
    sleeper = subprocess.Popen([sys.executable, "-c", holder, str(run_dir), str(tmp_path / "busy")],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "locked"
        for argv in (["--resume", run_dir, "--max_steps", 10], flags(corpus, cache, tmp_path / "busy")):
            code, _, err = run_main(argv, capsys)
            assert code == 2
            one_error(err, "in use by process", str(sleeper.pid))
    finally:
        sleeper.kill()
        sleeper.wait()
    # a .lock left behind by a process that died (killed, on this host or another) is taken over: the OS
    # released its lock with it; the file's "pid host" alone does not hold the directory
    (run_dir / ".lock").write_text("999999 some-other-host")
    code, _, err = run_main(["--resume", run_dir, "--max_steps", 10], capsys)
    assert code == 0, err
    assert not (run_dir / ".lock").exists()


def test_partial_writes_of_a_killed_save_are_removed_on_resume(corpus, cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, run_dir, max_steps=5, ckpt_interval=5), capsys)[0] == 0
    (run_dir / "ckpt.pt.tmp").write_bytes(b"half a checkpoint")  # what a kill inside torch.save leaves
    (run_dir / "tokenizer.json.tmp4242").write_text("{")
    for name in ("notes.txt", "draft.tmp", "notes.tmp2", "old_ckpt.pt.tmp"):  # not our own temporary file: stays
        (run_dir / name).write_text("mine")
    code, _, err = run_main(["--resume", run_dir, "--max_steps", 6], capsys)
    assert code == 0, err
    assert not (run_dir / "ckpt.pt.tmp").exists() and not (run_dir / "tokenizer.json.tmp4242").exists()
    assert all((run_dir / name).read_text() == "mine" for name in ("notes.txt", "draft.tmp", "notes.tmp2",
                                                                    "old_ckpt.pt.tmp"))
    assert hf_io.load_checkpoint_file(str(run_dir / "ckpt.pt"))["step"] == 6


def test_resume_refuses_data_that_changed_and_finds_relative_paths_from_elsewhere(corpus, cache, tmp_path, capsys,
                                                                                 monkeypatch):
    own = tmp_path / "data" / "corpus.txt"
    own.parent.mkdir()
    shutil.copy(corpus, own)
    monkeypatch.chdir(own.parent)
    run_dir = tmp_path / "run"
    assert run_main(flags("corpus.txt", cache, run_dir, max_steps=5, ckpt_interval=5), capsys)[0] == 0
    monkeypatch.chdir(tmp_path)  # elsewhere, where corpus.txt names nothing (or another file)
    (tmp_path / "corpus.txt").write_text("another text entirely\n" * 2000)
    code, _, err = run_main(["--resume", run_dir, "--max_steps", 8], capsys)  # reads the run's own file
    assert code == 0, err
    code, _, err = run_main(["--resume", run_dir, "--max_steps", 10, "--data", own], capsys)  # the same, named absolutely
    assert code == 0, err
    step = hf_io.load_checkpoint_file(str(run_dir / "ckpt.pt"))["step"]
    own.write_text(own.read_text()[: len(own.read_text()) // 2])  # the corpus edited in place
    code, _, err = run_main(["--resume", run_dir, "--max_steps", 12], capsys)
    assert code == 2
    one_error(err, "is not the data this run was trained on")
    assert "the code that makes them" not in err  # ckpt.pt records the token format: the tokens were made as now
    assert hf_io.load_checkpoint_file(str(run_dir / "ckpt.pt"))["step"] == step  # nothing saved was touched
    # a checkpoint of a version before the token format was recorded: the code may be what changed the tokens (found
    # resuming older revisions' runs: '[SEP]' in the text was the [SEP] id before 2026-11-27, a cause no file shows)
    ckpt = hf_io.load_checkpoint_file(str(run_dir / "ckpt.pt"))
    assert ckpt.pop("token_format") == token_files.FORMAT_VERSION
    torch.save(ckpt, run_dir / "ckpt.pt")
    code, _, err = run_main(["--resume", run_dir, "--max_steps", 12], capsys)
    assert code == 2
    one_error(err, "is not the data this run was trained on", "or the code that makes them: the run's token format "
              "is not recorded", "finish the run with the version it started with")


def test_init_from_flags_that_cannot_work_are_refused(corpus, cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, run_dir, max_steps=5, ckpt_interval=5), capsys)[0] == 0
    export = tmp_path / "export"
    export.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt"):
        shutil.copy(run_dir / name, export / name)
    weights = (export / "model.safetensors").read_bytes()
    for extra, needle in ((["--init_from", export, "--out_dir", export], "overwrite the weights it starts from"),
                          (["--init_from", export, "--cased"], "is used as it is"),  # not ignored in silence
                          (["--tokenizer", export, "--limit_alphabet", 5000], "is used as it is"),
                          (["--init_from", run_dir, "--model_size", "base"], "--model_size base"),
                          (["--resume", run_dir, "--max_steps", 3], "already at step 5")):
        code, _, err = run_main(flags(corpus, cache, tmp_path / "new") + extra, capsys)
        assert code == 2, err
        one_error(err, needle)
    assert (export / "model.safetensors").read_bytes() == weights
    # a config.json whose pad_token_id is not the tokenizer's [PAD]: trained, it exported a model eval.py refuses
    cfg_json = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**cfg_json, "pad_token_id": 5}))
    code, _, err = run_main(flags(corpus, cache, tmp_path / "new") + ["--init_from", export], capsys)
    assert code == 2, err
    one_error(err, "[PAD], [SEP] = (", "does not match the tokenizer's")
    assert not (tmp_path / "new").exists()
    (export / "config.json").write_text(json.dumps(cfg_json))
    # weights without their vocabulary: a fresh tokenizer would give every id another meaning
    for name in ("tokenizer.json", "vocab.txt"):
        (export / name).unlink()
    code, _, err = run_main(flags(corpus, cache, tmp_path / "new") + ["--init_from", export], capsys)
    assert code == 2, err
    one_error(err, "no tokenizer.json or vocab.txt", "--tokenizer")
    assert not (tmp_path / "new").exists()
    # a tokenizer of another size with the same special ids: the line says why the sizes must agree
    data.train_tokenizer([Path(corpus).read_text()], vocab_size=100, save_dir=str(tmp_path / "tok100"))  # of 126
    code, _, err = run_main(flags(corpus, cache, tmp_path / "new") + ["--init_from", export, "--tokenizer",
                                                                       tmp_path / "tok100"], capsys)
    assert code == 2, err
    one_error(err, "does not match the tokenizer's", "training needs them equal")
    # --init_from a ckpt.pt takes the tokenizer of its directory, as --init_from the directory does
    other = tmp_path / "other.txt"
    other.write_text(Path(corpus).read_text().upper().replace("E", "Q"))  # trains another vocabulary
    code, out, err = run_main(flags(other, cache, tmp_path / "cont", max_steps=2) + ["--init_from", run_dir / "ckpt.pt"],
                              capsys)
    assert code == 0, err
    assert (tmp_path / "cont" / "vocab.txt").read_text() == (run_dir / "vocab.txt").read_text()


@pytest.mark.skipif(os.name == "nt", reason="flock")
def test_init_from_a_run_still_training_says_which_step_it_starts_from(corpus, cache, tmp_path, capsys):
    # TaCL or continued MLM started before its --init_from run had finished: nothing said it took the weights of
    # an intermediate step (eval.py says so of the export it scores)
    import fcntl
    run_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, run_dir, max_steps=5, ckpt_interval=5), capsys)[0] == 0
    code, out, err = run_main(flags(corpus, cache, tmp_path / "a", max_steps=2) + ["--init_from", run_dir], capsys)
    assert code == 0, err
    assert "still training" not in out
    with open(run_dir / ".lock", "a+") as held:  # the run's train.py, at step 5 of more
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, out, err = run_main(flags(corpus, cache, tmp_path / "b", max_steps=2) + ["--init_from", run_dir], capsys)
    assert code == 0, err
    assert f"note: {run_dir} is still training" in out and "starts from its step 5 export" in out


def test_a_checkpoint_config_of_the_wrong_type_is_one_error_line(corpus, cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, run_dir, max_steps=5, ckpt_interval=5), capsys)[0] == 0
    ckpt = torch.load(run_dir / "ckpt.pt", weights_only=True)
    for config, needle in (({**ckpt["config"], "lr": "0.001"}, "lr = '0.001', not a float"), ([1], "not a dict")):
        torch.save({**ckpt, "config": config}, run_dir / "ckpt.pt")
        code, _, err = run_main(["--resume", run_dir, "--max_steps", 10], capsys)
        assert code == 2
        one_error(err, needle)
    # a step that is no count, optimizer moments of the wrong shape, a missing weight: refused before any step
    optimizer = copy.deepcopy(ckpt["optimizer"])
    optimizer["state"][0]["exp_avg"] = optimizer["state"][0]["exp_avg"][:1]
    model = {k: v for k, v in ckpt["model"].items() if k != "embeddings.ln.bias"}
    config = {k: v for k, v in ckpt["config"].items() if k != "max_steps"}
    for edit, needle in ((dict(step="5"), "its step is '5'"), (dict(step=-5), "its step is -5"),
                         (dict(elapsed_s="x"), "its elapsed_s is 'x'"), (dict(loader=-5), "its loader state is -5"),
                         (dict(loader={"sequences": "1"}), "its loader state is"),
                         (dict(loader={"sequences": 2 ** 63}), "its loader state is"),  # past int64
                         (dict(model_config={**ckpt["model_config"], "rotary": True}),
                          "unknown model_config keys ['rotary']"),
                         (dict(config={}), "its config lacks objective"), (dict(config=config), "lacks max_steps"),
                         (dict(optimizer=optimizer), "optimizer state of shape"),
                         (dict(model=model), 'Missing key(s) in state_dict: "embeddings.ln.bias"')):
        torch.save({**ckpt, **edit}, run_dir / "ckpt.pt")
        lines = (run_dir / "log.jsonl").read_text()
        code, _, err = run_main(["--resume", run_dir, "--max_steps", 10], capsys)
        assert code == 2
        one_error(err, needle)
        assert (run_dir / "log.jsonl").read_text() == lines
    torch.save({k: v for k, v in ckpt.items() if k != "loader"}, run_dir / "ckpt.pt")  # a key gone, not just edited
    code, _, err = run_main(["--resume", run_dir, "--max_steps", 10], capsys)
    assert code == 2
    one_error(err, "not a resumable checkpoint of this version (missing ['loader']")


def test_resume_with_another_batch_size_continues_at_the_same_sequence(corpus, cache, tmp_path, capsys,
                                                                      monkeypatch):
    """12 steps of 8 sequences in one go, or 6 steps then 6 more with --batch_size 4 (2 micro-batches):
    the training loader yields the same rows in the same order."""
    seen = {}
    real_next = data.BlockLoader.next_batch

    def recording(self):
        batch = real_next(self)
        if self.seed == 1337:  # the training loader (the validation one has seed 0)
            seen.setdefault(run, []).extend(batch.tolist())
        return batch
    monkeypatch.setattr(data.BlockLoader, "next_batch", recording)
    run = "whole"
    assert run_main(flags(corpus, cache, tmp_path / "whole", max_steps=12), capsys)[0] == 0
    run = "split"
    assert run_main(flags(corpus, cache, tmp_path / "split", max_steps=6), capsys)[0] == 0
    code, out, err = run_main(["--resume", tmp_path / "split", "--max_steps", 12, "--batch_size", 4], capsys)
    assert code == 0, err
    assert "grad_accum 2" in out and "the learning-rate schedule moved (max_steps 6 -> 12)" in out
    assert len(seen["whole"]) == 12 * 8 and seen["split"] == seen["whole"]
    assert hf_io.load_checkpoint_file(str(tmp_path / "split" / "ckpt.pt"))["loader"] == {"sequences": 96}
    assert "negative pool" not in out  # MLM has none
    # TACO without --negative_pool draws from the per-process micro-batch: a resume that halves it says so
    assert run_main(flags(corpus, cache, tmp_path / "taco", objective="taco", max_steps=6), capsys)[0] == 0
    code, out, err = run_main(["--resume", tmp_path / "taco", "--max_steps", 8, "--batch_size", 4], capsys)
    assert code == 0 and "note: the negative pool is the per-process micro-batch, now 4 sequences (was 8" in out, err
    # the data order and split may not change on resume
    for name, value in (("seed", 1), ("val_fraction", 0.1)):
        code, _, err = run_main(["--resume", tmp_path / "split", f"--{name}", value], capsys)
        assert code == 2
        one_error(err, name, "data order")


def test_a_half_written_log_line_is_dropped(corpus, cache, tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, out_dir, max_steps=10), capsys)[0] == 0
    with open(out_dir / "log.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 3.')  # killed mid-write
    code, out, err = run_main(["--resume", out_dir, "--max_steps", 20], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in open(out_dir / "log.jsonl")]  # every line parses
    assert records[-1]["step"] == 20 and any(r.get("resumed_from_step") == 10 for r in records)
    assert "step 20/20" in out and "eta" in out and "done: " in out and "ckpt.pt (step 20" in out


def test_a_whole_last_log_record_without_its_newline_is_kept(corpus, cache, tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert run_main(flags(corpus, cache, out_dir, max_steps=10), capsys)[0] == 0
    text = (out_dir / "log.jsonl").read_text()
    (out_dir / "log.jsonl").write_text(text[:-1])  # the newline never written
    rundir.repair_log(str(out_dir / "log.jsonl"))
    assert (out_dir / "log.jsonl").read_text() == text  # the step-10 record stays, ended


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_nonzero(corpus, cache, tmp_path):
    out_dir = tmp_path / "run"
    argv = flags(corpus, cache, out_dir, max_steps=100000, warmup_steps=10, log_interval=1, ckpt_interval=100000)
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log, deadline = out_dir / "log.jsonl", time.time() + 120
    while time.time() < deadline and not (log.is_file() and sum(1 for _ in open(log)) > 5):
        time.sleep(0.05)  # a few steps in
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)  # a scheduler and torchrun both send one: the second must not abort the save
    out, err = proc.communicate(timeout=120)
    # 143 = 128 + SIGTERM; a repeat landing after the save, while the interpreter shuts down, is -SIGTERM
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), err
    assert "Traceback" not in err and "SIGTERM: stopped after step" in out
    step = int(out.split("SIGTERM: stopped after step ")[1].split(";")[0])
    assert step > 0 and hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))["step"] == step
    assert rundir.export_step(str(out_dir)) == step and not (out_dir / ".lock").exists()


@pytest.mark.slow
def test_a_closed_terminal_saves_as_sigterm_does_unless_under_nohup(corpus, cache, tmp_path):
    # SIGHUP (an ssh session lost, no nohup or tmux) killed the run outright: the steps since its last checkpoint lost
    def started(out_dir, ignore_hup):
        argv = flags(corpus, cache, out_dir, max_steps=100000, warmup_steps=10, log_interval=1, ckpt_interval=100000)
        proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=HERE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN) if ignore_hup else None)
        log, deadline = out_dir / "log.jsonl", time.time() + 120
        while time.time() < deadline and not (log.is_file() and sum(1 for _ in open(log, encoding="utf-8")) > 5):
            time.sleep(0.05)  # a few steps in
        proc.send_signal(signal.SIGHUP)
        return proc
    proc = started(tmp_path / "run", ignore_hup=False)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP and "Traceback" not in err, err
    step = int(out.split("SIGHUP: stopped after step ")[1].split(";")[0])
    assert step > 0 and hf_io.load_checkpoint_file(str(tmp_path / "run" / "ckpt.pt"))["step"] == step
    proc = started(tmp_path / "nohup", ignore_hup=True)  # nohup's ignored SIGHUP stays ignored
    time.sleep(1)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "SIGTERM: stopped after step" in out, err


# ---- 5. errors from data.py are one line too

def test_corrupt_tokenizer_and_unreadable_corpus_are_one_error_line(corpus, cache, tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 64)
    for extra in (["--tokenizer", tmp_path / "tokenizer.json"], ["--data", tmp_path / "binary.txt"]):
        code, _, err = run_main(flags(corpus, cache, tmp_path / "run") + extra, capsys)
        assert code == 2, err
        one_error(err)


# ---- 6. provenance: the code that ran

def test_provenance_records_commit_and_diff(corpus, cache, tmp_path, capsys, monkeypatch):
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=5, ckpt_interval=5), capsys)
    assert code == 0, err
    header, _ = read_log(tmp_path / "run")
    prov = header["provenance"]
    assert prov["torch"] == torch.__version__ and prov["host"] and isinstance(prov["dirty"], bool)
    if prov["git_commit"] and prov["dirty"]:
        diff = (tmp_path / "run" / "code.diff").read_text()
        assert hashlib.sha1(diff.encode()).hexdigest() == prov["diff_sha1"]

    # a checkout with a local edit (git pointed at a scratch repository)
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)
    git("init", "-q")
    (repo / "losses.py").write_text("weight = 1.0\n")
    git("add", "losses.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (repo / "losses.py").write_text("weight = 0.5  # an ablation\n")
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(repo))
    (tmp_path / "out").mkdir()
    prov = rundir.provenance(str(tmp_path / "out"))
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    diff = (tmp_path / "out" / "code.diff").read_text()
    assert prov["git_commit"] == head and prov["dirty"] and "+weight = 0.5" in diff
    assert prov["diff_sha1"] == hashlib.sha1(diff.encode()).hexdigest()
    # a resume's local changes go to code-step{N}.diff, and its done line names that file
    code, out, err = run_main(["--resume", tmp_path / "run", "--max_steps", "6"], capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "code-step5.diff").is_file() and "log.jsonl, code-step5.diff" in out, out[-500:]
    # an ablation in a new, untracked module is part of the code that ran
    git("checkout", "-q", "losses.py")
    (repo / "my_loss.py").write_text("def loss(): return 0\n")
    prov = rundir.provenance(str(tmp_path / "out"))
    diff = (tmp_path / "out" / "code.diff").read_text()
    assert prov["dirty"] and "untracked file my_loss.py:\n+def loss(): return 0" in diff
    # outside a git checkout: no commit, no failure
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "nowhere"))
    prov = rundir.provenance(str(tmp_path / "out2"))
    assert prov["git_commit"] is None and prov["dirty"] is False and prov["diff_sha1"] is None


@pytest.mark.skipif(os.name == "nt", reason="a fake git as a shell script")
def test_a_checkout_git_cannot_read_is_a_note_not_a_clean_checkout_or_a_stop(tmp_path, capsys, monkeypatch):
    # an edit that is not UTF-8 (a latin-1 comment) stopped every run: "error: 'utf-8' codec can't decode byte 0xe9"
    repo, out = tmp_path / "repo", tmp_path / "out"
    repo.mkdir(), out.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)
    git("init", "-q")
    (repo / "losses.py").write_text("weight = 1.0\n")
    git("add", "losses.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (repo / "losses.py").write_bytes(b"weight = 0.5  # caf\xe9\n")
    (tmp_path / "unborn").mkdir()  # a checkout with no commit yet: no commit, and no note
    subprocess.run(["git", "-C", str(tmp_path / "unborn"), "init", "-q"], check=True)
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "unborn" / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(tmp_path / "unborn"))
    capsys.readouterr()
    prov = rundir.provenance(str(out))
    assert prov["git_commit"] is None and prov["dirty"] is False and capsys.readouterr().out == ""
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(repo))
    prov = rundir.provenance(str(out))
    assert prov["git_commit"] and prov["dirty"] is True and "+weight = 0.5  # caf" in (out / "code.diff").read_text()
    # `git diff HEAD` failing (an edited file this user cannot read: "fatal: cannot hash"; here its external diff
    # dies) after rev-parse worked recorded the commit as a clean checkout
    (out / "code.diff").unlink()
    monkeypatch.setenv("GIT_EXTERNAL_DIFF", "false")
    capsys.readouterr()
    prov = rundir.provenance(str(out))
    assert prov["git_commit"] and prov["dirty"] is None and prov["diff_sha1"] is None and not os.listdir(out)
    assert "note: `git diff HEAD` failed (fatal: external diff died" in capsys.readouterr().out
    # a git that hangs (a stale NFS mount) was a silent wait, then "no git"
    monkeypatch.delenv("GIT_EXTERNAL_DIFF")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "git").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "bin" / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(rundir, "GIT_TIMEOUT", 1, raising=False)
    prov = rundir.provenance(str(out))
    assert prov["git_commit"] is None and prov["dirty"] is None
    assert "note: `git rev-parse HEAD` did not answer in 1 s: log.jsonl records no commit" in capsys.readouterr().out


def test_a_resume_after_an_edit_names_the_changed_modules(corpus, cache, tmp_path, capsys, monkeypatch):
    # an ablation edits losses.py, then resumes a run made before the edit: one run, two codes, said
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=5, ckpt_interval=5), capsys)
    assert code == 0, err
    header, _ = read_log(tmp_path / "run")
    assert header["provenance"]["modules"] == rundir.code_fingerprint()
    code, out, err = run_main(["--resume", tmp_path / "run", "--max_steps", "6"], capsys)  # the same code: no note
    assert code == 0 and "changed since this run last started" not in out, err
    real = rundir.code_fingerprint
    monkeypatch.setattr(rundir, "code_fingerprint", lambda: {**real(), "losses.py": "0123456789ab"})
    code, out, err = run_main(["--resume", tmp_path / "run", "--max_steps", "7"], capsys)
    assert code == 0, err
    assert "note: losses.py changed since this run last started: the steps after 6 run the new code" in out, out


def test_a_resume_of_a_log_without_module_hashes_names_the_commits(corpus, cache, tmp_path, capsys):
    # a run made before log.jsonl recorded each module's sha1, resumed after a git pull: it went on with the new
    # code silently (found by a compatibility audit: a run of 300 commits back changed its held-out numbers)
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=5, ckpt_interval=5), capsys)
    assert code == 0, err
    log = tmp_path / "run" / "log.jsonl"
    now = json.loads(log.read_text().splitlines()[0])["provenance"]

    def earlier_version(commit, diff_sha1):  # log.jsonl's one start line as an earlier version wrote it
        lines = log.read_text().splitlines()
        start = json.loads(lines[0])
        start["provenance"].pop("modules", None)
        start["provenance"].update(git_commit=commit, diff_sha1=diff_sha1)
        log.write_text("\n".join([json.dumps(start)] + [s for s in lines[1:] if not s.startswith('{"config"')]) + "\n")
    earlier_version(now["git_commit"], now["diff_sha1"])  # the same commit and local changes: nothing to say
    code, out, err = run_main(["--resume", tmp_path / "run", "--max_steps", "6"], capsys)
    assert code == 0 and "changed since this run last started" not in out, err
    earlier_version("0123456789abcdef", None)
    code, out, err = run_main(["--resume", tmp_path / "run", "--max_steps", "7"], capsys)
    assert code == 0, err
    assert "note: the code (commit 0123456, now " in out and "changed since this run last started" in out, out


def test_resume_applies_the_new_optimizer_flags_dropout_and_dtype(corpus, cache, tmp_path, capsys):
    # the saved param groups and model config must not silently override what the flags say now;
    # an fp32 checkpoint (empty GradScaler state) resumes under fp16 without a traceback
    out_dir = tmp_path / "run"
    code, out, err = run_main(flags(corpus, cache, out_dir, max_steps=10), capsys)
    assert code == 0, err
    assert "on a CPU" not in out  # fp32
    seen = {}
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        seen.update(self.param_groups[0], dropout=[m.p for m in modules if isinstance(m, torch.nn.Dropout)],
                    no_decay=self.param_groups[1]["weight_decay"])
        return real_step(self, *a, **k)

    modules = []
    real_init = model.Bert.__init__

    def keep(self, *a, **k):
        real_init(self, *a, **k)
        modules.extend(self.modules())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim.AdamW, "step", spy)
        mp.setattr(model.Bert, "__init__", keep)
        code, out, err = run_main(["--resume", out_dir, "--max_steps", "12", "--weight_decay", "0.5", "--beta2", "0.9",
                                 "--adam_eps", "1e-3", "--dropout", "0.3", "--dtype", "fp16"], capsys)
    assert code == 0, err
    assert "note: --dtype fp16 on a CPU" in out  # slower than fp32 there
    assert seen["weight_decay"] == 0.5 and seen["betas"] == (0.9, 0.9) and seen["eps"] == 1e-3
    assert seen["no_decay"] == 0.0  # biases and LayerNorms: --weight_decay is the matrices' only
    assert seen["dropout"] and set(seen["dropout"]) == {0.3}


class InfGradFrom(losses.MLM):
    """Every training step from the third on has an infinite gradient (a finite loss): under fp16 the
    GradScaler skips each one and halves its scale, which would reach 0 and then poison the weights."""
    calls = 0

    def forward(self, model, batch, rng):
        loss, metrics = super().forward(model, batch, rng)
        if self.training:
            InfGradFrom.calls += 1
            if InfGradFrom.calls >= 3:
                loss = InfGrad.apply(loss)
        return loss, metrics


@pytest.mark.slow
def test_a_collapsing_fp16_loss_scale_is_a_divergence(corpus, cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(losses.LOSSES, "mlm", InfGradFrom)
    monkeypatch.setattr(InfGradFrom, "calls", 0)
    out_dir = tmp_path / "run"
    code, out, err = run_main(flags(corpus, cache, out_dir, max_steps=300, dtype="fp16", log_interval=50,
                                    ckpt_interval=1000), capsys)
    assert code == 1
    one_error(err, "non-finite loss or gradient norm at step 50", "loss_scale", "nothing was saved")
    assert not (out_dir / "ckpt.pt").exists()
    log = [json.loads(line) for line in open(out_dir / "log.jsonl")]
    assert not any("loss_scale" in r for r in log[1:])  # stopped at the first log step, before logging it


# ---- tests from a mutation audit of the run machinery: each fails on a mutant that survived the suite

def test_the_run_holds_its_lock_while_it_trains(corpus, cache, tmp_path, capsys, monkeypatch):
    # a lock released as soon as taken would let a second run in, and eval.py would not see a run in progress
    held, real_save = [], rundir.Run.save

    def save(self, step, elapsed_s):
        held.append(hf_io.still_training(str(self.cfg.out_dir)))
        return real_save(self, step, elapsed_s)
    monkeypatch.setattr(rundir.Run, "save", save)
    assert run_main(flags(corpus, cache, tmp_path / "run", max_steps=5, ckpt_interval=5), capsys)[0] == 0
    assert held == [True] and not hf_io.still_training(str(tmp_path / "run"))


def test_a_torch_save_dying_mid_write_keeps_the_last_checkpoint(corpus, cache, tmp_path, capsys, monkeypatch):
    # atomic_save itself under a failure (the kill tests replace atomic_save whole): half a file never lands
    real, calls = torch.save, []

    def dies_second(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:
            with open(f, "wb") as out:
                out.write(b"half a checkpoint")
            raise RuntimeError("killed")
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", dies_second)
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=20, ckpt_interval=10), capsys)
    monkeypatch.undo()
    assert code == 1 and hf_io.load_checkpoint_file(str(tmp_path / "run" / "ckpt.pt"))["step"] == 10, err
    assert not [p for p in (tmp_path / "run").iterdir() if ".tmp" in p.name]


def test_nan_weights_with_a_finite_loss_are_not_saved(corpus, cache, tmp_path, capsys, monkeypatch):
    # weights gone non-finite in the step before a save, the loss and gradient norm still finite
    real_step, calls = torch.optim.AdamW.step, []

    def poisons_tenth(self, *a, **k):
        out = real_step(self, *a, **k)
        calls.append(1)
        if len(calls) == 10:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return out
    monkeypatch.setattr(torch.optim.AdamW, "step", poisons_tenth)
    code, _, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=20, ckpt_interval=10, log_interval=100),
                            capsys)
    assert code == 1 and not (tmp_path / "run" / "ckpt.pt").exists(), err
    one_error(err, "at step 10", "nothing was saved")


def test_resume_refuses_another_seq_len(corpus, cache, tmp_path, capsys):
    # blocks, and the saved loader position, are counted in seq_len units
    assert run_main(flags(corpus, cache, tmp_path / "run", max_steps=5, ckpt_interval=5), capsys)[0] == 0
    code, _, err = run_main(["--resume", str(tmp_path / "run"), "--seq_len", "64", "--max_steps", "6"], capsys)
    assert code == 2
    one_error(err, "seq_len")
    # the model and its vocabulary are the checkpoint's: another size or tokenizer is refused, not ignored in silence
    for name, value in (("model_size", "small"), ("vocab_size", "300"), ("tokenizer", tmp_path / "run" / "vocab.txt"),
                        ("cased", "true"), ("limit_alphabet", "0")):  # the last two: how its tokenizer was trained
        code, _, err = run_main(["--resume", tmp_path / "run", f"--{name}", value, "--max_steps", "6"], capsys)
        assert code == 2, (name, err)
        one_error(err, f"checkpoint has {name}=", "it would change the model")


def test_the_data_fingerprint_sees_an_edit_that_keeps_the_token_count():
    a = np.arange(3000, dtype=np.uint16)
    b = a.copy()
    b[1234] += 1
    assert rundir.data_fingerprint(a[:2000], a[2000:]) != rundir.data_fingerprint(b[:2000], b[2000:])
    c = a.copy()
    c[2500] += 1  # in the validation stream
    assert rundir.data_fingerprint(a[:2000], a[2000:]) != rundir.data_fingerprint(c[:2000], c[2000:])


def test_a_glob_one_folder_down_reads_into_the_cache(tmp_path):
    (tmp_path / "texts").mkdir()
    assert config.reads_into(f"{tmp_path}/texts/*/*.txt", str(tmp_path / "texts"))


# ---- fp16 on a CPU: the GradScaler's state is part of the run

class InfGradOn(losses.MLM):
    """An infinite gradient (a finite loss) on the training calls in `calls`: fp16 overflows that the
    GradScaler skips. Counted per training forward (one a step here), across a resume in this process."""
    calls, on = 0, ()

    def forward(self, model, batch, rng):
        loss, metrics = super().forward(model, batch, rng)
        if self.training:
            InfGradOn.calls += 1
            if InfGradOn.calls in InfGradOn.on:
                loss = InfGrad.apply(loss)
        return loss, metrics


def test_an_fp16_run_killed_and_resumed_is_bit_identical_with_its_loss_scale(corpus, cache, tmp_path, capsys,
                                                                               monkeypatch):
    """Steps 3 and 4 overflow (skipped: the scale halves twice), and the scale grows back after every 4 good
    steps, so at the step-10 checkpoint both the scale and the growth tracker are off their fresh values.
    Killed right after that checkpoint and resumed, the run logs the same loss and loss_scale at every step
    and ends on the same weights, scale and tracker as one that ran through: a resume that dropped the
    scaler's state restarted at 65,536 and skipped or grew on other steps."""
    real_scaler = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: real_scaler(*a, growth_interval=4, **k))
    monkeypatch.setitem(losses.LOSSES, "mlm", InfGradOn)
    monkeypatch.setattr(InfGradOn, "on", (3, 4, 15))
    args = dict(max_steps=20, dtype="fp16", log_interval=1, ckpt_interval=10)
    monkeypatch.setattr(InfGradOn, "calls", 0)
    code, _, err = run_main(flags(corpus, cache, tmp_path / "whole", **args), capsys)
    assert code == 0, err

    real_save = rundir.Run.save

    def killed_after_step_10(self, step, elapsed_s):
        real_save(self, step, elapsed_s)
        if step == 10:
            raise KeyboardInterrupt  # the process dies here: steps after 10 are not run
    monkeypatch.setattr(InfGradOn, "calls", 0)
    with monkeypatch.context() as mp:
        mp.setattr(rundir.Run, "save", killed_after_step_10)
        code, _, err = run_main(flags(corpus, cache, tmp_path / "split", **args), capsys)
    assert code == 130, err
    saved = hf_io.load_checkpoint_file(str(tmp_path / "split" / "ckpt.pt"))
    assert saved["step"] == 10 and saved["scaler"]["scale"] != 2.0 ** 16 and saved["scaler"]["_growth_tracker"] > 0
    code, out, err = run_main(["--resume", tmp_path / "split"], capsys)
    assert code == 0 and "resumed from step 10" in out, err

    logs = {}
    for run_dir in ("whole", "split"):  # later lines win: the resumed segment's
        logs[run_dir] = {r["step"]: (r["loss"], r["loss_scale"], r["lr"]) for r in read_log(tmp_path / run_dir)[1]
                         if "loss" in r}
    assert sorted(logs["whole"]) == list(range(1, 21))
    assert logs["split"] == logs["whole"]
    scales = [logs["whole"][s][1] for s in range(1, 21)]
    assert scales[2] == scales[1] / 2 and scales[3] == scales[1] / 4 and max(scales[4:]) > scales[3]  # skips, growth
    assert scales[10] != 2.0 ** 16  # step 11, the first after the resume, goes on from the checkpoint's scale
    # a skipped step is a step: it moves the step count, the data and the learning-rate schedule
    schedule = config.TrainConfig(lr=2e-3, warmup_steps=2, max_steps=20)
    assert [logs["whole"][s][2] for s in range(1, 21)] == [train.lr_at(s - 1, schedule) for s in range(1, 21)]
    a, b = (hf_io.load_checkpoint_file(str(tmp_path / d / "ckpt.pt")) for d in ("whole", "split"))
    assert a["step"] == b["step"] == 20 and a["scaler"] == b["scaler"]
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_an_electra_run_killed_and_resumed_ends_on_the_same_generator_and_optimizer(corpus, cache, tmp_path, capsys,
                                                                                   monkeypatch):
    """ELECTRA's generator is the objective's own weights (ckpt.pt's "objective"): killed after its step-2
    checkpoint and resumed, the run ends on the weights, generator and AdamW state of one that ran through. A
    resume that left the generator at its fresh init, or gave the no-decay group --weight_decay, ends elsewhere."""
    args = dict(objective="electra", max_steps=4, ckpt_interval=2, eval_interval=1000, log_interval=4)
    assert run_main(flags(corpus, cache, tmp_path / "whole", **args), capsys)[0] == 0
    real_save = rundir.Run.save

    def killed_after_step_2(self, step, elapsed_s):
        real_save(self, step, elapsed_s)
        if step == 2:
            raise KeyboardInterrupt
    with monkeypatch.context() as mp:
        mp.setattr(rundir.Run, "save", killed_after_step_2)
        assert run_main(flags(corpus, cache, tmp_path / "split", **args), capsys)[0] == 130
    code, out, err = run_main(["--resume", tmp_path / "split"], capsys)
    assert code == 0 and "resumed from step 2" in out, err
    a, b = (hf_io.load_checkpoint_file(str(tmp_path / d / "ckpt.pt")) for d in ("whole", "split"))
    assert a["step"] == b["step"] == 4 and a["objective"].keys() == b["objective"].keys() and a["objective"]
    for part in ("model", "objective"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def test_tokens_per_s_counts_the_training_steps_only(corpus, cache, tmp_path, capsys, monkeypatch):
    """monitor's clock is faked: a training step takes 1 s, an evaluation 1000 s, a save 500 s. Every record's
    tokens_per_s is then one step's 256 tokens a second: the window restarts after the step-0 evaluation,
    each record counts the tokens since the previous one, the evaluations and saves between two records
    (the record after each read a fraction of the rate) and a resume's start-up stay out. elapsed_s is wall
    time: it keeps the mid-run evaluations, and goes on from the checkpoint's across the resume."""
    import monitor

    class Clock:
        now = 1e6

        def time(self):
            return self.now
    clock = Clock()
    monkeypatch.setattr(monitor, "time", clock)  # monitor's clock only
    real_forward, real_evaluate, real_save = losses.MLM.forward, train.evaluate, rundir.Run.save

    def forward(self, *a, **k):
        clock.now += 1.0 if self.training else 0.0
        return real_forward(self, *a, **k)

    def evaluate(*a, **k):
        clock.now += 1000.0
        return real_evaluate(*a, **k)

    def save(*a, **k):
        clock.now += 500.0
        return real_save(*a, **k)
    monkeypatch.setattr(losses.MLM, "forward", forward)
    monkeypatch.setattr(train, "evaluate", evaluate)
    monkeypatch.setattr(rundir.Run, "save", save)
    args = dict(max_steps=10, log_interval=2, eval_interval=4, ckpt_interval=10)
    assert run_main(flags(corpus, cache, tmp_path / "run", **args), capsys)[0] == 0
    clock.now += 1e5  # the process is gone a while, and the next one starts up
    code, _, err = run_main(["--resume", tmp_path / "run", "--max_steps", 16], capsys)
    assert code == 0, err
    records = [r for r in read_log(tmp_path / "run")[1] if "tokens_per_s" in r]
    assert [r["step"] for r in records] == list(range(2, 17, 2))
    assert [r["tokens_per_s"] for r in records] == [256.0] * len(records)
    # step 10's record comes before its evaluation; step 4's and 8's are in, step 0's is not. The checkpoint
    # holds the time up to its own save (10 steps, 3 evaluations), the resume goes on from there
    assert {r["step"]: r["elapsed_s"] for r in records if r["step"] in (10, 12, 16)} == {10: 2010.0, 12: 3012.0,
                                                                                          16: 4016.0}


@pytest.mark.skipif(os.name == "nt", reason="flock")
def test_a_lock_file_deleted_by_its_leaving_holder_is_not_taken(tmp_path, monkeypatch):
    """The race take_lock's samestat check closes: run B opens .lock while run A holds it; A leaves
    (release_lock deletes .lock, then unlocks it) and run C creates a new .lock and locks that one; B's
    flock then succeeds on A's deleted file. Without the check B would go on holding a lock nobody else
    can see, beside C: two runs in one out_dir. With it, B sees the file at .lock is another, tries that
    one, and is refused."""
    import fcntl
    out_dir = tmp_path / "run"
    a = rundir.take_lock(str(out_dir))
    real_flock, held = fcntl.flock, []

    def a_leaves_and_c_comes(f, op):  # between B's open and B's flock
        if not held:
            held.append(None)  # once: C's own flock is the real one
            rundir.release_lock(a)
            held[0] = rundir.take_lock(str(out_dir))  # C
        return real_flock(f, op)
    monkeypatch.setattr(fcntl, "flock", a_leaves_and_c_comes)
    with pytest.raises(ValueError, match="is in use by process"):
        rundir.take_lock(str(out_dir))  # B
    monkeypatch.undo()
    c = held[0]
    assert os.path.samestat(os.fstat(c.fileno()), os.stat(out_dir / ".lock"))  # C holds the file at .lock
    rundir.release_lock(c)
    # the holder gone and the file deleted just before B's flock: B locks a new file at .lock, which a D sees
    a = rundir.take_lock(str(out_dir))
    monkeypatch.setattr(fcntl, "flock", lambda f, op: (rundir.release_lock(a), real_flock(f, op))[1]
                        if not a.closed else real_flock(f, op))
    b = rundir.take_lock(str(out_dir))
    monkeypatch.undo()
    assert os.path.samestat(os.fstat(b.fileno()), os.stat(out_dir / ".lock"))
    with pytest.raises(ValueError, match="is in use by process"):
        rundir.take_lock(str(out_dir))  # D
    rundir.release_lock(b)
    assert not (out_dir / ".lock").exists()


@pytest.mark.skipif(os.name == "nt", reason="flock")
def test_a_lock_taken_over_from_a_dead_run_names_its_new_holder(tmp_path):
    # .lock is opened for appending: without emptying it first, the dead run's "pid host" stays in front
    import socket
    (tmp_path / ".lock").write_text("999999 a-host-that-is-gone")
    lock = rundir.take_lock(str(tmp_path))
    try:
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()} {socket.gethostname()}"
        with pytest.raises(ValueError, match=f"in use by process {os.getpid()} on {socket.gethostname()}"):
            rundir.take_lock(str(tmp_path))
    finally:
        rundir.release_lock(lock)


def test_a_host_name_that_is_not_utf8_names_the_lock_holder(tmp_path, monkeypatch):
    # the kernel takes any bytes as a host name (`hostname` refuses few): Python decodes a latin-1 one with a
    # surrogate, which the lock's "pid host" could not encode, so train.py and eval.py refused every run with
    # "error: 'utf-8' codec can't encode character '\\udcf6'"
    monkeypatch.setattr(socket, "gethostname", lambda: "h\udcf6st")
    lock = rundir.take_lock(str(tmp_path))
    try:
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()} h\\xf6st"
        with pytest.raises(ValueError, match=rf"in use by process {os.getpid()} on h\\xf6st"):
            rundir.take_lock(str(tmp_path))
    finally:
        rundir.release_lock(lock)


@pytest.mark.skipif(os.name == "nt", reason="flock")
def test_a_file_system_without_locks_runs_unlocked_and_says_so(corpus, cache, tmp_path, capsys, monkeypatch):
    # Lustre without -o flock (ENOSYS), an NFS mount whose lock daemon is gone (ENOLCK), some FUSE mounts: flock
    # fails there for every caller. That was "--out_dir is in use by another process" for every run: none could start
    import errno
    import fcntl
    import reproduce
    real_flock = fcntl.flock

    def no_locks(f, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=2), capsys)
    assert code == 0 and "done: steps 0 -> 2" in out, err
    assert err == (f"note: cannot lock {tmp_path / 'run' / '.lock'} (Function not implemented): this file system has "
                   f"no file locks, so another writer into --out_dir {tmp_path / 'run'} would not be refused; run one at a time "
                   f"there\n")
    assert not hf_io.still_training(str(tmp_path / "run"))  # it cannot tell: not "still training"
    reproduce.try_lock(str(tmp_path / "r.lock")).close()  # reproduce.py goes on too
    # a lock another process holds is still refused, by take_lock, reproduce.py and still_training
    monkeypatch.setattr(fcntl, "flock", real_flock)
    lock = rundir.take_lock(str(tmp_path / "run"))
    monkeypatch.setattr(fcntl, "flock", lambda f, op: (_ for _ in ()).throw(OSError(errno.EWOULDBLOCK, "held")))
    with pytest.raises(ValueError, match="is in use by process"):
        rundir.take_lock(str(tmp_path / "run"))
    assert hf_io.still_training(str(tmp_path / "run")) and reproduce.try_lock(str(tmp_path / "r.lock")) is None
    monkeypatch.setattr(fcntl, "flock", real_flock)
    rundir.release_lock(lock)


@pytest.mark.skipif(os.name == "nt", reason="flock")
def test_a_leaving_run_deletes_its_lock_file_while_it_still_holds_it(tmp_path, monkeypatch):
    # unlocked first, another run could lock the file in between and then lose it to the delete (see take_lock)
    lock, held, real_remove = rundir.take_lock(str(tmp_path)), [], os.remove
    monkeypatch.setattr(os, "remove", lambda path: (held.append(hf_io.still_training(str(tmp_path))),
                                                    real_remove(path))[1])
    rundir.release_lock(lock)
    assert held == [True] and lock.closed and not (tmp_path / ".lock").exists()


def test_out_of_memory_is_one_line_that_says_what_to_lower_and_the_checkpoint_stands(corpus, cache, tmp_path,
                                                                                        capsys, monkeypatch):
    # a micro-batch too big for the GPU (or the CPU's RAM) was a traceback ending in "CUDA out of memory"
    lr_at = train.lr_at
    errors = [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                          "capacity of 79.1 GiB of which 1.2 GiB is free. Including non-PyTorch ..."),
              RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 123 bytes. Error code 12 (Cannot allocate memory)"), MemoryError()]

    def runs_out(step, cfg):
        if step == 3:
            raise errors[0]
        return lr_at(step, cfg)
    monkeypatch.setattr(train, "lr_at", runs_out)
    code, out, err = run_main(flags(corpus, cache, tmp_path / "run", max_steps=6, ckpt_interval=2), capsys)
    assert code == 1 and err == (
        f"error: out of memory (CUDA out of memory. Tried to allocate 20.00 GiB): lower --batch_size (this run's micro-batch, 8 sequences a process; --tokens_per_step stays, with more "
        f"gradient accumulation), --seq_len or --model_size; {tmp_path / 'run'}/ckpt.pt stands: --resume "
        f"{tmp_path / 'run'} --batch_size N goes on from it\n"), err
    assert hf_io.load_checkpoint_file(str(tmp_path / "run" / "ckpt.pt"))["step"] == 2
    for error, shown in zip(errors[1:], ("DefaultCPUAllocator: can't allocate memory", "(MemoryError)")):
        errors[0] = error  # the CPU allocator's RuntimeError, Python's MemoryError; before any checkpoint
        code, out, err = run_main(flags(corpus, cache, tmp_path / error.__class__.__name__, max_steps=6), capsys)
        assert code == 1 and err.count("\n") == 1 and shown in err and "no checkpoint was saved yet" in err, err
    errors[0] = RuntimeError("mat1 and mat2 shapes cannot be multiplied")  # any other error keeps its traceback
    with pytest.raises(RuntimeError, match="shapes"):
        run_main(flags(corpus, cache, tmp_path / "other", max_steps=6), capsys)


def test_a_lost_peer_is_one_line_and_exit_1_and_an_own_error_keeps_its_traceback(corpus, cache, tmp_path, capsys,
                                                                                 monkeypatch):
    # rundir.run_main around a train() that fails as a torchrun rank's collective fails when another rank died
    argv = [str(a) for a in flags(corpus, cache, tmp_path / "run")]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun sets all three (config.validate refuses a half-set one)

    def peer_died(cfg, ckpt):
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:10165: Connection reset by peer. This is typically")
    with pytest.raises(SystemExit) as info:
        rundir.run_main(peer_died, argv, usage="")
    assert info.value.code == 1
    assert capsys.readouterr().err == ("error (rank 1): lost another process of this run (Read error "
                                       "[127.0.0.1]:10165: Connection reset by peer); the last checkpoint stands: "
                                       f"rerun with --resume {tmp_path / 'run'}\n")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")  # torchrun --max_restarts 2, first attempt: it restarts
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(SystemExit):
        rundir.run_main(peer_died, argv, usage="")
    assert capsys.readouterr().err.endswith("the last checkpoint stands: torchrun restarts the job (2 restart(s) "
                                            "left), which goes on from it where the command has --resume auto\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # its last attempt: torchrun restarts it no more
    with pytest.raises(SystemExit):
        rundir.run_main(peer_died, argv, usage="")
    assert capsys.readouterr().err.endswith(f"the last checkpoint stands: rerun with --resume {tmp_path / 'run'}\n")

    def own_error(cfg, ckpt):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        rundir.run_main(own_error, argv, usage="")


def test_ctrl_c_before_training_starts_exits_130_and_leaves_nothing(corpus, cache, tmp_path, capsys):
    def interrupted(cfg, ckpt):  # while the corpus is tokenized, say
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as info:
        rundir.run_main(interrupted, [str(a) for a in flags(corpus, cache, tmp_path / "run")], usage="")
    assert info.value.code == 130
    assert capsys.readouterr().err == "interrupted before training started: nothing was saved\n"
    assert not (tmp_path / "run").exists()  # its lock released, the directory it made removed


# ---- tests from a mutation audit of the training loop: each fails on a mutant of train.py that survived the suite

def test_the_held_out_score_does_not_depend_on_the_batch_size(corpus, cache, tmp_path, capsys):
    # the held-out blocks are a fixed row count (16, or the negative pool), not the per-process micro-batch, which
    # --batch_size and the process count change: the same weights score the same at 8 sequences or 2 x 4
    first = []
    for batch_size in (8, 4):
        out_dir = tmp_path / f"batch{batch_size}"
        assert run_main(flags(corpus, cache, out_dir, max_steps=1, warmup_steps=1, batch_size=batch_size,
                                 eval_batches=2), capsys)[0] == 0
        first.append(read_log(out_dir)[1][0])
    assert first[0]["step"] == 0 and first[0] == first[1]


@pytest.mark.parametrize("objective, dtype, grad_clip", [
    ("cocolm", "fp32", 0.05),  # COCO-LM owns a generator and heads beside the encoder
    ("mlm", "fp32", 0.0),  # clipping off: the raw norm
    ("mlm", "fp16", 0.05),  # clipped once the GradScaler has unscaled (COCO-LM's first fp16 steps overflow: skipped)
])
def test_every_trained_parameter_is_clipped_and_follows_the_schedule(corpus, cache, tmp_path, capsys, monkeypatch,
                                                                     objective, dtype, grad_clip):
    """At every optimizer step each param group (the undecayed biases and LayerNorms too) has the step's
    lr_at, and the gradient norm over every trained parameter, the objective's own included, is --grad_clip
    (of the true gradients, not fp16's scaled ones), or the raw norm with clipping off; every parameter
    the objective owns moves."""
    seen, start = [], {}
    real_step, real_init = torch.optim.AdamW.step, losses.LOSSES[objective].__init__

    def step(self, *a, **k):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen.append(([group["lr"] for group in self.param_groups], torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()))
        return real_step(self, *a, **k)

    def init(self, *a, **k):
        real_init(self, *a, **k)
        start.update({name: p.detach().clone() for name, p in self.named_parameters() if p.requires_grad})
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(losses.LOSSES[objective], "__init__", init)
    out_dir = tmp_path / "run"
    code, _, err = run_main(flags(corpus, cache, out_dir, objective=objective, max_steps=2, warmup_steps=2, dtype=dtype,
                                  grad_clip=grad_clip, ckpt_interval=2), capsys)
    assert code == 0, err
    assert [lrs for lrs, _ in seen] == [[1e-3, 1e-3], [2e-3, 2e-3]]  # warm-up: lr x (step + 1) / 2
    for _, norm in seen:
        assert norm == pytest.approx(grad_clip, rel=1e-4) if grad_clip else norm > 1.0
    trained = hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))["objective"]
    assert bool(start) == (objective == "cocolm")  # MLM owns no parameter
    assert [name for name in start if torch.equal(trained[name], start[name])] == []


def test_the_last_step_is_logged_evaluated_and_saved_off_the_intervals(corpus, cache, tmp_path, capsys,
                                                                       monkeypatch):
    # max_steps 3 with every interval 2: step 3 is logged, evaluated and saved all the same; the resume to step 5
    # evaluates at 4 and 5, not again at its start. Each record counts the global tokens of the steps since the
    # last one: 256 a step, in 2 micro-steps of 4 x 32 here
    import monitor
    counted, real_record = [], monitor.StepLog.record

    def record(self, step, *a):
        counted.append((step, self.tokens))
        return real_record(self, step, *a)
    monkeypatch.setattr(monitor.StepLog, "record", record)
    out_dir = tmp_path / "run"
    args = dict(batch_size=4, log_interval=2, eval_interval=2, ckpt_interval=2)
    assert run_main(flags(corpus, cache, out_dir, max_steps=3, **args), capsys)[0] == 0
    assert hf_io.load_checkpoint_file(str(out_dir / "ckpt.pt"))["step"] == 3
    assert run_main(["--resume", out_dir, "--max_steps", 5], capsys)[0] == 0
    records = read_log(out_dir)[1]
    assert [r["step"] for r in records if "loss" in r] == [2, 3, 4, 5]
    assert [r["step"] for r in records if "val_mlm_loss" in r] == [0, 2, 3, 4, 5]
    assert counted == [(2, 512), (3, 256), (4, 256), (5, 256)]


def test_text_files_and_pipes_are_utf8_whatever_the_locale():
    # open() and a text-mode subprocess without encoding= use the locale's encoding: under one that is not UTF-8
    # (Windows' cp1252; C without Python's UTF-8 mode) reproduce.py's and device_run.py's results.md (the
    # +- and -- signs) failed to write, and git's diff of an edited file holding a non-ASCII comment to read
    unpinned = []
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("test_") or path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            kw, func = {k.arg: k.value for k in node.keywords}, node.func
            if isinstance(func, ast.Name) and func.id == "open":
                mode = node.args[1] if len(node.args) > 1 else kw.get("mode")
                text = not (isinstance(mode, ast.Constant) and "b" in mode.value)
            elif isinstance(func, ast.Attribute) and func.attr in ("run", "Popen", "check_output"):
                text = any(isinstance(kw.get(k), ast.Constant) and kw[k].value for k in ("text", "universal_newlines"))
            elif isinstance(func, ast.Attribute) and func.attr in ("read_text", "write_text"):
                text = len(node.args) == (func.attr == "write_text")  # pathlib's, not corpus.read_text(path)
            else:
                continue
            if text and "encoding" not in kw:
                unpinned.append(f"{path.name}:{node.lineno}")
    assert not unpinned
