"""train.py end to end on CPU: flags, every objective's smoke run, bad input, DDP, kill + resume."""
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import config
import rundir
import train

HERE = Path(__file__).resolve().parent
WORDS = dict(det=["the", "a", "every", "some"], adj=["red", "small", "quiet", "old", "bright", "heavy"],
             noun=["cat", "river", "engine", "garden", "teacher", "city", "storm", "letter"],
             verb=["sees", "follows", "moves", "finds", "builds", "carries"])


def write_corpus(path, n_sentences=6000, seed=0):
    """Structured toy text: determiner-adjective-noun-verb patterns an MLM can learn fast."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences // 10):
        lines.append(" ".join(
            f"{rng.choice(WORDS['det'])} {rng.choice(WORDS['adj'])} {rng.choice(WORDS['noun'])} "
            f"{rng.choice(WORDS['verb'])} {rng.choice(WORDS['det'])} {rng.choice(WORDS['noun'])} ."
            for _ in range(10)))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "toy.txt")


def run(args, cwd=HERE, timeout=300, **kw):
    return subprocess.run([sys.executable, "train.py", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)


def common(corpus, tmp_path, out="run", **over):
    flags = dict(data=corpus, cache_dir=tmp_path / "cache", out_dir=tmp_path / out, vocab_size=200, seq_len=32,
                 batch_size=8, tokens_per_step=256, max_steps=40, lr=2e-3, warmup_steps=5, log_interval=5,
                 eval_interval=20, eval_batches=2, ckpt_interval=20, taco_negatives=8)
    flags.update(over)
    return [x for k, v in flags.items() for x in (f"--{k}", v)]


def read_log(out_dir):
    lines = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    return lines[0], lines[1:]


# ---- flags

def test_flags_presets_and_types():
    cfg, given = config.parse_args(["--max_steps", "7", "--preset=small", "--compile", "--taco_stop_grad=false"])
    assert cfg.max_steps == 7 and cfg.model_size == "small" and cfg.seq_len == 256  # preset, then flags
    # each preset runs in its own default folder: a small run without --out_dir met the quick start's out/smoke
    assert cfg.out_dir == "out/small" and config.parse_args(["--preset=base"])[0].out_dir == "out/base"
    assert config.parse_args([])[0].out_dir == "out/smoke" and config.parse_args(["--preset", "tacl"])[0].out_dir == "out/tacl"
    assert config.parse_args(["--preset=small", "--out_dir", "x"])[0].out_dir == "x"
    assert cfg.compile is True and cfg.taco_stop_grad is False and set(given) == {
        "max_steps", "preset", "compile", "taco_stop_grad"}
    assert [config.parse_args(["--compile", v])[0].compile for v in ("0", "1", "off")] == [False, True, False]
    # a preset's warm-up longer than a shortened run becomes 10% of the run; a given one stays
    assert cfg.warmup_steps == 0 and config.parse_args(["--preset=small", "--max_steps=1000"])[0].warmup_steps == 100
    assert config.parse_args(["--max_steps", "7", "--warmup_steps", "9"])[0].warmup_steps == 9  # validate() refuses it
    for bad, msg in ((["--nope", "1"], "unknown flag"), (["--max_steps", "x"], "expects int"),
                     (["--preset", "huge"], "unknown preset"), (["--compile", "maybe"], "true or false")):
        with pytest.raises(ValueError, match=msg):
            config.parse_args(bad)
    # a range's message marks its closed and open ends
    for field, value, msg in (("dropout", 1.0, "[0, 1)"), ("mask_prob", 0.0, "(0, 1)")):
        with pytest.raises(ValueError, match=re.escape(f"must be in {msg}")):
            config.validate(config.TrainConfig(**{field: value}))


def test_cache_dir_is_absolute(tmp_path, monkeypatch):
    # saved absolute in the checkpoint and log.jsonl, so `eval.py --analysis` or a resume from another directory
    # finds the run's token cache instead of re-tokenizing the corpus into a new ./cache there
    monkeypatch.chdir(tmp_path)
    assert config.parse_args([])[0].cache_dir == str(tmp_path / "cache")
    cfg, given = config.parse_args(["--cache_dir", "sub/c"])
    assert cfg.cache_dir == given["cache_dir"] == str(tmp_path / "sub" / "c")


def test_a_flag_the_objective_never_reads_gets_a_note(monkeypatch):
    import losses
    # --cocolm_mask_all under --objective electra (or --taco_window under mlm) was accepted without a word
    notes = lambda *argv: config.unread_flags(*config.parse_args(list(argv)))
    assert notes("--objective", "electra", "--cocolm_mask_all", "--gen_shape", "electra") == [
        "note: --cocolm_mask_all does nothing under --objective electra (it is read by cocolm)"]
    assert notes("--objective", "mlm", "--taco_window", "3", "--tacl_temperature", "0.1", "--mlm_predict_all") == [
        "note: --taco_window does nothing under --objective mlm (it is read by taco)",
        "note: --tacl_temperature does nothing under --objective mlm (it is read by tacl)"]
    assert notes("--objective", "taco", "--taco_window", "3", "--mlm_predict_all", "--negative_pool", "4") == []
    # an objective added to LOSSES and not to the table may read any flag: no note (it said "--mlm_predict_all does
    # nothing under --objective half_mlm" of an MLM copy whose log had tp_loss)
    monkeypatch.setitem(losses.LOSSES, "half_mlm", type("Halved", (losses.MLM,), {}))
    assert notes("--objective", "half_mlm", "--mlm_predict_all", "--taco_window", "3") == []
    missing = unlisted_objective_flags([f.name for f in config.fields(config.TrainConfig)], losses.LOSSES)
    assert not missing, f"--{missing[0]}: add it (or its prefix) to config.OBJECTIVE_FLAGS with the objectives that read it"


def unlisted_objective_flags(names, objectives):
    """The flags named after an objective (NAME_..., an added objective's own too) that config.OBJECTIVE_FLAGS does not
    give to that objective, and the generator's (gen_...) it lacks: each would draw no note under another objective."""
    readers = lambda name: [o for p, users in config.OBJECTIVE_FLAGS.items() if name.startswith(p) for o in users.split()]
    return [name for name in names if any(name.startswith(o + "_") and o not in readers(name) for o in objectives)
            or name.startswith("gen_") and not readers(name)]


def test_an_added_objectives_own_flag_must_be_in_the_objective_table():
    # the check went by name.split("_")[0]: the flags of an objective whose name holds "_" (half_mlm, above) went
    # unchecked, and so did taco_lite_* (their first word taco is in the table, read by taco alone)
    objectives = ("mlm", "taco", "half_mlm", "taco_lite")
    assert unlisted_objective_flags(["half_mlm_scale", "taco_lite_width", "taco_window", "mlm_predict_all", "gen_shape",
                                     "lr"], objectives) == ["half_mlm_scale", "taco_lite_width"]


def test_a_preset_shortened_to_near_its_warm_up_gets_a_note():
    # --preset small --max_steps 3000 kept the preset's 2,500 warm-up steps: the lr peaked near the end, without a word
    note = lambda *argv: config.warmup_note(*config.parse_args(list(argv)))
    assert note("--preset", "small", "--max_steps", "3000") == [
        "note: the preset's warm-up is 2,500 of the 3,000 steps: the learning rate peaks at step 2,500 of 3,000; "
        "--warmup_steps N shortens it (10%: --warmup_steps 300)"]
    assert "peaks at step 2,500 of 2,500;" in note("--preset", "small", "--max_steps", "2500")[0]  # never decays
    assert note("--preset", "small", "--max_steps", "5000") == []  # half: decay as long as the warm-up
    assert note("--preset", "small", "--max_steps", "3000", "--warmup_steps", "2500") == []  # asked for
    assert note("--preset", "small", "--max_steps", "2000") == []  # cut to 10% (200) by parse_args
    assert note("--preset", "small") == [] and note("--max_steps", "60") == []  # the smoke preset's 30: half of 60
    assert note("--max_steps", "40")[0].startswith("note: the preset's warm-up is 30 of the 40 steps")
    # --preset tacl's warm-up is TaCL's rule, 10% of the steps, at any --max_steps (Table 5's presets keep step counts)
    warmup = lambda *argv: config.parse_args(["--preset", "tacl", *argv])[0].warmup_steps
    assert (warmup(), warmup("--max_steps", "40000"), warmup("--max_steps", "40000", "--warmup_steps", "15000")) == (
        15_000, 4_000, 15_000)
    assert note("--preset", "small", "--max_steps", "3000", "--resume", "out/small") == []  # a resume: a new run's note


def test_help_lists_fields_with_comments():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=HERE, capture_output=True, text=True)
    assert out.returncode == 0 and "--taco_negatives" in out.stdout and "K negatives" in out.stdout
    out = subprocess.run([sys.executable, "train.py", "--help", "--preset", "small", "--preset=base"], cwd=HERE,
                         capture_output=True, text=True)
    assert "values of --preset base" in out.stdout  # the last --preset wins, as when training


@pytest.mark.slow
def test_help_into_a_closed_pipe_is_quiet():
    """`python train.py --help | head`: the reader is gone before the flags are printed; no traceback."""
    proc = subprocess.Popen([sys.executable, "train.py", "--help"], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before train.py (which imports torch first) writes a line
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err


def test_the_plan_says_how_many_tokens_the_run_trains_on(capsys):
    # a user sizing a GPU run read steps x blocks and epochs, but not the total: --preset small is 82B tokens
    from types import SimpleNamespace
    import monitor
    small = config.TrainConfig(**config.PRESETS["small"], objective="mlm")
    monitor.print_plan(small, SimpleNamespace(num_params=lambda: 29e6), SimpleNamespace(world=16, device="cuda:0"),
                       "bf16", 1, SimpleNamespace(num_blocks=10_000_000), 2_540_000_000)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("this run reads the 2.5B-token training split 32.00 times (epochs): 250,000 steps x 1,280 blocks "
                    "of 254 text tokens (+ [CLS], [SEP]) = 81.9B tokens"), line


def test_micro_batching_keeps_the_global_batch():
    tacl = config.TrainConfig(**config.PRESETS["tacl"])  # 64 x 256 tokens per process, 65,536 per step
    assert config.micro_batching(tacl, 1) == (64, 4)
    assert config.micro_batching(tacl, 8) == (32, 1)  # 8 GPUs: the cap drops to 32 sequences each
    assert config.micro_batching(tacl, 16) == (16, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        config.micro_batching(tacl, 3)  # 65,536 tokens do not split over 3 processes
    # a step that does not split says what would: a 6-GPU node under --preset small (1,280 sequences, pools of 80),
    # the smoke flags on 3 processes (whose batch_size 5 is --batch_size 16 lowered), a --batch_size that divides
    small = config.TrainConfig(**config.PRESETS["small"], objective="taco")
    with pytest.raises(ValueError, match=r"x 6 processes = 122880; it splits on 1, 2, 4, 8 or 16 processes; or with "
                                         r"--tokens_per_step 245760 or 368640$"):
        config.micro_batching(small, 6)
    with pytest.raises(ValueError, match=r"batch_size 5 \(--batch_size 16, lowered\) x seq_len 128 x 3 processes = "
                                         r"1920; it splits on 1, 2, 4 or 8 processes; or with --tokens_per_step 1920 or"):
        config.micro_batching(config.TrainConfig(objective="taco"), 3)
    with pytest.raises(ValueError, match=r"= 2560; it splits with --batch_size 16; or on 3, 4, "):
        config.micro_batching(config.TrainConfig(tokens_per_step=48 * 128, batch_size=20), 1)
    assert config.micro_batching(config.TrainConfig(tokens_per_step=48 * 128, batch_size=16), 1) == (16, 3)
    with pytest.raises(ValueError, match="not a multiple"):  # a step shorter than one sequence: a clear error
        config.micro_batching(config.TrainConfig(tokens_per_step=64), 1)
    base = config.TrainConfig(**config.PRESETS["base"], objective="taco")  # 1,280 x 256 per step, pools of 80
    assert config.micro_batching(base, 1) == (80, 16) and config.micro_batching(base, 16) == (80, 1)
    with pytest.raises(ValueError, match="negative_pool 80.* with 32 process.* allows 40$"):
        config.micro_batching(base, 32)  # 40 sequences per process: no whole pool of 80
    # the smoke flags on 16 processes leave 1 sequence each: COCO-LM's NT-Xent would have no negative (loss 0)
    smoke = config.TrainConfig(objective="cocolm")
    with pytest.raises(ValueError, match="16 process.*1 sequence.*pool.* of >= 2 sequences, not 1"):
        config.micro_batching(smoke, 16)
    with pytest.raises(ValueError, match="--taco_negatives 50: must be <= 32,.*lower --taco_negatives"):  # 2 sequences of 32: 32 candidates for 50
        config.micro_batching(config.TrainConfig(objective="taco", seq_len=32, tokens_per_step=128), 2)


def test_an_added_objective_that_trains_the_mlm_head_is_told_when_init_from_has_none(corpus, tmp_path, monkeypatch,
                                                                                       capsys):
    # the note followed a list of names (mlm, taco, tacl): an objective added to LOSSES trains the head from an
    # ELECTRA run's export (a BertModel) without a word. Now the built objective says it (its head needs a gradient)
    import losses
    monkeypatch.setitem(losses.LOSSES, "half_mlm", type("Halved", (losses.MLM,), {}))
    short = dict(max_steps=1, warmup_steps=0, log_interval=1, eval_interval=1, eval_batches=1, ckpt_interval=1,
                 device="cpu")
    train.main(common(corpus, tmp_path, out="electra", objective="electra", **short))
    capsys.readouterr()
    note = "has no MLM head that its run trained"
    for objective, told in (("half_mlm", True), ("mlm", True), ("cocolm", False)):  # COCO-LM never trains it
        train.main(common(corpus, tmp_path, out=objective, objective=objective, init_from=tmp_path / "electra", **short))
        assert (note in capsys.readouterr().out) is told, objective
        ckpt = torch.load(tmp_path / objective / "ckpt.pt", weights_only=True)  # what --init_from a ckpt.pt reads
        assert ckpt["mlm_head_trained"] is (objective != "cocolm"), objective


def test_an_objective_added_by_copying_taco_keeps_its_pool_rules(monkeypatch):
    # the pool rules follow the class (uses_negative_pool), not a list of names: an ablation's copy keeps them
    import losses
    monkeypatch.setitem(losses.LOSSES, "taco2", type("TACO2", (losses.TACO,), {}))
    base = config.TrainConfig(**config.PRESETS["base"], objective="taco2")
    assert config.micro_batching(base, 1) == (80, 16)
    with pytest.raises(ValueError, match="negative_pool 80.* with 32 process.* allows 40$"):
        config.micro_batching(base, 32)
    assert config.micro_batching(config.TrainConfig(**config.PRESETS["base"], objective="mlm"), 32) == (40, 1)


def test_gradient_accumulation_averages_the_micro_batches(corpus, tmp_path, monkeypatch):
    # each micro-batch's loss is divided by grad_accum: the gradient the step clips and applies is the mean of
    # the micro-batches' own gradients, as one batch of them all would give. Adam's first step hides a 2x scale,
    # so the gradients are read, in process: each micro-batch's by autograd.grad, the accumulated one at clipping.
    # The logged loss and terms are the micro-batches' mean too, not the last one's
    micro, accumulated, terms = [], [], []
    forward, clip = train.Pretrainer.forward, torch.nn.utils.clip_grad_norm_

    def recording_forward(self, batch, rng):
        loss, metrics = forward(self, batch, rng)
        params = list(self.parameters())
        micro.append(dict(zip(map(id, params), torch.autograd.grad(loss, params, retain_graph=True))))
        terms.append({"loss": loss.item(), **{k: float(v) for k, v in metrics.items()}})
        return loss, metrics

    def recording_clip(params, max_norm):
        accumulated.append({id(p): p.grad.clone() for p in params})
        return clip(params, max_norm)
    monkeypatch.setattr(train.Pretrainer, "forward", recording_forward)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    # 256 tokens = 2 micro-batches x 4 x 32; on the CPU: fp32, no compile
    train.main(common(corpus, tmp_path, batch_size=4, max_steps=1, warmup_steps=1, eval_batches=1, device="cpu"))
    assert len(micro) == 2 and len(accumulated) == 1
    # a CPU run leaves torch's process-wide TF32 switches alone (a test runner cannot undo what main sets)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == tf32
    for key, grad in accumulated[0].items():
        torch.testing.assert_close(grad, (micro[0][key] + micro[1][key]) / 2, rtol=1e-5, atol=1e-8)
    logged = next(r for r in read_log(tmp_path / "run")[1] if "loss" in r)
    assert terms[0]["loss"] != terms[1]["loss"]
    for k in terms[0]:
        assert logged[k] == pytest.approx((terms[0][k] + terms[1][k]) / 2, rel=1e-6), k


def test_small_and_base_presets_are_taco_table_5():
    # TACO App. A, Table 5, typed in from the paper (not from train.py), so the presets cannot drift
    table5 = dict(seq_len=256, vocab_size=30522, lr=1e-4, beta2=0.999, adam_eps=1e-8, weight_decay=0.01,
                  grad_clip=1.0, dropout=0.1, mask_prob=0.15)
    for preset, size, steps, warmup in (("small", "small", 250_000, 2_500), ("base", "base", 500_000, 10_000)):
        cfg = config.TrainConfig(**config.PRESETS[preset])
        assert {k: getattr(cfg, k) for k in table5} == table5
        assert (cfg.model_size, cfg.max_steps, cfg.warmup_steps) == (size, steps, warmup)
        assert cfg.tokens_per_step == 1280 * 256  # batch 1,280 sequences of 256 tokens
        # one GPU: 80 sequences x 16 accumulation micro-steps = 1,280; 16 GPUs (the paper's 80 per GPU): none
        assert config.micro_batching(cfg, 1) == (80, 16) and config.micro_batching(cfg, 16) == (80, 1)
        assert set(config.PRESET_SOURCES[preset]) >= set(table5) | {"tokens_per_step", "max_steps", "warmup_steps"}
    # Table 5's architecture rows (layers, hidden, heads, FFN inner size); §4 names the sizes but gives no numbers
    for size, shape in (("small", (4, 512, 8, 2048)), ("base", (12, 768, 12, 3072))):
        m = config.MODEL_PRESETS[size]
        assert (m["num_layers"], m["hidden_size"], m["num_heads"], m["intermediate_size"]) == shape
        assert config.PRESET_SOURCES[size]["model_size"].startswith("TACO Table 5")


def test_tacl_and_smoke_presets_are_what_the_docs_say():
    # docs/fidelity.md note 3, typed in from TaCL's train_tacl_english.sh / train.py: 256 x 256 tokens, 150k steps,
    # 10% warm-up, lr 1e-4, transformers' AdamW defaults (eps 1e-6, no weight decay), clip 1.0
    tacl = config.TrainConfig(**config.PRESETS["tacl"])
    assert (tacl.objective, tacl.model_size, tacl.seq_len, tacl.tokens_per_step) == ("tacl", "base", 256, 256 * 256)
    assert (tacl.max_steps, tacl.warmup_steps, tacl.lr, tacl.adam_eps, tacl.weight_decay, tacl.grad_clip) == (
        150_000, 15_000, 1e-4, 1e-6, 0.0, 1.0)
    # the smoke run (README, the fields' comments): 300 steps of 16 x 128 tokens, a vocabulary of 8,192, no dropout
    smoke = config.TrainConfig(**config.PRESETS["smoke"])
    assert (smoke.model_size, smoke.max_steps, smoke.tokens_per_step, smoke.batch_size, smoke.seq_len) == (
        "tiny", 300, 16 * 128, 16, 128)
    assert (smoke.vocab_size, smoke.dropout, smoke.lr) == (8192, 0.0, 1e-3)


def test_every_recipe_value_of_a_paper_preset_names_its_source():
    # --help prints each preset value's source: every value small, base and tacl set, bookkeeping aside (how often to
    # log, evaluate and save, where), names one, so --preset tacl's beta2 no longer reads as TACO's Table 5
    bookkeeping = {"objective", "out_dir", "log_interval", "eval_interval", "eval_batches", "ckpt_interval"}
    for preset in ("small", "base", "tacl"):
        assert set(config.PRESETS[preset]) - bookkeeping <= set(config.PRESET_SOURCES[preset]), preset


def test_every_fidelity_note_is_cited_in_the_code_and_every_citation_is_a_note():
    # a deviation's comment cites "fidelity note N" (or "note N", "notes N, M"); docs/fidelity.md numbers each note
    # "N. **...**" for good and says each is a comment at its spot: a cited number must be a note, and each note cited
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "docs", "fidelity.md")) as f:
        notes = {int(n) for n in re.findall(r"^(\d+)\. \*\*", f.read(), re.M)}
    cited = {}
    for name in sorted(n for n in os.listdir(here) if n.endswith(".py") and not n.startswith("test_")):
        with open(os.path.join(here, name)) as f:
            for group in re.findall(r"\bnotes? (\d+(?:(?:, | and | or |, and )\d+)*)", f.read()):
                cited.update({int(n): name for n in re.findall(r"\d+", group)})
    assert len(notes) >= 42 and not {n: name for n, name in cited.items() if n not in notes}
    assert notes <= set(cited), f"notes no code comment cites: {sorted(notes - set(cited))}"


def test_objective_defaults_are_the_papers():
    # typed in from the papers (the sources config.py's comments and --help name), so a default cannot drift:
    # TACO App. A (tau 0.07, K = 50 negatives; W = 5 from the official scripts), TACO Eq. 11 (lambda 1),
    # TaCL §3 (tau 0.01), COCO-LM §3 CLM / SCL, §4 (lambda_copy 50, 90% crop, SCL tau 1), ELECTRA §2 (lambda 50)
    papers = dict(taco_temperature=0.07, taco_window=5, taco_negatives=50, taco_weight=1.0, tacl_temperature=0.01,
                  cocolm_copy_weight=50.0, cocolm_crop_fraction=0.9, cocolm_scl_temperature=1.0,
                  electra_disc_weight=50.0, mask_prob=0.15)
    cfg = config.TrainConfig()
    assert {k: getattr(cfg, k) for k in papers} == papers


def test_weight_decay_on_matrices_and_embeddings_only():
    # BERT decays weight matrices and embedding tables, never biases or LayerNorm parameters; group 0 is the
    # decayed one (a resume re-applies --weight_decay to the saved groups in that order)
    model = train.Bert(train.BertConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                                        intermediate_size=64))
    cfg = config.TrainConfig(weight_decay=0.05, beta2=0.98, adam_eps=1e-6)  # off the defaults: the flags' values
    decayed, other = train.configure_optimizer(model.parameters(), cfg, "cpu").param_groups
    matrices = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert decayed["weight_decay"] == 0.05 and other["weight_decay"] == 0.0
    assert all(g["betas"] == (0.9, 0.98) and g["eps"] == 1e-6 for g in (decayed, other))
    assert {id(p) for p in decayed["params"]} == matrices
    assert {id(p) for p in other["params"]} == {id(p) for p in model.parameters()} - matrices


def test_lr_schedule_warmup_then_linear_decay():
    cfg = config.TrainConfig(lr=1.0, warmup_steps=10, max_steps=110)
    assert train.lr_at(0, cfg) == pytest.approx(0.1) and train.lr_at(9, cfg) == pytest.approx(1.0)
    assert train.lr_at(60, cfg) == pytest.approx(0.5) and train.lr_at(110, cfg) == 0.0
    assert train.lr_at(10, cfg) == 1.0  # the first decay step trains at the peak, never above it
    # a run that is all warm-up: its last step's lr (a resume's report asks for it) is 0, not a ZeroDivisionError
    assert train.lr_at(10, config.TrainConfig(lr=1.0, warmup_steps=10, max_steps=10)) == 0.0


def test_each_micro_batch_and_stream_draws_from_its_own_seed():
    # the objective's draws (stream 0) and dropout (stream 1) of every (step, global micro-batch) are seeded
    # apart: a shared seed would make dropout's masks follow the MLM masks. The same inputs give the same seed
    seeds = [train.step_seed(1337, step, micro, stream) for step in range(3) for micro in range(4) for stream in (0, 1)]
    assert len(set(seeds)) == len(seeds) == 24 and train.step_seed(1337, 2, 3, 1) == seeds[-1]


# ---- every objective trains through train.py and its loss falls

def test_mlm_smoke_run_held_out_loss_falls_and_exports(corpus, tmp_path):
    r = run(common(corpus, tmp_path, max_steps=60, eval_interval=10))
    assert r.returncode == 0, r.stderr
    header, records = read_log(tmp_path / "run")
    assert header["config"]["objective"] == "mlm"
    val = [x["val_mlm_loss"] for x in records if "val_mlm_loss" in x]
    assert len(val) == 7 and val[-1] < val[0] - 0.5, val
    train_lines = [x for x in records if "loss" in x]
    assert {"mlm_loss", "mlm_acc", "lr", "tokens_per_s", "elapsed_s"} <= set(train_lines[-1])
    for f in ("ckpt.pt", "config.json", "model.safetensors", "vocab.txt", "tokenizer.json"):
        assert (tmp_path / "run" / f).is_file(), f
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "run"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "run"))
    assert hf.config.vocab_size == len(tok)


@pytest.mark.parametrize("objective", ["taco", "cocolm", "electra"])
def test_objective_trains_and_loss_falls(corpus, tmp_path, objective):
    r = run(common(corpus, tmp_path, objective=objective, max_steps=40))
    assert r.returncode == 0, r.stderr
    _, records = read_log(tmp_path / "run")
    losses = [x["loss"] for x in records if "loss" in x]
    assert losses[-1] < losses[0], losses
    # COCO-LM and ELECTRA never train the MLM head: the export is the encoder alone (BertModel)
    hf_config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert hf_config["architectures"] == (["BertForMaskedLM"] if objective == "taco" else ["BertModel"])
    exported = train.Bert.from_pretrained(str(tmp_path / "run")).hf_state_dict()
    trained = train.Bert.from_pretrained(str(tmp_path / "run" / "ckpt.pt")).hf_state_dict()
    for k, v in exported.items():
        if not k.startswith("cls.") or objective == "taco":  # a BertModel export loads with a fresh head
            assert torch.equal(v, trained[k]), k


def test_an_objective_added_to_losses_trains(corpus, tmp_path, monkeypatch):
    # adding an objective is a module and a LOSSES entry: train.py and bench.py need nothing more (no MFU for it)
    import bench
    import losses

    class Halved(losses.MLM):
        def forward(self, model, batch, rng):
            loss, metrics = super().forward(model, batch, rng)
            return loss / 2, metrics
    monkeypatch.setitem(losses.LOSSES, "half_mlm", Halved)
    train.main(common(corpus, tmp_path, objective="half_mlm", max_steps=2, warmup_steps=1, log_interval=1,
                      eval_interval=2, eval_batches=1, ckpt_interval=2, device="cpu"))
    header, records = read_log(tmp_path / "run")
    assert header["config"]["objective"] == "half_mlm" and records[-1]["step"] == 2
    assert (tmp_path / "run" / "ckpt.pt").exists() and (tmp_path / "run" / "config.json").exists()
    from model import BertConfig
    tiny = BertConfig(**config.MODEL_PRESETS["tiny"])
    assert bench.objective_flops_per_token("half_mlm", tiny, config.TrainConfig(), 64) is None


@pytest.mark.slow
def test_tacl_needs_init_from_then_continues_an_mlm_run(corpus, tmp_path):
    r = run(common(corpus, tmp_path, objective="tacl", out="tacl"))
    assert r.returncode != 0 and "--objective mlm" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert run(common(corpus, tmp_path, out="mlm", max_steps=20)).returncode == 0
    r = run(common(corpus, tmp_path, objective="tacl", out="tacl", init_from=tmp_path / "mlm"))
    assert r.returncode == 0, r.stderr
    _, records = read_log(tmp_path / "tacl")
    train_lines = [x for x in records if "loss" in x]
    losses = [x["loss"] for x in train_lines]
    assert "tacl_loss" in train_lines[0] and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_the_same_weights_score_the_same_for_every_seed(corpus, tmp_path):
    # the step-0 evaluation of one set of weights, contextual score included, does not depend on --seed
    assert run(common(corpus, tmp_path, out="mlm", max_steps=5, ckpt_interval=5)).returncode == 0
    for seed in (1, 2):
        r = run(common(corpus, tmp_path, out=f"seed{seed}", max_steps=1, warmup_steps=0, seed=seed,
                       init_from=tmp_path / "mlm"))
        assert r.returncode == 0, r.stderr
    first = [read_log(tmp_path / f"seed{seed}")[1][0] for seed in (1, 2)]
    assert first[0]["step"] == 0 and "contextual_score" in first[0] and first[0] == first[1]


@pytest.mark.slow
def test_init_from_a_hugging_face_bert_model_with_a_pooler(corpus, tmp_path):
    """--init_from a transformers BertModel directory (a pooler, no MLM head): every encoder weight is
    loaded, the vocabulary comes from its vocab.txt, the pooler reaches the export unchanged (and GLUE)."""
    transformers = pytest.importorskip("transformers")
    assert run(common(corpus, tmp_path, out="mlm", max_steps=5, ckpt_interval=5)).returncode == 0
    hf = transformers.BertModel.from_pretrained(str(tmp_path / "mlm"))  # our export, plus a fresh pooler
    state = {k: v[:64] if k.endswith("position_embeddings.weight") else v for k, v in hf.state_dict().items()}
    hf = transformers.BertModel(transformers.BertConfig(**{**hf.config.to_dict(), "max_position_embeddings": 64}))
    hf.load_state_dict(state)  # a model of 64 positions, as HF models of fewer than 512 come
    hf.save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "vocab.txt").write_text((tmp_path / "mlm" / "vocab.txt").read_text())
    r = run(common(corpus, tmp_path, out="cont", max_steps=1, lr=1e-12, warmup_steps=0, init_from=tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert "has no MLM head that its run trained (a BertModel, or an ELECTRA / COCO-LM run)" in r.stdout
    # the run's tokenizer says where the model's positions end: transformers' truncation=True cuts there
    assert json.loads((tmp_path / "cont" / "tokenizer_config.json").read_text())["model_max_length"] == 64
    ours = train.Bert.from_pretrained(str(tmp_path / "cont")).state_dict()
    start = train.Bert.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert "pooler.weight" in ours
    for k, v in ours.items():
        if not k.startswith("head."):  # BertModel has no MLM head: it starts fresh
            assert torch.allclose(v, start[k], atol=1e-6), k
    # trained on (a real learning rate), the pooler stays as it came, frozen, through a resume on 2 DDP processes
    # (DDP fails on a parameter that requires a gradient and gets none)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                        *map(str, common(corpus, tmp_path, out="cont", max_steps=3, warmup_steps=0,
                                         resume=tmp_path / "cont"))],
                       cwd=HERE, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = train.Bert.from_pretrained(str(tmp_path / "cont"))
    assert resumed.training_step == 3
    assert torch.equal(resumed.pooler.weight, start["pooler.weight"])
    assert not torch.equal(resumed.embeddings.word.weight, start["embeddings.word.weight"])


@pytest.mark.slow
def test_every_rank_waits_for_the_slowest_data_under_the_data_timeout(tmp_path):
    # a node with its own --cache_dir tokenizes for hours after rank 0 is done: rank 0 must wait for it under
    # DATA_TIMEOUT, not in DDP's set-up, whose 15-minute timeout (3 s here) would kill the job
    script = tmp_path / "ranks.py"
    script.write_text(f"""import sys, time, datetime, types
sys.path.insert(0, {str(HERE)!r})
import torch, torch.distributed as dist
import distributed
distributed.DDP_TIMEOUT = datetime.timedelta(seconds=3)
layout = distributed.setup(types.SimpleNamespace(device="cpu"))
distributed.rank0_first(layout, lambda: time.sleep(0 if layout.master else 8))
x = torch.ones(1)
dist.all_reduce(x)  # rank 0's first collective on the default group, as DDP's set-up
open(f"ok{{layout.rank}}", "w").write(str(int(x.item())))  # a file each: two ranks' prints interleave
distributed.close(layout)
""")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert [(tmp_path / f"ok{rank}").read_text() for rank in (0, 1)] == ["2", "2"]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_with_their_own_data_and_cache(corpus, tmp_path):
    # torchrun across two "nodes" on this machine, each with its own copy of the corpus and its own --cache_dir:
    # node 1 trains the same tokenizer and tokenizes the same stream itself; a copy that differs stops the run,
    # and so does a checkout of node 1's own whose losses.py was edited
    def two_nodes(node1_data, out, node1_code=HERE, **node1_flags):
        port, procs = free_port(), []
        for node, data, code in ((0, corpus, HERE), (1, node1_data, node1_code)):
            flags = common(corpus, tmp_path, out=out, data=data, cache_dir=tmp_path / f"cache{node}_{out}",
                           max_steps=2, warmup_steps=1, ckpt_interval=2, eval_interval=100,
                           **(node1_flags if node else {}))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                 "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "train.py",
                 *map(str, flags)], cwd=code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"}))
        return [(p.wait(timeout=300), p.communicate()[1]) for p in procs]

    copy = tmp_path / "node1" / "toy.txt"
    copy.parent.mkdir()
    copy.write_text(corpus.read_text())
    (code0, err0), (code1, err1) = two_nodes(copy, "same")
    assert code0 == code1 == 0, err0[-2000:] + err1[-2000:]
    assert torch.load(tmp_path / "same" / "ckpt.pt", weights_only=True)["step"] == 2
    assert list((tmp_path / "cache1_same").glob("tokens-*.bin"))  # node 1 tokenized for itself
    write_corpus(copy, seed=1)  # node 1's copy is other text: its own vocabulary, other tokens
    (code0, err0), (code1, err1) = two_nodes(copy, "other")
    errors = [line for line in err0.splitlines() if line.startswith("error")]
    assert code0 != 0 and code1 != 0 and errors == [errors[0]], err0[-2000:]
    assert errors[0].startswith("error: --data") and "rank(s) 1 read other data than rank 0" in errors[0]
    assert "error (rank 1): --data" in err1  # node 1's first process says so too
    assert not (tmp_path / "other").exists()  # stopped before anything was written
    checkout = tmp_path / "checkout1"
    checkout.mkdir()
    for module in HERE.glob("*.py"):
        (checkout / module.name).write_text(module.read_text())
    with open(checkout / "losses.py", "a") as f:
        f.write("# an ablation's edit on node 1 only\n")
    (code0, err0), (code1, err1) = two_nodes(corpus, "edited", node1_code=checkout)
    errors = [line for line in err0.splitlines() if line.startswith("error")]
    assert code0 != 0 and code1 != 0 and errors == [
        "error: rank(s) 1 run other code than rank 0 (on rank 1, other losses.py): every node needs the same "
        "checkout of this project and the same torch"], err0[-2000:]
    assert not (tmp_path / "edited").exists()
    (code0, err0), (code1, err1) = two_nodes(corpus, "lr", lr=5e-4)  # node 1's command drifted: it trained its own lr
    errors = [line for line in err0.splitlines() if line.startswith("error")]
    assert code0 != 0 and code1 != 0 and errors[0].startswith(
        "error: rank(s) 1 run with other flags than rank 0 (on rank 1: --lr 0.0005 (here "), err0[-2000:]
    assert not (tmp_path / "lr").exists() and not list((tmp_path / "cache1_lr").glob("tokens-*"))  # before the data


# ---- bad input: one clear line, non-zero exit, nothing saved lost

@pytest.mark.slow
def test_bad_input_is_one_clear_error(corpus, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    assert run(common(corpus, tmp_path, out="good", max_steps=5, ckpt_interval=5)).returncode == 0
    saved = (tmp_path / "good" / "ckpt.pt").read_bytes()
    cases = [
        (["--objective", "bogus"], "--objective 'bogus': choose from"),
        (["--bogus_flag", "1"], "unknown flag"),
        (["--data", tmp_path / "missing.txt"], "missing.txt"),
        (["--data", tmp_path / "empty.txt"], "empty"),
        (["--seq_len", "600"], "max_position_embeddings"),
        (["--resume", tmp_path / "corrupt.pt"], "corrupt"),
        (["--init_from", tmp_path / "corrupt.pt"], "corrupt"),
        (["--init_from", tmp_path], "not a checkpoint"),
        (["--resume", tmp_path / "good", "--objective", "taco"], "objective"),
        (["--out_dir", tmp_path / "good"], "already holds a run"),
        (["--objective", "cocolm", "--batch_size", "1"], "COCO-LM's SCL draw negatives"),  # an NT-Xent of one pair
    ]
    for extra, message in cases:
        r = run(common(corpus, tmp_path, out="bad") + [str(x) for x in extra], timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), (extra, r.stderr)
        assert message.lower() in lines[0].lower(), (extra, lines[0])
    assert (tmp_path / "good" / "ckpt.pt").read_bytes() == saved


# ---- distributed: two gloo processes == one process with the same global batch

@pytest.fixture(scope="module")
def ddp_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("ddp_cache")  # one tokenizer and token file for the DDP cases


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["taco", "cocolm"])
def test_ddp_two_processes_match_one_process(corpus, tmp_path, ddp_cache, objective):
    # TACO runs MLM's masking and head, plus negatives from pools; COCO-LM pools too, and owns weights outside the
    # model (a generator, sampled from a second, dropout-off forward, and heads). Pools of 4 rows, smaller than a
    # process's micro-batch of 8: each rank forms the pools one process forms. With dropout: its masks are seeded
    # per (step, global micro-batch), so DDP draws what one process draws
    flags = dict(max_steps=3, warmup_steps=1, log_interval=1, eval_interval=100, ckpt_interval=3, tokens_per_step=1024,
                 dropout=0.1, objective=objective, negative_pool=4, cache_dir=ddp_cache)
    single = run(common(corpus, tmp_path, out="single", **flags))  # 4 micro-batches of 8 accumulated
    assert single.returncode == 0, single.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "train.py", *map(str, common(corpus, tmp_path, out="ddp", **flags))],
                         cwd=HERE, capture_output=True, text=True, timeout=300, env=env)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    assert "grad_accum 2" in ddp.stdout and "grad_accum 4" in single.stdout  # DDP accumulates under no_sync
    assert "negative pool: 4 sequences" in ddp.stdout and "batch_size 8 x" in ddp.stdout
    single_ckpt = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=True)
    ddp_ckpt = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)
    torch.manual_seed(1337)  # train.py's seed: the same initial weights (the model's, then the objective's)
    init = train.Bert(train.BertConfig(**single_ckpt["model_config"]))
    init = {"model": init.state_dict(), "objective": train.LOSSES[objective](init, config.TrainConfig()).state_dict()}
    moved = dict(model=0, objective=0)
    for part in moved:  # the encoder, and what the objective owns (COCO-LM's generator and heads)
        assert single_ckpt[part].keys() == ddp_ckpt[part].keys()
        for k, a in single_ckpt[part].items():
            assert torch.allclose(a, ddp_ckpt[part][k], atol=1e-5), (part, k)
            moved[part] += int(not torch.allclose(a, init[part][k]))
    assert moved["model"] > 10 and (objective == "taco" or moved["objective"] > 10), moved  # trained (TACO owns none)
    logged = [read_log(tmp_path / run_dir)[1] for run_dir in ("single", "ddp")]  # training and held-out records
    assert [x["step"] for x in logged[0]] == [0, 1, 2, 3, 3]
    assert [x.keys() for x in logged[0]] == [x.keys() for x in logged[1]]
    for a, b in zip(*logged):  # every logged term of the global batch, not rank 0's half
        terms = [k for k in a if k not in ("step", "tokens_per_s", "mfu", "elapsed_s")]
        assert [a[k] for k in terms] == pytest.approx([b[k] for k in terms], abs=1e-5), (a["step"], terms)


# ---- a run killed with SIGKILL resumes from its checkpoint onto the same curve

@pytest.mark.slow
def test_sigkill_then_resume_continues_the_same_curve(corpus, tmp_path):
    flags = dict(max_steps=60, log_interval=1, ckpt_interval=10, eval_interval=1000, dropout=0.1)
    ref = run(common(corpus, tmp_path, out="ref", **flags))
    assert ref.returncode == 0, ref.stderr
    proc = subprocess.Popen([sys.executable, "train.py", *map(str, common(corpus, tmp_path, out="killed", **flags))],
                            cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "killed" / "log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if log.is_file() and sum(1 for _ in open(log)) > 25:  # past the step-20 checkpoint
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, before = read_log(tmp_path / "killed")
    assert max(x["step"] for x in before) < 60, "the run finished before it could be killed"
    saved = torch.load(tmp_path / "killed" / "ckpt.pt", weights_only=True)
    r = run(["--resume", tmp_path / "killed"])
    assert r.returncode == 0, r.stderr
    _, records = read_log(tmp_path / "killed")
    resumed = {x["step"]: x["loss"] for x in records if "loss" in x}  # later lines win
    elapsed = {x["step"]: x["elapsed_s"] for x in records if "loss" in x}
    assert elapsed[saved["step"] + 1] > saved["elapsed_s"] > 0  # the clock goes on from the checkpoint's
    _, reference = read_log(tmp_path / "ref")
    for x in reference:
        if "loss" in x:
            assert resumed[x["step"]] == pytest.approx(x["loss"], abs=1e-6), x["step"]


# ---- SIGTERM to torchrun: the ranks agree on a stop, rank 0 saves; the run resumes on another layout

@pytest.mark.slow
@pytest.mark.parametrize("ckpt_interval", [100000, 1])
def test_torchrun_sigterm_saves_then_resumes_on_one_process(corpus, tmp_path, ckpt_interval):
    # no log step after step 0: the ranks agree on the stop at any step (torchrun kills its workers 30 s after
    # passing a SIGTERM on, which a stop at the next log step of a slow run would miss). ckpt_interval 1: the stop
    # comes right after a save, which every rank must know of (a rank that saves again waits on the others)
    flags = dict(max_steps=100000, warmup_steps=5, log_interval=100000, ckpt_interval=ckpt_interval,
                 eval_interval=100000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py", *map(str, common(corpus, tmp_path, out="ddp", **flags))],
                            cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log, deadline = tmp_path / "ddp" / "log.jsonl", time.time() + 180
    while time.time() < deadline and not (log.is_file() and sum(1 for _ in open(log)) > 1):
        time.sleep(0.05)  # past the step-0 evaluation
    time.sleep(2)  # a few steps in
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler would; torchrun passes it on
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0 and "SIGTERM: stopped after step" in out, err[-2000:]
    # no rank failed after init_process_group (whose excepthook prefixes "[rankN]: "; torchrun's own traceback is there)
    assert "]: Traceback" not in err, err[-3000:]
    step = int(out.split("SIGTERM: stopped after step ")[1].split(";")[0])
    ckpt = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)
    sequences_per_step = 256 // 32  # common(): tokens_per_step / seq_len
    assert step > 0, step
    assert ckpt["step"] == step and ckpt["loader"] == {"sequences": step * sequences_per_step}
    assert rundir.export_step(str(tmp_path / "ddp")) == step and not (tmp_path / "ddp" / ".lock").exists()

    r = run(["--resume", tmp_path / "ddp", "--max_steps", step + 4])  # one process now
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == step + 4 and ckpt["loader"] == {"sequences": (step + 4) * sequences_per_step}
    _, records = read_log(tmp_path / "ddp")
    assert max(x["step"] for x in records if "loss" in x) == step + 4


def test_only_a_lost_process_reads_as_a_lost_peer(monkeypatch):
    # a peer's death is named in one line; this process's own errors keep their traceback
    import distributed
    import torch.distributed as dist
    monkeypatch.setenv("WORLD_SIZE", "2")
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:10165: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert distributed.lost_peer(gloo) == "Read error [127.0.0.1]:10165: Connection reset by peer"
    assert distributed.lost_peer(dist.DistBackendError("NCCL error: remote process exited or there was a network "
                                                       "error, NCCL version 2.27 ncclRemoteError"))
    for own in (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error: out of memory"),
                RuntimeError("CUDA error: peer access is not supported between these two devices"),
                RuntimeError("Parent directory /runs/peer_review/taco does not exist."), ValueError("by peer")):
        assert distributed.lost_peer(own) is None, own
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.lost_peer(gloo) is None


def test_rank0_prepares_the_data_first_and_every_rank_leaves_together(monkeypatch):
    # the barriers on the data group, recorded: rank 0 tokenizes while the others wait, then they read its cache,
    # and all leave once the slowest is done (two barriers on every rank, or the ranks would pair them up wrongly)
    import distributed
    import torch.distributed as dist
    events = []
    monkeypatch.setattr(dist, "barrier", lambda group=None: events.append(group))
    for rank, expected in ((0, ["prepare", "data", "data"]), (1, ["data", "prepare", "data"])):
        events.clear()
        layout = distributed.Layout(ddp=True, rank=rank, world=2, device="cpu", data_group="data")
        assert distributed.rank0_first(layout, lambda: events.append("prepare") or "tokens") == "tokens"
        assert events == expected, rank
    # a rank that stopped on bad input (or took over DATA_TIMEOUT) is one line on the others, not gloo's traceback
    def stopped(group=None):
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(dist, "barrier", stopped)
    with pytest.raises(ValueError, match="rank 0 stopped while preparing the data"):
        distributed.rank0_first(layout, lambda: None)


def test_every_rank_runs_the_same_code_and_read_the_same_tokens(monkeypatch, tmp_path):
    # Run() gathers each rank's (code, flags, data) fingerprints: a node whose checkout differs in one module (an
    # ablation's edit), runs another torch, was given other flags (its own --lr: its replica trained with it,
    # silently) or read other tokens stops every rank, naming what differs; its own paths are its own
    import distributed
    code, cfg = rundir.code_fingerprint(), config.TrainConfig(out_dir=str(tmp_path / "out"))
    assert {"torch", "losses.py", "model.py", "train.py", "rundir.py"} <= code.keys()
    assert not any(name.startswith("test_") for name in code) and code == rundir.code_fingerprint()
    layout = distributed.Layout(ddp=True, rank=0, world=3, device="cpu")
    peers = {}
    monkeypatch.setattr(distributed, "every_rank", lambda layout, mine: [mine, *peers["values"]])
    edited, other_torch = {**code, "losses.py": "0" * 12}, {**code, "torch": "2.0.0"}
    flags = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in rundir.NODE_FLAGS}
    other_lr = {**flags, "lr": 5e-4, "taco_temperature": 0.5}
    cases = [([(code, flags, "A", None), (edited, flags, "A", None)],
              r"rank\(s\) 2 run other code than rank 0 \(on rank 2, other losses.py\)"),
             ([(other_torch, flags, "A", None), (edited, flags, "B", None)], r"rank\(s\) 1, 2 run other code .*\(on rank 1, other torch\)"),
             ([(code, flags, "A", None), (code, other_lr, "A", None)], r"rank\(s\) 2 run with other flags than rank 0 \(on rank 2: "
              r"--lr 0.0005 \(here 0.001\), --taco_temperature 0.5 \(here 0.07\)\): every node needs the same"),
             ([(code, flags, "B", None), (code, flags, "A", None)], r"rank\(s\) 1 read other data than rank 0 \(A; rank 1: B\)"),
             # a node whose --out_dir is not the shared one: a stale ckpt.pt, or none (a new run under --resume auto)
             ([(code, flags, "A", 5000), (code, flags, "A", None)], r"rank\(s\) 1 start from step 5000, "
              r"rank 0 from a new run: every node must see the same --out_dir .* and its ckpt.pt"),
             # a node on an older checkout gathers (code, flags, data): its code is named, not 'not enough values'
             ([(code, flags, "A", None), (edited, flags, "A")], r"rank\(s\) 2 run other code than rank 0 \(on rank 2, "
              r"other losses.py\)"),
             ([(code, flags, "A", None), (edited, flags, "A", 5000)], r"rank\(s\) 2 run other code")]
    for values, message in cases:
        peers["values"] = values
        with pytest.raises(ValueError, match=message):
            rundir.Run(cfg, layout, None, "A")
    seen = []  # what a node with its own paths and device gathers: the same flags as rank 0's
    node1 = dataclasses.replace(cfg, data="/node1/wiki", tokenizer="/node1/tok", cache_dir="/node1/cache",
                                out_dir="/mnt/out", resume="/mnt/out", init_from="/node1/bert", device="cuda",
                                compile=not cfg.compile)
    monkeypatch.setattr(distributed, "every_rank", lambda layout, mine: seen.append(mine) or [mine])
    rundir.same_on_every_rank(node1, layout, "A")
    peers["values"] = [seen[0]] * 2
    monkeypatch.setattr(distributed, "every_rank", lambda layout, mine: [mine, *peers["values"]])
    assert seen[0][1] == flags and rundir.Run(cfg, layout, None, "A").fingerprint == "A"


def test_a_node_that_would_start_from_another_step_stops_before_any_data_is_read(corpus, tmp_path, monkeypatch,
                                                                                 capsys):
    # train.py checks code, flags and step on every node before tokenizing: a node without the shared ckpt.pt (a new
    # run under --resume auto) met the check only after hours of tokenizing Wikipedia, or trained its own tokenizer
    import data
    import distributed
    monkeypatch.setattr(distributed, "every_rank", lambda layout, mine: [mine, (*mine[:3], 5000)])
    read = []
    monkeypatch.setattr(data, "prepare_data", lambda *a, **k: read.append(a) or pytest.fail("the data was read"))
    with pytest.raises(SystemExit) as stop:
        train.main(common(corpus, tmp_path))
    assert stop.value.code == 2 and not read
    assert "rank(s) 1 start from step 5000, rank 0 from a new run" in capsys.readouterr().err


def test_ranks_agree_on_the_logged_mean_the_first_bad_step_and_a_stop(monkeypatch):
    # the collectives against a simulated second rank, whose values are `peer`: what this rank gets from them
    import distributed
    import torch.distributed as dist
    peer = {}

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None):
        tensor.copy_(torch.minimum(tensor, peer["value"]) if op == dist.ReduceOp.MIN else tensor + peer["value"])
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    layout = distributed.Layout(ddp=True, rank=0, world=2, device="cpu")
    peer["value"] = torch.tensor([4.0, 1.0])
    mean = distributed.mean_over_ranks(layout, {"loss": 2.0, "mlm_acc": torch.tensor(0.5)})
    assert {k: float(v) for k, v in mean.items()} == {"loss": 3.0, "mlm_acc": 0.75}  # the global batch's, not a sum
    peer["value"], bad = torch.tensor(5), torch.tensor(7)
    assert distributed.first_across_ranks(layout, bad) == 5 and int(bad) == 7  # the first bad step; its own unchanged
    stop = distributed.StopSignals(layout)
    peer["value"] = torch.tensor([0])
    assert not stop.stopping()
    peer["value"] = torch.tensor([1])  # the signal reached the other rank only: this one stops too, and says why
    assert stop.stopping() and stop.name == "SIGTERM"

    class Trainer:
        def no_sync(self):
            return "no_sync"
    # gradients are all-reduced on the last micro-step only; one process has nothing to hold back
    from contextlib import nullcontext
    assert distributed.no_sync(layout, Trainer(), last_micro_step=False) == "no_sync"
    assert isinstance(distributed.no_sync(layout, Trainer(), last_micro_step=True), nullcontext)
    one = distributed.Layout(ddp=False, rank=0, world=1, device="cpu")
    assert isinstance(distributed.no_sync(one, Trainer(), last_micro_step=False), nullcontext)


def test_a_second_sigterm_is_ignored_and_a_second_ctrl_c_stops_at_once():
    import distributed
    layout = distributed.Layout(ddp=False, rank=0, world=1, device="cpu")
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with distributed.StopSignals(layout) as stop:
            assert not stop.stopping()
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # no stop: handed back
        with distributed.StopSignals(layout) as stop:
            stop.on_signal(signal.SIGTERM, None)
            try:
                stop.on_signal(signal.SIGTERM, None)  # torchrun's, after the scheduler's: the save must go on
            except KeyboardInterrupt:
                pytest.fail("a second SIGTERM stopped the run at once")
            assert stop.stopping() and stop.name == "SIGTERM"
            with pytest.raises(KeyboardInterrupt):
                stop.on_signal(signal.SIGINT, None)
        # a stop was seen: a late repeated SIGTERM keeps being ignored while the process saves and exits
        assert signal.getsignal(signal.SIGTERM) == stop.on_signal
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_only_fp16_gets_a_loss_scaler_and_every_gpu_index_is_a_cuda_device():
    import types
    import distributed
    layout = distributed.Layout(ddp=False, rank=0, world=1, device="cpu")
    for dtype, scaled in (("fp32", False), ("bf16", False), ("fp16", True)):  # bf16 has fp32's range: nothing to scale
        name, _, scaler = distributed.precision(types.SimpleNamespace(dtype=dtype), layout)
        assert name == dtype and scaler.is_enabled() is scaled, dtype
    # torchrun's rank 1 trains on cuda:1: autocast and the fused optimizer want the device type
    assert distributed.Layout(ddp=True, rank=1, world=2, device="cuda:1").device_type == "cuda"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux /proc")
def test_a_killed_rank_is_one_error_line_on_the_others(corpus, tmp_path):
    # rank 0 killed (out of memory, a lost node): rank 1's next collective fails; it says so in one line, not gloo's
    # traceback, and the checkpoint saved before stands
    flags = dict(max_steps=100000, warmup_steps=5, log_interval=100000, ckpt_interval=5, eval_interval=100000)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py", *map(str, common(corpus, tmp_path, out="ddp", **flags))], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 180
    while time.time() < deadline and not (tmp_path / "ddp" / "ckpt.pt").is_file():
        time.sleep(0.05)
    saved = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)["step"]
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    rank0 = next(pid for pid in workers if b"\0RANK=0\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes())
    os.kill(int(rank0), signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "error (rank 1): lost another process of this run" in err and f"--resume {tmp_path / 'ddp'}" in err, err
    assert "[rank1]: Traceback" not in err, err[-3000:]
    assert torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)["step"] >= saved > 0


def test_held_out_draws_are_the_same_for_every_seed_and_objective():
    # one ruler for every run: held-out batch i is drawn from seed i, whatever --seed is and however many
    # draws the objective makes after its masks (TACO's negatives used to move the later batches' masks)
    import contextlib
    import numpy as np
    import data

    class Recorder(torch.nn.Module):
        def __init__(self, extra):
            super().__init__()
            self.extra, self.first = extra, []

        def forward(self, model, batch, rng):
            self.first.append(torch.randint(2 ** 30, (1,), generator=rng).item())  # the masks' first draw
            torch.rand(self.extra, generator=rng)  # an objective's own later draws
            return None, {}

    loader = data.BlockLoader(np.arange(5000, dtype=np.int32), seq_len=16, batch_size=4, cls_id=2, sep_id=3)
    seen = []
    for seed, extra in ((1, 0), (2, 0), (1, 1000)):
        recorder = Recorder(extra)
        cfg = config.TrainConfig(seed=seed, eval_batches=3)
        train.evaluate(torch.nn.Linear(1, 1), recorder, loader, cfg, "cpu", contextlib.nullcontext())
        seen.append(recorder.first)
    assert seen[0] == seen[1] == seen[2] and len(set(seen[0])) == 3


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux /proc")
def test_an_unwritable_out_dir_is_found_by_writing(tmp_path):
    # os.access says yes to root even where nothing can be written (/proc): the check writes a probe file
    assert "cannot be created or written (/proc is not" in config.dir_problem("/proc/nope/run")
    assert config.dir_problem(str(tmp_path / "new" / "run")) is None and not list(tmp_path.iterdir())


def test_evaluate_averages_the_same_blocks_every_time():
    # held-out metrics are the mean over eval_batches (not their sum), on the same blocks at every evaluation,
    # and the model is back in training mode after it
    import contextlib
    import numpy as np

    class Alternating(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.batches = []

        def forward(self, model, batch, rng):
            self.batches.append(batch["input_ids"].clone())
            return None, {"mlm_loss": torch.tensor(2.0 + len(self.batches) % 2)}  # 3, 2, 3, 2
    loader = train.data.BlockLoader(np.arange(5000, dtype=np.int32), seq_len=16, batch_size=4, cls_id=2, sep_id=3)
    objective, model, cfg = Alternating(), torch.nn.Linear(1, 1), config.TrainConfig(eval_batches=4)
    first = train.evaluate(model, objective, loader, cfg, "cpu", contextlib.nullcontext())
    second = train.evaluate(model, objective, loader, cfg, "cpu", contextlib.nullcontext())
    assert first == second == {"val_mlm_loss": pytest.approx(2.5)}
    assert all(torch.equal(x, y) for x, y in zip(objective.batches[:4], objective.batches[4:]))
    assert model.training and objective.training
