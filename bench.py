"""
Time pretraining steps: tokens/s, MFU and peak memory for each objective and model size,
after warm-up and compile, on random token blocks. Data loading is excluded unless --loader
(then batches come through data.BlockLoader: pinned memory, asynchronous copy).

    python bench.py --model_size small --batch_size 256 --seq_len 128 --objectives mlm,taco --json out/bench.json
    python bench.py --model_size tiny --device cpu --batch_size 8 --steps 5     # runs anywhere (the test does this)

Compare with Hugging Face BertForMaskedLM in the same process group with
../shared/bench/hf_baseline.py: GPU numbers are only comparable within one run.
"""
import argparse
import json
import platform
import time
from contextlib import nullcontext
from dataclasses import replace

import torch

from losses import LOSSES
from model import Bert, BertConfig, MODEL_PRESETS
from train import TrainConfig, Pretrainer, configure_optimizer, gpu_peak_flops


def objective_flops_per_token(objective, config, cfg, seq_len):
    """Model FLOPs per token of one training step, counting what the objective computes.
    A forward costs 2 FLOPs per multiply-add, a backward twice the forward (so 6 per MAC trained,
    2 per MAC run without grad). Per token and per layer: 4 D^2 + 2 D F matmul MACs, 2 T D for
    attention (QK^T and AV). The MLM head costs D^2 + D V MACs on the mask_prob share of tokens.
      mlm      6 * (L * (4D^2 + 2DF + 2TD) + p (D^2 + DV))
      taco     mlm + 6 * (K + 1) * D           (cosines of every anchor with 1 positive, K negatives)
      tacl     mlm + 2 * L * (...)             (teacher forward, no grad) + 6 * p * T * D (scores)
      electra  6 * G * (...) + 6 * p (D^2 + DV) (generator + its head) + 6 * L * (...) + 6 D (disc. head)
      cocolm   electra's generator + 2 views of the main model + the LM head (D V, no transform) on p
    """
    L, D, F, V = config.num_layers, config.hidden_size, config.intermediate_size, config.padded_vocab_size
    G = cfg.gen_layers or max(1, round(L / 3))
    p = cfg.mask_prob
    layer = 4 * D * D + 2 * D * F + 2 * seq_len * D
    mlm_head = p * (D * D + D * V)
    if objective == "mlm":
        return 6 * (L * layer + mlm_head)
    if objective == "taco":
        return 6 * (L * layer + mlm_head + (cfg.taco_negatives + 1) * D)
    if objective == "tacl":
        return 6 * (L * layer + mlm_head + p * seq_len * D) + 2 * L * layer
    generator = 6 * (G * layer + mlm_head)
    if objective == "electra":
        return generator + 6 * (L * layer + D * D + D)
    if objective == "cocolm":
        return generator + 6 * (2 * L * layer + p * D * V + 2 * D * D + D)
    raise ValueError(f"unknown objective {objective!r}")


def random_blocks(batch_size, seq_len, config, device):
    # packed [CLS] ... [SEP] blocks of ordinary tokens, like data.BlockLoader's
    ids = torch.randint(config.mask_token_id + 1, config.vocab_size, (batch_size, seq_len), device=device)
    ids[:, 0], ids[:, -1] = config.cls_token_id, config.sep_token_id
    return ids


def bench(objective, args, device):
    cfg = replace(TrainConfig(), objective=objective, seq_len=args.seq_len, batch_size=args.batch_size,
                  init_from="random weights", dropout=args.dropout, taco_negatives=args.taco_negatives)
    config = BertConfig(**MODEL_PRESETS[args.model_size], dropout=args.dropout)
    model = Bert(config).to(device)
    loss_fn = LOSSES[objective](model, cfg).to(device)
    params = list(model.parameters()) + [p for p in loss_fn.parameters() if p.requires_grad]
    opt = configure_optimizer(params, cfg, device.type)
    compiled = args.compile if device.type == "cuda" else 0
    if compiled == 1:  # the encoder only; sampling, heads and losses run eagerly
        trainer = Pretrainer(torch.compile(model, dynamic=False), loss_fn)
    else:  # 2: the whole step (graph breaks at each seeded random draw), or 0: eager
        trainer = Pretrainer(model, loss_fn)
        trainer = torch.compile(trainer, dynamic=False) if compiled == 2 else trainer
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    gen = torch.Generator(device).manual_seed(0)
    batches = [{"input_ids": random_blocks(args.batch_size, args.seq_len, config, device)} for _ in range(4)]
    if args.loader:
        import numpy as np
        import data
        stream = np.random.default_rng(0).integers(config.mask_token_id + 1, config.vocab_size, 4 * args.batch_size
                                                   * args.seq_len, dtype=np.uint16)
        loader = data.BlockLoader(stream, args.seq_len, args.batch_size, config.cls_token_id, config.sep_token_id,
                                  device=device)

    def step(i):
        batch = {"input_ids": loader.next_batch()} if args.loader else batches[i % len(batches)]
        with autocast:
            loss, _ = trainer(batch, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(args.warmup):  # compile and autotune happen here
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for i in range(args.steps):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / args.steps
    tokens_per_s = args.batch_size * args.seq_len / dt
    flops = objective_flops_per_token(objective, config, cfg, args.seq_len)
    peak = gpu_peak_flops(device) if device.type == "cuda" else None
    return dict(objective=objective, model_size=args.model_size, batch=args.batch_size, seq=args.seq_len,
                compile=compiled, dropout=args.dropout, step_ms=dt * 1e3, tokens_per_s=tokens_per_s,
                model_tflops=tokens_per_s * flops / 1e12, mfu=tokens_per_s * flops / peak if peak else None,
                peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objectives", default="mlm,taco,tacl,cocolm,electra", help="comma list of losses.LOSSES keys")
    p.add_argument("--model_size", default="small", choices=list(MODEL_PRESETS))
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--taco_negatives", type=int, default=50)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (compile, autotune)")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="0.1: the small/base presets' and Hugging Face's default (the README's H100 table used 0)")
    p.add_argument("--compile", type=int, default=1, choices=[0, 1, 2],
                   help="on CUDA: 0 eager, 1 compile the encoder (train.py's choice), 2 compile the whole step")
    p.add_argument("--loader", action="store_true", help="include data loading (data.BlockLoader)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    info = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or "cpu", threads=torch.get_num_threads())
    print(json.dumps(info), flush=True)
    results = []
    for objective in args.objectives.split(","):
        if objective not in LOSSES:
            p.error(f"unknown objective {objective!r} (choose from {', '.join(LOSSES)})")
        r = bench(objective, args, device)
        results.append(r)
        mfu = f"  mfu {r['mfu']:.1%}" if r["mfu"] else ""
        mem = f"  peak {r['peak_mem_gb']:.1f} GB" if r["peak_mem_gb"] else ""
        print(f"{objective:8s} {args.model_size} b{args.batch_size} s{args.seq_len}: {r['step_ms']:8.1f} ms/step "
              f"{r['tokens_per_s'] / 1e6:7.3f} M tok/s  x{r['step_ms'] / results[0]['step_ms']:.2f} of "
              f"{results[0]['objective']}{mfu}{mem}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
