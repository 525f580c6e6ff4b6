"""bench.py runs on CPU with the tiny model: every objective, the Hugging Face baseline, the profiler."""
import copy
import os
import types
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import bench
from losses import LOSSES, crop_views
from model import Bert, BertConfig, MODEL_PRESETS
from config import TrainConfig

TINY = ["--model_size", "tiny", "--device", "cpu", "--batch_size", "2", "--seq_len", "32", "--steps", "1",
        "--warmup", "1"]


@pytest.mark.slow
def test_bench_runs_every_objective_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench.main(TINY + ["--taco_negatives", "4", "--loader", "--json", str(out)])
    assert [r["objective"] for r in results] == list(LOSSES)
    for r in results:  # an objective added to LOSSES runs too, with no FLOPs until monitor.py counts them (README)
        counted = r["objective"] in ("mlm", "taco", "tacl", "cocolm", "electra")
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and (r["model_tflops"] > 0 if counted else
                                                              r["model_tflops"] is None), r
        assert r["mfu"] is None and r["peak_mem_gb"] is None  # CPU: no GPU peak to divide by, no CUDA memory
    assert results[0]["vs_mlm"] == 1.0
    table = capsys.readouterr().out
    assert bench.HEADER in table and all(f"tiny   {name} " in table for name in LOSSES)
    assert out.is_file() and not (tmp_path / "bench.json.tmp").exists()


def test_hf_baseline_same_config_on_cpu(capsys):
    transformers = pytest.importorskip("transformers")
    results = bench.main(TINY + ["--objectives", "mlm", "--hf", "--hf_masked"])
    ours, hf, hf_masked = results
    assert (ours["objective"], hf["objective"], hf_masked["objective"]) == ("mlm", "hf-mlm", "hf-masked")
    assert hf_masked["params_m"] == hf["params_m"] and hf_masked["tokens_per_s"] > 0
    # same architecture: the parameter counts differ only by our 6 padded vocab rows (30522 -> 30528)
    config = BertConfig(**MODEL_PRESETS["tiny"])
    padding = (config.padded_vocab_size - config.vocab_size) * (config.hidden_size + 1)  # embedding rows + head bias
    assert ours["params_m"] * 1e6 - hf["params_m"] * 1e6 == pytest.approx(padding, abs=0.5)
    out = capsys.readouterr().out
    assert "tiny   mlm " in out and "tiny   hf-mlm " in out
    assert "our MLM runs" in out and "Hugging Face's tokens/s" in out
    assert "Hugging Face's, its head on the selected positions, tokens/s" in out
    hf_config = transformers.BertConfig(**bench.config_to_hf(config))
    assert (hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.num_attention_heads,
            hf_config.intermediate_size, hf_config.hidden_dropout_prob) == (128, 2, 2, 512, 0.1)


def test_each_ablation_turns_off_its_feature_and_computes_what_ours_does(capsys, monkeypatch):
    # the attention with one speed feature off, on our weights: the same outputs and gradients as model.py's
    from model import SelfAttention
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_heads=4, intermediate_size=64, dropout=0.0)
    x, mask = torch.randn(3, 7, 32), torch.ones(3, 7, dtype=torch.bool)
    mask[0, 5:] = False  # a padded row
    for kw in (dict(sdpa=False), dict(fused=False), dict(sdpa=False, fused=False)):
        ours = SelfAttention(config)
        ablated = bench.AttentionWithout(copy.deepcopy(ours), **kw)
        assert (ablated.attn.qkv is None) == (kw.get("fused") is False)  # no idle fused weight for the optimizer
        for attn_mask in (None, mask[:, None, None, :]):
            x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
            y1, y2 = ours(x1, attn_mask), ablated(x2, attn_mask)
            (y1 ** 2).sum().backward()
            (y2 ** 2).sum().backward()
            assert torch.allclose(y1, y2, atol=1e-5) and torch.allclose(x1.grad, x2.grad, atol=1e-4), kw
    sdpa_calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa_calls.append(1) or real_sdpa(*a, **k))
    bench.AttentionWithout(SelfAttention(config), sdpa=False)(x)
    assert not sdpa_calls  # written out
    bench.AttentionWithout(SelfAttention(config), fused=False)(x)
    assert sdpa_calls
    # each bench row: every layer's attention swapped, or the vocabulary unpadded (30,522 rows, not 30,528)
    made, real = [], bench.AttentionWithout
    monkeypatch.setattr(bench, "AttentionWithout", lambda attn, **kw: made.append(kw) or real(attn, **kw))
    args = types.SimpleNamespace(compile=0, batch_size=2, seq_len=8, loader=False)
    for name, swapped, rows in (("mlm", None, 30528), ("no-sdpa", dict(sdpa=False), 30528),
                                ("no-fused", dict(fused=False), 30528), ("no-pad", None, 30522)):
        made.clear()
        _, params = bench.build_ours(replace(TrainConfig(), objective="mlm"), BertConfig(**MODEL_PRESETS["tiny"]),
                                     args, torch.device("cpu"), torch.autocast("cpu", enabled=False), ablation=name)
        assert made == ([swapped] * 2 if swapped else []) and params[0].shape[0] == rows, name
    results = bench.main(TINY + ["--objectives", "mlm", "--ablate"])
    assert [r["objective"] for r in results] == ["mlm", "no-sdpa", "no-fused", "no-pad"]
    assert all(r["vs_mlm"] > 0 for r in results) and "tiny   no-sdpa" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(TINY + ["--objectives", "taco", "--ablate"])  # nothing to compare against


def test_hf_masking_matches_the_collator():
    config = BertConfig(**MODEL_PRESETS["tiny"])
    rng = torch.Generator().manual_seed(0)
    ids = bench.random_blocks(64, 128, config, "cpu", rng)
    batch = bench.hf_mlm_batch(ids, config, rng)
    selected = batch["labels"] != -100
    assert not selected[:, [0, -1]].any()  # [CLS] and [SEP] are never selected
    assert torch.equal(batch["labels"][selected], ids[selected])
    assert torch.equal(batch["input_ids"][~selected], ids[~selected])  # unselected tokens are untouched
    assert selected[:, 1:-1].float().mean().item() == pytest.approx(0.15, abs=0.01)
    masked = (batch["input_ids"] == config.mask_token_id)[selected].float().mean().item()
    unchanged = (batch["input_ids"] == ids)[selected].float().mean().item()
    assert masked == pytest.approx(0.8, abs=0.03) and unchanged == pytest.approx(0.1, abs=0.03)


def test_profile_on_cpu_prints_top_ops_and_writes_a_trace(tmp_path, capsys):
    results = bench.main(TINY + ["--objectives", "mlm", "--profile", "--profile_steps", "1", "--out_dir",
                                 str(tmp_path)])
    ops = results[0]["profile"]["ops"]
    assert ops and ops[0]["ms_per_step"] > 0 and all(0 < op["share"] <= 1 for op in ops)
    assert any(op["name"].startswith("aten::") for op in ops)
    assert "top ops by self CPU time" in capsys.readouterr().out
    assert (tmp_path / "trace_tiny_mlm.json.gz").stat().st_size > 0


def test_profile_objectives_profiles_those_runs_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ is home, as in train.py (bash leaves `--out_dir=~/x` alone)
    monkeypatch.chdir((tmp_path / "cwd").mkdir() or tmp_path / "cwd")
    results = bench.main(TINY + ["--objectives", "mlm,tacl", "--profile", "--profile_objectives", "mlm",
                                 "--profile_steps", "1", "--out_dir=~/traces", "--json=~/b.json"])
    assert "profile" in results[0] and "profile" not in results[1]
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["trace_tiny_mlm.json.gz"]
    assert (tmp_path / "b.json").is_file() and not os.listdir(tmp_path / "cwd")


def test_gpu_profile_tables_count_each_kernel_once():
    # the CUDA branch, on the event fields torch.profiler's key_averages() gives (no GPU needed)
    from types import SimpleNamespace
    from torch.autograd import DeviceType

    def event(key, device_type, self_device_us, annotation=False, count=2):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=self_device_us, count=count,
                               is_user_annotation=annotation, self_cpu_time_total=0)
    events = [event("aten::mm", DeviceType.CPU, 600), event("aten::add", DeviceType.CPU, 200),
              event("sm90_gemm", DeviceType.CUDA, 600), event("elementwise", DeviceType.CUDA, 200),
              event("## forward ##", DeviceType.CUDA, 5000, annotation=True)]  # spans the kernels above
    tables = bench.where_time_goes(events, on_gpu=True, steps=2, n=5)
    assert tables["gpu_busy_ms_per_step"] == pytest.approx(0.4)  # (600 + 200) us over 2 steps
    assert [k["name"] for k in tables["kernels"]] == ["sm90_gemm", "elementwise"]
    assert tables["kernels"][0]["share"] == pytest.approx(0.75) and tables["kernels"][0]["calls_per_step"] == 1
    assert [op["name"] for op in tables["ops"]] == ["aten::mm", "aten::add"]


def test_interleave_times_one_step_of_each_run_in_turn(capsys):
    calls = []
    steps = {name: (lambda i, name=name: calls.append((name, i))) for name in ("mlm", "taco")}
    timings = bench.time_interleaved(steps, types.SimpleNamespace(warmup=1, steps=2))
    assert calls == [("mlm", 0), ("taco", 0), ("mlm", 0), ("taco", 0), ("mlm", 1), ("taco", 1)]
    assert set(timings) == {"mlm", "taco"}
    assert all(wall >= 0 and cpu >= 0 and peak is None for wall, cpu, peak in timings.values())
    results = bench.main(TINY + ["--objectives", "mlm,taco", "--taco_negatives", "4", "--interleave"])
    assert [r["objective"] for r in results] == ["mlm", "taco"] and all(r["interleaved"] for r in results)
    assert all(r["run_s"] is None for r in results)  # every run's build and steps overlap: no run's own time
    assert results[0]["vs_mlm"] == 1.0 and results[1]["vs_mlm"] > 0


@pytest.mark.parametrize("argv", [["--bogus"], ["--objectives", "mlm,nope"], ["--model_size", "huge"],
                                  ["--steps", "0"], ["--gen_shape", "nope"], ["--interleave", "--profile"],
                                  ["--profile", "--profile_objectives", "mlm,nope"],
                                  ["--dropout", "1"], ["--dropout", "nan"], ["--taco_negatives", "0"], ["--warmup", "-3"],
                                  ["--device", "mps"], ["--json", __file__ + "/x.json"],
                                  ["--json", os.path.dirname(os.path.abspath(__file__))],
                                  TINY + ["--loader", "--hf"], ["--seq_len", "2"],
                                  ["--objectives", "taco", "--taco_negatives", "1000", "--batch_size", "2", "--seq_len", "32"],
                                  ["--objectives", "cocolm", "--batch_size", "1"],
                                  # found by a fuzz of bench.py's flags: each of these ran (a name twice timed twice,
                                  # failing with KeyError under --interleave; a profile of no run; an empty table)
                                  TINY + ["--objectives", "mlm,mlm", "--interleave"], TINY + ["--objectives", "mlm", "--model_size", "tiny,tiny"],
                                  TINY + ["--objectives", "mlm", "--profile", "--profile_objectives", "taco"],
                                  TINY + ["--objectives", "mlm", "--profile_objectives", "mlm"],
                                  TINY + ["--objectives", "mlm", "--profile", "--profile_top", "0"],
                                  TINY + ["--objectives", "all,mlmm", "--taco_negatives", "4"],
                                  TINY + ["--profile", "--profile_objectives", "all,tacoo", "--taco_negatives", "4"]])
def test_bad_flags_give_one_error_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_flops_count_what_each_objective_computes():
    config, cfg = BertConfig(**MODEL_PRESETS["small"]), TrainConfig()
    mlm = bench.objective_flops_per_token("mlm", config, cfg, 128)
    assert mlm < bench.objective_flops_per_token("taco", config, cfg, 128) < 1.05 * mlm
    assert 1.2 * mlm < bench.objective_flops_per_token("tacl", config, cfg, 128) < 1.4 * mlm  # + teacher forward
    assert bench.objective_flops_per_token("cocolm", config, cfg, 128) > 2 * mlm


def linear_macs(module):
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def hand_flops_per_token(objective, model, loss_fn, T):
    """The slow count: FLOPs of one packed block of T tokens from the shapes of the modules the
    objective built (every nn.Linear where it runs, 2 T^2 width per attention layer), over T."""
    config, D = model.config, model.config.hidden_size
    masked = loss_fn.generator.mask_prob * T

    def encoder_fwd(encoder, n):  # MACs of an encoder over n tokens
        width = encoder.layers[0].up.in_features
        return n * linear_macs(encoder) + len(encoder.layers) * 2 * n * n * width

    g = loss_fn.generator
    gen_fwd = (T * linear_macs(g.project) + encoder_fwd(g.encoder, T)
               + masked * (linear_macs(g.head) + D * config.padded_vocab_size))  # tied decoder: padded rows
    if objective == "electra":
        return (6 * gen_fwd + 6 * (encoder_fwd(model.encoder, T) + T * linear_macs(loss_fn.disc_head))) / T
    crop_len = crop_views(bench.random_blocks(1, T, config, "cpu"), config, None)[0].shape[1]
    main = (encoder_fwd(model.encoder, T) + encoder_fwd(model.encoder, crop_len) + masked * D * config.vocab_size
            + T * linear_macs(loss_fn.copy_head) + 2 * linear_macs(loss_fn.scl_head))
    sampling = 2 * gen_fwd if config.dropout > 0 else 0  # COCO-LM's dropout-off forward, no backward
    return (6 * gen_fwd + sampling + 6 * main) / T


@pytest.mark.parametrize("objective", ["electra", "cocolm"])
@pytest.mark.parametrize("gen_shape", ["cocolm", "electra"])
def test_generator_flops_follow_the_generator_built(objective, gen_shape):
    for size in ("small", "base"):  # base: the 1/3-width ELECTRA generator
        config, cfg = BertConfig(**MODEL_PRESETS[size]), replace(TrainConfig(), gen_shape=gen_shape)
        model = Bert(config)
        loss_fn = LOSSES[objective](model, cfg)
        for dropout in (0.1, 0.0):
            config = model.config = replace(model.config, dropout=dropout)
            assert bench.objective_flops_per_token(objective, config, cfg, 128) == pytest.approx(
                hand_flops_per_token(objective, model, loss_fn, 128), rel=1e-12), (size, dropout)
    # COCO-LM's dropout-off sampling pass costs a forward; ELECTRA samples from its training forward
    on, off = (bench.objective_flops_per_token(objective, replace(config, dropout=p), cfg, 128) for p in (0.1, 0.0))
    assert on > off if objective == "cocolm" else on == off


def test_electra_shape_generator_costs_less_on_small():
    config = BertConfig(**MODEL_PRESETS["small"])
    flops = {shape: bench.objective_flops_per_token("electra", config, replace(TrainConfig(), gen_shape=shape), 128)
             for shape in ("cocolm", "electra")}
    # 4 layers at width 128 (+ the 512 -> 128 projection) against 1 layer at width 512
    assert flops["electra"] < 0.95 * flops["cocolm"]


@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("objective,gen_shape", [("electra", "cocolm"), ("electra", "electra"),
                                                 ("cocolm", "cocolm"), ("cocolm", "electra")])
def test_flops_match_torch_flop_counter_on_a_real_step(objective, gen_shape, dropout):
    # torch's own count of every matmul in one real forward + backward on the tiny model. T = 120
    # makes the M = ceil(0.15 T) masked slots exactly 0.15 T; SDPA's math backend because the
    # counter misses CPU's fused flash kernel. COCO-LM's sampling pass is ~10% of its count here:
    # counting it for ELECTRA, or missing it for COCO-LM with dropout, fails by far.
    T, B = 120, 2
    config = BertConfig(**MODEL_PRESETS["tiny"], dropout=dropout)
    cfg = replace(TrainConfig(), gen_shape=gen_shape)
    torch.manual_seed(0)
    model = Bert(config)
    loss_fn = LOSSES[objective](model, cfg)
    ids = bench.random_blocks(B, T, config, "cpu", torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_fn(model, {"input_ids": ids}, torch.Generator().manual_seed(0))[0].backward()
    measured = counter.get_total_flops() / (B * T)
    # 1e-4: what the count leaves out, NT-Xent's (2B)^2 D similarities, is ~4e-6 of it here
    assert bench.objective_flops_per_token(objective, config, cfg, T) == pytest.approx(measured, rel=1e-4)


def test_a_failing_run_keeps_the_other_rows_and_hf_runs_after_our_mlm(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    real = bench.build_ours

    def build_ours(cfg, *rest, **kw):
        if cfg.objective == "taco":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(cfg, *rest, **kw)
    monkeypatch.setattr(bench, "build_ours", build_ours)
    out = tmp_path / "bench.json"
    results = bench.main(TINY + ["--objectives", "taco,mlm,electra", "--taco_negatives", "4", "--hf", "--json", str(out)])
    assert [r["objective"] for r in results] == ["taco", "mlm", "hf-mlm", "electra"]
    assert "OutOfMemoryError" in results[0]["error"] and not any("error" in r for r in results[1:])
    text = capsys.readouterr().out
    assert "tiny   taco      failed: OutOfMemoryError" in text and "our MLM runs" in text and "failed: tiny taco" in text
    import json
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == 4 and len(saved["hf_ratios"]) == 1
    # our MLM failing leaves Hugging Face's row without a ratio, not a crash
    monkeypatch.setattr(bench, "build_ours", lambda cfg, *rest, **kw: 1 / 0)
    results = bench.main(TINY + ["--objectives", "mlm", "--hf", "--json", str(out)])
    assert "ZeroDivisionError" in results[0]["error"] and "error" not in results[1]
    assert json.loads(out.read_text())["hf_ratios"] == []
    # the same under --interleave, where every run of a size is built before any is timed
    monkeypatch.setattr(bench, "build_ours", build_ours)
    results = bench.main(TINY + ["--objectives", "taco,mlm", "--taco_negatives", "4", "--interleave"])
    assert "OutOfMemoryError" in results[0]["error"] and "error" not in results[1]


def test_timed_steps_come_in_windows_whose_spread_is_reported(capsys):
    # one mean over a single window hides a drifting machine: up to 3 windows, each's ms per step kept
    r = bench.main(TINY[:-4] + ["--steps", "7", "--warmup", "1", "--objectives", "mlm"])[0]
    windows = r["step_ms_windows"]
    assert len(windows) == 3 and r["step_ms"] == pytest.approx((3 * windows[0] + 2 * windows[1] + 2 * windows[2]) / 7,
                                                               rel=0.05)
    assert bench.HEADER.endswith("spread") and "%" in capsys.readouterr().out.splitlines()[-2]
    assert r["spread"] == pytest.approx((max(windows) - min(windows)) / r["step_ms"])
    one = bench.main(TINY + ["--objectives", "mlm"])[0]  # one timed step: one window, no spread
    assert len(one["step_ms_windows"]) == 1 and one["spread"] is None and bench.table_row(one).endswith(" -")


def test_gpu_peak_flops_tells_the_h100_parts_apart(monkeypatch):
    from monitor import gpu_peak_flops
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
                       ("NVIDIA H200", 989e12), ("Some GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert gpu_peak_flops(0) == peak, name


# --- the comparison is like for like: what each side's step really runs (a mutation audit's gaps) ---
COMPARED = ("mlm", "hf-mlm", "hf-masked")  # our MLM and the Hugging Face rows it is measured against
CPU = torch.device("cpu")


def run_args(**overrides):
    return types.SimpleNamespace(**{**dict(batch_size=8, seq_len=128, compile=0, loader=False, dropout=0.1,
                                           taco_negatives=4, gen_shape="cocolm", interleave=False), **overrides})


def record_one_step(name, monkeypatch, **overrides):
    """Build run `name` at the tiny size on the CPU as main() does, take one training step and return what
    reached SDPA, dropout and cross-entropy (with whether each SDPA call ran inside the run's autocast) and the
    padding mask Hugging Face's BertModel was given (transformers >= 5 only: 4.x builds it elsewhere), the autocast
    contexts the build made and how often each was entered, and the model config."""
    pytest.importorskip("transformers")
    from transformers.models.bert import modeling_bert
    F = torch.nn.functional
    seen, contexts, inside = dict(sdpa=[], dropout=[], ce=[]), [], []

    class Autocast:  # stands in for the CPU's nullcontext (torch.autocast on CUDA): one a run, entered each step
        def __init__(self):
            self.entered = 0
            contexts.append(self)

        def __enter__(self):
            self.entered += 1
            inside.append(self)

        def __exit__(self, *exc):
            inside.remove(self)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, real=F.scaled_dot_product_attention, **kw):
        seen["sdpa"].append(dict(shape=tuple(q.shape), mask=attn_mask, p=dropout_p, causal=is_causal,
                                 autocast=len(inside) == 1 and inside[0] is contexts[0]))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    def dropout(x, p=0.5, training=True, inplace=False, real=F.dropout):
        seen["dropout"].append((p, training))
        return real(x, p, training, inplace)

    def cross_entropy(logits, labels, *a, real=F.cross_entropy, **kw):
        seen["ce"].append((logits.shape[0], logits.shape[-1], int((labels != -100).sum())))
        return real(logits, labels, *a, **kw)

    def bidirectional_mask(*a, real=getattr(modeling_bert, "create_bidirectional_mask", None), **kw):
        seen["hf_mask"].append(kw["attention_mask"])
        return real(*a, **kw)
    if hasattr(modeling_bert, "create_bidirectional_mask"):
        seen["hf_mask"] = []
        monkeypatch.setattr(modeling_bert, "create_bidirectional_mask", bidirectional_mask)
    monkeypatch.setattr(bench, "nullcontext", Autocast)
    for attr, spy in (("scaled_dot_product_attention", sdpa), ("dropout", dropout), ("cross_entropy", cross_entropy)):
        monkeypatch.setattr(F, attr, spy)
    step, _, _, config, _ = bench.build(name, "tiny", run_args(**overrides), CPU)
    step(0)
    monkeypatch.undo()
    return seen, [c.entered for c in contexts], config


def test_both_sides_attend_through_sdpa_unmasked_with_the_same_dropout_in_train_mode(monkeypatch):
    # every layer's attention through SDPA (attn_implementation="sdpa"), no mask tensor (flash-eligible), attention
    # and hidden dropout at --dropout (not the 0.1 default here) and training mode, inside the run's autocast:
    # Hugging Face eager, in eval mode, at another dropout, given a mask or outside autocast all fail here. An
    # all-ones attention_mask reaches SDPA as None only when eager: compiled, Hugging Face builds the mask tensor
    for name in COMPARED:
        seen, entered, config = record_one_step(name, monkeypatch, batch_size=2, seq_len=32, dropout=0.05)
        if "hf_mask" in seen:  # recorded on transformers >= 5 (tokenizers >= 0.22) only
            assert seen["hf_mask"] == ([None] if name.startswith("hf") else []), name
        head_size = config.hidden_size // config.num_heads
        assert seen["sdpa"] == [dict(shape=(2, config.num_heads, 32, head_size), mask=None, p=0.05, causal=False,
                                     autocast=True)] * config.num_layers, name
        assert seen["dropout"] == [(0.05, True)] * (1 + 2 * config.num_layers), name  # embeddings, 2 a layer
        assert entered == [1], name


def test_both_sides_predict_the_same_share_of_tokens_ours_with_the_head_on_those_only(monkeypatch):
    # batch 8 x 128 on both sides; ours: exactly round(0.15 x 126) targets a row in M = ceil(0.15 x 128) head
    # slots; Hugging Face: a Bernoulli(0.15) draw (its collator's), full-vocabulary logits at every position
    # (the stated difference: where our speed-up comes from), hf-masked: its head on its selected positions only
    ce = {name: record_one_step(name, monkeypatch)[0]["ce"] for name in COMPARED}
    B, T, V = 8, 128, BertConfig.vocab_size
    assert ce["mlm"] == [(B * 20, V, B * 19)]
    [(rows, vocab, targets)] = ce["hf-mlm"]
    assert (rows, vocab) == (B * T, V) and targets == pytest.approx(B * 19, rel=0.25)  # ~3 sd of the draw
    assert ce["hf-masked"] == [(targets, V, targets)]  # the same batches, the head on the selected rows only


def test_both_sides_clip_step_the_optimizer_and_free_the_gradients(monkeypatch):
    clips, real = [], torch.nn.utils.clip_grad_norm_
    def clip(params, max_norm, *a, **kw):
        clips.append((params, max_norm))
        return real(params, max_norm, *a, **kw)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    for name in COMPARED:
        clips.clear()
        step, params, *_ = bench.build(name, "tiny", run_args(batch_size=2, seq_len=32), CPU)
        before = [p.detach().clone() for p in params]
        step(0)
        [(clipped, max_norm)] = clips
        assert max_norm == 1.0 and [id(p) for p in clipped] == [id(p) for p in params], name
        assert not any(torch.equal(b, p) for b, p in zip(before, params)), name  # AdamW moved every tensor
        assert all(p.grad is None for p in params), name  # zero_grad(set_to_none=True): no gradients held over


@pytest.mark.parametrize("mode,runs_through", [
    (0, {}), (1, dict(mlm="Bert", hf_mlm="BertForMaskedLM", hf_masked="BertModel")),
    (2, dict(mlm="Pretrainer", hf_mlm="BertForMaskedLM", hf_masked="BertModel"))])
def test_compile_wraps_what_the_docstring_says_on_each_side(monkeypatch, mode, runs_through):
    # --compile 1: our encoder (masking, head and loss eager) against Hugging Face's whole model, loss included (its
    # encoder for hf-masked, whose head is eager as ours); 2: our whole step; 0: neither. main() forces 0 on a CPU,
    # so this is the CUDA path's choice: torch.compile is a spy noting which module each step runs through
    pytest.importorskip("transformers")
    called = []

    class Compiled:
        def __init__(self, module):
            self.module = module

        def __call__(self, *a, **kw):
            called.append(type(self.module).__name__)
            return self.module(*a, **kw)

        def __getattr__(self, attr):
            return getattr(self.module, attr)
    monkeypatch.setattr(torch, "compile", lambda module, **kw: Compiled(module))
    for name in COMPARED:
        called.clear()
        step = bench.build(name, "tiny", run_args(batch_size=2, seq_len=32, compile=mode), CPU)[0]
        step(0)
        assert called == ([runs_through[name.replace("-", "_")]] if mode else []), name


def test_timing_syncs_the_device_and_leaves_warm_up_and_its_memory_out(monkeypatch):
    # time_steps' CUDA path on a simulated device: a step only queues its work (1 s a warm-up step, as compiling;
    # 0.1 s after) and 10 ms of host time, sync waits for the queue, memory peaks at 10 GB in warm-up and 2 GB
    # after. Reading the clock before a sync, timing warm-up or keeping its peak all give other numbers
    state = dict(now=0.0, cpu=0.0, queued=0.0, peak=0.0, calls=[])

    def step(i):
        warm = len(state["calls"]) < 2
        state["calls"].append(i)
        state["queued"] += 1.0 if warm else 0.1
        state["cpu"] += 0.01
        state["peak"] = max(state["peak"], 10e9 if warm else 2e9)

    def sync(device):
        state["now"], state["queued"] = state["now"] + state["queued"], 0.0
    monkeypatch.setattr(bench, "sync", sync)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: state["now"],
                                                             process_time=lambda: state["cpu"]))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=1e9))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    step_ms, cpu_ms, peak_gb, windows = bench.time_steps(step, types.SimpleNamespace(warmup=2, steps=7),
                                                         types.SimpleNamespace(type="cuda"))
    assert state["calls"] == [0, 1] + list(range(7))
    assert step_ms == pytest.approx(100) and windows == pytest.approx([100] * 3) and cpu_ms == pytest.approx(10)
    assert peak_gb == pytest.approx(2.0)


def test_rows_count_every_token_and_give_hugging_face_our_mlm_flops():
    pytest.importorskip("transformers")
    args = run_args(batch_size=2, seq_len=32)
    timing = (50.0, 40.0, None, [50.0])  # wall ms, CPU ms, peak GB, windows
    rows = {name: bench.summarise(name, "tiny", args, CPU, bench.build(name, "tiny", args, CPU), timing)
            for name in COMPARED}
    assert all(r["tokens_per_s"] == pytest.approx(2 * 32 / 0.05) for r in rows.values())  # padding-free blocks
    assert rows["mlm"]["model_tflops"] > 0 and rows["hf-mlm"]["model_tflops"] == rows["hf-masked"]["model_tflops"] \
        == rows["mlm"]["model_tflops"]  # so the MFU ratio is the tokens/s ratio


def test_ratios_put_our_mlm_over_hugging_faces():
    ours = dict(model_size="small", objective="mlm", tokens_per_s=3000.0, cpu_ms=10.0, peak_mem_gb=None)
    hf = dict(model_size="small", objective="hf-mlm", tokens_per_s=1000.0, cpu_ms=30.0, peak_mem_gb=None)
    cpu = bench.hf_ratio(ours, hf)
    assert cpu["tokens_per_s_ratio"] == cpu["cpu_time_ratio"] == 3.0 and "our MLM runs 3.00x" in cpu["line"]
    gpu = bench.hf_ratio(dict(ours, peak_mem_gb=4.0), dict(hf, peak_mem_gb=8.0))
    assert gpu["peak_mem_ratio"] == 0.5 and "0.50x its peak memory (4.00 vs 8.00 GB)" in gpu["line"]


def test_docstring_cites_the_saved_hf_masked_ratios():
    # the encoder-only comparison is the honest one: the docstring quotes the run saved in results/, not an earlier one
    import json
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench", "cpu_hf_masked.json")) as f:
        saved = {r["model_size"]: r["tokens_per_s_ratio"] for r in json.load(f)["hf_ratios"]
                 if r["against"] == "hf-masked"}
    assert (f"our MLM ran at {saved['tiny']:.2f}x its tokens/s (tiny) and {saved['small']:.2f}x (small), "
            "results/bench/cpu_hf_masked.json") in " ".join(bench.__doc__.split())


def test_efficiency_md_cites_the_saved_cpu_step_times():
    # was: docs/efficiency.md gave "550 here, and ours ... 155" for the tiny steps of cpu_mlm_vs_hf.json, which
    # holds 556 and 161 ms (the ratio it quotes, 3.5x, is that file's)
    import json
    root = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(root, "results", "bench", "cpu_mlm_vs_hf.json")) as f:
        ms = {r["objective"]: r["step_ms"] for r in json.load(f)["results"] if r["model_size"] == "tiny"}
    with open(os.path.join(root, "docs", "efficiency.md"), encoding="utf-8") as f:
        doc = " ".join(f.read().split())
    assert (f"Hugging Face's tiny step took 844 ms against {ms['hf-mlm']:.0f} here, and ours 192 against "
            f"{ms['mlm']:.0f}.") in doc


def test_all_in_a_list_means_every_objective_and_every_run(monkeypatch):
    # was: --objectives all,mlm was refused as "unknown objective 'all' (choose from ..., or all)"
    monkeypatch.setattr(bench, "build", lambda name, *a: (_ for _ in ()).throw(RuntimeError("not built")))
    results = bench.main(TINY + ["--objectives", "mlm,all", "--taco_negatives", "4", "--profile",
                                 "--profile_objectives", "all,mlm"])
    assert [r["objective"] for r in results] == list(LOSSES)  # each a failed row: nothing built, nothing timed


def test_json_refuses_a_path_that_is_not_a_regular_file(tmp_path, capsys):
    # was: the atomic write renamed its file over the path: as root, bench.py --json /dev/null (or /dev/full) put a
    # regular file in place of the device; a FIFO here, which the same rename replaced
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(TINY + ["--objectives", "mlm", "--json", str(fifo)])
    assert exit_info.value.code == 2 and fifo.is_fifo()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --json {fifo}: not a regular file") and "\n" not in err


def test_ctrl_c_is_one_line_naming_the_rows_kept(tmp_path, monkeypatch, capsys):
    # was: a KeyboardInterrupt traceback from inside a step, which said nothing of the rows --json held
    import json
    real, calls = bench.time_steps, []

    def time_steps(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a)
    monkeypatch.setattr(bench, "time_steps", time_steps)
    out = tmp_path / "bench.json"
    with pytest.raises((SystemExit, KeyboardInterrupt)) as exit_info:  # (an escaped Ctrl-C would stop pytest)
        bench.main(TINY + ["--objectives", "mlm,taco", "--taco_negatives", "4", "--json", str(out)])
    assert exit_info.type is SystemExit and exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == f"interrupted; {out} holds the 1 row(s) above"
    assert [r["objective"] for r in json.loads(out.read_text())["results"]] == ["mlm"]
    calls.clear()
    with pytest.raises((SystemExit, KeyboardInterrupt)):  # no --json: the table is what is kept
        bench.main(TINY + ["--objectives", "taco,mlm", "--taco_negatives", "4"])
    assert capsys.readouterr().err.strip() == "interrupted; the rows above are kept"
    monkeypatch.setattr(bench, "time_steps", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises((SystemExit, KeyboardInterrupt)):
        bench.main(TINY + ["--objectives", "mlm"])
    assert capsys.readouterr().err.strip() == "interrupted; no row finished"


def test_the_table_says_what_it_measures_and_the_json_which_cpu(tmp_path, capsys):
    # was: a bare "tokens/s" column, and "device": "cpu" in the JSON (platform.processor() is empty on Linux), so a
    # reader of results/bench/ could not tell which CPU gave a ratio that differs from one CPU to another
    import json
    out = tmp_path / "bench.json"
    bench.main(TINY + ["--objectives", "mlm", "--json", str(out)])
    assert ("tokens/s: all 2 x 32 positions, masked or not, per full training step (forward, backward, clip, "
            "optimizer)") in capsys.readouterr().out
    device = json.loads(out.read_text())["info"]["device"]
    assert device == bench.cpu_name() and device.endswith(f"({torch.backends.cpu.get_cpu_capability()})")
    if os.path.isfile("/proc/cpuinfo") and "model name" in open("/proc/cpuinfo").read():
        assert not device.startswith("cpu (")
    bench.main(TINY + ["--objectives", "mlm", "--steps", "2", "--interleave"])
    assert "1 warm-up + 2 timed rounds, one step of each run in turn (step ms: the median)" in capsys.readouterr().out
