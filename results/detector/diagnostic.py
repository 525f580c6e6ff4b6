"""Can a replaced-token detector learn from context at the smoke scale? (docs/detectors.md: "Does each objective learn")

A detector trained alone, with no generator: 15% of the tokens of each block are replaced by tokens
drawn from the batch itself, so a replacement is as frequent as the token it replaces (token identity
tells nothing) and only context can give it away. Three encoders under ELECTRA's head
(dense -> GELU -> linear(1)), trained alike: AdamW (betas 0.9/0.98, eps 1e-6, weight decay 0.01 on
every parameter), lr * min(1, (step+1)/warmup) * (1 - step/steps), clipping at 1.0:
  bert    this project's model.Bert (--size tiny: 2 layers x 128, as the smoke preset)
  hf      transformers' BertModel, same size and initialisation
  window  an MLP over each token's embedding and its two neighbours' (no attention, no depth)
--init RUN_DIR starts the bert encoder from a train.py run instead. Prints, every 100 steps on fixed
held-out blocks (never-replaced [CLS] left out): BCE, the trivial BCE, AUC, the mean cosine between
the token states of one held-out batch (every pair, itself included; near 1: collapsed to one vector).

    python results/detector/diagnostic.py --encoder window --data AA.txt.xz --steps 1000
    python results/detector/diagnostic.py --init out/mlm --data AA.txt.xz --lr 1e-4 --prior_bias
    python results/detector/diagnostic.py --init out/mlm --data AA.txt.xz --attention   # where its attention looks
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from data import DEFAULT_DATA, prepare_data, special_token_ids  # noqa: E402
from losses import auc, binary_entropy, masked_bce  # noqa: E402
from model import MODEL_PRESETS, Bert, BertConfig  # noqa: E402


class Window(nn.Module):
    """h_t = LN(GELU(W [e_{t-1}; e_t; e_{t+1}])): bigram context, nothing else."""

    def __init__(self, vocab_size, D):
        super().__init__()
        self.emb, self.mlp = nn.Embedding(vocab_size, D), nn.Sequential(nn.Linear(3 * D, D), nn.GELU(), nn.LayerNorm(D))

    def forward(self, x):
        e = self.emb(x)
        return self.mlp(torch.cat([F.pad(e[:, :-1], (0, 0, 1, 0)), e, F.pad(e[:, 1:], (0, 0, 0, 1))], -1))


class HFEncoder(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, x):
        return self.hf(x).last_hidden_state


def encoder(kind, vocab_size, size, dropout=0.0, init=""):
    shape = MODEL_PRESETS[size]
    if init:  # a run directory of train.py: its encoder, with its own size and dropout
        return Bert.from_pretrained(init)
    if kind == "bert":
        return Bert(BertConfig(vocab_size=vocab_size, dropout=dropout, **shape))
    if kind == "hf":
        import transformers
        hf = transformers.BertModel(transformers.BertConfig(
            vocab_size=vocab_size, hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_layers"],
            num_attention_heads=shape["num_heads"], intermediate_size=shape["intermediate_size"],
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout), add_pooling_layer=False)
        return HFEncoder(hf)
    return Window(vocab_size, shape["hidden_size"])


def blocks(tokens, n, T, cls_id, gen, rate):
    """n random T-token windows of the stream, [CLS] first; (replaced ids, is-replaced) with the
    replacements drawn from the windows' own tokens."""
    starts = torch.randint(len(tokens) - T, (n,), generator=gen).tolist()
    x = torch.from_numpy(np.stack([tokens[s:s + T] for s in starts]).astype(np.int64))
    x[:, 0] = cls_id
    replace = torch.rand(x.shape, generator=gen) < rate
    replace[:, 0] = False
    pool = x[:, 1:].flatten()
    y = torch.where(replace, pool[torch.randint(len(pool), x.shape, generator=gen)], x)
    return y, y != x  # a draw equal to the original counts as original, as in ELECTRA


def attention_weights(attn, h):
    """softmax(q k^T / sqrt(d)) of a model.SelfAttention on h (B, T, D), unmasked: (B, heads, T, T)."""
    B, T, D = h.shape
    q, k, _ = attn.qkv(h).split(D, 2)
    q, k = (t.view(B, T, attn.num_heads, -1).transpose(1, 2) for t in (q, k))
    return (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).softmax(-1)


def neighbour_attention(model, x):
    """Per layer, the mean attention weight a token puts on itself and on its two neighbours
    (averaged over heads and blocks; uniform attention gives 1/T to each)."""
    h, T, rows = model.embeddings(x), x.size(1), []
    i = torch.arange(1, T - 1)
    for layer in model.encoder.layers:
        a = attention_weights(layer.attn, h)
        rows.append(dict(previous=a[..., i, i - 1].mean().item(), self=a[..., i, i].mean().item(),
                         next=a[..., i, i + 1].mean().item(), uniform=1 / T))
        h = layer(h)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--encoder", choices=("bert", "hf", "window"), default="bert")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--size", default="tiny", choices=tuple(MODEL_PRESETS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--rate", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--init", default="", help="start the bert encoder from this train.py run directory")
    p.add_argument("--attention", action="store_true", help="with --init: print its attention on neighbours, then exit")
    p.add_argument("--prior_bias", action="store_true", help="head bias starts at the log-odds of --rate")
    a = p.parse_args()
    if a.attention and not a.init:
        p.error("--attention reads a trained run: give it --init RUN_DIR")
    if a.init and a.encoder != "bert":
        p.error("--init starts the bert encoder from a run: it does not go with --encoder " + a.encoder)
    tok, train, val = prepare_data(a.data, tokenizer=a.init or None, vocab_size=8192)
    cls_id, V = special_token_ids(tok)["cls"], tok.get_vocab_size()
    torch.manual_seed(a.seed)
    if a.attention:
        model = Bert.from_pretrained(a.init).eval()
        x, _ = blocks(val, a.batch_size, a.seq_len, cls_id, torch.Generator().manual_seed(1234), 0.0)
        with torch.no_grad():
            for layer, row in enumerate(neighbour_attention(model, x)):
                print(json.dumps(dict(layer=layer, **{k: round(v, 4) for k, v in row.items()})))
        return
    model = encoder(a.encoder, V, a.size, a.dropout, a.init)
    D = model.config.hidden_size if a.init else MODEL_PRESETS[a.size]["hidden_size"]
    head = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, 1))
    head.apply(Bert._init_weights)
    if a.prior_bias:  # the constant part of the BCE is solved at step 0
        nn.init.constant_(head[-1].bias, math.log(a.rate / (1 - a.rate)))
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    gen, val_gen = torch.Generator().manual_seed(a.seed), torch.Generator().manual_seed(1234)
    held_out = [blocks(val, a.batch_size, a.seq_len, cls_id, val_gen, a.rate) for _ in range(8)]
    not_cls = torch.ones(a.batch_size * 8, a.seq_len, dtype=torch.bool)
    not_cls[:, 0] = False
    for step in range(a.steps + 1):
        if step % 100 == 0 or step == a.steps:
            model.eval()
            with torch.no_grad():
                h = torch.cat([model(y) for y, _ in held_out])
                logit, replaced = head(h).squeeze(-1), torch.cat([r for _, r in held_out])
                hn = F.normalize(h[:a.batch_size].flatten(0, 1), dim=-1)
            model.train()
            print(json.dumps(dict(step=step, bce=round(masked_bce(logit, replaced, not_cls).item(), 4),
                                  trivial=round(binary_entropy(replaced[not_cls].float().mean()).item(), 4),
                                  auc=round(auc(logit, replaced, not_cls).item(), 4),
                                  cos=round((hn @ hn.T).mean().item(), 3))), flush=True)
        if step == a.steps:
            break
        for group in opt.param_groups:
            group["lr"] = a.lr * min(1, (step + 1) / a.warmup) * (1 - step / a.steps)
        y, replaced = blocks(train, a.batch_size, a.seq_len, cls_id, gen, a.rate)
        mask = torch.ones_like(replaced)
        mask[:, 0] = False
        loss = masked_bce(head(model(y)).squeeze(-1), replaced, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()


if __name__ == "__main__":
    main()
