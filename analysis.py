"""
Representation analysis: the pictures each paper draws of its representation space,
computed the same way for every model given, so objectives can be compared side by side.

- TACO (Fu et al. 2022, Fig. 3/6, App. A.3, Table 9): for every token of the held-out
  sentences (unmasked input, last hidden states) one partner is drawn from its own sentence
  (intra) and one from another sentence (inter). Contextual score = mean intra cosine minus
  mean inter cosine. Table 9's ratios = mean intra measurement / mean inter measurement for
  L1, L2, L10 distance and cosine and dot-product similarity, as the paper defines them: a
  model that knows its contexts gives distance ratios < 1 and similarity ratios > 1.
  Embedding similarity (A.3, Fig. 3a): mean cosine of the word embeddings of 20 strongly
  related ("frequently co-occurring") WordSim353 pairs.
- TaCL (Su et al. 2022): layer-wise self-similarity (mean pairwise cosine of the tokens of
  one sentence, [CLS]/[SEP] excluded) and a token x token cosine heatmap.
- COCO-LM (Meng et al. 2021, Fig. 1): cosine of [CLS] and of mean-pooled sentence vectors
  for random pairs of held-out sentences vs STS-B validation pairs scored 5.0 (top score; fidelity note 24).
- Word embeddings: Spearman correlation with WordSim353 / SimLex-999 human scores;
  isotropy: mean cosine of random token pairs across the corpus (Ethayarajh 2019).

WordSim353 and SimLex-999 ship in assets/ next to this file. STS-B comes from --glue_dir
(GLUE TSVs) or the hub; without either, one line says so and the STS-B pairs are left out
(the random pairs stay).
Training-time hooks (cheap): contextual_score() and wordsim_similarity(). There a context
is one packed [CLS] ... [SEP] block; in --analysis it is one held-out sentence, so the training
log's contextual_score and analysis.json's are on different scales.
Entry points: run_analysis(args) and plot_logs(paths, out).
"""
import argparse
import hashlib
import json
import math
import os
import random
import re
import socket
import sys
import textwrap
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import data
from atomic import replace_atomic, strict_json, write_atomic
from config import dir_problem
from corpus import read_text, resolve_files
from glue_tasks import TASKS, load_hub, read_tsv
from hf_io import still_training
from model import Bert
from rundir import locked, move_aside
from token_files import cache_ok, corpus_key, stream_dtype, tokens_file, vocab_matches

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
WORDSIM353 = os.path.join(ASSETS, "wordsim353", "combined.csv")
SIMLEX999 = os.path.join(ASSETS, "simlex999", "simlex999.txt")
# TACO App. A.3: "20 randomly sampled pairs of frequently co-occurrent words" of WordSim353. The
# paper names no criterion; we read "frequently co-occurring" as strongly related (human score
# >= 7.5 of 10: 91 distinct pairs, e.g. money/bank 8.5) and draw the 20 with a fixed seed (fidelity note 23).
COOC_PAIRS, COOC_MIN_SCORE, COOC_SEED = 20, 7.5, 0
ENCODE_BATCH = 64  # sentences per forward pass; memory is dominated by all_layers=True
RANDOM_SENTENCE_PAIRS = 1000  # COCO-LM Fig. 1's random pairs, drawn from the held-out sentences
# run_analysis's settings where args leaves them out (eval.py's parser may not define them all)
ANALYSIS_DEFAULTS = dict(model=None, out=None, text=None, num_sentences=1000, max_len=128,
                         glue_dir=None, seed=0, device=None)


# ----------------------------------------------------------------------------------
# Statistics on token representations


def sample_context_partners(context_id, rng):
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
    u = torch.rand(2, N, generator=rng, device=rng.device).to(device)
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


def lp_distance(a, b, p):
    """Row-wise L_p distance of (N, D) tensors. Scaled by the largest |difference| first:
    |d| ** 10 overflows float32 once |d| > ~7e3 and underflows below ~1e-4."""
    d = (a - b).abs()
    scale = d.amax(-1, keepdim=True).clamp(min=1e-30)
    return scale.squeeze(-1) * (d / scale).pow(p).sum(-1).pow(1 / p)


# TACO Table 9's measurements between a token's state and its partner's, (N, D) x (N, D) -> (N,)
TABLE9_MEASURES = {
    "l1": lambda a, b: lp_distance(a, b, 1),
    "l2": lambda a, b: lp_distance(a, b, 2),
    "l10": lambda a, b: lp_distance(a, b, 10),
    "cos": lambda a, b: F.cosine_similarity(a, b, dim=-1),
    "dot": lambda a, b: (a * b).sum(-1),
}
TABLE9_NAMES = {"l1": "L1 distance", "l2": "L2 distance", "l10": "L10 distance",
                "cos": "cosine similarity", "dot": "dot-product similarity"}


def context_similarity(hidden, context_id, rng, ratios=True):
    """TACO's contextual score on token states hidden (N, D) grouped by context_id (N,), and
    unless ratios=False Table 9's intra/inter ratios (App. A.3): for each measurement, the
    mean over tokens of measure(token, intra partner) divided by the mean of
    measure(token, inter partner), a ratio of means as the paper computes "statistics, then
    the ratio" (a mean of per-token ratios would explode where an inter cosine is near 0).
    All five use the same partners. A similarity ratio whose inter mean is <= 0 is NaN: its
    sign would flip the reading (> 1 = contextual). Only tokens with both partners count (fidelity note 22)."""
    intra, inter = sample_context_partners(context_id, rng)
    keep = (intra >= 0) & (inter >= 0)
    names = ["intra", "inter", "contextual"] + ([f"{m}_{s}" for m in TABLE9_MEASURES
                                                  for s in ("intra", "inter", "ratio")] if ratios else [])
    if not keep.any():
        return {**{k: float("nan") for k in names}, "num_tokens": 0}
    h = hidden.float()
    anchor, same, other = h[keep], h[intra[keep]], h[inter[keep]]
    stats = dict(intra=F.cosine_similarity(anchor, same, dim=-1).mean().item(),
                 inter=F.cosine_similarity(anchor, other, dim=-1).mean().item())
    stats["contextual"] = stats["intra"] - stats["inter"]
    for name, measure in TABLE9_MEASURES.items() if ratios else ():
        near, far = measure(anchor, same).mean().item(), measure(anchor, other).mean().item()
        stats.update({f"{name}_intra": near, f"{name}_inter": far,
                      f"{name}_ratio": near / far if far > 0 else float("nan")})
    stats["num_tokens"] = int(keep.sum())
    return stats


def random_pair_cosine(hidden, rng):
    """Isotropy: mean cosine between each token and one uniformly drawn other token (N, D)."""
    N = hidden.size(0)
    if N < 2:
        return float("nan")
    r = torch.minimum((torch.rand(N, generator=rng, device=rng.device).to(hidden.device) * (N - 1)).long(),
                      torch.tensor(N - 2, device=hidden.device))
    partner = r + (r >= torch.arange(N, device=hidden.device)).long()  # skip the token itself
    return F.cosine_similarity(hidden.float(), hidden[partner].float(), dim=-1).mean().item()


def sentence_self_similarity(hidden, token_mask):
    """TaCL's self-similarity: mean pairwise cosine (i != j) among the tokens of each
    sentence (the official script pools pairs over sentences, [CLS]/[SEP] in: fidelity note 39).
    hidden (B, T, D), token_mask (B, T) bool. Returns (B,) values and (B,) valid
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
def contextual_score(model, input_ids, rng, special_ids):
    """TACO's contextual score on a batch of packed [CLS] ... [SEP] blocks (B, T): each
    block is one context (A.3: a sentence; fidelity note 38), every non-special position one token, no masking.
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
    stats = context_similarity(hidden[real], block[real], rng, ratios=False)
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


def cooc_pairs(tok, path=WORDSIM353):
    """TACO App. A.3's pairs: COOC_PAIRS distinct WordSim353 pairs scored >= COOC_MIN_SCORE
    whose two words are single tokens, as (word1, word2, id1, id2). The candidates are shuffled
    with a fixed seed before the tokenizer filters them, so tokenizers that keep the same words
    whole get the same pairs. Duplicates (money/cash is listed twice) and identical words
    (tiger/tiger, cosine 1 by construction) are left out."""
    seen, candidates = set(), []
    for a, b, score in read_word_pairs(path):
        key = frozenset((a.lower(), b.lower()))
        if score >= COOC_MIN_SCORE and len(key) == 2 and key not in seen:
            seen.add(key)
            candidates.append((a, b))
    random.Random(COOC_SEED).shuffle(candidates)
    chosen = []
    for a, b in candidates:
        ids = single_token_id(tok, a), single_token_id(tok, b)
        if None not in ids:
            chosen.append((a, b, *ids))
        if len(chosen) == COOC_PAIRS:
            break
    return chosen


@torch.no_grad()
def wordsim_similarity(model, tok, path=WORDSIM353):
    """TACO App. A.3 / Fig. 3a embedding similarity: mean cosine of the input word-embedding
    rows (not contextual states) of the cooc_pairs(). None when the file is missing or no
    pair has two single-token words."""
    if not path or not os.path.isfile(path):
        return None
    pairs = cooc_pairs(tok, path)
    if not pairs:
        return None
    weight = model.embeddings.word.weight
    a = torch.tensor([p[2] for p in pairs], device=weight.device)
    b = torch.tensor([p[3] for p in pairs], device=weight.device)
    return F.cosine_similarity(weight[a].float(), weight[b].float(), dim=-1).mean().item()


def _distinct_pair_mean(sim):
    cos = [c for c, same in zip(sim["cos"], sim["same"]) if not same]
    return sum(cos) / len(cos) if cos else None


# ----------------------------------------------------------------------------------
# Held-out text, tokenizers, encoding


# a WikiText heading run into the text (a decoded validation split joins an article's lines): "= = career = ="
# at the start or after a sentence's end
RUN_IN_HEADING = re.compile(r"(?:^|(?<=[.!?] ))(?:(=(?: =)*) [^=]+? \1(?: |$))+")  # as many = each side


# a period after one of these (or after one letter: an initial, "e. g.", "u. s.") does not end a sentence
ABBREVIATIONS = frozenset("al approx ca capt cf ch col dr ed eds fig figs gen jr lt mr mrs mt no nos op pp prof "
                          "rev sgt sr st vol vols vs jan feb aug sept oct nov dec".split())


def _ends_sentence(before, after):
    """Whether a candidate break after `before` (ending in . ! or ?) is a sentence end; `after` follows it."""
    if not before.endswith("."):
        return True
    word = re.search(r"([^\s.(\[\"']*)\.$", before).group(1).lower()
    possessive = word == "s" and re.search(r"' ?s\.$", before)  # "the hero ' s." as a decoder spaces it
    if (len(word) == 1 and word.isalpha() and not possessive) or word in ABBREVIATIONS:
        return False
    return not (word.isdigit() and after[:1].isdigit())  # "3. 4": a decimal point, as an uncased decoder spaces it


# these end a sentence wherever they stand: Chinese and Japanese 。！？ (no space follows), Devanagari's danda, Arabic ؟
SENTENCE_ENDS = "\u3002\uff01\uff1f\uff61\u0964\u0965\u061f\u06d4"
CLOSERS = "\u300d\u300f\uff09\u3011\u3015\u3009\u300b\u201d\u2019)"  # 」』）】〕〉》”’): stay with the 。 before them
# a word, as BERT's tokenizer counts them: each CJK ideograph is one (Chinese and Japanese write no spaces)
WORD = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]|"
                  r"[^\s\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]+")


def count_words(sentence):
    return len(WORD.findall(sentence))


def split_sentences(text):
    """Cheap sentence splitter for WikiText-style prose (undoes its @-@ escapes, raw " @-@ " or decoded
    " @ - @ ", and drops headings): a new sentence starts after . ! or ? and a capital (any letter in
    lowercased text), but not after an initial, an abbreviation (ABBREVIATIONS) or a decoded decimal point;
    and after any of SENTENCE_ENDS (。 ！ ？ । ؟) and the CLOSERS that follow it (「…。」 is one sentence)."""
    text = RUN_IN_HEADING.sub("\n", re.sub(r" ?@ ?([-,.]) ?@ ?", r"\1", text))
    starts = "A-Z" if text != text.lower() else "a-z0-9"  # text decoded by an uncased tokenizer
    pieces, start = [], 0
    ends = rf"(?<=[{SENTENCE_ENDS}])(?:\s*[{re.escape(CLOSERS)}])*\s*"  # 。 and the quotes or brackets it closes
    for m in re.finditer(rf"(?<=[.!?])\s+(?=[{starts}\"'(\[])|{ends}|\n", text):
        if "\n" in m.group() or _ends_sentence(text[start:m.start()], text[m.end():]):
            pieces.append(text[start:m.start() + len(m.group().rstrip())])  # up to a closing 」 (and no space)
            start = m.end()
    pieces.append(text[start:])
    return [s.strip() for s in pieces if s.strip()]


def load_sentences(documents, num_sentences, seed=0, min_words=5):
    """A seeded sample of sentences (>= min_words words) from lines/documents of text."""
    sentences = []
    for doc in documents:
        doc = doc.strip()
        if not doc or (doc.startswith("=") and doc.endswith("=")):  # WikiText section headings
            continue
        sentences += [s for s in split_sentences(doc) if count_words(s) >= min_words]
    if len(sentences) > num_sentences:
        sentences = random.Random(seed).sample(sentences, num_sentences)
    return sentences


def read_lines(path):
    """Lines of a UTF-8 text file, compressed (.xz .gz .bz2) or not (CRLF or LF)."""
    return read_text(path).splitlines()


def held_out_documents(text_path, model_path):
    """Held-out text: --text, else the run's own validation split through data.py (decoded back
    to text so every model re-tokenizes it), else the sample corpus that ships with the repo
    (data.SAMPLE_CORPUS, WikiText-2 test; a Hugging Face directory has no validation split)."""
    if text_path:
        if not os.path.isfile(text_path):
            raise ValueError(f"--text {text_path}: " + ("a directory; pass one text file" if os.path.isdir(text_path)
                                                         else "no such file"))
        return read_lines(text_path), text_path
    run_dir = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    cfg = None
    try:  # train.py's first log line holds data.prepare_data's arguments under their names
        if not os.path.isfile(os.path.join(run_dir, "log.jsonl")):  # a FIFO's open would wait for a writer forever
            raise FileNotFoundError(f"no log.jsonl in {run_dir}")
        with open(os.path.join(run_dir, "log.jsonl"), encoding="utf-8") as f:
            cfg = json.loads(f.readline())["config"]
        hub_split_cached(cfg, run_dir)
        tok, _, val = data.prepare_data(cfg["data"], cfg["cache_dir"], run_dir, cfg["vocab_size"], cfg["val_fraction"])
    except Exception as e:
        if cfg is not None and isinstance(e, OSError):  # the cache cannot be written (full, read-only): eval.py's
            raise  # exit-1 line, as train.py's, not the sample corpus analysed in the split's place
        sample = getattr(data, "SAMPLE_CORPUS", None)
        if sample and os.path.isfile(sample):
            why = f": {e}" if isinstance(e, (LookupError, ValueError)) else ""  # data moved, a folder now refused
            return read_lines(sample), f"{os.path.basename(sample)} (sample corpus; no validation split of {run_dir}{why})"
        raise ValueError(f"no held-out text: pass --text FILE (validation split of {run_dir} unavailable: "
                         f"{type(e).__name__}: {e})") from None
    stream = np.asarray(val[:2_000_000]).astype(np.int64)
    cuts = np.flatnonzero(stream == tok.token_to_id("[SEP]"))
    docs = np.split(stream, cuts + 1)
    return [tok.decode(d.tolist()) for d in docs if len(d) > 1], f"{run_dir} validation split"


def hub_split_cached(cfg, run_dir):
    """A run trained on a hub dataset has its validation split here only in the token cache: without it, reading the
    split would download the whole corpus (all of English Wikipedia, for a run handed over or copied to another
    machine) and tokenize it, for 1000 sentences. LookupError (the sample corpus, said why) when it is not there."""
    if resolve_files(cfg["data"]) is not None:  # local files: the user's own, read as train.py read them
        return
    tok = data.load_tokenizer(run_dir)
    if not cache_ok(tokens_file(cfg["cache_dir"], corpus_key(cfg["data"], None), tok, stream_dtype(tok))):
        raise LookupError(f"the hub dataset {cfg['data']} is not in its token cache {cfg['cache_dir']}, and an "
                          f"analysis downloads no corpus: pass --text FILE")


def tokenizer_problem(model, tok, path):
    """The error line when tok is not model's tokenizer (ids beyond its embedding; for an export of this
    project, any other size, or a vocab.txt that is not tokenizer.json's: a run exports both, of exactly its
    model's size), else None."""
    size, rows, ours = tok.get_vocab_size(), model.config.vocab_size, model.training_step is not None
    if size > rows or (ours and size != rows):
        return (f"{path}: the tokenizer has {size} tokens, the model {rows}" + (
            " (a run of this project exports a tokenizer of exactly its model's size: its tokenizer files were "
            "replaced or edited)" if ours else ""))
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if ours and os.path.lexists(os.path.join(folder, "vocab.txt")) and not vocab_matches(tok, folder):
        # we read tokenizer.json; transformers' BertTokenizer reads vocab.txt: results would not carry over
        return (f"{path}: its vocab.txt disagrees with its tokenizer.json (edited or replaced): put back the "
                f"run's vocab.txt (the cache's tokenizer-* directory has a copy)")
    return None


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


def read_stsb(glue_dir=None):
    """(sentence1, sentence2, score) rows of the STS-B validation split: glue_dir/STS-B/dev.tsv, read
    as strictly as GLUE fine-tuning reads it, when glue_dir is given, else nyu-mll/glue from the hub.
    Raises ValueError saying why when neither can be read."""
    if glue_dir:
        path = os.path.join(glue_dir, "STS-B", "dev.tsv")
        if not os.path.isfile(path):
            raise ValueError(f"no STS-B/dev.tsv in --glue_dir {glue_dir}")
        ds = read_tsv(path, TASKS["stsb"])
        return list(zip(ds["text_a"], ds["text_b"], ds["label"]))
    offline = any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    # offline mode reads the local hub cache; otherwise, without a network the hub client would
    # retry for ~25 s: one 3 s probe fails faster
    if not offline and not _hub_reachable():
        raise ValueError("huggingface.co is unreachable (offline?) and no --glue_dir was given")
    ds = load_hub("stsb")["validation"]
    return list(zip(ds["sentence1"], ds["sentence2"], ds["label"]))


def _hub_reachable(host="huggingface.co", timeout=3.0):
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def sentence_pair_similarity(model, tok, rows, max_len, device):
    """COCO-LM Fig. 1's similar pairs: cosine of the [CLS] and mean-pooled vectors of the
    STS-B pairs scored 5.0 (the top score), each sentence encoded on its own."""
    similar = [(a, b) for a, b, score in rows if score >= 5.0]
    sentences = sorted({s for pair in similar for s in pair})
    where = {s: i for i, s in enumerate(sentences)}
    out = {"num_similar_pairs": len(similar)}
    if not similar:
        return out
    enc = encode(model, tokenize(tok, sentences, max_len), tok.token_to_id("[PAD]"), device)
    a = torch.tensor([where[p[0]] for p in similar])
    b = torch.tensor([where[p[1]] for p in similar])
    for pooling in ("cls", "mean"):
        out[f"{pooling}_similar"] = F.cosine_similarity(enc[pooling][a], enc[pooling][b], dim=-1).tolist()
    return out


def random_sentence_pairs(enc, num_pairs, seed=0):
    """COCO-LM Fig. 1's random pairs ("from the pretraining corpus"): cosine of the [CLS] and
    mean-pooled vectors of num_pairs seeded pairs of distinct held-out sentences; every pair once where the
    sentences make no more than num_pairs (2 sentences: 1 pair, not the same one num_pairs times)."""
    S = enc["cls"].size(0)
    if S < 2:
        return {"num_random_pairs": 0}
    rng = random.Random(seed)
    if S * (S - 1) // 2 <= num_pairs:
        pairs = [(i, j) for i in range(S) for j in range(i + 1, S)]
    else:
        pairs = [rng.sample(range(S), 2) for _ in range(num_pairs)]
    a, b = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    out = {"num_random_pairs": len(pairs)}
    for pooling in ("cls", "mean"):
        out[f"{pooling}_random"] = F.cosine_similarity(enc[pooling][a], enc[pooling][b], dim=-1).tolist()
    return out


# ----------------------------------------------------------------------------------
# run_analysis: every statistic for every model, then the plots


def _labels(paths, given=None):
    """Legend names: the run directory's name, or more of the path where names collide, or the path given (given:
    the files, where paths are their directories) where two share a directory: a run dir and its ckpt.pt, two logs
    in one folder. The labels key the results, so two equal labels kept one of the two runs. A name's bytes the
    locale could not decode (LC_ALL=C, or latin-1 bytes under UTF-8) are read as UTF-8, else written \\xNN: their
    surrogates were a matplotlib traceback in the legend."""
    dirs = [os.path.normpath(p if os.path.isdir(p) or not os.path.basename(p).endswith(".pt") else os.path.dirname(p))
            for p in paths]
    names = [os.path.basename(d) for d in dirs]
    labels = [d if names.count(n) > 1 else n for d, n in zip(dirs, names)]
    labels = [os.path.normpath(g) if labels.count(l) > 1 else l for l, g in zip(labels, given or paths)]
    return [l.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for l in labels]


def _mean(values):
    return sum(values) / len(values) if values else None


@torch.no_grad()
def analyze_model(model, tok, sentences, max_len, device, seed, stsb_rows, heatmap_sentence):
    """All numbers for one model (a JSON-ready dict) and the raw values the plots need.
    stsb_rows: read_stsb()'s rows, or None to leave out COCO-LM's similar pairs."""
    enc = encode(model, tokenize(tok, sentences, max_len), tok.token_to_id("[PAD]"), device)
    rng = torch.Generator().manual_seed(seed)
    result = {"num_sentences": len(sentences), "num_tokens": int(enc["tokens"].size(0))}
    result["contextual"] = context_similarity(enc["tokens"], enc["sentence"], rng)
    result["isotropy_random_pair_cos"] = random_pair_cosine(enc["tokens"], rng)
    result["self_similarity_per_layer"] = enc["self_similarity"]
    raw = {}
    # token x token cosine of one sentence (TaCL), non-special tokens only
    ids = tokenize(tok, [heatmap_sentence], max_len)[0]
    h = model(torch.tensor([ids], device=device))[0, 1:-1].float().cpu()
    unit = F.normalize(h, dim=-1)
    raw["heatmap"] = (unit @ unit.T).numpy()
    raw["heatmap_tokens"] = [tok.id_to_token(i) for i in ids[1:-1]]
    # input word embeddings (not contextual states)
    for name, path in (("wordsim353", WORDSIM353), ("simlex999", SIMLEX999)):
        sim = word_pair_similarity(model, tok, path)
        raw[name] = sim
        result[name] = dict(pairs=sim["pairs"], covered=sim["covered"], coverage=sim["coverage"],
                            spearman=spearman(sim["cos"], sim["human"]), mean_cos=_distinct_pair_mean(sim))
    result["wordsim353"]["cooc_pairs"] = [f"{a}/{b}" for a, b, _, _ in cooc_pairs(tok)]
    result["wordsim353"]["cooc_cos"] = wordsim_similarity(model, tok)
    # sentence pairs (COCO-LM Fig. 1)
    pairs = random_sentence_pairs(enc, RANDOM_SENTENCE_PAIRS, seed)
    if stsb_rows is not None:
        pairs.update(sentence_pair_similarity(model, tok, stsb_rows, max_len, device))
    raw["sentence_pairs"] = pairs
    s = result["sentence_similarity"] = {k: (_mean(v) if isinstance(v, list) else v) for k, v in pairs.items()}
    for pooling in ("cls", "mean"):
        both = s.get(f"{pooling}_similar") is not None and s.get(f"{pooling}_random") is not None
        s[f"{pooling}_gap"] = s[f"{pooling}_similar"] - s[f"{pooling}_random"] if both else None
    return result, raw


def _save_json(obj, path):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(strict_json(obj, indent=2))  # a NaN (a one-sentence context has no score) is null
    replace_atomic(path, write)


def _save_figure(fig, path, dpi=110):
    """Save fig; matplotlib's one warning per character its font lacks (a Hindi or Chinese heatmap's token labels:
    dozens, two lines each, above the summary) becomes one note."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replace_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    glyphs = {str(w.message) for w in caught if re.match(r"Glyph \d+ .* missing from font", str(w.message))}
    for w in caught:
        if str(w.message) not in glyphs:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if glyphs:
        print(f"note: {os.path.basename(path)}: its font has no glyph for {len(glyphs)} characters of the text "
              f"(drawn as boxes); a font covering the script (e.g. Noto) draws them")


PLOTS = ("contextual", "self_similarity", "heatmap", "sentence_similarity", "word_similarity")  # analysis_NAME.png


def plot_file(name, k=None):
    return f"analysis_{name}.png" if k is None else f"analysis_{name}.{k}.png"  # k: an earlier one set aside


def set_aside_earlier(out, head, paths, log=print, stsb=None):
    """An earlier analysis.json in `out` is replaced only by the same measurement redone (the same text,
    sentences (their sha1: an edited --text, or another version's split, has the same name and count), seed
    and max_len, and every model it held among `paths`: reproduce.py's growing set of runs; its STS-B pairs, if it had
    them, measured again: `stsb` is this one's source, None where they are skipped);
    any other (another --analysis_seed, --text, model) moves aside with its plots to analysis.K.json and
    analysis_NAME.K.png: never overwritten, as eval.py's glue.json."""
    path = os.path.join(out, "analysis.json")
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        old = None
    if (isinstance(old, dict) and all(old.get(k) == v for k, v in head.items())
            and isinstance(old.get("models"), dict)
            and {m.get("path") if isinstance(m, dict) else None for m in old["models"].values()} <= set(paths)
            and (stsb or not old.get("stsb"))):
        return
    # the plots, then analysis.json last: a kill before it leaves the rest to move to the same k next time
    k = move_aside(out, lambda k: [(plot_file(n), plot_file(n, k)) for n in PLOTS] +
                   [("analysis.json", f"analysis.{k}.json")])
    log(f"note: {path} was another measurement (other models, sentences, seed, --max_len or STS-B pairs): moved to "
        f"analysis.{k}.json")


def run_analysis(args):
    """eval.py --analysis. Reads args.model (run dirs, HF dirs or ckpt.pt files), args.out
    (default: the first model's directory) and args.text (default: the first cased model's validation split, else
    the first model's); optional: num_sentences, max_len,
    glue_dir (STS-B/dev.tsv; default the hub), seed, device. Writes analysis.json and the
    analysis_*.png plots into out and returns the results dict."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    args = argparse.Namespace(**{**ANALYSIS_DEFAULTS, **given})
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    models = [args.model] if isinstance(args.model, str) else list(args.model or [])
    if not models:
        raise ValueError("--analysis needs --model DIR [DIR ...]")
    out = args.out or (models[0] if os.path.isdir(models[0]) else os.path.dirname(models[0]) or ".")
    problem = dir_problem(out)
    if problem:  # before any work: the default --out is the model's own directory
        raise ValueError(f"cannot write the analysis into {out}: it {problem}; pass --out DIR")
    cased = []  # a model whose tokenizer keeps case and accents: the held-out split is decoded from the first such
    for path in models:  # every model checked first, one at a time: a bad --model is one line before any work
        model, tok = Bert.from_pretrained(path), load_tokenizer(path)
        if tok.normalizer is None or tok.normalizer.normalize_str("Éa") == "Éa":
            cased.append(path)
        problem = tokenizer_problem(model, tok, path)
        if problem:
            raise ValueError(problem)
        if "max_len" in given and args.max_len > model.config.max_position_embeddings:  # as eval.py's GLUE refuses
            raise ValueError(f"--max_len {args.max_len}: exceeds {path}'s {model.config.max_position_embeddings} positions")
        del model  # loaded again at its turn: six base models at once would hold 2.6 GB
    # an uncased model's split decodes lowercased, its accents stripped: a cased one would be scored on that text
    documents, text_source = held_out_documents(args.text, (cased or models)[0])
    sentences = load_sentences(documents, args.num_sentences, args.seed)
    if len(sentences) < 2:
        raise ValueError(f"{text_source}: fewer than 2 sentences of 5+ words")
    print(f"held-out text: {len(sentences)} sentences of {text_source}")
    try:
        stsb_rows, stsb_source = read_stsb(args.glue_dir), args.glue_dir or "hub nyu-mll/glue stsb"
    except ValueError as e:  # the rest of the analysis needs no STS-B
        stsb_rows, stsb_source = None, None
        print(f"STS-B skipped (the sentence-similarity plot keeps its random pairs; the rest goes on): {e}; "
              f"pass --glue_dir DIR holding STS-B/dev.tsv")
    # one readable sentence for the heatmap, the same text for every model
    heatmap_sentence = next((s for s in sentences if 8 <= count_words(s) <= 16), sentences[0])
    # the sentences' sha1: the same --text name and count can hold other sentences (the file edited, or an earlier
    # version's split_sentences): another measurement, which must not overwrite this one's analysis.json
    digest = hashlib.sha1("\n".join(sentences).encode("utf-8")).hexdigest()[:16]
    results = {"text": text_source, "num_sentences": len(sentences), "sentences_sha1": digest, "seed": args.seed,
               "max_len": args.max_len, "stsb": stsb_source and f"{stsb_source} (validation split)",
               "heatmap_sentence": heatmap_sentence, "models": {}}
    # one eval.py --analysis at a time writes here: two wrote their plots and analysis.json over each other (the
    # last analysis.json beside the other's plots), or one died on the other's temporary file
    with locked(out, ".analysis.lock", f"the analysis' output directory {out}"):
        set_aside_earlier(out, {k: results[k] for k in ("text", "num_sentences", "sentences_sha1", "seed", "max_len")},
                          models, stsb=results["stsb"])
        raws = {}
        for label, path in zip(_labels(models), models):
            print(f"analysing {path}")
            model, tok = Bert.from_pretrained(path).to(device).eval(), load_tokenizer(path)
            if still_training(path):  # said of this load: the export may have moved on since the check above
                print(f"note: {path} is still training (a train.py holds its .lock): this analyses its step "
                      f"{model.training_step} export, and analysis.json records that step")
            max_len = min(args.max_len, model.config.max_position_embeddings)  # the default 128 on a shorter model
            result, raws[label] = analyze_model(model, tok, sentences, max_len, device, args.seed, stsb_rows,
                                                heatmap_sentence)
            results["models"][label] = {"path": path, "training_step": model.training_step, "max_len": max_len,
                                        **result}
            del model
        png = lambda name: os.path.join(out, plot_file(name))  # name: one of PLOTS
        # the plots name each model's step: a run still training, or runs of other lengths, side by side
        shown = {label: label if r["training_step"] is None else f"{label} (step {r['training_step']})"
                 for label, r in results["models"].items()}
        plotted = {**results, "models": {shown[label]: r for label, r in results["models"].items()}}
        raws = {shown[label]: raw for label, raw in raws.items()}
        plot_contextual(plotted, png("contextual"))
        plot_self_similarity(plotted, png("self_similarity"))
        plot_heatmaps(raws, heatmap_sentence, png("heatmap"))
        plot_sentence_similarity(raws, png("sentence_similarity"))
        plot_word_similarity(plotted, raws, png("word_similarity"))
        _save_json(results, os.path.join(out, "analysis.json"))  # last: its presence means the whole analysis
    print_summary(results)
    print(f"wrote analysis.json and analysis_*.png to {out}")
    return results


def summary_rows(result):
    """(statistic, value) rows of the console summary for one model's result, full names, each with the direction
    the papers read as better where they give one; the 'n:' rows (ints) count what the rows above them rest on."""
    c, ws, sl = result["contextual"], result["wordsim353"], result["simlex999"]
    ss = result["sentence_similarity"]
    rows = [("training step of the export (- : not this project's)", result.get("training_step")),
            ("intra-context cosine (token vs same sentence)", c["intra"]),
            ("inter-context cosine (token vs other sentence)", c["inter"]),
            ("contextual score = intra - inter (TACO Fig. 3b, higher: contextual)", c["contextual"])]
    rows += [(f"intra/inter {TABLE9_NAMES[m]} (Table 9, {'< 1' if m.startswith('l') else '> 1'}: contextual)",
              c[f"{m}_ratio"]) for m in TABLE9_MEASURES]
    rows += [("  n: tokens, each with one partner of each kind", c.get("num_tokens")),
             ("isotropy: cosine of random token pairs (lower: more isotropic)", result["isotropy_random_pair_cos"]),
             ("self-similarity within a sentence, last layer (TaCL, lower: tokens apart)",
              result["self_similarity_per_layer"][-1]),
             ("WordSim353 related pairs, embedding cosine (A.3)", ws["cooc_cos"]),
             (f"  n: related pairs of single-token words (A.3 draws {COOC_PAIRS})", len(ws.get("cooc_pairs") or [])),
             ("WordSim353 Spearman, embedding cosine vs human (higher: better)", ws["spearman"]),
             (f"  n: of its {ws['pairs']} pairs, both words single tokens", ws["covered"]),
             ("SimLex-999 Spearman, embedding cosine vs human (higher: better)", sl["spearman"]),
             (f"  n: of its {sl['pairs']} pairs, both words single tokens", sl["covered"]),
             ("sentence cosine [CLS], random pairs (COCO-LM, lower: more uniform)", ss.get("cls_random")),
             ("sentence cosine [CLS], STS-B 5.0 minus random pairs (higher: apart)", ss.get("cls_gap")),
             ("sentence cosine mean-pooled, random pairs (lower: more uniform)", ss.get("mean_random")),
             ("sentence cosine mean-pooled, STS-B 5.0 minus random (higher: apart)", ss.get("mean_gap")),
             ("  n: random pairs of held-out sentences", ss.get("num_random_pairs")),
             ("  n: STS-B dev pairs scored 5.0", ss.get("num_similar_pairs"))]
    return rows


def print_summary(results):
    """One row per statistic, one column per model (last-layer token states unless noted)."""
    labels = list(results["models"])
    table = {label: summary_rows({"training_step": r.get("training_step"), **r}) for label, r in results["models"].items()}
    names = [name for name, _ in table[labels[0]]]
    width = max(len(n) for n in names)
    heads = [label if len(label) <= 11 else "..." + label[-8:] for label in labels]
    fmt = lambda v: (f"{v:>12d}" if isinstance(v, int) and not isinstance(v, bool)
                     else f"{v:>12.3f}" if isinstance(v, float) and math.isfinite(v) else f"{'-':>12}")
    print(f"{'statistic':<{width}}" + "".join(f"{h:>12}" for h in heads))
    for k, name in enumerate(names):
        print(f"{name:<{width}}" + "".join(fmt(table[label][k][1]) for label in labels))
    if any(h != label for h, label in zip(heads, labels)):
        print("models: " + ", ".join(f"{h} = {label}" for h, label in zip(heads, labels) if h != label))
    print(f"{results.get('num_sentences')} held-out sentences; - : not available (no STS-B, no covered word pairs, "
          f"or a similarity ratio whose inter mean is <= 0)")


# ----------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: works on headless training machines
    import matplotlib.pyplot as plt
    return plt


def _wrap(label, width=26):
    """Long run paths as legend/title labels: wrapped, not cut."""
    return "\n".join(textwrap.wrap(label, width, break_on_hyphens=False)) or label


def _grouped_bars(ax, groups, series, colors, base=0.0, digits=2):
    """groups: x tick labels; series: {legend label: [value per group]} (None = missing).
    Bars start at base (1 for ratios, so they point up or down from 'no difference');
    value labels turn vertical beyond three models so that six stay readable."""
    width = 0.8 / max(len(series), 1)
    vertical = len(series) > 3
    values = []
    for k, (label, heights) in enumerate(series.items()):
        x = np.arange(len(groups)) + (k - (len(series) - 1) / 2) * width
        heights = np.array([np.nan if v is None else v for v in heights], dtype=float)
        values += [v for v in heights if np.isfinite(v)]
        bars = ax.bar(x, heights - base, width, bottom=base, label=_wrap(label), color=colors[k % len(colors)])
        ax.bar_label(bars, labels=["" if not np.isfinite(v) else f"{v:.{digits}f}" for v in heights],
                     fontsize=6 if vertical else 7, rotation=90 if vertical else 0, padding=2)
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=8)
    ax.axhline(base, color="black", linewidth=0.6)
    if values:  # room for the value labels above and below
        low, high = min(min(values), base), max(max(values), base)
        pad = 0.25 * (high - low or 1.0)
        ax.set_ylim(low - (pad if low < base else 0.05 * pad), high + pad)


def _legend_below(fig, ax, n):
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=min(n, 3), frameon=False, fontsize=8)


def plot_contextual(results, path):
    plt = _pyplot()
    colors = plt.cm.tab10.colors
    models = results["models"]
    n = len(models)
    legend_rows = math.ceil(n / 3)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 5 + 0.35 * legend_rows),
                                              gridspec_kw=dict(width_ratios=[4, 3, 2.2]))
    groups = ["intra-context", "inter-context", "contextual score\n(intra - inter)", "random pairs\n(isotropy)"]
    _grouped_bars(left, groups, {label: [r["contextual"]["intra"], r["contextual"]["inter"],
                                         r["contextual"]["contextual"], r["isotropy_random_pair_cos"]]
                                 for label, r in models.items()}, colors)
    left.set_ylabel("mean cosine of last-layer token states")
    left.set_title("Token vs a token of its own / another sentence (TACO)", fontsize=10)
    distances, similarities = [m for m in TABLE9_MEASURES if m.startswith("l")], ["cos", "dot"]
    _grouped_bars(middle, [TABLE9_NAMES[m].replace(" ", "\n") for m in distances],
                  {label: [r["contextual"][f"{m}_ratio"] for m in distances] for label, r in models.items()},
                  colors, base=1.0, digits=3)
    middle.set_ylabel("mean intra-context / mean inter-context")
    middle.set_title("Table 9 distance ratios (< 1: closer to own sentence)", fontsize=10)
    _grouped_bars(right, [TABLE9_NAMES[m].replace(" ", "\n") for m in similarities],
                  {label: [r["contextual"][f"{m}_ratio"] for m in similarities] for label, r in models.items()},
                  colors, base=1.0, digits=3)
    right.set_title("Table 9 similarity ratios\n(> 1: more similar to own sentence)", fontsize=10)
    _legend_below(fig, left, n)
    fig.tight_layout(rect=(0, 0.07 * legend_rows, 1, 1))
    _save_figure(fig, path)
    plt.close(fig)


def plot_self_similarity(results, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for label, r in results["models"].items():
        values = r["self_similarity_per_layer"]
        ax.plot(range(len(values)), values, marker="o", label=_wrap(label, 40))
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("mean pairwise cosine within a sentence")
    ax.set_title("Layer-wise self-similarity (TaCL), [CLS]/[SEP] excluded", fontsize=10)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def plot_heatmaps(raws, sentence, path):
    """One panel per model in a grid of at most three columns."""
    plt = _pyplot()
    labels = list(raws)
    ncols = min(len(labels), 3)
    nrows = math.ceil(len(labels) / ncols)
    n_tokens = max(len(raws[l]["heatmap_tokens"]) for l in labels)
    size = min(max(3.5, 0.22 * n_tokens + 1.2), 6.5)  # inches per panel: token labels stay legible
    fontsize = 8 if n_tokens <= 24 else 6
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols + 1.2, size * nrows + 0.9), squeeze=False,
                             layout="constrained")
    vmin = min(0.0, min(float(raws[l]["heatmap"].min()) for l in labels))
    for ax, label in zip(axes.flat, labels):
        tokens = raws[label]["heatmap_tokens"]
        image = ax.imshow(raws[label]["heatmap"], vmin=vmin, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=fontsize)
        ax.set_title(_wrap(label, 40), fontsize=9)
    for ax in axes.flat[len(labels):]:
        ax.set_axis_off()
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="cosine, last layer")
    wrapped = "\n".join(textwrap.wrap(f'"{sentence}"', 110)[:3])
    fig.suptitle(f"Token x token cosine (TaCL) of one held-out sentence:\n{wrapped}", fontsize=10)
    _save_figure(fig, path)
    plt.close(fig)


def plot_sentence_similarity(raws, path):
    """One row per model: histograms of [CLS] and mean-pooled cosine, random vs STS-B 5.0 pairs. Each column has
    one cosine axis and one set of bins for every model: a model squeezed into 0.97-1 looks squeezed beside one
    spread over 0.8-1 (COCO-LM Fig. 1's point), not alike."""
    plt = _pyplot()
    labels = list(raws)
    fig, axes = plt.subplots(len(labels), 2, figsize=(10, 2.7 * len(labels) + 0.8), squeeze=False)
    poolings = (("cls", "[CLS]"), ("mean", "mean-pooled"))
    column_bins = {}
    for pooling, _ in poolings:
        every = [v for label in labels for kind in ("random", "similar")
                 for v in raws[label]["sentence_pairs"].get(f"{pooling}_{kind}", [])]
        if every:
            low, high = min(every), max(1.0, max(every))  # rounding can give 1 + 1e-7
            column_bins[pooling] = np.linspace(min(low, high - 1e-3), high, 40)
    for row, label in enumerate(labels):
        pairs = raws[label]["sentence_pairs"]
        for col, (pooling, name) in enumerate(poolings):
            ax = axes[row, col]
            rand, sim = pairs.get(f"{pooling}_random", []), pairs.get(f"{pooling}_similar", [])
            if not rand + sim:
                ax.text(0.5, 0.5, "no sentence pairs", ha="center", va="center", transform=ax.transAxes)
                continue
            bins = column_bins[pooling]
            ax.set_xlim(bins[0], bins[-1])
            # fractions, not densities: comparable heights however narrow the cosine range
            for values, color, what in ((rand, "tab:gray", "random pairs"), (sim, "tab:red", "STS-B score 5")):
                if values:
                    ax.hist(values, bins=bins, weights=np.full(len(values), 1 / len(values)), alpha=0.6,
                            color=color, label=f"{what} (n={len(values)}, mean {np.mean(values):.3f})")
            ax.ticklabel_format(axis="x", useOffset=False)
            ax.set_xlabel(f"cosine of {name} vectors", fontsize=8)
            ax.set_ylabel("fraction of pairs", fontsize=8)
            ax.set_title(_wrap(label, 50) + ("" if sim else " (STS-B skipped)"), fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Sentence similarity: random held-out pairs vs STS-B pairs scored 5.0 (COCO-LM Fig. 1)",
                 fontsize=11)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def plot_word_similarity(results, raws, path):
    """Top: the word-embedding scores side by side; below: one scatter per model."""
    plt = _pyplot()
    colors = plt.cm.tab10.colors
    labels = list(raws)
    ncols = min(len(labels), 3)
    nrows = math.ceil(len(labels) / ncols)
    fig = plt.figure(figsize=(14, 4.8 + 3.4 * nrows))
    grid = fig.add_gridspec(1 + nrows, ncols, height_ratios=[4.2] + [3.4] * nrows)
    top = fig.add_subplot(grid[0, :])
    series = {label: [r["wordsim353"]["cooc_cos"], r["wordsim353"]["mean_cos"], r["wordsim353"]["spearman"],
                      r["simlex999"]["spearman"]] for label, r in results["models"].items()}
    _grouped_bars(top, ["WordSim353, related pairs\nmean cosine (TACO A.3)",
                        "WordSim353, every covered\npair: mean cosine", "WordSim353\nSpearman vs human",
                        "SimLex-999\nSpearman vs human"], series, colors)
    top.set_title("Input word embeddings (single-token words only; pairs counted below)", fontsize=10)
    top.set_ylabel("cosine, or Spearman ρ with human scores", fontsize=8)
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for k, label in enumerate(labels):
        ax = fig.add_subplot(grid[1 + k // ncols, k % ncols])
        sim = raws[label]["wordsim353"]
        ax.scatter(sim["human"], sim["cos"], s=8, alpha=0.6, color=colors[k % len(colors)])
        ws, sl = results["models"][label]["wordsim353"], results["models"][label]["simlex999"]
        ax.set_title(_wrap(f"{label}: {sim['covered']}/{sim['pairs']} WordSim353 pairs (shown), {sl['covered']}/"
                           f"{sl['pairs']} SimLex-999, {len(ws['cooc_pairs'])} A.3 related", 60), fontsize=9)
        ax.set_xlabel("human score", fontsize=8)
        ax.set_ylabel("embedding cosine", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


# ----------------------------------------------------------------------------------
# Training curves of several runs


NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}  # log.jsonl's `non_finite` names


def read_log(path, finite=True):
    """{key: (steps, values)} of every numeric key in a log.jsonl; the first line (config)
    and unparsable lines (a run killed mid-write) are skipped; a resumed run's repeated
    steps keep the latest value. finite=False keeps inf and NaN values (a diverged held-out loss: null in
    log.jsonl, named in its line's `non_finite`; bare NaN / Infinity in a log of an earlier version)."""
    series = {}
    for line in read_text(path).splitlines():  # not UTF-8: one error naming file and line
        try:
            record = json.loads(line)
        except ValueError:  # a damaged line, or an integer of over 4,300 digits (an edited log)
            continue
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            continue
        named = record.get("non_finite") if isinstance(record.get("non_finite"), dict) else {}
        for key, value in record.items():
            value = NON_FINITE.get(named.get(key)) if value is None and isinstance(named.get(key), str) else value
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and (type(value) is float or abs(value) < 2 ** 1024) and (math.isfinite(value) or not finite):
                series.setdefault(key, {})[record["step"]] = value
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in series.items()}


def read_records(path):
    """log.jsonl's records (JSON objects), in order; a damaged line is left out."""
    records = []
    for line in read_text(path).splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_starts(path):
    """log.jsonl's start and resume records ({"config", "provenance", ...}), in order."""
    return [r for r in read_records(path) if isinstance(r.get("config"), dict)]


def diverged_at(path):
    """The step where the run stopped diverged (train.py's last log line then says so), or None: a resume since,
    or a run that did not diverge."""
    records = read_records(path)
    return records[-1].get("step") if records and "diverged" in records[-1] else None


def plot_logs(paths, out):
    """eval.py --plot_log: one subplot per numeric key, one line per run (legend = run
    directory). paths: log.jsonl files or run directories (each stands for its log.jsonl, as in --plot_log). out: a .png
    path or a directory (written as training_curves.png)."""
    paths = [os.path.join(p, "log.jsonl") if os.path.isdir(p) else p for p in paths]  # (a raw IsADirectoryError before)
    plt = _pyplot()
    path = out if out and out.lower().endswith(".png") else os.path.join(out or ".", "training_curves.png")
    table_path = os.path.splitext(path)[0] + ".md"  # the last held-out values, beside the picture
    for target in (path, table_path):
        if os.path.isdir(target):  # an earlier GLUE --out x.png made a folder of that name
            raise ValueError(f"{target} is a directory, where --plot_log writes a file: choose another --out")
    first = open(table_path, encoding="utf-8", errors="replace").readline() if os.path.isfile(table_path) else None
    if first is not None and not first.startswith("| run | step |"):
        raise ValueError(f"{table_path} exists and is not a table that --plot_log wrote: it would be overwritten; "
                         f"choose another --out")
    labels = _labels([os.path.dirname(os.path.abspath(p)) for p in paths], paths)
    raw = {label: read_log(p, finite=False) for label, p in zip(labels, paths)}  # the table shows an inf as inf
    logs = {label: {} for label in raw}  # the curves leave the non-finite points out
    for label, log in raw.items():
        for key, (steps, values) in log.items():
            kept = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
            if kept:
                logs[label][key] = ([s for s, _ in kept], [v for _, v in kept])
    keys = []
    for log in logs.values():
        keys += [k for k in log if k not in keys]
    # training terms, then held-out metrics, then representation scores, then bookkeeping
    bookkeeping = ("lr", "tokens_per_s", "elapsed_s", "mfu", "grad_norm")
    keys.sort(key=lambda k: 3 if k in bookkeeping else 2 if k in ("contextual_score", "wordsim_cooc_sim")
              else 1 if k.startswith("val_") else 0)
    if not keys:
        raise ValueError(f"no numeric log lines in {', '.join(paths)}")
    ncols = min(3 if len(keys) <= 9 else 4, len(keys))
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
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys):]:
        ax.set_axis_off()
    drawn = [l for l in logs if l in handles]  # not `labels`: a run with no point yet (its start line only) is in the table
    fig.legend([handles[l] for l in drawn], drawn, loc="upper center", ncol=min(len(drawn), 4), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.4 * nrows + 0.6)))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # only now: a bad log makes no folder
    _save_figure(fig, path)
    plt.close(fig)
    print(f"wrote {path}")
    stops = {label: diverged_at(p) for label, p in zip(labels, paths)}
    table = last_held_out({label if stops[label] is None else f"{label} (diverged at step {stops[label]})": log
                           for label, log in raw.items()})
    if table:  # the numbers an ablation compares, beside the picture, and what each run changed
        settings = run_settings({label: read_starts(p) for label, p in zip(labels, paths)})
        table += "\n\n" + settings if settings else ""
        write_atomic(table_path, table + "\n")
        print(f"wrote {table_path}:\n{table}")
    return path


def last_held_out(logs):
    """A markdown table of each run's held-out metrics at its last evaluated step ('' if none were logged)."""
    keys = []
    for log in logs.values():
        keys += [k for k in log if (k.startswith("val_") or k in ("contextual_score", "wordsim_cooc_sim"))
                 and k not in keys]
    if not keys:
        return ""
    lines = ["| run | step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for label, log in logs.items():
        step = max((log[k][0][-1] for k in keys if k in log), default=None)
        cells = [f"{log[k][1][-1]:.4f}" if k in log and log[k][0][-1] == step else "–" for k in keys]
        lines.append(f"| {label} | {'–' if step is None else step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


WHERE_FLAGS = ("out_dir", "resume", "cache_dir")  # where a run reads and writes, not what it trains: not compared


def run_settings(starts):
    """starts: {label: read_starts(log)}. A markdown table of what each run changed against the first: the flags
    set otherwise (its latest segment's) and the code (commit, + local changes and their code.diff's sha1, and
    the modules whose hashes differ from the first run's), one entry per segment where a resume changed it.
    '' with fewer than two runs that have a start record."""
    starts = {label: records for label, records in starts.items() if records}
    if len(starts) < 2:
        return ""
    first, missing = next(iter(starts)), object()
    ref, ref_modules = starts[first][-1]["config"], starts[first][0].get("provenance", {}).get("modules") or {}
    cell = lambda text: str(text).replace("|", "\\|")

    def value(v):
        return "(unset)" if v is missing else str(v).lower() if isinstance(v, bool) else repr(v) if v == "" else v

    def code(record, label):
        prov = record.get("provenance")
        if not isinstance(prov, dict):
            return "(not recorded)"
        unread = prov.get("dirty", False) is None  # git could not read the checkout (provenance's note)
        text = prov["git_commit"][:7] if prov.get("git_commit") else "commit unknown" if unread else "no git"
        if prov.get("dirty"):
            text += f" + local changes {(prov.get('diff_sha1') or '')[:7]}".rstrip()
        elif unread and prov.get("git_commit"):
            text += " + local changes unknown"
        modules = prov.get("modules")
        if isinstance(modules, dict) and label != first:
            moved = sorted(k for k in modules.keys() | ref_modules.keys() if modules.get(k) != ref_modules.get(k))
            if moved:
                text += f" ({', '.join(moved) if len(moved) <= 4 else f'{len(moved)} modules'} unlike {first}'s)"
        return text

    lines = [f"| run | flags unlike {cell(first)}'s | code |", "|---|---|---|"]
    for label, records in starts.items():
        config = records[-1]["config"]
        keys = list(ref) + [k for k in config if k not in ref]
        flags = [f"--{k} {value(config.get(k, missing))}" for k in keys
                 if k not in WHERE_FLAGS and config.get(k, missing) != ref.get(k, missing)]
        codes = []  # (step, code) of each segment whose code differs from the one before
        for record in records:
            if not codes or codes[-1][1] != code(record, label):
                codes.append((record.get("resumed_from_step"), code(record, label)))
        code_cell = "; ".join(f"from step {step}: {text}" if step else text for step, text in codes)
        lines.append(f"| {cell(label)} | {cell(' '.join(flags))} | {cell(code_cell)} |")
    return "\n".join(lines)


if __name__ == "__main__":  # a module, not a command: say where its command is instead of doing nothing
    sys.exit("error: analysis.py is run through eval.py: python eval.py --analysis --model RUN_DIR [RUN_DIR ...]")
