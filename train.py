"""
Pretrain BERT with MLM, TACO, TaCL, COCO-LM or ELECTRA. One loop from a laptop CPU to
a multi-node GPU cluster.

    python train.py --objective taco                      # preset "smoke": tiny model, bundled sample text, CPU
    python train.py --objective taco --preset small --data DIR_OF_TEXT   # TACO Table 5 on one GPU
    torchrun --standalone --nproc_per_node=8 train.py --objective taco --preset base

Flags are the TrainConfig fields in config.py (--name value or --name=value); --help lists them
with the chosen preset's values and where each comes from.
"""
# train() below reads top to bottom: config -> data -> model -> objective -> optimizer -> steps (lr,
# micro-steps with their seeded draws, clip, step; then log / eval / save at their intervals). What makes
# a run safe to kill and resume lives beside it: rundir.py (lock, checkpoints, resume), distributed.py
# (device, torchrun, signals), monitor.py (divergence watch, FLOPs, log lines), console.py (the console).
import sys
import time

import torch
import torch.nn as nn

import data
import distributed
import rundir
from analysis import contextual_score, wordsim_similarity
from config import batch_note, micro_batching
from console import Console
from losses import LOSSES
from model import Bert, BertConfig, MODEL_PRESETS
from monitor import DivergenceWatch, StepLog, print_plan


class Pretrainer(nn.Module):
    """The model and the objective as one module, so DDP sees every trained parameter
    (an objective may own a generator or heads) in a single forward."""

    def __init__(self, model, objective):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, batch, rng):
        return self.objective(self.model, batch, rng)


def configure_optimizer(params, cfg, device_type):
    # weight decay on matrices and embeddings only, as BERT excludes biases and LayerNorm
    params = [p for p in params if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=cfg.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), eps=cfg.adam_eps, fused=device_type == "cuda")


def lr_at(step, cfg):
    if step < cfg.warmup_steps:  # (s+1)/W: Hugging Face's s/W trains step 0 at lr 0 (fidelity note 1)
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.warmup_steps))


def step_seed(seed, step, micro_index, stream=0):
    # every micro-batch's random draws come from generators seeded by (seed, step, global micro-batch
    # index): stream 0 is the objective's (masks, negatives, samples), stream 1 torch's global RNG
    # (dropout). Resuming needs no RNG state, and two DDP ranks draw exactly what one process
    # accumulating two micro-batches draws. Tuples of ints hash the same in every process (CPython >= 3.8,
    # 64-bit: a resume on another build would draw other masks, not wrong ones).
    return hash((seed, step, micro_index, stream)) % (2 ** 62)


@torch.no_grad()
def evaluate(model, objective, val_loader, cfg, device, autocast, special=None, tok=None):
    """The objective's metrics on a fixed set of held-out blocks with fixed random draws:
    val_mlm_loss / val_mlm_acc for MLM, TACO and TaCL, the generator's val_gen_loss for
    ELECTRA and COCO-LM (their main model's MLM head is never trained). Batch i is drawn with seed i whatever
    the run's --seed and objective: every run is scored on the same masks, so two runs compare.
    With the special ids and the tokenizer, TACO's Fig. 3/6 measures too: how contextual the token
    states are, and how close co-occurring words' embeddings are."""
    model.eval(), objective.eval()
    rng = torch.Generator(device)
    val_loader.rewind()  # the same held-out blocks every evaluation
    totals = {}
    for i in range(cfg.eval_batches):
        rng.manual_seed(i)  # not one stream: TACO's extra draws would move the masks of the batches after
        with autocast:
            _, metrics = objective(model, {"input_ids": val_loader.next_batch()}, rng)
        for k, v in metrics.items():
            totals["val_" + k] = totals.get("val_" + k, 0.0) + float(v) / cfg.eval_batches
    model.train(), objective.train()
    if special is not None:
        val_loader.rewind()
        rng = torch.Generator(device).manual_seed(0)  # the same partner draws for every --seed (fidelity note 26)
        totals["contextual_score"] = contextual_score(model, val_loader.next_batch(), rng, special)["contextual"]
        wordsim = wordsim_similarity(model, tok)
        totals.update({} if wordsim is None else {"wordsim_cooc_sim": wordsim})
    return totals


def main(argv=None):
    rundir.run_main(train, argv, usage=__doc__)  # flags -> checked config -> locked out_dir -> train()


def train(cfg, ckpt=None):
    """The run. cfg: the checked flags (config.TrainConfig), which rundir.run_main parsed, with --resume's
    checkpoint as ckpt, after locking out_dir. Returns 0, or 128 + the signal number when SIGINT / SIGTERM
    / SIGHUP stopped it."""
    layout = distributed.setup(cfg)  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or one process
    device, master = layout.device, layout.master
    torch.manual_seed(cfg.seed)  # the initial weights (DDP broadcasts rank 0's anyway)
    if layout.device_type == "cuda":  # TF32 matmuls: process-wide state, so set only where it acts
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # --init_from's model; its directory's tokenizer becomes cfg.tokenizer (the vocabulary its weights know)
    init_model = rundir.start_weights(cfg, master) if cfg.init_from and not ckpt else None
    max_pos = (init_model.config if init_model else BertConfig).max_position_embeddings
    if cfg.seq_len > max_pos:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_position_embeddings {max_pos}")
    batch_size, grad_accum = micro_batching(cfg, layout.world)  # tokens_per_step -> micro-batches
    note = batch_note(cfg, batch_size, layout.world)  # why batch_size differs from --batch_size, if it does
    if note and master:
        print(note)
    cfg.batch_size = batch_size
    rundir.same_on_every_rank(cfg, layout, ckpt=ckpt)  # same code, flags, step on every node, before tokenizing

    # ---- data: a token stream, cut into [CLS] + seq_len - 2 tokens + [SEP] blocks (rank 0 tokenizes first)
    tok, train_tokens, val_tokens = distributed.rank0_first(layout, lambda: data.prepare_data(
        cfg.data, cfg.cache_dir, rundir.run_tokenizer(cfg, ckpt), cfg.vocab_size, cfg.val_fraction,
        cased=cfg.cased, limit_alphabet=cfg.limit_alphabet))
    special = data.special_token_ids(tok)
    run = rundir.Run(cfg, layout, ckpt, rundir.data_fingerprint(train_tokens, val_tokens))
    loader_args = dict(seq_len=cfg.seq_len, cls_id=special["cls"], sep_id=special["sep"], device=device)
    train_loader = data.BlockLoader(train_tokens, batch_size=cfg.batch_size, rank=layout.rank,
                                    world_size=layout.world, seed=cfg.seed, **loader_args)
    # the held-out set must not follow the per-process batch (lowered by the process count): a fixed row
    # count, the negative pool where there is one (TACO's held-out negatives then match training's), else 16
    try:
        val_loader = data.BlockLoader(val_tokens, batch_size=cfg.negative_pool or 16, seed=0, **loader_args)
    except ValueError as e:
        raise ValueError(f"the held-out split (--val_fraction {cfg.val_fraction}): {e}") from None

    # ---- model, objective, optimizer
    fresh = BertConfig(**MODEL_PRESETS[cfg.model_size], vocab_size=tok.get_vocab_size(), dropout=cfg.dropout,
                       **{f"{k}_token_id": v for k, v in special.items()})  # a new model's shape
    model_config = rundir.model_config_for(cfg, ckpt, init_model, fresh, special)  # or a resume's / --init_from's
    model = Bert(model_config)
    rundir.load_start_weights(model, init_model, ckpt)  # --init_from's weights (a resume's come in run.restore)
    model.to(device)
    objective = LOSSES[cfg.objective](model, cfg).to(device)
    rundir.note_fresh_head(cfg, init_model, model, master)  # --init_from's head untrained, where this one trains it
    params = list(model.parameters()) + [p for p in objective.parameters() if p.requires_grad]
    optimizer = configure_optimizer(params, cfg, layout.device_type)
    dtype, autocast, scaler = distributed.precision(cfg, layout)  # bf16 autocast (pre-Ampere: fp16 + scaler); CPU: fp32
    run.attach(model, model_config, objective, optimizer, train_loader, scaler)  # what a checkpoint holds
    step, trained_s = run.restore()  # --resume: where it stopped; else step 0

    # compile the encoder's forward (fixed shapes: one graph, two for COCO-LM's crop): +28% tokens/s on an
    # H100 (docs/efficiency.md). The compiled wrapper shares the raw model's weights: saving and evaluation
    # use the raw one. TACO compiles its negative scoring itself under the same flag (losses.fused_gather_dot).
    compiled = torch.compile(model, dynamic=False) if cfg.compile and layout.device_type == "cuda" else model
    trainer = distributed.wrap(layout, Pretrainer(compiled, objective))

    run.start(tok, step)  # the tokenizer, and log.jsonl's first record (config, code, model shape)
    if master:  # what this run will do: model, layout, the tokens_per_step derivation, epochs
        print_plan(cfg, model, layout, dtype, grad_accum, train_loader, len(train_tokens))
        run.report_resume(step, lr_at)

    def run_eval(step):  # rank 0 scores the held-out blocks; the other ranks go on
        if master:
            record = {"step": step, **evaluate(model, objective, val_loader, cfg, device, autocast, special, tok)}
            run.log(record)
            print(f"step {step:6d} | " + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))

    watch = DivergenceWatch(layout, cfg, scaler, params, run)  # stops the run before it saves NaN weights
    meter = StepLog(cfg, model_config, layout, step, trained_s)
    metrics = {}  # the last step's; save() shows them if the weights diverged
    stop = distributed.StopSignals(layout)  # SIGINT / SIGTERM / SIGHUP: stop after the step in flight

    def save(step):
        watch.check(metrics, step, run.saved_step, weights=True)  # never overwrite good weights with NaN
        run.save(step, meter.elapsed())
    try:
        with stop:
            if step == 0:
                run_eval(step)  # the untrained baseline
                meter.restart()
            while step < cfg.max_steps and not stop.stopping():
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                bad, metrics = torch.zeros((), dtype=torch.bool, device=device), {}
                for micro in range(grad_accum):
                    batch = {"input_ids": train_loader.next_batch()}  # (B, T) token ids, no padding
                    index = micro * layout.world + layout.rank  # this micro-batch's place in the global batch
                    rng = torch.Generator(device).manual_seed(step_seed(cfg.seed, step, index))  # masks, negatives
                    torch.manual_seed(step_seed(cfg.seed, step, index, stream=1))  # dropout
                    with distributed.no_sync(layout, trainer, last_micro_step=micro == grad_accum - 1):
                        with autocast:
                            loss, terms = trainer(batch, rng)
                        scaler.scale(loss / grad_accum).backward()
                    bad |= ~torch.isfinite(loss.detach())
                    for k, v in {"loss": loss.detach(), **terms}.items():  # logged: the mean over micro-steps
                        metrics[k] = metrics.get(k, 0) + v / grad_accum
                if cfg.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    if not scaler.is_enabled():  # under fp16 an inf gradient only makes the GradScaler skip the step
                        bad |= ~torch.isfinite(norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                watch.record(bad, step)
                meter.tokens += cfg.tokens_per_step

                if step % cfg.log_interval == 0 or step == cfg.max_steps:
                    metrics = distributed.mean_over_ranks(layout, metrics)
                    record = meter.record(step, metrics, lr, scaler)
                    watch.check(metrics, step, run.saved_step)
                    run.log(record)
                    if master:
                        print(meter.line(record), flush=True)
                with meter.paused():  # tokens/s counts the training steps only
                    if step % cfg.eval_interval == 0 or step == cfg.max_steps:
                        run_eval(step)
                    if step % cfg.ckpt_interval == 0 or step == cfg.max_steps:
                        save(step)
            if stop.received and step > run.saved_step:  # between two steps: every rank holds the weights of `step`
                save(step)
    except KeyboardInterrupt:  # a second signal, mid-step: the last checkpoint stands
        run.close(step, stopped_by="KeyboardInterrupt")
        return 130
    finally:
        distributed.close(layout)
    run.close(step, meter.first_step, time.time() - meter.t0, stop.name)
    return stop.exit_code


if __name__ == "__main__":
    sys.stdout, sys.stderr = Console(sys.stdout), Console(sys.stderr)  # a closed `| tee` cannot stop the run
    main()
