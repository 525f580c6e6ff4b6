"""bench.py runs on CPU with the tiny model and reports every objective."""
import pytest

import bench
from losses import LOSSES
from model import BertConfig, MODEL_PRESETS
from train import TrainConfig, flops_per_token


def test_bench_runs_every_objective_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    results = bench.main(["--model_size", "tiny", "--device", "cpu", "--batch_size", "4", "--seq_len", "32",
                          "--steps", "2", "--warmup", "1", "--taco_negatives", "4", "--loader", "--json", str(out)])
    assert [r["objective"] for r in results] == list(LOSSES)
    for r in results:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["model_tflops"] > 0
    assert out.is_file()


def test_flops_count_what_each_objective_computes():
    config, cfg = BertConfig(**MODEL_PRESETS["small"]), TrainConfig()
    mlm = bench.objective_flops_per_token("mlm", config, cfg, 128)
    assert mlm == pytest.approx(flops_per_token(config, 128, cfg.mask_prob))  # one formula, two places
    assert mlm < bench.objective_flops_per_token("taco", config, cfg, 128) < 1.05 * mlm
    assert 1.2 * mlm < bench.objective_flops_per_token("tacl", config, cfg, 128) < 1.4 * mlm  # + teacher forward
    assert bench.objective_flops_per_token("cocolm", config, cfg, 128) > 2 * mlm
