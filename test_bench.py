"""bench.py runs on CPU with the tiny model: every objective, the Hugging Face baseline, the profiler."""
import pytest
import torch

import bench
from losses import LOSSES
from model import BertConfig, MODEL_PRESETS
from train import TrainConfig, flops_per_token

TINY = ["--model_size", "tiny", "--device", "cpu", "--batch_size", "2", "--seq_len", "32", "--steps", "1",
        "--warmup", "1"]


def test_bench_runs_every_objective_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench.main(TINY + ["--taco_negatives", "4", "--loader", "--json", str(out)])
    assert [r["objective"] for r in results] == list(LOSSES)
    for r in results:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["model_tflops"] > 0
        assert r["mfu"] is None and r["peak_mem_gb"] is None  # CPU: no GPU peak to divide by, no CUDA memory
    assert results[0]["vs_mlm"] == 1.0
    table = capsys.readouterr().out
    assert bench.HEADER in table and all(f"tiny   {name} " in table for name in LOSSES)
    assert out.is_file() and not (tmp_path / "bench.json.tmp").exists()


def test_hf_baseline_same_config_on_cpu(capsys):
    transformers = pytest.importorskip("transformers")
    results = bench.main(TINY + ["--objectives", "mlm", "--hf"])
    ours, hf = results
    assert (ours["objective"], hf["objective"]) == ("mlm", "hf-mlm")
    # same architecture: the parameter counts differ only by our 6 padded vocab rows (30522 -> 30528)
    config = BertConfig(**MODEL_PRESETS["tiny"])
    padding = (config.padded_vocab_size - config.vocab_size) * (config.hidden_size + 1)  # embedding rows + head bias
    assert ours["params_m"] * 1e6 - hf["params_m"] * 1e6 == pytest.approx(padding, abs=0.5)
    out = capsys.readouterr().out
    assert "tiny   mlm " in out and "tiny   hf-mlm " in out
    assert "our MLM runs" in out and "Hugging Face's tokens/s" in out
    hf_config = transformers.BertConfig(**bench.config_to_hf(config))
    assert (hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.num_attention_heads,
            hf_config.intermediate_size, hf_config.hidden_dropout_prob) == (128, 2, 2, 512, 0.1)


def test_hf_masking_matches_the_collator():
    config = BertConfig(**MODEL_PRESETS["tiny"])
    gen = torch.Generator().manual_seed(0)
    ids = bench.random_blocks(64, 128, config, "cpu", gen)
    batch = bench.hf_mlm_batch(ids, config, gen)
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


@pytest.mark.parametrize("argv", [["--bogus"], ["--objectives", "mlm,nope"], ["--model_size", "huge"],
                                  ["--steps", "0"]])
def test_bad_flags_give_one_error_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_flops_count_what_each_objective_computes():
    config, cfg = BertConfig(**MODEL_PRESETS["small"]), TrainConfig()
    mlm = bench.objective_flops_per_token("mlm", config, cfg, 128)
    assert mlm == pytest.approx(flops_per_token(config, 128, cfg.mask_prob))  # one formula, two places
    assert mlm < bench.objective_flops_per_token("taco", config, cfg, 128) < 1.05 * mlm
    assert 1.2 * mlm < bench.objective_flops_per_token("tacl", config, cfg, 128) < 1.4 * mlm  # + teacher forward
    assert bench.objective_flops_per_token("cocolm", config, cfg, 128) > 2 * mlm
