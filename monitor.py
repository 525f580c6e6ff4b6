"""What a run watches and reports: the divergence watch, FLOP / MFU counting, the console and log lines.

The algorithm does not need this module. It guarantees (test_reliability.py's NaN / inf / fp16 tests,
test_bench.py's FLOP tests, test_train.py's log tests):
- a non-finite loss or gradient norm, or an fp16 loss scale collapsing below MIN_LOSS_SCALE, stops the run
  with Diverged before it can save NaN weights (ckpt.pt and its export keep the last good step), and all
  DDP ranks stop at the same step, and log.jsonl's last line says why; the check reads the device only at log
  steps and before saves, so the step itself never waits for the host;
- a negative training loss (a sign flipped by an edit to losses.py: every built-in loss sums cross-entropies,
  >= 0) is said once, on the console, at the first log or save step that shows it (rank 0's loss at a save
  step, the mean over ranks at a log step); the run goes on;
- MFU is counted with the FLOPs the objective really computes (objective_flops_per_token).
(The console that outlives its reader is console.py's.)
"""
import time
from contextlib import contextmanager

import torch

from distributed import first_across_ranks
from losses import generator_config

NOT_YET = 2 ** 62  # first_bad holds this until a non-finite loss or gradient norm is seen
MIN_LOSS_SCALE = 1e-4  # fp16: a GradScaler scale below this is a divergence (fairseq's --min-loss-scale)


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before it can save NaN weights."""


class DivergenceWatch:
    """Notes on the device, without a host sync, the first step whose loss or gradient norm was not finite;
    check() reads it (collectively, under DDP) and raises Diverged."""

    def __init__(self, layout, cfg, scaler, params, run=None):
        self.layout, self.cfg, self.scaler, self.params = layout, cfg, scaler, params
        self.run = run  # rundir.Run: log.jsonl records the stop, and a run on edited code names its code.diff
        self.first_bad = torch.full((), NOT_YET, dtype=torch.long, device=layout.device)
        self.negative_said = False

    def record(self, bad, step):
        self.first_bad.masked_fill_(bad & (self.first_bad == NOT_YET), step)

    def check(self, metrics, step, saved_step, weights=False):
        """Stop with Diverged on a non-finite loss / grad norm since the last check; before a save
        (`weights`), on non-finite weights too. All ranks check at the same step and stop together."""
        bad = first_across_ranks(self.layout, self.first_bad)
        loss = float(metrics.get("loss", 0))  # rank 0 says it (at log steps the mean over ranks)
        if loss < 0 and not self.negative_said and self.layout.master:
            self.negative_said = True
            print(f"note: loss {loss:.4g} < 0 at step {step}: every built-in objective's loss is a sum of "
                  f"cross-entropies (>= 0); unless a term you added is negative by design, a sign in losses.py "
                  f"flipped (python -m pytest -q test_losses.py compares it with its references)", flush=True)
        if bad == NOT_YET and weights and not torch.stack([torch.isfinite(p).all() for p in self.params]).all():
            bad = step
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        if bad == NOT_YET and scale is not None and scale < MIN_LOSS_SCALE:
            bad = step  # fp16: every skipped step halved the scale; the gradients stay non-finite, nothing trains
        if bad != NOT_YET:
            cfg = self.cfg
            terms = " | ".join(f"{k} {float(v):.4g}" for k, v in {**metrics, "loss_scale": scale}.items()
                               if v is not None)
            kept = (f"{cfg.out_dir}/ckpt.pt and its export keep step {saved_step}" if saved_step else
                    "nothing was saved")
            local_changes = getattr(self.run, "local_changes", None)
            message = (f"non-finite loss or gradient norm at step {bad} (step {step}: {terms}); stopped "
                       f"without saving: {kept}. Try a lower learning rate: "
                       + (f"python train.py --resume {cfg.out_dir} --lr {cfg.lr / 2:.3g}" if saved_step else
                          f"--lr {cfg.lr / 2:.3g}") + (
                           f"; or check the code's local changes ({local_changes}: python -m pytest -q "
                           f"test_losses.py compares losses.py with its references)" if local_changes else "")
                       + scale_flags_hint(cfg))
            if self.run is not None:  # log.jsonl says why the run ends here (eval.py --plot_log shows it)
                self.run.log({"step": step, "diverged": message})
            raise Diverged(message)


SCALE_FLAGS = ("taco_temperature", "tacl_temperature", "cocolm_scl_temperature", "taco_weight", "cocolm_copy_weight",
               "electra_disc_weight", "adam_eps", "grad_clip", "weight_decay")  # flags that scale the loss or the update


def scale_flags_hint(cfg):
    """Where a run diverged with one of SCALE_FLAGS moved off its preset, the line names it too."""
    from config import PRESETS  # here: config is the flags' module, and this one serves train.py's loop
    default = type(cfg)(**PRESETS.get(cfg.preset, {}))
    owners = ("taco", "tacl", "cocolm", "electra")  # taco_* acts on TACO alone, and so on
    known = cfg.objective in ("mlm", *owners)  # one added to losses.LOSSES may read any (a copy of TACO): all named
    used = lambda k: not known or k.split("_")[0] not in owners or k.startswith(cfg.objective + "_")
    moved = [f"--{k} {getattr(cfg, k):g}" for k in SCALE_FLAGS if used(k) and getattr(cfg, k) != getattr(default, k)]
    return f"; or undo {', '.join(moved)} (off the preset's value)" if moved else ""


class StepLog:
    """Turns the loop's metrics into a log.jsonl record (tokens/s, MFU, elapsed seconds across resumes)
    and a console line with the ETA."""

    def __init__(self, cfg, model_config, layout, step, trained_s):
        flops = objective_flops_per_token(cfg.objective, model_config, cfg, cfg.seq_len)
        peak = gpu_peak_flops(layout.device) if layout.device_type == "cuda" and flops else None
        self.flops, self.peak = flops, peak * layout.world if peak else None  # every GPU's peak
        self.cfg, self.first_step, self.trained_s = cfg, step, trained_s  # trained_s: before this process
        self.restart()

    def restart(self):  # tokens/s and the ETA count training steps only, not the step-0 evaluation
        self.t0 = self.t_log = time.time()
        self.tokens = 0

    @contextmanager
    def paused(self):
        """An evaluation or a save inside the loop: its time stays out of the next record's tokens/s (MFU),
        which would otherwise read a fraction of the training rate after each one. elapsed_s and the ETA
        keep it: they are wall time, and evaluations and saves recur."""
        start = time.time()
        try:
            yield
        finally:
            self.t_log += time.time() - start

    def elapsed(self):
        return self.trained_s + time.time() - self.t0

    def record(self, step, metrics, lr, scaler):
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}, "lr": lr}
        if scaler.is_enabled():  # fp16: a falling scale is a run skipping steps
            record["loss_scale"] = scaler.get_scale()
        dt, self.t_log = time.time() - self.t_log, time.time()
        record["tokens_per_s"] = self.tokens / dt
        self.tokens = 0
        if self.peak:
            record["mfu"] = record["tokens_per_s"] * self.flops / self.peak
        record["elapsed_s"] = self.elapsed()
        return record

    def line(self, record):
        cfg, step = self.cfg, record["step"]
        terms = " | ".join(f"{k} {v:.4g}" if k == "loss_scale" else f"{k} {v:.4f}" for k, v in record.items()
                           if k not in ("step", "lr", "tokens_per_s", "mfu", "elapsed_s"))
        mfu = f" | mfu {record['mfu']:.1%}" if "mfu" in record else ""
        eta = (time.time() - self.t0) / (step - self.first_step) * (cfg.max_steps - step)
        return (f"step {step}/{cfg.max_steps} | {terms} | lr {record['lr']:.2e} | "
                f"{record['tokens_per_s'] / 1e3:.1f}k tok/s{mfu} | {duration(record['elapsed_s'])} | eta {duration(eta)}")


def print_plan(cfg, model, layout, dtype, grad_accum, train_loader, num_train_tokens):
    """What the run will do: the model, the layout, how tokens_per_step splits, how often it reads the data."""
    print(f"{cfg.objective} | {model.num_params() / 1e6:.1f}M params | {layout.world} process(es) on {layout.device}, "
          f"{dtype}")
    print(f"tokens_per_step {cfg.tokens_per_step} = batch_size {cfg.batch_size} x seq_len {cfg.seq_len} "
          f"x {layout.world} process(es) x grad_accum {grad_accum}")
    from config import pooled  # here, as PRESETS above
    if pooled(cfg.objective):
        print(f"negative pool: {cfg.negative_pool or cfg.batch_size} sequences" + ("" if cfg.negative_pool else
              " (the per-process micro-batch: changes with the layout; --negative_pool fixes it)"))
    blocks = cfg.tokens_per_step // cfg.seq_len  # a step's [CLS] + seq_len - 2 tokens + [SEP] blocks
    epochs = cfg.max_steps * blocks / train_loader.num_blocks
    size = lambda n: f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"
    print(f"this run reads the {size(num_train_tokens)}-token training split {epochs:.2f} times (epochs): "
          f"{cfg.max_steps:,} steps x {blocks:,} blocks of {cfg.seq_len - 2} text tokens "
          f"(+ [CLS], [SEP]) = {size(cfg.max_steps * cfg.tokens_per_step)} tokens")


def duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def objective_flops_per_token(objective, config, cfg, seq_len):
    """Model FLOPs per token of one training step, counting what the objective computes.
    A forward costs 2 FLOPs per multiply-add, a backward twice the forward (so 6 per MAC trained,
    2 per MAC run without grad). Per token and per layer: 4 D^2 + 2 D F matmul MACs, 2 T D for
    attention (QK^T and AV). The MLM head costs D^2 + D V MACs on the mask_prob share of tokens.
      mlm      6 * (L * (4D^2 + 2DF + 2TD) + p (D^2 + DV))
      taco     mlm + 6 * (K + 1) * D           (cosines of every anchor with 1 positive, K negatives)
      tacl     mlm + 2 * L * (...)             (teacher forward, no grad) + 6 * p * T * D (scores)
      electra  6 * gen + 6 * L * (...) + 6 (D^2 + D)                   (generator + disc. head)
      cocolm   6 * gen + 6 * (L * (...) + T_c / T * L * (...)[T = T_c] + p D V + D + 2 D^2 / T)
               + 2 * gen if dropout > 0  (x^MLM; the crop view of T_c = 2 + round(0.9 (T - 2)) tokens;
               LM head, no transform; copy head; SCL head on the two [CLS]; the dropout-off sampling
               forward, no grad)
    gen is the generator's forward MACs at losses.generator_config's width d, FFN F_g and depth G:
      gen = D d (the embeddings projection, if d != D) + G (4d^2 + 2d F_g + 2Td) + p (d D + D V)
    (its head's dense maps d -> D for the tied decoder). ELECTRA samples from its training
    forward, so it pays no extra pass."""
    L, D, F, V = config.num_layers, config.hidden_size, config.intermediate_size, config.padded_vocab_size
    p = cfg.mask_prob
    layer = 4 * D * D + 2 * D * F + 2 * seq_len * D
    mlm_head = p * (D * D + D * V)
    if objective == "mlm":
        return 6 * (L * layer + mlm_head)
    if objective == "taco":
        return 6 * (L * layer + mlm_head + (cfg.taco_negatives + 1) * D)
    if objective == "tacl":
        return 6 * (L * layer + mlm_head + p * seq_len * D) + 2 * L * layer
    if objective not in ("electra", "cocolm"):
        return None  # an objective added to losses.LOSSES: no MFU until its FLOPs are written here
    gen_config, G = generator_config(config, cfg)
    d, gen_ffn = gen_config.hidden_size, gen_config.intermediate_size
    gen = ((D * d if d != D else 0) + G * (4 * d * d + 2 * d * gen_ffn + 2 * seq_len * d)
           + p * (d * D + D * V))
    if objective == "electra":
        return 6 * gen + 6 * (L * layer + D * D + D)
    # Generator.forward reruns the generator without dropout to sample when the model has dropout
    sampling_pass = 2 * gen if config.dropout > 0 else 0
    # the crop view of a packed block is cut to 2 + round(crop_fraction (T - 2)) tokens (losses.crop_views)
    crop_len = 2 + round((seq_len - 2) * cfg.cocolm_crop_fraction)
    crop_layer = 4 * D * D + 2 * D * F + 2 * crop_len * D
    views = L * layer + crop_len / seq_len * L * crop_layer
    # the LM head decodes with the unpadded embedding rows, no transform
    return 6 * gen + sampling_pass + 6 * (views + p * D * config.vocab_size + D + 2 * D * D / seq_len)


def gpu_peak_flops(device):
    # dense bf16 tensor-core peaks from the datasheets; unknown GPUs report no MFU
    name = torch.cuda.get_device_name(device)
    # (H100 PCIe and NVL have lower clocks than the SXM part's 989 TFLOP/s: matched first)
    for key, peak in (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
                      ("A100", 312e12), ("L4", 121e12), ("4090", 165e12)):
        if key in name:
            return peak
    return None
