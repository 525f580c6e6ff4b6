"""
Time pretraining steps: tokens/s, step time, MFU and peak memory for each objective and model
size, after warm-up and compile, on random token blocks, next to Hugging Face's BertForMaskedLM
at the same config in the same process (GPU numbers are only comparable within one run).

    python bench.py --model_size small,base --objectives all --hf --json out/bench.json   # docs/efficiency.md's table
    python bench.py --model_size small --objectives mlm --profile --out_dir out/profile      # where a step's time goes
    python bench.py --model_size small --hf --profile --profile_objectives mlm   # every row, the MLM step profiled
    python bench.py --model_size tiny --device cpu --batch_size 8 --seq_len 128 --steps 3 --hf   # runs anywhere
    OMP_NUM_THREADS=1 python bench.py --model_size tiny --device cpu --batch_size 16 --steps 15 --interleave   # ratios
    python bench.py --model_size small --objectives mlm --ablate     # what SDPA, the fused QKV and the padding buy

Every step is a full training step: forward, backward, grad-norm clip at 1.0, fused AdamW on CUDA
(train.configure_optimizer), bf16 autocast on CUDA and fp32 on CPU, dropout --dropout (0.1, BERT's
and Hugging Face's default). Data loading is excluded unless --loader (then batches come through
data.BlockLoader: pinned memory, asynchronous copy).
On a shared CPU, --interleave builds every run of a size first and then times one step of each in
turn (medians over --steps rounds), so the machine's drift does not skew the ratios.

--hf times transformers.BertForMaskedLM built from hf_io.config_to_hf (same hidden size, layers,
heads, FFN, vocabulary, positions, dropout in train mode, attention through SDPA (attn_implementation
"sdpa", as ours); sequence length, batch, dtype, optimizer and clip as ours; tokens/s counts every
position of the batch on both sides), the way Hugging Face users train it: labels with -100 on the
unselected positions, 15% of the non-special tokens selected by a Bernoulli draw
(DataCollatorForLanguageModeling's 80/10/10), and the head computing full-vocabulary logits at every
position (Hugging Face's behaviour; ours runs the head on the selected positions only, and that head is
where our speed-up comes from: --hf_masked adds a row of Hugging Face's encoder, compiled as ours, with
its head on the selected positions only, eager as ours; on the CPU our MLM ran at 0.88x its tokens/s
(tiny) and 0.98x (small), results/bench/cpu_hf_masked.json: not faster). Differences, each in
Hugging Face's favour or neutral unless said:
- its masking is done before the timed steps (the collator runs in DataLoader workers); ours runs
  inside the timed step, on the device;
- its vocabulary is 30,522 rows, ours padded to 30,528 (a multiple of 64) with the padded logits dropped:
  in our favour where tensor cores want multiples of 8 (a Hugging Face user can pad it too);
- no attention_mask is passed to either: packed blocks have no padding (an all-ones mask would
  keep Hugging Face off SDPA's flash kernel once compiled);
- --compile 1 compiles our encoder (and TACO's negative scoring: train.py's choice) but Hugging
  Face's whole model, loss included (what Trainer's torch_compile does); --compile 2 our whole step and
  Hugging Face's whole model; --compile 0 runs both eagerly;
- --hf_masked's head runs on its Bernoulli count of selected positions (about 0.15 (T - 2) a row,
  where ours fills ceil(0.15 T) slots), picked by a boolean index: one host sync a step on CUDA, which
  ours avoids (against it);
- our step also computes the mlm_acc metric (a max over the selected logits; Hugging Face's computes no
  metric) and its cross-entropy on logits sliced from the padded vocabulary (on the CPU 30 ms forward and
  backward against 18 ms unsliced at tiny b8: in Hugging Face's favour).
MFU counts the same model FLOPs for both (objective_flops_per_token("mlm"): the MLM head on the
selected 15% only), so the MFU ratio equals the tokens/s ratio. "vs mlm" is the step time relative
to our MLM step at the same size. transformers is needed for --hf only. Hugging Face's row comes
right after our MLM's. A run that fails (out of memory, a compile error) is one "failed" line and an
"error" entry in --json; the other runs go on, and the exit status is 1.

--profile runs torch.profiler over --profile_steps more steps of each timed run (of --profile_objectives) and prints the
top kernels (GPU time) and ops (self CUDA time on GPU, self CPU time on CPU), then writes a
chrome trace (chrome://tracing, ui.perfetto.dev) per run into --out_dir.
"""
import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

import torch

from atomic import write_atomic
from losses import LOSSES, eligible_positions
from hf_io import config_to_hf
from model import Bert, BertConfig, MODEL_PRESETS
from config import Parser, TrainConfig, dir_problem, pool_problem
from console import Console
from monitor import gpu_peak_flops, objective_flops_per_token
from train import Pretrainer, configure_optimizer


def random_blocks(batch_size, seq_len, config, device, rng=None):
    # packed [CLS] ... [SEP] blocks of ordinary tokens, like data.BlockLoader's
    ids = torch.randint(config.mask_token_id + 1, config.vocab_size, (batch_size, seq_len), device=device,
                        generator=rng)
    ids[:, 0], ids[:, -1] = config.cls_token_id, config.sep_token_id
    return ids


class AttentionWithout(torch.nn.Module):
    """--ablate: model.SelfAttention with one of its speed features off, same weights and maths (test_bench checks
    it against ours): Q, K and V from three Linears (fused=False), or softmax attention written out (sdpa=False)."""

    def __init__(self, attn, fused=True, sdpa=True):
        super().__init__()
        self.attn, self.fused, self.sdpa = attn, fused, sdpa
        if not fused:  # the fused weight's thirds, as Hugging Face stores them
            D = attn.proj.in_features
            self.q, self.k, self.v = (torch.nn.Linear(D, D) for _ in range(3))
            for i, linear in enumerate((self.q, self.k, self.v)):
                linear.weight.data.copy_(attn.qkv.weight.data[i * D:(i + 1) * D])
                linear.bias.data.copy_(attn.qkv.bias.data[i * D:(i + 1) * D])
            attn.qkv = None

    def forward(self, x, attn_mask=None):
        a, (B, T, D) = self.attn, x.shape
        q, k, v = a.qkv(x).split(D, dim=2) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (t.view(B, T, a.num_heads, D // a.num_heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        dropout = a.dropout if self.training else 0.0
        if self.sdpa:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, T)
            if attn_mask is not None:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            y = torch.nn.functional.dropout(scores.softmax(-1), dropout) @ v
        return a.proj(y.transpose(1, 2).reshape(B, T, D))  # (B, nh, T, hs) -> (B, T, D)


# --ablate: our MLM with one of model.py's speed features off, each row's "vs mlm" its cost
ABLATIONS = {"no-sdpa": ({}, dict(sdpa=False)), "no-fused": ({}, dict(fused=False)),  # (config, attention) changes
             "no-pad": (dict(pad_vocab_to=1), {})}


def hf_mlm_batch(input_ids, config, rng, mask_prob=0.15):
    """Hugging Face's DataCollatorForLanguageModeling masking: each non-special token is selected
    with probability mask_prob (Bernoulli, so the count varies by row); of the selected, 80% become
    [MASK], 10% a random id from the whole vocabulary, 10% stay. labels: -100 where not selected."""
    probs = eligible_positions(input_ids, config).float() * mask_prob  # special tokens are never selected
    selected = torch.bernoulli(probs, generator=rng).bool()
    labels = input_ids.masked_fill(~selected, -100)
    draw = torch.rand(input_ids.shape, generator=rng, device=input_ids.device)
    inputs = input_ids.masked_fill(selected & (draw < 0.8), config.mask_token_id)
    random_ids = torch.randint(config.vocab_size, input_ids.shape, generator=rng, device=input_ids.device)
    inputs = torch.where(selected & (draw >= 0.8) & (draw < 0.9), random_ids, inputs)
    return dict(input_ids=inputs, labels=labels)


def build_ours(cfg, config, args, device, autocast, ablation=None):
    """(train_step(i) -> None, trained params) for our model and cfg.objective (ablation: a key of ABLATIONS)."""
    config_off, attention_off = ABLATIONS.get(ablation, ({}, {}))
    model = Bert(replace(config, **config_off))
    for layer in model.encoder.layers if attention_off else ():
        layer.attn = AttentionWithout(layer.attn, **attention_off)
    model = model.to(device)
    loss_fn = LOSSES[cfg.objective](model, cfg).to(device)
    params = list(model.parameters()) + [p for p in loss_fn.parameters() if p.requires_grad]
    if args.compile == 1:  # the encoder (and TACO's fused_gather_dot); sampling, heads and losses run eagerly
        trainer = Pretrainer(torch.compile(model, dynamic=False), loss_fn)
    else:  # 2: the whole step (graph breaks at each seeded random draw), or 0: eager
        trainer = Pretrainer(model, loss_fn)
        trainer = torch.compile(trainer, dynamic=False) if args.compile == 2 else trainer
    rng = torch.Generator(device).manual_seed(0)
    batches = [{"input_ids": random_blocks(args.batch_size, args.seq_len, config, device, rng)} for _ in range(4)]
    if args.loader:
        import numpy as np
        import data
        stream = np.random.default_rng(0).integers(config.mask_token_id + 1, config.vocab_size, 4 * args.batch_size
                                                   * args.seq_len, dtype=np.uint16)
        loader = data.BlockLoader(stream, args.seq_len, args.batch_size, config.cls_token_id, config.sep_token_id,
                                  device=device)

    def loss_at(i):
        batch = {"input_ids": loader.next_batch()} if args.loader else batches[i % len(batches)]
        with autocast:
            return trainer(batch, rng)[0]
    return training_step(loss_at, params, cfg, device), params


def build_hf(cfg, config, args, device, autocast, masked=False):
    """The same, for transformers.BertForMaskedLM at our config (see the module docstring); masked: its
    encoder and its head on the selected positions only, as ours."""
    import transformers  # main() checked it is installed
    hf_config = transformers.BertConfig(**config_to_hf(config), attn_implementation="sdpa")
    model = transformers.BertForMaskedLM(hf_config).to(device)
    params = list(model.parameters())  # the tied decoder weight appears once
    compiled = torch.compile(model, dynamic=False) if args.compile else model
    rng = torch.Generator(device).manual_seed(0)
    batches = [hf_mlm_batch(random_blocks(args.batch_size, args.seq_len, config, device, rng), config, rng)
               for _ in range(4)]

    def loss_at(i):
        with autocast:
            return compiled(**batches[i % len(batches)]).loss

    encoder = (torch.compile(model.bert, dynamic=False) if args.compile else model.bert) if masked else None

    def masked_loss_at(i):  # the head on the selected positions (a boolean index: one host sync, ours has none)
        batch = batches[i % len(batches)]
        with autocast:
            h = encoder(input_ids=batch["input_ids"]).last_hidden_state  # (B, T, D)
            selected = batch["labels"] != -100
            return torch.nn.functional.cross_entropy(model.cls(h[selected]), batch["labels"][selected])
    return training_step(masked_loss_at if masked else loss_at, params, cfg, device), params  # our optimizer, clip


def training_step(loss_at, params, cfg, device):
    optimizer = configure_optimizer(params, cfg, device.type)

    def step(i):
        loss_at(i).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, args, device):
    """(wall ms per step, process CPU ms per step, peak GB or None, wall ms per step of each window) over
    args.steps steps after args.warmup untimed ones, timed in up to 3 windows: their spread says how steady
    the mean is. CPU time (all threads) is the steadier measure on a shared CPU."""
    for i in range(args.warmup):  # compile happens here
        step(i)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    parts = [len(w) for w in torch.arange(args.steps).tensor_split(min(3, args.steps))]
    t, cpu_t, windows, i = time.perf_counter(), time.process_time(), [], 0
    for n in parts:
        t_window = time.perf_counter()
        for _ in range(n):
            step(i)
            i += 1
        sync(device)  # each window ends when its kernels do
        windows.append((time.perf_counter() - t_window) / n * 1e3)
    step_ms = (time.perf_counter() - t) / args.steps * 1e3
    cpu_ms = (time.process_time() - cpu_t) / args.steps * 1e3
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return step_ms, cpu_ms, peak_gb, windows


def top_events(events, self_time, n, steps):
    """The n events with the largest self time (microseconds, from self_time(event)), as rows of
    name, ms per step, share of the summed self time, calls per step."""
    total = sum(self_time(e) for e in events) or 1
    ranked = sorted(events, key=self_time, reverse=True)[:n]
    return [dict(name=e.key, ms_per_step=self_time(e) / steps / 1e3, share=self_time(e) / total,
                 calls_per_step=e.count / steps) for e in ranked if self_time(e) > 0]


def print_profile_table(title, rows):
    print(f"  {title}")
    print(f"    {'self ms/step':>12} {'share':>6} {'calls':>6}  name")
    for r in rows:
        print(f"    {r['ms_per_step']:12.3f} {r['share']:6.1%} {r['calls_per_step']:6.0f}  {r['name'][:90]}")


def where_time_goes(events, on_gpu, steps, n):
    """Top-n tables from a profiler's key_averages(). On a GPU: kernels by GPU time (and the
    kernels' total, the GPU's busy time) and ops by the GPU time of the kernels they launch; on a
    CPU: ops by self CPU time."""
    from torch.autograd import DeviceType
    if not on_gpu:
        return dict(ops=top_events(list(events), lambda e: e.self_cpu_time_total, n, steps))
    # GPU-side user annotations (record_function ranges) span kernels: counting them would count twice
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    return dict(gpu_busy_ms_per_step=sum(e.self_device_time_total for e in kernels) / steps / 1e3,
                kernels=top_events(kernels, lambda e: e.self_device_time_total, n, steps),
                ops=top_events(ops, lambda e: e.self_device_time_total, n, steps))


def profile_steps(step, args, device, label):
    """Profile args.profile_steps steps (after time_steps' warm-up), print where their time goes,
    write a chrome trace. Returns the tables as lists of rows."""
    from torch.profiler import ProfilerActivity, profile
    on_gpu = device.type == "cuda"
    steps = args.profile_steps
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        t = time.perf_counter()
        for i in range(steps):
            step(i)
        sync(device)
        wall_ms = (time.perf_counter() - t) / steps * 1e3
    result = dict(label=label, wall_ms_per_step=wall_ms,
                  **where_time_goes(prof.key_averages(), on_gpu, steps, args.profile_top))
    print(f"profile {label}: {steps} steps, {wall_ms:.1f} ms/step under the profiler")
    if on_gpu:
        busy_ms = result["gpu_busy_ms_per_step"]
        print(f"  GPU kernels busy {busy_ms:.1f} ms/step = {busy_ms / wall_ms:.0%} of the step (the rest: launch and "
              f"host overhead, syncs)")
        print_profile_table("top kernels by GPU time", result["kernels"])
        print_profile_table("top ops by self CUDA time (the kernels they launch directly)", result["ops"])
    else:
        print_profile_table("top ops by self CPU time", result["ops"])
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"trace_{label.replace(' ', '_')}.json.gz")
    tmp = path[:-len(".json.gz")] + ".tmp.json.gz"  # the .gz ending makes the export gzip it
    prof.export_chrome_trace(tmp)
    os.replace(tmp, path)
    print(f"  chrome trace: {path}", flush=True)
    result["trace"] = path
    return result


def build(name, size, args, device):
    """Build one run: name is an objective, "hf-mlm", "hf-masked" or a key of ABLATIONS. Returns (train step,
    params, cfg, config, start time)."""
    torch._dynamo.reset()  # a fresh compile cache per run: no stale graphs, no recompile limit across runs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    config = BertConfig(**MODEL_PRESETS[size], dropout=args.dropout)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    # one cfg for the step and its FLOPs count (taco_negatives, gen_shape and dropout change both)
    cfg = replace(TrainConfig(), objective=name if name in LOSSES else "mlm", seq_len=args.seq_len,
                  batch_size=args.batch_size, init_from="random weights", dropout=args.dropout,
                  taco_negatives=args.taco_negatives, gen_shape=args.gen_shape,
                  compile=bool(args.compile))  # TACO's fused negative scoring follows --compile
    if name in HF_RUNS:
        step, params = build_hf(cfg, config, args, device, autocast, masked=name == "hf-masked")
    else:
        step, params = build_ours(cfg, config, args, device, autocast, ablation=name)
    return step, params, cfg, config, t0


def summarise(name, size, args, device, built, timing):
    """The result row of a built run and its (wall ms, process CPU ms, peak GB) per step."""
    _, params, cfg, config, t0 = built
    step_ms, cpu_ms, peak_gb, *windows = timing  # --interleave: medians over rounds, no windows
    tokens_per_s = args.batch_size * args.seq_len / (step_ms / 1e3)
    flops = objective_flops_per_token(cfg.objective, config, cfg, args.seq_len)
    peak_flops = gpu_peak_flops(device) if device.type == "cuda" and flops else None
    return dict(model_size=size, objective=name, params_m=sum(p.numel() for p in params) / 1e6, batch=args.batch_size,
                seq=args.seq_len, compile=args.compile, dropout=args.dropout, gen_shape=args.gen_shape,
                dtype="bf16 autocast" if device.type == "cuda" else "fp32", step_ms=step_ms, cpu_ms=cpu_ms,
                tokens_per_s=tokens_per_s, model_tflops=tokens_per_s * flops / 1e12 if flops else None,
                mfu=tokens_per_s * flops / peak_flops if peak_flops else None, peak_mem_gb=peak_gb,
                step_ms_windows=windows[0] if windows else None, interleaved=args.interleave,
                # the windows' range over the mean step time: how steady the row is
                spread=(max(windows[0]) - min(windows[0])) / step_ms if windows and len(windows[0]) > 1 else None,
                # run_s: build + compile + steps (interleaved: every run's, so none)
                run_s=None if args.interleave else time.perf_counter() - t0)


def time_interleaved(steps, args):
    """CPU, --interleave: {name: (wall ms, process CPU ms, None)}, the medians over args.steps rounds of one
    step of each run in turn, after args.warmup rounds. Drift on a shared machine then hits every run alike."""
    for i in range(args.warmup):
        for step in steps.values():
            step(i)
    times = {name: [] for name in steps}
    for i in range(args.steps):
        for name, step in steps.items():
            t, cpu_t = time.perf_counter(), time.process_time()
            step(i)
            times[name].append(((time.perf_counter() - t) * 1e3, (time.process_time() - cpu_t) * 1e3))
    return {name: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts), None)
            for name, ts in times.items()}


HEADER = (f"{'size':6} {'objective':9} {'params':>7} {'tokens/s':>10} {'step ms':>9} {'vs mlm':>7} {'MFU':>6} "
          f"{'peak GB':>8} {'spread':>7}")


def table_row(r):
    vs = f"{r['vs_mlm']:.2f}x" if r["vs_mlm"] else "-"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    mem = f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "-"
    spread = f"{r['spread']:.1%}" if r.get("spread") is not None else "-"
    return (f"{r['model_size']:6} {r['objective']:9} {r['params_m']:6.1f}M {r['tokens_per_s']:10,.0f} "
            f"{r['step_ms']:9.1f} {vs:>7} {mfu:>6} {mem:>8} {spread:>7}")


HF_RUNS = ("hf-mlm", "hf-masked")


def hf_ratio(ours, hf):
    """Our MLM against Hugging Face's, measured in the same run."""
    ratio = dict(model_size=ours["model_size"], tokens_per_s_ratio=ours["tokens_per_s"] / hf["tokens_per_s"])
    mem = ""
    if ours["peak_mem_gb"] is not None:
        ratio["peak_mem_ratio"] = ours["peak_mem_gb"] / hf["peak_mem_gb"]
        mem = (f", {ratio['peak_mem_ratio']:.2f}x its peak memory ({ours['peak_mem_gb']:.2f} vs "
               f"{hf['peak_mem_gb']:.2f} GB)")
    else:  # on a CPU shared with other work, wall time swings; process CPU time much less
        ratio["cpu_time_ratio"] = hf["cpu_ms"] / ours["cpu_ms"]
        mem = f"; by process CPU time per step {ratio['cpu_time_ratio']:.2f}x"
    against = "Hugging Face's" if hf["objective"] == "hf-mlm" else "Hugging Face's, its head on the selected positions,"
    ratio.update(against=hf["objective"])
    ratio["line"] = (f"{ours['model_size']}: our MLM runs {ratio['tokens_per_s_ratio']:.2f}x {against} tokens/s "
                     f"({ours['tokens_per_s']:,.0f} vs {hf['tokens_per_s']:,.0f}){mem}")
    return ratio


def cpu_name():
    """The CPU's model name (/proc/cpuinfo on Linux, where platform.processor() is empty): CPU ratios depend on it
    (the tiny MLM-vs-Hugging-Face ratio was 4.4x on one 2-core machine, 3.3-3.9x on another), and the
    instruction set torch uses on it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    name = (names[0] if names else platform.processor()) or "cpu"
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"  # a VM's name can hide the model: AVX2, AVX512


def write_json(path, obj):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=1))


def main(argv=None):
    t_start = time.perf_counter()
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objectives", default="all", help=f"comma list of {', '.join(LOSSES)}, or all")
    p.add_argument("--model_size", default="small", help=f"comma list of {', '.join(MODEL_PRESETS)}")
    p.add_argument("--hf", action="store_true", help="also time transformers.BertForMaskedLM at each size")
    p.add_argument("--hf_masked", action="store_true", help="with --hf: also Hugging Face's encoder with its head "
                   "on the selected positions only, as ours (where the speed-up comes from)")
    p.add_argument("--ablate", action="store_true", help="also our MLM with each of model.py's speed features off: "
                   f"{', '.join(ABLATIONS)} (softmax attention written out, three Q/K/V Linears, the vocabulary unpadded)")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--taco_negatives", type=int, default=50)
    p.add_argument("--gen_shape", default="cocolm", choices=["cocolm", "electra"],
                   help="ELECTRA's and COCO-LM's generator (train.py's gen_shape): cocolm = same width, L/3 layers; "
                        "electra = full depth, 1/4 width (1/3 for base)")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (compile happens here)")
    p.add_argument("--dropout", type=float, default=0.1, help="0.1: BERT's, the presets' and Hugging Face's default")
    p.add_argument("--compile", type=int, default=1, choices=[0, 1, 2],
                   help="on CUDA (CPU runs stay eager): 0 eager, 1 compile the encoder and TACO's negative scoring "
                        "(train.py's choice), "
                        "2 compile the whole step")
    p.add_argument("--loader", action="store_true", help="include data loading (data.BlockLoader)")
    p.add_argument("--interleave", action="store_true",
                   help="CPU: build every run of a size, then time one step of each in turn (medians over --steps "
                        "rounds): ratios that a shared machine's drift does not skew")
    p.add_argument("--device", default="auto")
    p.add_argument("--profile", action="store_true", help="profile each run after timing it (see above)")
    p.add_argument("--profile_steps", type=int, default=3, help="steps under the profiler")
    p.add_argument("--profile_objectives", default="all", help="with --profile: the runs profiled, a comma list of "
                   "objectives and hf-mlm, or all")
    p.add_argument("--profile_top", type=int, default=12, help="rows per profile table")
    p.add_argument("--out_dir", default="out/bench", type=os.path.expanduser,  # ~ as train.py: `--out_dir=~/x`
                   help="--profile writes its chrome traces here")
    p.add_argument("--json", default="", type=os.path.expanduser, help="write the results here")
    args = p.parse_args(argv)

    # "all" anywhere in the list is every objective: "all,mlm" was refused as "unknown objective 'all' (choose
    # from ..., or all)"
    named, named_profiled = args.objectives.split(","), args.profile_objectives.split(",")
    objectives = list(LOSSES) if "all" in named else named
    sizes = args.model_size.split(",")
    for objective in named:  # the names beside "all" too: "all,mlmm" is a typo
        if objective not in LOSSES and objective != "all":
            p.error(f"unknown objective {objective!r} (choose from {', '.join(LOSSES)}, or all)")
    for size in sizes:
        if size not in MODEL_PRESETS:
            p.error(f"unknown model size {size!r} (choose from {', '.join(MODEL_PRESETS)})")
    for flag, names in (("objectives", objectives), ("model_size", sizes)):  # a name twice was timed twice, and
        twice = [n for n in names if names.count(n) > 1]  # under --interleave its second row failed with KeyError
        if twice:
            p.error(f"--{flag} {getattr(args, flag)}: {twice[0]} is named twice")
    runs = list(LOSSES) + list(HF_RUNS) + list(ABLATIONS)
    profiled = runs if "all" in named_profiled else named_profiled
    for name in named_profiled:
        if name not in runs and name != "all":
            p.error(f"--profile_objectives: unknown run {name!r} (choose from {', '.join(runs)}, or all)")
    # a run this call does not time was profiled by none, silently, exit 0 (e.g. --objectives mlm
    # --profile_objectives taco); without --profile the flag did nothing
    timed = objectives + ["hf-mlm"] * args.hf + ["hf-masked"] * args.hf_masked + list(ABLATIONS) * args.ablate
    if args.profile_objectives != "all" and not args.profile:
        p.error("--profile_objectives goes with --profile")
    untimed = [n for n in profiled if n not in timed] if args.profile and profiled is not runs else []
    if untimed:
        p.error(f"--profile_objectives {untimed[0]}: not a run this call times ({', '.join(timed)})")
    if args.hf_masked and not args.hf:
        p.error("--hf_masked goes with --hf")
    if args.ablate and "mlm" not in objectives:
        p.error("--ablate times our MLM with a feature off against our MLM: add mlm to --objectives")
    for name in ("batch_size", "seq_len", "steps", "profile_steps", "taco_negatives", "profile_top"):  # top 0 or -3:
        # an empty table, or all rows but the last 3
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
    if not 0 <= args.dropout < 1:  # NaN fails too
        p.error(f"--dropout {args.dropout}: must be in [0, 1)")
    if args.json and os.path.isdir(args.json):
        p.error(f"--json {args.json}: a directory; name the file to write, e.g. {os.path.join(args.json, 'bench.json')}")
    if args.json and os.path.exists(args.json) and not os.path.isfile(args.json):  # the atomic write's rename put a
        # regular file in place of /dev/null (as root) or a FIFO
        p.error(f"--json {args.json}: not a regular file (the JSON replaces it); leave --json out for no file")
    for flag, path in (("json", os.path.dirname(os.path.abspath(args.json)) if args.json else ""),
                       ("out_dir", args.out_dir if args.profile else "")):
        problem = path and dir_problem(path)
        if problem:
            p.error(f"--{flag} {getattr(args, flag)}: {path} {problem}")
    if args.seq_len < 3:
        p.error(f"--seq_len {args.seq_len}: must be >= 3 (a row is [CLS] + tokens + [SEP], as train.py's)")
    for objective in objectives:  # TACO's and COCO-LM's pool of negatives is the batch here: train.py's rule
        problem = pool_problem(replace(TrainConfig(), objective=objective, seq_len=args.seq_len,
                                       taco_negatives=args.taco_negatives), args.batch_size)
        if problem:
            p.error(f"--{problem[0]} with --objectives {objective}: {problem[1]}")
    if args.seq_len > BertConfig.max_position_embeddings:
        p.error(f"--seq_len {args.seq_len} exceeds max_position_embeddings {BertConfig.max_position_embeddings}")
    if args.loader and args.hf:
        p.error("--loader times our data loading only: not with --hf (Hugging Face's batches are prepared)")
    if args.hf:
        try:
            import transformers
        except ImportError:
            p.error("--hf needs the transformers package (pip install transformers)")
    try:
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(auto if args.device == "auto" else args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA GPU")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device {args.device}: bench.py times cpu or cuda")
    if device.type != "cuda":
        args.compile = 0  # CPU runs stay eager, as in train.py
        if args.device == "auto":
            print("note: no CUDA GPU, timing on the CPU (minutes per row at batch 256; see docs/efficiency.md's CPU commands)")
    if args.interleave and (device.type == "cuda" or args.profile):
        p.error("--interleave is for CPU timing, without --profile (it holds every run of a size at once)")
    if device.type == "cuda":  # TF32 matmuls: process-wide state, set only where it acts
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    info = dict(command="python bench.py " + " ".join(sys.argv[1:] if argv is None else argv), torch=torch.__version__,
                transformers=transformers.__version__ if args.hf else None,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
                threads=torch.get_num_threads())
    print(json.dumps(info), flush=True)
    print(f"batch {args.batch_size} x seq {args.seq_len}, dropout {args.dropout}, gen_shape {args.gen_shape}, "
          f"compile {args.compile}, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}, {args.warmup} warm-up + {args.steps} timed "
          + ("rounds, one step of each run in turn (step ms: the median)" if args.interleave else "steps"))
    # what a row measures: the table alone said "tokens/s" (of which tokens? which part of a step?)
    print(f"tokens/s: all {args.batch_size} x {args.seq_len} positions, masked or not, per full training step "
          f"(forward, backward, clip, optimizer); vs mlm: step time over our MLM's")
    print(HEADER, flush=True)
    results, ratios = [], []
    try:
        for size in sizes:
            # Hugging Face right after our MLM: the headline pair is measured first, back to back
            names = list(objectives)
            if args.hf:
                names.insert(names.index("mlm") + 1 if "mlm" in names else len(names), "hf-mlm")
                if args.hf_masked:
                    names.insert(names.index("hf-mlm") + 1, "hf-masked")
            if args.ablate:
                names += list(ABLATIONS)
            mlm_ms = None
            if args.interleave:
                built, unbuilt = {}, {}
                for name in names:
                    try:
                        built[name] = build(name, size, args, device)
                    except Exception as e:  # a failed row below, as without --interleave
                        unbuilt[name] = e
                timings = time_interleaved({name: b[0] for name, b in built.items()}, args)
            for name in names:
                try:
                    if args.interleave and name in unbuilt:
                        raise unbuilt[name]
                    run = built.pop(name) if args.interleave else build(name, size, args, device)
                    step = run[0]
                    r = summarise(name, size, args, device, run, timings[name] if args.interleave else
                                  time_steps(step, args, device))
                    mlm_ms = r["step_ms"] if name == "mlm" else mlm_ms
                    r["vs_mlm"] = r["step_ms"] / mlm_ms if mlm_ms else None
                    print(table_row(r), flush=True)
                    if args.profile and name in profiled:
                        try:
                            r["profile"] = profile_steps(step, args, device, f"{size} {name}")
                        except Exception as e:  # the timing stands
                            r["profile_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                            print(f"  profile failed: {r['profile_error']}", flush=True)
                except Exception as e:  # one run's failure (out of memory, a compile error) keeps the others' rows
                    r = dict(model_size=size, objective=name,
                             error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
                    print(f"{size:6} {name:9} failed: {r['error']}", flush=True)
                step = run = None  # frees the model before the next run is built
                results.append(r)
                if args.json:  # after every run, so a run cut off by a time limit keeps what it measured
                    write_json(args.json, dict(info=info, results=results, hf_ratios=ratios))
            done = {r["objective"]: r for r in results if r["model_size"] == size and "error" not in r}
            for hf in (h for h in HF_RUNS if "mlm" in done and h in done):
                ratios.append(hf_ratio(done["mlm"], done[hf]))
                print(ratios[-1]["line"], flush=True)
                if args.json:
                    write_json(args.json, dict(info=info, results=results, hf_ratios=ratios))
    except KeyboardInterrupt:  # Ctrl-C was a traceback from deep inside a step; the rows so far are on screen and in
        # --json (rewritten after each)
        kept = f"{args.json} holds the {len(results)} row(s) above" if args.json else "the rows above are kept"
        print(f"interrupted; {kept if results else 'no row finished'}", file=sys.stderr)
        sys.exit(130)
    if args.profile:  # the profiles interleaved the table: print it whole again
        print("\n" + HEADER)
        print("\n".join([table_row(r) if "error" not in r else f"{r['model_size']:6} {r['objective']:9} failed"
                         for r in results] + [ratio["line"] for ratio in ratios]))
    if args.json:
        write_json(args.json, dict(info=info, results=results, hf_ratios=ratios))
    failed = [f"{r['model_size']} {r['objective']}" for r in results if "error" in r]
    print(f"done in {time.perf_counter() - t_start:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""),
          flush=True)
    return results


if __name__ == "__main__":
    sys.stdout, sys.stderr = Console(sys.stdout), Console(sys.stderr)  # a closed `| head` does not lose --json
    sys.exit(1 if any("error" in r for r in main()) else 0)
