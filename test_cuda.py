"""The CUDA paths, checked on a GPU before a long run: bf16 autocast, the compiled encoder and TACO's compiled
negative scoring, torch.Generator("cuda") draws, pinned asynchronous copies, fused AdamW, SDPA's flash kernel, and
train.py / bench.py / eval.py end to end with their GPU defaults (subprocesses, run in the background alongside the
in-process tests). Run it first on the GPU machine (meant to take under 3 minutes on an H100, compiles included):

    python -m pytest -q test_cuda.py

Without a CUDA GPU the module is one skip. BERTCL_TEST_DEVICE=cpu runs the same checks on the CPU, to test their logic:

    BERTCL_TEST_DEVICE=cpu OMP_NUM_THREADS=1 python -m pytest -q test_cuda.py

There the code takes the CPU's settings (train.py: fp32, no compile, no pinned memory, no fused AdamW; TACO's fused
scoring only where a test asks for it), the in-process bf16 checks run under CPU autocast with torch.compile's eager
backend (real bf16 rounding: it calibrates their tolerances), and CPU results are compared with CPU results.
"""
import copy
import importlib.util
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

DEVICE = os.environ.get("BERTCL_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (BERTCL_TEST_DEVICE=cpu runs these checks on the CPU)", allow_module_level=True)
CUDA = DEVICE == "cuda"

from torch.nn.attention import SDPBackend, sdpa_kernel

import data
import losses
from config import TrainConfig
from losses import LOSSES, NegativeDots, sample_tokens
from model import Bert, BertConfig
from test_eval import write_glue
from test_losses import TINY, dense_negative_dots, make_batch, make_cfg
from test_train import HERE, common, read_log, write_corpus
from train import configure_optimizer


@pytest.fixture
def tf32_off():
    """fp32 matmuls in full precision for this test, restored after (set by assignment: torch's backend switches
    are properties, which pytest's monkeypatch cannot undo)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def autocast():  # train.py's on CUDA; on the CPU bf16 too, so that the loose tolerances meet real bf16 rounding
    return torch.autocast(DEVICE, dtype=torch.bfloat16)


def compiled(model):  # train.py compiles the encoder with inductor on CUDA; dynamo's eager backend traces it on CPU
    return torch.compile(model, dynamic=False, backend="inductor" if CUDA else "eager")


class DrawsFrom:
    """Stands in for `torch` inside losses.py: rand and randint draw on the generator's device, then move to the
    device asked for, so a CPU reference makes exactly a CUDA generator's draws (CUDA's Philox stream is another)."""

    def __getattr__(self, name):
        draw = getattr(torch, name)
        if name not in ("rand", "randint"):
            return draw
        return lambda *args, generator, device, **kw: draw(*args, generator=generator, device=generator.device,
                                                           **kw).to(device)


# ------------------------------------------------------------------------------------------
# in process: the objectives, and the pieces the GPU runs differently


@pytest.mark.parametrize("name", list(LOSSES))
def test_objective_on_device_matches_the_cpu(name, monkeypatch, tf32_off):
    """Loss terms and gradients on the device (fp32 eager; bf16 autocast + compiled encoder, train.py's GPU step)
    equal float64 CPU ones on the same weights and draws. fp32 is tight (TF32 off); bf16 loose: under CPU autocast
    the terms come within 2e-3 and the gradients within 5e-3 of float64, 10x less than allowed here."""
    monkeypatch.setattr(losses, "torch", DrawsFrom())
    drawn = []  # the generators' samples: every run must draw the reference's tokens
    monkeypatch.setattr(losses, "sample_tokens", lambda *args: drawn.append(sample_tokens(*args)) or drawn[-1])
    torch.manual_seed(0)
    model = Bert(BertConfig(**{**TINY, "hidden_size": 32, "intermediate_size": 64}))
    objective = LOSSES[name](model, make_cfg(taco_negatives=7))  # compile=True: TACO's fused scoring on CUDA
    batch = make_batch()  # packed rows, no attention mask, as train.py's
    results = {}
    for mode in ("reference", "fp32", "bf16"):
        m, o = copy.deepcopy(model), copy.deepcopy(objective)
        m, o = (m.double(), o.double()) if mode == "reference" else (m.to(DEVICE), o.to(DEVICE))
        on, rng = "cpu" if mode == "reference" else DEVICE, torch.Generator(DEVICE).manual_seed(1)
        drawn.clear()
        # TaCL's teacher runs in bf16 on CUDA whatever the autocast: here in the bf16 run only, so fp32 stays tight
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kwargs: mode == "bf16")
        with autocast() if mode == "bf16" else torch.autocast(DEVICE, enabled=False):
            loss, metrics = o(compiled(m) if mode == "bf16" else m, {k: v.to(on) for k, v in batch.items()}, rng)
        loss.backward()
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double().cpu()
                           for p in [*m.parameters(), *o.parameters()] if p.requires_grad])
        terms = {k: float(v) for k, v in {"loss": loss.detach(), **metrics}.items() if k.endswith("loss")}
        results[mode] = terms, grads, [d.cpu() for d in drawn]
    want, want_grads, want_drawn = results["reference"]
    for mode, rtol, grad_tol in (("fp32", 1e-4, 1e-4), ("bf16", 2e-2, 5e-2)):
        terms, grads, samples = results[mode]
        # bf16 logits may flip a Gumbel-max near-tie (rare; then try another seed): not a bug, but every term moves
        assert all(map(torch.equal, samples, want_drawn)), f"{mode}: other generator samples than the reference's"
        for k, v in want.items():
            assert math.isfinite(terms[k]) and terms[k] == pytest.approx(v, rel=rtol, abs=rtol * 0.1), (mode, k)
        assert (grads - want_grads).norm() < grad_tol * want_grads.norm(), mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_negative_scoring_matches_the_dense_gather(dtype, monkeypatch, tf32_off):
    """TACO's NegativeDots with fused_gather_dot (inductor-compiled, as with --compile on CUDA) and without it:
    the dense gather's scores and gradients (anchor, and the targets' of the taco_stop_grad=False ablation)."""
    # tf32_off: the dense reference's einsum is a matmul
    torch.manual_seed(0)
    B, T, K, D = 4, 16, 7, 32
    anchor = torch.randn(B, T, D, device=DEVICE, requires_grad=True)
    targets = torch.randn(B * T, D, device=DEVICE).to(dtype).requires_grad_()
    negatives, weights = torch.randint(B * T, (B, T, K), device=DEVICE), torch.randn(B, T, K, device=DEVICE)
    results = []
    for fn in (lambda *args: NegativeDots.apply(*args, True), NegativeDots.apply, dense_negative_dots):
        anchor.grad = targets.grad = None
        scores = fn(anchor, targets, negatives)
        (scores * weights).sum().backward()
        results.append((scores.detach(), anchor.grad.clone(), targets.grad.float()))
    (scores, anchor_grad, targets_grad), tol = results.pop(), 1e-5 if dtype == torch.float32 else 3e-2
    for got_scores, got_anchor_grad, got_targets_grad in results:  # fused, chunked
        assert got_scores.dtype == torch.float32 and torch.allclose(got_scores, scores, atol=1e-5)  # whatever targets'
        assert torch.allclose(got_anchor_grad, anchor_grad, atol=1e-5)
        assert torch.allclose(got_targets_grad, targets_grad, atol=tol, rtol=tol)  # added up in the targets' dtype


@pytest.mark.skipif(not CUDA, reason="TACO fuses its negative scoring on CUDA only")
def test_taco_fuses_its_scoring_in_training_only(monkeypatch):
    """With --compile on CUDA, TACO's training steps score negatives with the compiled kernel; held-out batches
    (eval mode, another batch size) take the chunked path, so the kernel compiles once in a run, not twice."""
    fused = []
    monkeypatch.setattr(NegativeDots, "apply", lambda *args: fused.append(args[-1]) or dense_negative_dots(*args))
    torch.manual_seed(0)
    model = Bert(BertConfig(**TINY)).to(DEVICE)
    objective = LOSSES["taco"](model, make_cfg(taco_negatives=7)).to(DEVICE)
    batch, rng = {k: v.to(DEVICE) for k, v in make_batch().items()}, torch.Generator(DEVICE).manual_seed(1)
    objective(model, batch, rng)
    model.eval(), objective.eval()
    with torch.no_grad():
        objective(model, batch, rng)
    assert fused == [True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_tokens_follow_the_softmax_on_device(dtype):
    """The generators' Gumbel-max sampler with a device generator: 200k draws match softmax within 5 standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5], [0.0, 0.0, 0.0, 0.0, 0.0, float("-inf")]])
    n = 100_000
    draws = sample_tokens(logits.to(DEVICE, dtype).repeat_interleave(n, 0), torch.Generator(DEVICE).manual_seed(0))
    probs = logits.to(dtype).double().softmax(-1)
    freq = torch.stack([torch.bincount(row, minlength=6) for row in draws.cpu().view(2, n)]).double() / n
    assert torch.all((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-12), (freq, probs)


def test_flash_attention_pinned_batches_and_fused_adamw():
    """Three GPU-only switches keep the numbers: the unpadded encoder runs on SDPA's flash kernel (bf16) as on the
    math kernel; BlockLoader's pinned non_blocking copies deliver the CPU loader's batches; train.py's fused AdamW
    takes the plain one's steps."""
    torch.manual_seed(0)
    model = Bert(BertConfig(**{**TINY, "hidden_size": 64})).to(DEVICE).eval()  # 2 heads of 32
    with torch.no_grad():  # sharper attention than at init: a wrong kernel would move the states by ~50%, not 1%
        for p in model.encoder.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = make_batch(B=8)["input_ids"].to(DEVICE)
    outputs = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        with autocast(), sdpa_kernel(backend), torch.no_grad():  # flash raises if it cannot run (a mask, fp32)
            outputs.append(model(x).float())
    assert (outputs[0] - outputs[1]).norm() < 5e-2 * outputs[1].norm()
    stream = torch.randint(5, 50, (5000,)).numpy().astype("uint16")
    loaders = [data.BlockLoader(stream, 32, 8, cls_id=2, sep_id=3, device=d) for d in (DEVICE, "cpu")]
    for _ in range(20):  # a reused pinned buffer would show as rows of another batch
        got, want = (loader.next_batch() for loader in loaders)
        assert got.device.type == DEVICE and torch.equal(got.cpu(), want)
    params = [[p.detach().to(d, copy=True).requires_grad_() for p in model.parameters()] for d in (DEVICE, "cpu")]
    optimizers = [configure_optimizer(ps, TrainConfig(lr=1e-2), d) for ps, d in zip(params, (DEVICE, "cpu"))]
    assert optimizers[0].defaults["fused"] == CUDA
    for step in range(3):
        for ps, optimizer in zip(params, optimizers):
            for i, p in enumerate(ps):
                p.grad = torch.linspace(-1, 1, p.numel(), device=p.device).view_as(p) * (step + 1) + i
            optimizer.step()
    assert all(torch.allclose(got.cpu(), want, atol=1e-6) for got, want in zip(*params))


# ------------------------------------------------------------------------------------------
# end to end: train.py, bench.py and eval.py as subprocesses with their defaults (on CUDA: bf16, compile)

MLM_PAIR = dict(max_steps=60, log_interval=1, eval_interval=60, ckpt_interval=60, dropout=0.1)


def run_all(root, results, live, cancel):
    """Every subprocess the tests below read, in two waves of parallel runs; SIGTERMs "mlm_stopped" a few steps in.
    Each run's output goes to root/NAME.out; results[NAME] = (exit status, output); live holds the running ones."""
    corpus = write_corpus(root / "toy.txt")
    write_glue(root / "glue")
    train = lambda out, **flags: ["train.py", *common(corpus, root, out=out, **flags)]
    resume = lambda out, *flags: ["train.py", "--resume", root / out, *flags]
    hf = ["--hf"] if importlib.util.find_spec("transformers") else []
    first = dict(mlm=train("mlm", **MLM_PAIR), mlm_stopped=train("mlm_stopped", **MLM_PAIR),
                 bench=["bench.py", "--model_size", "tiny", "--objectives", "mlm", "--batch_size", 8, "--seq_len", 64,
                        "--steps", 3, "--warmup", 2, "--json", root / "bench.json", *hf],
                 **{name: train(name, objective=name, max_steps=20) for name in ("taco", "electra", "cocolm")})
    second = dict(tacl=train("tacl", objective="tacl", init_from=root / "mlm", max_steps=20),
                  mlm_resumed=resume("mlm_stopped"),
                  **{f"{name}_more": resume(name, "--max_steps", 25) for name in ("taco", "electra", "cocolm")},
                  glue=["eval.py", "--model", root / "mlm", "--glue_dir", root / "glue", "--tasks", "cola", "--epochs",
                        1, "--max_train_samples", 32, "--max_eval_samples", 16, "--precision", "bf16", "--out",
                        root / "glue_out"])
    # several processes at once: on the CPU one thread each; on CUDA a few inductor compile workers each, not 16
    env = {**({"TORCHINDUCTOR_COMPILE_THREADS": "4"} if CUDA else {"OMP_NUM_THREADS": "1"}), **os.environ}
    deadline = time.time() + 480  # both waves: inside a 10-minute device call, with pytest's start and report
    for wave in (first, second):
        if cancel.is_set():
            return
        procs = {name: subprocess.Popen([sys.executable, *map(str, args)], cwd=HERE, env=env, stderr=subprocess.STDOUT,
                                        stdout=open(root / f"{name}.out", "w")) for name, args in wave.items()}
        live[:] = procs.values()
        stop_log = root / "mlm_stopped" / "log.jsonl"
        while "mlm_stopped" in procs and procs["mlm_stopped"].poll() is None and time.time() < deadline:
            if stop_log.is_file() and stop_log.read_text().count('"loss"') >= 3:  # past the compile, steps 1-3 done
                procs["mlm_stopped"].send_signal(signal.SIGTERM)
                break
            time.sleep(0.01)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            results[name] = proc.returncode, (root / f"{name}.out").read_text()


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """Starts the subprocesses at the module's first test, so that they overlap the in-process tests; calling
    runs() waits for them and returns (root, {name: (exit status, output)}). A selection (-k) of in-process
    tests only starts none of them (device_run.py's speed chunk runs those alone, on a budget)."""
    root, results, live, cancel = tmp_path_factory.mktemp("runs"), {}, [], threading.Event()
    worker = threading.Thread(target=run_all, args=(root, results, live, cancel), daemon=True)
    wanted = any("runs" in inspect.signature(item.function).parameters
                 for item in request.session.items if item.module is request.module)
    if wanted:
        worker.start()
    yield lambda: worker.join() or (root, results)
    cancel.set()  # a -k selection that read none of them, or an interrupt: stop what still runs
    for proc in list(live):
        proc.kill()
    if wanted:
        worker.join()


def finished(runs, name):  # (root, output) of a run that exited 0
    root, results = runs()
    assert results[name][0] == 0, results[name][1][-3000:]
    return root, results[name][1]


@pytest.mark.parametrize("objective", ["mlm", "taco", "tacl", "electra", "cocolm"])
def test_train_on_device(runs, objective):
    """train.py with its defaults on this device: exit 0, finite losses (MLM's falls); for TACO, ELECTRA and COCO-LM
    a --resume with a larger --max_steps goes on from the checkpoint: the held-out loss stays by step 20's, far from
    the untrained one. (MLM's resume: the SIGTERM test below; TaCL's is not run.)"""
    root, output = finished(runs, objective)
    assert f"on {DEVICE}, {'bf16' if CUDA else 'fp32'}" in output  # the GPU default: bf16 autocast
    records = read_log(root / objective)[1]
    assert all(math.isfinite(v) for r in records for k, v in r.items() if k.endswith("loss")), records
    train_loss = [r["loss"] for r in records if "loss" in r]
    if objective == "mlm":
        assert sum(train_loss[-5:]) < sum(train_loss[:5]) - 5 * 0.3, train_loss
    if objective in ("taco", "electra", "cocolm"):
        finished(runs, f"{objective}_more")
        key = "val_mlm_loss" if objective == "taco" else "val_gen_loss"
        val = {r["step"]: r[key] for r in read_log(root / objective)[1] if key in r}
        assert sorted(val) == [0, 20, 25] and all(map(math.isfinite, val.values()))
        assert abs(val[25] - val[20]) < 0.3 * (val[0] - val[20]), val


def test_sigterm_then_resume_continues_the_same_curve(runs):
    """SIGTERM saves between two steps; --resume continues the uninterrupted run's curve, with dropout. Exact on the
    CPU; on CUDA only close: inductor's and SDPA's backward kernels add with atomics in no fixed order, ~1e-7 per
    step, which bf16 rounding and 60 steps grow. Measured on the CPU in bf16 with another thread count (another
    summation order): 4e-4 of the loss at most; a resume that loses the optimizer state: 2e-2, the loader's: 1e-1."""
    root, results = runs()
    code, output = results["mlm_stopped"]
    assert code == 128 + signal.SIGTERM and "SIGTERM: stopped after step" in output, output[-3000:]
    stop = int(output.split("SIGTERM: stopped after step ")[1].split(";")[0])
    assert 3 <= stop < MLM_PAIR["max_steps"]
    finished(runs, "mlm_resumed")
    resumed = {r["step"]: r["loss"] for r in read_log(root / "mlm_stopped")[1] if "loss" in r}  # later lines win
    reference = {r["step"]: r["loss"] for r in read_log(root / "mlm")[1] if "loss" in r}
    assert resumed.keys() == reference.keys() == set(range(1, MLM_PAIR["max_steps"] + 1))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-2 if CUDA else 0, abs=1e-6), (step, stop)


def test_bench_on_device(runs):
    """bench.py times our MLM step (and Hugging Face's, with transformers) on this device and writes --json."""
    root, _ = finished(runs, "bench")
    report = json.loads((root / "bench.json").read_text())
    hf = importlib.util.find_spec("transformers") is not None
    assert [r["objective"] for r in report["results"]] == ["mlm"] + ["hf-mlm"] * hf
    for r in report["results"]:
        assert "error" not in r and math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
        assert (r["peak_mem_gb"] is not None and r["peak_mem_gb"] > 0) == CUDA and r["compile"] == int(CUDA)


def test_glue_on_device(runs):
    """eval.py fine-tunes and scores CoLA (tiny synthetic TSVs) on this device, in bf16 on CUDA: a finite score."""
    root, _ = finished(runs, "glue")
    report = json.loads((root / "glue_out" / "glue.json").read_text())
    cola = report["tasks"]["cola"]
    assert report["device"].startswith(DEVICE) and cola["status"] == "ok" and cola["n_train"] == 32
    assert cola["runs"]["seed 1"]["hparams"]["precision"] == ("bf16" if CUDA else "fp32")
    assert cola["mean"] and all(map(math.isfinite, cola["mean"].values()))
