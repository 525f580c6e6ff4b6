"""
Representation analysis: the pictures each paper draws of its representation space,
computed the same way for every model given, so objectives can be compared side by side.

- TACO (Fu et al. 2022, Fig. 3/6, App. A.3): contextual score = intra-context minus
  inter-context cosine of last-layer token states, on unmasked input. For every token one
  partner is drawn from its own context and one from another context. Alongside, the
  distance version of the same comparison (our reading of TACO's Table 9, whose exact
  definition we could not retrieve): l1_ratio = mean L1 distance to the inter-context
  partner / mean L1 distance to the intra-context partner, l2_ratio likewise; > 1 means a
  token sits closer to its own context. Plus the cosine of WordSim353 pairs' static word
  embeddings (TACO Fig. 3a).
- TaCL (Su et al. 2022): layer-wise self-similarity (mean pairwise cosine of the tokens of
  one sentence, [CLS]/[SEP] excluded) and a token x token cosine heatmap.
- COCO-LM (Meng et al. 2021, Fig. 1): cosine of [CLS] and of mean-pooled sentence vectors
  for random sentence pairs vs STS-B pairs with the top score 5.0.
- Static embeddings: Spearman correlation with WordSim353 / SimLex-999 human scores;
  isotropy: mean cosine of random token pairs across the corpus (Ethayarajh 2019).

Training-time hooks (cheap): contextual_score() and wordsim_similarity(). There a context
is one packed [CLS] ... [SEP] block; in --analysis it is one held-out sentence, so the training
log's contextual_score and analysis.json's are on different scales.
Entry points: run_analysis(args) and plot_logs(paths, out).
"""
import argparse
import json
import math
import os
import random
import re

import numpy as np
import torch
import torch.nn.functional as F

import data
from model import Bert

ANALYSIS_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data")
HELD_OUT_TEXT = "corpus/wikitext2_raw_test/wiki.test.raw"  # relative to ANALYSIS_DATA
WORDSIM353 = os.path.join(ANALYSIS_DATA, "wordsim353", "combined.csv")  # train.py's wordsim_cooc_sim
ENCODE_BATCH = 64  # sentences per forward pass; memory is dominated by all_layers=True
# run_analysis's settings where args leaves them out (eval.py's parser may not define them all)
ANALYSIS_DEFAULTS = dict(model=None, out=None, text=None, num_sentences=1000, max_len=128,
                         analysis_data=ANALYSIS_DATA, seed=0, device=None)


# ----------------------------------------------------------------------------------
# Statistics on token representations


def sample_context_partners(context_id, gen):
    """For every token, one other token of its own context (intra) and one token of any
    other context (inter), each uniform. context_id (N,) long; returns two (N,) index
    tensors, -1 where no partner exists (a one-token context, or a single context)."""
    N, device = context_id.numel(), context_id.device
    order = torch.argsort(context_id, stable=True)  # make each context a contiguous run
    sorted_id = context_id[order]
    first = torch.ones(N, dtype=torch.bool, device=device)
    first[1:] = sorted_id[1:] != sorted_id[:-1]
    group = first.long().cumsum(0) - 1  # context number of each sorted token
    counts, starts = torch.bincount(group), torch.arange(N, device=device)[first]
    n, start = counts[group], starts[group]
    offset = torch.arange(N, device=device) - start  # rank of each token inside its context
    u = torch.rand(2, N, generator=gen, device=gen.device).to(device)
    # intra: draw r among the n-1 others, then skip over the token itself
    r = torch.minimum((u[0] * (n - 1)).long(), (n - 2).clamp(min=0))
    intra = torch.where(n >= 2, start + r + (r >= offset).long(), -1)
    # inter: draw r among the N-n tokens outside the context, then skip over the context
    r = torch.minimum((u[1] * (N - n)).long(), (N - n - 1).clamp(min=0))
    inter = torch.where(N - n >= 1, r + n * (r >= start).long(), -1)
    # back from sorted positions to the caller's indexing
    to_orig = lambda idx: torch.where(idx >= 0, order[idx.clamp(min=0)], -1)
    out_intra, out_inter = torch.empty_like(intra), torch.empty_like(inter)
    out_intra[order], out_inter[order] = to_orig(intra), to_orig(inter)
    return out_intra, out_inter


def context_similarity(hidden, context_id, gen, distances=True):
    """TACO's contextual score on token states hidden (N, D) grouped by context_id (N,),
    with the L1/L2 distance ratios unless distances=False. Only tokens that have both
    partners count, so intra and inter average over the same tokens."""
    intra, inter = sample_context_partners(context_id, gen)
    keep = (intra >= 0) & (inter >= 0)
    if not keep.any():
        nan = float("nan")
        return dict(intra=nan, inter=nan, contextual=nan, l1_intra=nan, l1_inter=nan, l1_ratio=nan,
                    l2_intra=nan, l2_inter=nan, l2_ratio=nan, num_tokens=0)
    h = hidden.float()
    anchor, same, other = h[keep], h[intra[keep]], h[inter[keep]]
    stats = dict(intra=F.cosine_similarity(anchor, same, dim=-1).mean().item(),
                 inter=F.cosine_similarity(anchor, other, dim=-1).mean().item())
    stats["contextual"] = stats["intra"] - stats["inter"]
    for p in (1, 2) if distances else ():
        near = (anchor - same).norm(p=p, dim=-1).mean().item()
        far = (anchor - other).norm(p=p, dim=-1).mean().item()
        stats.update({f"l{p}_intra": near, f"l{p}_inter": far, f"l{p}_ratio": far / max(near, 1e-12)})
    stats["num_tokens"] = int(keep.sum())
    return stats


def random_pair_cosine(hidden, gen):
    """Isotropy: mean cosine between each token and one uniformly drawn other token (N, D)."""
    N = hidden.size(0)
    if N < 2:
        return float("nan")
    r = torch.minimum((torch.rand(N, generator=gen, device=gen.device).to(hidden.device) * (N - 1)).long(),
                      torch.tensor(N - 2, device=hidden.device))
    partner = r + (r >= torch.arange(N, device=hidden.device)).long()  # skip the token itself
    return F.cosine_similarity(hidden.float(), hidden[partner].float(), dim=-1).mean().item()


def sentence_self_similarity(hidden, token_mask):
    """TaCL's self-similarity: mean pairwise cosine (i != j) among the tokens of each
    sentence. hidden (B, T, D), token_mask (B, T) bool. Returns (B,) values and (B,) valid
    (sentences with at least two tokens)."""
    unit = F.normalize(hidden.float(), dim=-1) * token_mask[..., None]
    n = token_mask.sum(1).float()
    # sum_ij cos_ij = |sum_i u_i|^2; subtract the diagonal sum_i |u_i|^2
    off_diagonal = unit.sum(1).pow(2).sum(-1) - unit.pow(2).sum((1, 2))
    return off_diagonal / (n * (n - 1)).clamp(min=1), n >= 2


def spearman(x, y):
    """Spearman rank correlation with average ranks for ties (as scipy.stats.spearmanr)."""
    def rank(a):
        a = np.asarray(a, dtype=np.float64)
        ranks = np.empty(len(a))
        ranks[np.argsort(a, kind="mergesort")] = np.arange(len(a))
        _, tie_group = np.unique(a, return_inverse=True)
        return (np.bincount(tie_group, ranks) / np.bincount(tie_group))[tie_group]
    if len(x) < 2:
        return float("nan")
    rx, ry = rank(x), rank(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else float("nan")


# ----------------------------------------------------------------------------------
# Training-time hooks: cheap enough to run at every eval interval


@torch.no_grad()
def contextual_score(model, input_ids, gen, special_ids):
    """TACO's contextual score on a batch of packed [CLS] ... [SEP] blocks (B, T): each
    block is one context, every non-special position one token, no masking (App. A.3).
    special_ids: data.special_token_ids(tok) dict, or any iterable of ids.
    Returns dict(intra=, inter=, contextual=) of floats."""
    ids = list(special_ids.values()) if isinstance(special_ids, dict) else list(special_ids)
    was_training = model.training
    model.eval()  # dropout would lower intra-context similarity
    try:
        hidden = model(input_ids)
    finally:
        model.train(was_training)
    real = ~torch.isin(input_ids, torch.tensor(ids, device=input_ids.device))
    block = torch.arange(input_ids.size(0), device=input_ids.device)[:, None].expand_as(input_ids)
    stats = context_similarity(hidden[real], block[real], gen, distances=False)
    return {k: stats[k] for k in ("intra", "inter", "contextual")}


def read_word_pairs(path):
    """(word1, word2, human score) from WordSim353 combined.csv (comma, header line) or
    SimLex-999 (tab, '#' comments); lines without a numeric third field are skipped."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = [p.strip() for p in re.split(r"[,\t]", line.strip())]
            if line.startswith("#") or len(parts) < 3:
                continue
            try:
                pairs.append((parts[0], parts[1], float(parts[2])))
            except ValueError:
                continue  # the header
    return pairs


def single_token_id(tok, word):
    """The word's id if the tokenizer keeps it as one known token, else None."""
    ids = tok.encode(word, add_special_tokens=False).ids
    return ids[0] if len(ids) == 1 and ids[0] != tok.token_to_id("[UNK]") else None


@torch.no_grad()
def word_pair_similarity(model, tok, path):
    """Cosine of the static word-embedding rows of each pair whose two words are single
    tokens. Returns dict(pairs=, covered=, coverage=, cos=[...], human=[...], same=[...])."""
    pairs = read_word_pairs(path)
    ids = [(single_token_id(tok, a), single_token_id(tok, b), score, a.lower() == b.lower()) for a, b, score in pairs]
    ids = [p for p in ids if p[0] is not None and p[1] is not None]
    weight = model.embeddings.word.weight.float()
    if ids:
        a, b = torch.tensor([p[0] for p in ids]), torch.tensor([p[1] for p in ids])
        cos = F.cosine_similarity(weight[a.to(weight.device)], weight[b.to(weight.device)], dim=-1).tolist()
    else:
        cos = []
    return dict(pairs=len(pairs), covered=len(ids), coverage=len(ids) / max(len(pairs), 1), cos=cos,
                human=[p[2] for p in ids], same=[p[3] for p in ids])


def wordsim_similarity(model, tok, path=WORDSIM353):
    """TACO Fig. 3a: mean cosine of the static word embeddings of WordSim353 pairs (both
    words single tokens; identical-word pairs such as tiger/tiger left out, their cosine
    is 1 by construction). None when the file is missing or no pair is covered."""
    if not path or not os.path.isfile(path):
        return None
    return _distinct_pair_mean(word_pair_similarity(model, tok, path))


def _distinct_pair_mean(sim):
    cos = [c for c, same in zip(sim["cos"], sim["same"]) if not same]
    return sum(cos) / len(cos) if cos else None


# ----------------------------------------------------------------------------------
# Held-out text, tokenizers, encoding


def split_sentences(text):
    """Cheap sentence splitter for WikiText-style prose (undoes its @-@ escapes): a new
    sentence starts after . ! or ? and a capital (any letter in lowercased text)."""
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    starts = "A-Z" if text != text.lower() else "a-z0-9"  # text decoded by an uncased tokenizer
    return [s.strip() for s in re.split(rf"(?<=[.!?])\s+(?=[{starts}\"'(\[])", text) if s.strip()]


def load_sentences(documents, num_sentences, seed=0, min_words=5):
    """A seeded sample of sentences (>= min_words words) from lines/documents of text."""
    sentences = []
    for doc in documents:
        doc = doc.strip()
        if not doc or (doc.startswith("=") and doc.endswith("=")):  # WikiText section headings
            continue
        sentences += [s for s in split_sentences(doc) if len(s.split()) >= min_words]
    if len(sentences) > num_sentences:
        sentences = random.Random(seed).sample(sentences, num_sentences)
    return sentences


def held_out_documents(text_path, model_path):
    """Held-out text: --text, else the run's own validation split through data.py (decoded back
    to text so every model re-tokenizes it), else WikiText-2 test from the shared data (a Hugging
    Face directory has no validation split)."""
    if text_path:
        if not os.path.isfile(text_path):
            raise ValueError(f"--text {text_path}: no such file")
        with open(text_path, encoding="utf-8") as f:
            return f.read().splitlines(), text_path
    run_dir = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    try:  # train.py's first log line holds data.prepare_data's arguments under their names
        with open(os.path.join(run_dir, "log.jsonl")) as f:
            cfg = json.loads(f.readline())["config"]
        tok, _, val = data.prepare_data(cfg["data"], cfg["cache_dir"], run_dir, cfg["vocab_size"], cfg["val_fraction"])
    except Exception as e:
        default = os.path.join(ANALYSIS_DATA, HELD_OUT_TEXT)
        if os.path.isfile(default):
            with open(default, encoding="utf-8") as f:
                return f.read().splitlines(), os.path.normpath(default)
        raise ValueError(f"no held-out text: pass --text FILE (validation split of {run_dir} unavailable: "
                         f"{type(e).__name__}: {e})") from None
    stream = np.asarray(val[:2_000_000]).astype(np.int64)
    cuts = np.flatnonzero(stream == tok.token_to_id("[SEP]"))
    docs = np.split(stream, cuts + 1)
    return [tok.decode(d.tolist()) for d in docs if len(d) > 1], f"{run_dir} validation split"


def load_tokenizer(model_path):
    """The tokenizer of a run directory, a Hugging Face directory, or a ckpt.pt's directory."""
    return data.load_tokenizer(model_path if os.path.isdir(model_path) else os.path.dirname(model_path))


def tokenize(tok, sentences, max_len):
    """[CLS] + word pieces (truncated) + [SEP]; specials added by hand, so a tokenizer
    without a BERT post-processor gives the same ids."""
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    return [[cls] + tok.encode(s, add_special_tokens=False).ids[:max_len - 2] + [sep] for s in sentences]


@torch.no_grad()
def encode(model, sequences, pad_id, device="cpu"):
    """Run the model over [CLS] ... [SEP] id lists (one sentence each), without masking.
    Returns dict: tokens (N, D) last-layer states of the non-special tokens, sentence (N,)
    their sentence index, cls (S, D), mean (S, D) mean over non-special tokens,
    self_similarity (L+1,) per layer (0 = embeddings) averaged over sentences."""
    S = len(sequences)
    order = sorted(range(S), key=lambda i: len(sequences[i]))  # similar lengths: little padding
    tokens, sentence, cls, mean = [], [], [None] * S, [None] * S
    self_sim_sum, self_sim_count = None, 0
    for k in range(0, S, ENCODE_BATCH):
        idx = order[k:k + ENCODE_BATCH]
        T = max(len(sequences[i]) for i in idx)
        ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
        lengths = torch.tensor([len(sequences[i]) for i in idx])
        attention_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        # tokens = everything but [CLS] (position 0), [SEP] (last) and padding
        token_mask = (torch.arange(T)[None, :] >= 1) & (torch.arange(T)[None, :] < lengths[:, None] - 1)
        layers = model(ids.to(device), attention_mask=attention_mask.to(device), all_layers=True)
        layers = [h.float().cpu() for h in layers]
        values = torch.stack([sentence_self_similarity(h, token_mask)[0] for h in layers])  # (L+1, B)
        valid = token_mask.sum(1) >= 2
        layer_sums = values[:, valid].sum(1)
        self_sim_sum = layer_sums if self_sim_sum is None else self_sim_sum + layer_sums
        self_sim_count += int(valid.sum())
        last = layers[-1]
        tokens.append(last[token_mask])
        sentence.append(torch.tensor(idx)[:, None].expand_as(token_mask)[token_mask])
        pooled = (last * token_mask[..., None]).sum(1) / token_mask.sum(1, keepdim=True).clamp(min=1)
        for row, i in enumerate(idx):
            cls[i], mean[i] = last[row, 0], pooled[row]
    return dict(tokens=torch.cat(tokens), sentence=torch.cat(sentence), cls=torch.stack(cls), mean=torch.stack(mean),
                self_similarity=(self_sim_sum / max(self_sim_count, 1)).tolist())


def read_stsb(glue_dir):
    """(sentence1, sentence2, score) rows of STS-B train + dev (GLUE TSV, no quoting)."""
    rows = []
    for split in ("train.tsv", "dev.tsv"):
        path = os.path.join(glue_dir, split)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            next(f)  # header
            for line in f:
                cols = line.rstrip("\n").split("\t")
                if len(cols) >= 10:
                    rows.append((cols[7], cols[8], float(cols[9])))
    return rows


def sentence_pair_similarity(model, tok, rows, max_len, device, seed=0):
    """COCO-LM Fig. 1: cosine of [CLS] and mean-pooled vectors for the STS-B pairs scored
    5.0 and for as many (at least 300) random pairs of STS-B sentences, each sentence
    encoded on its own."""
    similar = [(a, b) for a, b, score in rows if score >= 5.0]
    pool = sorted({s for a, b, _ in rows for s in (a, b)})
    rng = random.Random(seed)
    random_pairs = [tuple(rng.sample(pool, 2)) for _ in range(max(len(similar), 300))]
    sentences = sorted({s for pair in similar + random_pairs for s in pair})
    where = {s: i for i, s in enumerate(sentences)}
    enc = encode(model, tokenize(tok, sentences, max_len), tok.token_to_id("[PAD]"), device)
    out = {"num_similar_pairs": len(similar), "num_random_pairs": len(random_pairs)}
    for pooling in ("cls", "mean"):
        vectors = enc[pooling]
        for name, pairs in (("similar", similar), ("random", random_pairs)):
            a = torch.tensor([where[p[0]] for p in pairs], dtype=torch.long)
            b = torch.tensor([where[p[1]] for p in pairs], dtype=torch.long)
            out[f"{pooling}_{name}"] = F.cosine_similarity(vectors[a], vectors[b], dim=-1).tolist()
    return out


# ----------------------------------------------------------------------------------
# run_analysis: every statistic for every model, then the plots


def _labels(paths):
    """Legend names: the run directory's name, or more of the path where names collide."""
    dirs = [os.path.normpath(p if os.path.isdir(p) or not os.path.basename(p).endswith(".pt") else os.path.dirname(p))
            for p in paths]
    names = [os.path.basename(d) for d in dirs]
    return [d if names.count(n) > 1 else n for d, n in zip(dirs, names)]


def _mean(values):
    return sum(values) / len(values) if values else None


def _finite(obj):
    """NaN -> None, so analysis.json stays strict JSON (a one-sentence context has no score)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and math.isnan(obj) else obj


@torch.no_grad()
def analyze_model(model, tok, sentences, max_len, device, seed, data_dir, heatmap_sentence):
    """All numbers for one model (a JSON-ready dict) and the raw values the plots need."""
    enc = encode(model, tokenize(tok, sentences, max_len), tok.token_to_id("[PAD]"), device)
    gen = torch.Generator().manual_seed(seed)
    result = {"num_sentences": len(sentences), "num_tokens": int(enc["tokens"].size(0))}
    result["contextual"] = context_similarity(enc["tokens"], enc["sentence"], gen)
    result["isotropy_random_pair_cos"] = random_pair_cosine(enc["tokens"], gen)
    result["self_similarity_per_layer"] = enc["self_similarity"]
    raw = {}
    # token x token cosine of one sentence (TaCL), non-special tokens only
    ids = tokenize(tok, [heatmap_sentence], max_len)[0]
    h = model(torch.tensor([ids], device=device))[0, 1:-1].float().cpu()
    unit = F.normalize(h, dim=-1)
    raw["heatmap"] = (unit @ unit.T).numpy()
    raw["heatmap_tokens"] = [tok.id_to_token(i) for i in ids[1:-1]]
    # static word embeddings
    for name, rel in (("wordsim353", "wordsim353/combined.csv"), ("simlex999", "simlex999/simlex999.txt")):
        path = os.path.join(data_dir, rel)
        if not os.path.isfile(path):
            result[name] = None
            continue
        sim = word_pair_similarity(model, tok, path)
        raw[name] = sim
        result[name] = dict(pairs=sim["pairs"], covered=sim["covered"], coverage=sim["coverage"],
                            spearman=spearman(sim["cos"], sim["human"]),
                            mean_cos=_distinct_pair_mean(sim))
    # sentence pairs (COCO-LM)
    rows = read_stsb(os.path.join(data_dir, "glue", "STS-B"))
    if rows:
        pairs = sentence_pair_similarity(model, tok, rows, max_len, device, seed)
        raw["sentence_pairs"] = pairs
        result["sentence_similarity"] = {k: (_mean(v) if isinstance(v, list) else v) for k, v in pairs.items()}
        for pooling in ("cls", "mean"):
            s = result["sentence_similarity"]
            s[f"{pooling}_gap"] = s[f"{pooling}_similar"] - s[f"{pooling}_random"]
    else:
        result["sentence_similarity"] = None
    return result, raw


def run_analysis(args):
    """eval.py --analysis. Reads args.model (run dirs, HF dirs or ckpt.pt files), args.out
    (default: the first model's directory) and args.text; optional: num_sentences, max_len,
    analysis_data, seed, device. Writes analysis.json and the analysis_*.png plots into
    out and returns the results dict."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    args = argparse.Namespace(**{**ANALYSIS_DEFAULTS, **given})
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    models = [args.model] if isinstance(args.model, str) else list(args.model or [])
    if not models:
        raise ValueError("--analysis needs --model DIR [DIR ...]")
    out = args.out or (models[0] if os.path.isdir(models[0]) else os.path.dirname(models[0]) or ".")
    os.makedirs(out, exist_ok=True)
    documents, text_source = held_out_documents(args.text, models[0])
    sentences = load_sentences(documents, args.num_sentences, args.seed)
    if len(sentences) < 2:
        raise ValueError(f"{text_source}: fewer than 2 sentences of 5+ words")
    # one readable sentence for the heatmap, the same text for every model
    heatmap_sentence = next((s for s in sentences if 8 <= len(s.split()) <= 16), sentences[0])
    results = {"text": text_source, "num_sentences": len(sentences), "seed": args.seed, "max_len": args.max_len,
               "heatmap_sentence": heatmap_sentence, "models": {}}
    raws = {}
    for label, path in zip(_labels(models), models):
        print(f"analysing {path}")
        model = Bert.from_pretrained(path).to(device).eval()
        result, raws[label] = analyze_model(model, load_tokenizer(path), sentences, args.max_len, device,
                                            args.seed, args.analysis_data, heatmap_sentence)
        results["models"][label] = {"path": path, **result}
        del model
    with open(os.path.join(out, "analysis.json"), "w") as f:
        json.dump(_finite(results), f, indent=2)
    plot_contextual(results, os.path.join(out, "analysis_contextual.png"))
    plot_self_similarity(results, os.path.join(out, "analysis_self_similarity.png"))
    plot_heatmaps(raws, heatmap_sentence, os.path.join(out, "analysis_heatmap.png"))
    plot_sentence_similarity(raws, os.path.join(out, "analysis_sentence_similarity.png"))
    plot_word_similarity(results, raws, os.path.join(out, "analysis_word_similarity.png"))
    print_summary(results)
    print(f"wrote analysis.json and analysis_*.png to {out}")
    return results


def print_summary(results):
    print(f"{'model':<24} {'intra':>6} {'inter':>6} {'ctx':>6} {'L1r':>5} {'L2r':>5} {'iso':>6} "
          f"{'ws_cos':>6} {'ws_rho':>6} {'sl_rho':>6} {'cls_gap':>7} {'mean_gap':>8}")
    fmt = lambda v, w: f"{v:>{w}.3f}" if isinstance(v, float) and not math.isnan(v) else f"{'-':>{w}}"
    for label, r in results["models"].items():
        c, ws, sl, ss = r["contextual"], r["wordsim353"] or {}, r["simlex999"] or {}, r["sentence_similarity"] or {}
        print(f"{label[-24:]:<24} {fmt(c['intra'], 6)} {fmt(c['inter'], 6)} {fmt(c['contextual'], 6)} "
              f"{fmt(c['l1_ratio'], 5)} {fmt(c['l2_ratio'], 5)} {fmt(r['isotropy_random_pair_cos'], 6)} "
              f"{fmt(ws.get('mean_cos'), 6)} {fmt(ws.get('spearman'), 6)} {fmt(sl.get('spearman'), 6)} "
              f"{fmt(ss.get('cls_gap'), 7)} {fmt(ss.get('mean_gap'), 8)}")


# ----------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: works on headless training machines
    import matplotlib.pyplot as plt
    return plt


def _grouped_bars(ax, groups, series, colors):
    """groups: x tick labels; series: {legend label: [value per group]} (None = missing)."""
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        x = np.arange(len(groups)) + (k - (len(series) - 1) / 2) * width
        heights = [np.nan if v is None else v for v in values]
        bars = ax.bar(x, heights, width, label=label, color=colors[k % len(colors)])
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.axhline(0, color="black", linewidth=0.6)


def plot_contextual(results, path):
    plt = _pyplot()
    colors = plt.cm.tab10.colors
    models = results["models"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw=dict(width_ratios=[2, 1]))
    groups = ["intra-context", "inter-context", "contextual score\n(intra - inter)", "random pairs\n(isotropy)"]
    _grouped_bars(left, groups, {label: [r["contextual"]["intra"], r["contextual"]["inter"], r["contextual"]["contextual"],
                                         r["isotropy_random_pair_cos"]] for label, r in models.items()}, colors)
    left.set_ylabel("mean cosine, last layer")
    left.set_title("Token similarity within vs across sentences (TACO)")
    _grouped_bars(right, ["L1", "L2"], {label: [r["contextual"]["l1_ratio"], r["contextual"]["l2_ratio"]]
                                        for label, r in models.items()}, colors)
    right.axhline(1, color="gray", linestyle="--", linewidth=0.8)
    right.set_ylabel("inter / intra mean distance")
    right.set_title("Distance ratio (> 1: closer to own sentence)")
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=min(len(models), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_self_similarity(results, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, r in results["models"].items():
        values = r["self_similarity_per_layer"]
        ax.plot(range(len(values)), values, marker="o", label=label)
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("mean pairwise cosine within a sentence")
    ax.set_title("Layer-wise self-similarity (TaCL), [CLS]/[SEP] excluded")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heatmaps(raws, sentence, path):
    plt = _pyplot()
    labels = list(raws)
    n_tokens = max(len(raws[l]["heatmap_tokens"]) for l in labels)
    size = max(4.0, 0.28 * n_tokens + 1.5)
    fig, axes = plt.subplots(1, len(labels), figsize=(size * len(labels) + 1, size + 0.8), squeeze=False,
                             layout="constrained")
    vmin = min(0.0, min(float(raws[l]["heatmap"].min()) for l in labels))
    for ax, label in zip(axes[0], labels):
        tokens = raws[label]["heatmap_tokens"]
        image = ax.imshow(raws[label]["heatmap"], vmin=vmin, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="cosine, last layer")
    short = sentence if len(sentence) <= 100 else sentence[:97] + "..."
    fig.suptitle(f"Token x token cosine (TaCL): \"{short}\"", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sentence_similarity(raws, path):
    plt = _pyplot()
    labels = [l for l in raws if "sentence_pairs" in raws[l]]
    fig, axes = plt.subplots(2, max(len(labels), 1), figsize=(4.2 * max(len(labels), 1), 6.5), squeeze=False)
    if not labels:
        for ax in axes.flat:
            ax.text(0.5, 0.5, "STS-B not found", ha="center", va="center")
            ax.set_axis_off()
    for col, label in enumerate(labels):
        pairs = raws[label]["sentence_pairs"]
        for row, (pooling, name) in enumerate((("cls", "[CLS]"), ("mean", "mean-pooled"))):
            ax = axes[row, col]
            rand, sim = pairs[f"{pooling}_random"], pairs[f"{pooling}_similar"]
            low, high = min(min(rand), min(sim)), max(1.0, max(rand), max(sim))  # rounding can give 1 + 1e-7
            bins = np.linspace(min(low, high - 1e-3), high, 40)
            # fractions, not densities: comparable heights however narrow the cosine range
            ax.hist(rand, bins=bins, weights=np.full(len(rand), 1 / len(rand)), alpha=0.6, color="tab:gray",
                    label=f"random pairs (mean {np.mean(rand):.3f})")
            ax.hist(sim, bins=bins, weights=np.full(len(sim), 1 / len(sim)), alpha=0.6, color="tab:red",
                    label=f"STS-B score 5 (mean {np.mean(sim):.3f})")
            ax.ticklabel_format(axis="x", useOffset=False)
            ax.set_xlabel(f"cosine of {name} vectors")
            ax.set_ylabel("fraction of pairs")
            ax.set_title(label if row == 0 else "", fontsize=10)
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Sentence similarity: random vs semantically similar pairs (COCO-LM)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_word_similarity(results, raws, path):
    plt = _pyplot()
    colors = plt.cm.tab10.colors
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, label in enumerate(raws):
        sim = raws[label].get("wordsim353")
        if sim:
            left.scatter(sim["human"], sim["cos"], s=10, alpha=0.6, color=colors[k % len(colors)],
                         label=f"{label} ({sim['covered']}/{sim['pairs']} pairs)")
    left.set_xlabel("WordSim353 human score")
    left.set_ylabel("cosine of static word embeddings")
    left.set_title("WordSim353 pairs, single-token words")
    if left.has_data():
        left.legend(fontsize=8)
    else:
        left.text(0.5, 0.5, "WordSim353 not found", ha="center", va="center", transform=left.transAxes)
    series = {}
    for label, r in results["models"].items():
        ws, sl = r["wordsim353"] or {}, r["simlex999"] or {}
        series[label] = [ws.get("spearman"), sl.get("spearman"), ws.get("mean_cos")]
    _grouped_bars(right, ["WordSim353\nSpearman", "SimLex-999\nSpearman", "WordSim353\nmean cosine"], series, colors)
    right.set_title("Static embedding quality")
    right.set_ylabel("value")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------
# Training curves of several runs


def read_log(path):
    """{key: (steps, values)} of every numeric key in a log.jsonl; the first line (config)
    and unparsable lines (a run killed mid-write) are skipped; a resumed run's repeated
    steps keep the latest value."""
    series = {}
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict) or "step" not in record:
                continue
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    series.setdefault(key, {})[record["step"]] = value
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in series.items()}


def plot_logs(paths, out):
    """eval.py --plot_log: one subplot per numeric key, one line per run (legend = run
    directory). out: a .png path or a directory (written as training_curves.png)."""
    plt = _pyplot()
    path = out if out and out.endswith(".png") else os.path.join(out or ".", "training_curves.png")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    logs = {label: read_log(p) for label, p in zip(_labels([os.path.dirname(os.path.abspath(p)) for p in paths]), paths)}
    keys = []
    for log in logs.values():
        keys += [k for k in log if k not in keys]
    # training terms, then held-out metrics, then representation scores, then bookkeeping
    bookkeeping = ("lr", "tokens_per_s", "elapsed_s", "mfu", "grad_norm")
    keys.sort(key=lambda k: 3 if k in bookkeeping else 2 if k in ("contextual_score", "wordsim_cooc_sim")
              else 1 if k.startswith("val_") else 0)
    if not keys:
        raise ValueError(f"no numeric log lines in {', '.join(paths)}")
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.4 * nrows + 0.6), squeeze=False)
    colors = plt.cm.tab10.colors
    handles = {}
    for ax, key in zip(axes.flat, keys):
        for k, (label, log) in enumerate(logs.items()):
            if key in log:
                (line,) = ax.plot(*log[key], color=colors[k % len(colors)], linewidth=1.2,
                                  marker="o" if len(log[key][0]) < 30 else None, markersize=3)
                handles[label] = line
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys):]:
        ax.set_axis_off()
    labels = [l for l in logs if l in handles]
    fig.legend([handles[l] for l in labels], labels, loc="upper center", ncol=min(len(labels), 4), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.4 * nrows + 0.6)))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path
