"""Representation analysis: each statistic against a slow loop, fake models with known
answers, and the plots of --analysis / --plot_log written end to end on tiny models."""
import json
import math
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import analysis as A
import data
from model import Bert, BertConfig
from test_eval import Killed, renames_then_killed

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ("tiger cat love sex king queen money bank cash river water computer keyboard car train "
         "plane book paper stock market street avenue coast shore doctor nurse bread butter").split()
FILLER = "the a of in on and with near saw found gave took".split()
CLS, SEP = 2, 3


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def make_text(num_lines=40, seed=0):
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        sentences = []
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(WORDS if rng.random() < 0.5 else FILLER) for _ in range(rng.randint(5, 14))]
            sentences.append(words[0].capitalize() + " " + " ".join(words[1:]) + " .")
        lines.append(" ".join(sentences))
    return lines


def make_tokenizer():  # as a run's (data.train_tokenizer): `tokenizers` alone gives other ids on every run
    tok = data.train_tokenizer(make_text(200), vocab_size=300)
    assert [tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def tiny_bert(vocab_size, seed=0):
    torch.manual_seed(seed)
    return Bert(BertConfig(vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                           max_position_embeddings=128))


def save_model(model, tok, path, step=None):
    model.save_pretrained(str(path), step=step)
    tok.save(os.path.join(str(path), "tokenizer.json"))
    return str(path)


def blocks(B, T, vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (B, T), generator=g)
    ids[:, 0], ids[:, -1] = CLS, SEP
    ids[0, T // 2] = SEP  # a document boundary inside a block is still a special token
    return ids


# ----------------------------------------------------------------------------------
# statistics against slow references


def test_context_partners_valid_and_uniform():
    context = torch.tensor([3, 0, 3, 1, 3, 2, 2, 3, 0, 2])  # sizes: 0:2, 1:1, 2:3, 3:4
    ctx, draws = context.tolist(), {i: [] for i in range(len(context))}
    for seed in range(1000):
        intra, inter = (t.tolist() for t in A.sample_context_partners(context, torch.Generator().manual_seed(seed)))
        for i in range(len(ctx)):
            if ctx[i] == 1:
                assert intra[i] == -1  # a one-token context has no intra partner
            else:
                assert intra[i] != i and ctx[intra[i]] == ctx[i]
            assert ctx[inter[i]] != ctx[i]
            draws[i].append((intra[i], inter[i]))
    for i in (0, 5):  # every allowed partner about equally often
        for slot in (0, 1):
            allowed = [j for j in range(len(ctx)) if (ctx[j] == ctx[i]) == (slot == 0) and j != i]
            counts = np.bincount([d[slot] for d in draws[i]], minlength=len(ctx))[allowed]
            expected = 1000 / len(allowed)
            assert np.all(np.abs(counts - expected) < 4 * np.sqrt(expected)), (i, slot, counts)


def test_context_similarity_matches_loop():
    torch.manual_seed(0)
    hidden, context = torch.randn(40, 8) + 0.3, torch.randint(0, 5, (40,))  # + 0.3: inter cosine > 0
    stats = A.context_similarity(hidden, context, torch.Generator().manual_seed(7))
    intra, inter = A.sample_context_partners(context, torch.Generator().manual_seed(7))
    h = hidden.tolist()
    kept = [i for i in range(40) if intra[i] >= 0 and inter[i] >= 0]
    measures = {"l1": lambda a, b: sum(abs(x - y) for x, y in zip(a, b)),
                "l2": lambda a, b: math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))),
                "l10": lambda a, b: sum(abs(x - y) ** 10 for x, y in zip(a, b)) ** 0.1,
                "cos": cos, "dot": lambda a, b: sum(x * y for x, y in zip(a, b))}
    assert stats["num_tokens"] == len(kept)
    for name, measure in measures.items():  # TACO Table 9: mean intra measurement / mean inter measurement
        near = sum(measure(h[i], h[intra[i]]) for i in kept) / len(kept)
        far = sum(measure(h[i], h[inter[i]]) for i in kept) / len(kept)
        assert stats[f"{name}_intra"] == pytest.approx(near, rel=1e-5), name
        assert stats[f"{name}_inter"] == pytest.approx(far, rel=1e-5), name
        assert stats[f"{name}_ratio"] == pytest.approx(near / far, rel=1e-5), name
    assert stats["intra"] == pytest.approx(stats["cos_intra"], abs=1e-6)
    assert stats["contextual"] == pytest.approx(stats["cos_intra"] - stats["cos_inter"], abs=1e-6)


def test_a_single_context_has_no_score():
    # no other sentence, no inter partner: nothing to measure (NaN, 0 tokens), not a partner made up
    stats = A.context_similarity(torch.randn(6, 4), torch.zeros(6, dtype=torch.long), torch.Generator().manual_seed(0))
    assert stats["num_tokens"] == 0 and math.isnan(stats["contextual"]) and math.isnan(stats["cos_ratio"])


def test_table9_ratios_read_the_paper_way_round():
    # tokens = their sentence's centre + noise: a contextual model. Table 9's MLM rows have
    # distance ratios < 1 (0.77-0.98) and similarity ratios > 1 (1.09-3.59); so must ours.
    g = torch.Generator().manual_seed(0)
    context = torch.arange(20).repeat_interleave(10)
    centres = torch.randn(20, 16, generator=g) + 2.0  # + 2: all states share a direction, as BERT's do
    hidden = centres[context] + 0.5 * torch.randn(200, 16, generator=g)
    stats = A.context_similarity(hidden, context, torch.Generator().manual_seed(1))
    assert all(stats[f"{m}_ratio"] < 0.9 for m in ("l1", "l2", "l10"))
    assert all(stats[f"{m}_ratio"] > 1.05 for m in ("cos", "dot"))
    # no context at all: every ratio near 1
    flat = A.context_similarity(torch.randn(200, 16, generator=g) + 2.0, context, torch.Generator().manual_seed(1))
    assert all(abs(flat[f"{m}_ratio"] - 1) < 0.05 for m in A.TABLE9_MEASURES)
    # a similarity ratio over a non-positive inter mean would flip its reading: NaN instead
    anti = torch.tensor([[1.0, 0.0], [1.0, 0.1], [-1.0, 0.0], [-1.0, -0.1]])
    stats = A.context_similarity(anti, torch.tensor([0, 0, 1, 1]), torch.Generator().manual_seed(0))
    assert stats["cos_inter"] < 0 and math.isnan(stats["cos_ratio"]) and math.isnan(stats["dot_ratio"])
    assert stats["l1_ratio"] < 1


def test_lp_distance_no_overflow():
    a = torch.tensor([[3e4, -2e4, 1.0], [1e-6, 0.0, 2e-6]])
    b = torch.zeros(2, 3)
    for p in (1, 2, 10):
        exact = (a.double() - b.double()).abs().pow(p).sum(-1).pow(1 / p)
        assert torch.allclose(A.lp_distance(a, b, p).double(), exact, rtol=1e-5), p
    assert torch.isinf((a - b).abs().pow(10).sum(-1)).any()  # the trap the scaling avoids


def test_context_similarity_expectation():
    # averaged over draws, intra/inter -> the mean over all same-/other-context pairs
    torch.manual_seed(1)
    hidden, context = torch.randn(12, 6), torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
    h = hidden.tolist()
    same = [sum(cos(h[i], h[j]) for j in range(12) if j != i and context[j] == context[i]) /
            sum(1 for j in range(12) if j != i and context[j] == context[i]) for i in range(12)]
    other = [sum(cos(h[i], h[j]) for j in range(12) if context[j] != context[i]) /
             sum(1 for j in range(12) if context[j] != context[i]) for i in range(12)]
    runs = [A.context_similarity(hidden, context, torch.Generator().manual_seed(s)) for s in range(500)]
    assert np.mean([r["intra"] for r in runs]) == pytest.approx(np.mean(same), abs=0.02)
    assert np.mean([r["inter"] for r in runs]) == pytest.approx(np.mean(other), abs=0.02)


def test_random_pair_cosine_expectation():
    torch.manual_seed(2)
    hidden = torch.randn(10, 4) + 0.5
    h = hidden.tolist()
    exact = np.mean([cos(h[i], h[j]) for i in range(10) for j in range(10) if i != j])
    runs = [A.random_pair_cosine(hidden, torch.Generator().manual_seed(s)) for s in range(500)]
    assert np.mean(runs) == pytest.approx(exact, abs=0.02)


def test_self_similarity_matches_loop():
    torch.manual_seed(3)
    hidden = torch.randn(3, 7, 5)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 1:6], mask[1, 1:3], mask[2, 1:2] = True, True, True
    values, valid = A.sentence_self_similarity(hidden, mask)
    assert valid.tolist() == [True, True, False]
    for b in range(2):
        tokens = [hidden[b, t].tolist() for t in range(7) if mask[b, t]]
        pairs = [cos(tokens[i], tokens[j]) for i in range(len(tokens)) for j in range(len(tokens)) if i != j]
        assert values[b].item() == pytest.approx(sum(pairs) / len(pairs), abs=1e-5)


def test_spearman_matches_loop_with_ties():
    def ranks(a):
        return [1 + sum(y < x for y in a) + (sum(y == x for y in a) - 1) / 2 for x in a]

    def pearson(a, b):
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
        return num / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))

    rng = random.Random(0)
    x = [rng.choice([0.1, 0.2, 0.3, 0.5, 0.9]) for _ in range(30)]
    y = [v + rng.gauss(0, 0.3) for v in x]
    y[3] = y[4]
    assert A.spearman(x, y) == pytest.approx(pearson(ranks(x), ranks(y)), abs=1e-12)
    assert A.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_word_pair_similarity_matches_loop(tok, tmp_path):
    path = tmp_path / "ws.csv"
    path.write_text("Word 1,Word 2,Human (mean)\r\ntiger,cat,7.35\r\ntiger,tiger,10.00\r\nking,queen,8.58\r\n"
                    "money,zyzzyva,5.0\r\nbank,river,3.1\r\n")
    model = tiny_bert(tok.get_vocab_size())
    sim = A.word_pair_similarity(model, tok, str(path))
    assert sim["pairs"] == 5 and sim["covered"] == 4 and sim["coverage"] == pytest.approx(0.8)  # zyzzyva: pieces
    weight = model.embeddings.word.weight.tolist()
    row = lambda w: weight[tok.token_to_id(w)]
    expected = [cos(row(a), row(b)) for a, b in [("tiger", "cat"), ("tiger", "tiger"), ("king", "queen"), ("bank", "river")]]
    assert sim["cos"] == pytest.approx(expected, abs=1e-5)
    assert sim["human"] == [7.35, 10.0, 8.58, 3.1]


def test_cooc_pairs_and_wordsim_similarity(tok, tmp_path):
    # TACO App. A.3: 20 seeded pairs of strongly related words, input embeddings
    words = [w for w in WORDS if A.single_token_id(tok, w) is not None]
    lines = ["Word 1,Word 2,Human (mean)", "tiger,tiger,10.00", "money,zyzzyva,9.0", "Money,Cash,9.15", "money,cash,9.08"]
    related = [(a, b) for i, a in enumerate(words) for b in words[i + 1:]][:40]
    lines += [f"{a},{b},{7.5 + (k % 20) / 10:.2f}" for k, (a, b) in enumerate(related)]
    lines += ["bank,river,3.1", "car,train,7.49"]  # below the threshold
    path = tmp_path / "ws.csv"
    path.write_text("\r\n".join(lines) + "\r\n")
    pairs = A.cooc_pairs(tok, str(path))
    assert len(pairs) == A.COOC_PAIRS == 20 and pairs == A.cooc_pairs(tok, str(path))  # seeded
    chosen = {frozenset((a.lower(), b.lower())) for a, b, _, _ in pairs}
    allowed = {frozenset(p) for p in related} | {frozenset(("money", "cash"))}
    assert len(chosen) == 20 and chosen <= allowed  # no tiger/tiger, no pieces, no duplicate, no score < 7.5
    exactly = tmp_path / "ws20.csv"  # 20 candidates, all at the threshold (7.5 counts): each of them is drawn
    exactly.write_text("\n".join(lines[:1] + [f"{a},{b},7.50" for a, b in related[:20]]) + "\n")
    assert {frozenset((a, b)) for a, b, _, _ in A.cooc_pairs(tok, str(exactly))} == {frozenset(p) for p in related[:20]}
    model = tiny_bert(tok.get_vocab_size())
    weight = model.embeddings.word.weight.tolist()
    expected = np.mean([cos(weight[i], weight[j]) for _, _, i, j in pairs])
    assert A.wordsim_similarity(model, tok, str(path)) == pytest.approx(expected, abs=1e-5)
    assert A.wordsim_similarity(model, tok, str(tmp_path / "missing.csv")) is None
    assert A.wordsim_similarity(model, tok, None) is None
    assert A.wordsim_similarity(model, tok) is not None  # the embedded WordSim353, as train.py calls it


class WholeWords:
    """A tokenizer that keeps every word as one token."""

    def __init__(self):
        self.vocab = {"[UNK]": 1}

    def encode(self, text, add_special_tokens=False):
        return SimpleNamespace(ids=[self.vocab.setdefault(text.lower(), len(self.vocab) + 1)])

    def token_to_id(self, token):
        return self.vocab.get(token)


def test_cooc_pairs_are_a_seeded_draw_not_the_files_first():
    # A.3: "20 randomly sampled pairs": with every word whole, 20 of the 91 candidates, the same 20 each time
    candidates = []
    for a, b, score in A.read_word_pairs(A.WORDSIM353):
        key = frozenset((a.lower(), b.lower()))
        if score >= 7.5 and len(key) == 2 and key not in candidates:
            candidates.append(key)
    drawn = [frozenset((a.lower(), b.lower())) for a, b, _, _ in A.cooc_pairs(WholeWords())]
    assert len(set(drawn)) == 20 and set(drawn) <= set(candidates) and set(drawn) != set(candidates[:20])
    assert [frozenset((a.lower(), b.lower())) for a, b, _, _ in A.cooc_pairs(WholeWords())] == drawn


def test_embedded_word_similarity_assets():
    assert not os.path.relpath(A.WORDSIM353, HERE).startswith("..")  # inside the repo, not ../shared
    ws = A.read_word_pairs(A.WORDSIM353)
    assert len(ws) == 353 and ws[0] == ("love", "sex", 6.77)
    sl = A.read_word_pairs(A.SIMLEX999)
    assert len(sl) == 999 and sl[0] == ("old", "new", 1.58)
    # the A.3 candidates: distinct, non-identical pairs scored >= 7.5
    strong = {frozenset((a.lower(), b.lower())) for a, b, s in ws if s >= A.COOC_MIN_SCORE and a.lower() != b.lower()}
    assert len(strong) == 91


def test_encode_matches_unpadded_loop(tok):
    model = tiny_bert(tok.get_vocab_size()).eval()
    sentences = ["The tiger saw a cat near the river .", "King and queen .",
                 "Money in the bank of the river and the coast ."]
    sequences = A.tokenize(tok, sentences, max_len=64)
    enc = A.encode(model, sequences, pad_id=0)
    sims = []
    for s, ids in enumerate(sequences):
        with torch.no_grad():
            layers = model(torch.tensor([ids]), all_layers=True)
        last = layers[-1][0]
        assert torch.allclose(enc["cls"][s], last[0], atol=1e-5)
        assert torch.allclose(enc["mean"][s], last[1:-1].mean(0), atol=1e-5)
        assert torch.allclose(enc["tokens"][enc["sentence"] == s], last[1:-1], atol=1e-5)
        sims.append([A.sentence_self_similarity(h[:, 1:-1], torch.ones(1, len(ids) - 2, dtype=torch.bool))[0].item()
                     for h in layers])
    assert enc["self_similarity"] == pytest.approx(np.mean(sims, axis=0).tolist(), abs=1e-5)
    # a one-token sentence has no pair: it leaves the mean over sentences as it is
    one_word = A.encode(model, sequences + A.tokenize(tok, ["tiger"], max_len=64), pad_id=0)
    assert one_word["self_similarity"] == pytest.approx(enc["self_similarity"], abs=1e-6)


# ----------------------------------------------------------------------------------
# training-time hooks


def test_contextual_score_matches_loop_and_restores_mode(tok):
    model = tiny_bert(100).train()
    ids = blocks(4, 24)
    specials = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}  # data.special_token_ids(tok)
    stats = A.contextual_score(model, ids, torch.Generator().manual_seed(3), specials)
    assert model.training  # put back in train mode
    with torch.no_grad():
        h = model.eval()(ids)
    real = [(b, t) for b in range(4) for t in range(24) if ids[b, t] > 4]
    intra, inter = A.sample_context_partners(torch.tensor([b for b, _ in real]), torch.Generator().manual_seed(3))
    vec = lambda k: h[real[k][0], real[k][1]].tolist()
    assert stats["intra"] == pytest.approx(np.mean([cos(vec(k), vec(intra[k])) for k in range(len(real))]), abs=1e-5)
    assert stats["inter"] == pytest.approx(np.mean([cos(vec(k), vec(inter[k])) for k in range(len(real))]), abs=1e-5)
    assert set(stats) == {"intra", "inter", "contextual"}


class OneVectorPerSentence(nn.Module):
    """Every token of a row gets the same random vector, seeded by the row's ids."""

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, return_embeddings=False, all_layers=False):
        rows = [torch.randn(64, generator=torch.Generator().manual_seed(hash(tuple(r.tolist())) % 2 ** 31))
                for r in input_ids]
        h = torch.stack(rows)[:, None, :].expand(-1, input_ids.size(1), -1)
        return [h, h] if all_layers else h


class RandomVectors(nn.Module):
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, return_embeddings=False, all_layers=False):
        h = torch.randn(*input_ids.shape, 64)
        return [h, h] if all_layers else h


def test_contextual_score_of_fake_models():
    ids, specials = blocks(8, 64), [0, 1, 2, 3, 4]
    torch.manual_seed(0)
    one = A.contextual_score(OneVectorPerSentence(), ids, torch.Generator().manual_seed(0), specials)
    assert one["intra"] == pytest.approx(1.0, abs=1e-5) and one["contextual"] > 0.8
    rnd = A.contextual_score(RandomVectors(), ids, torch.Generator().manual_seed(0), specials)
    assert abs(rnd["intra"]) < 0.05 and abs(rnd["inter"]) < 0.05 and abs(rnd["contextual"]) < 0.05


def test_training_hooks_are_fast(tok, tmp_path):
    model = tiny_bert(tok.get_vocab_size())
    ids = blocks(8, 128, vocab=tok.get_vocab_size())
    A.contextual_score(model, ids, torch.Generator().manual_seed(0), [0, 1, 2, 3, 4])  # warm-up
    # this process's CPU time on one thread (~0.02 s), not the wall clock: on a loaded machine (pytest -n 2, other
    # jobs) torch's threads wait for the cores, and the wall clock passed 1 s with the same work
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.process_time()
        A.contextual_score(model, ids, torch.Generator().manual_seed(0), [0, 1, 2, 3, 4])
        A.wordsim_similarity(model, tok)
        assert time.process_time() - start < 1.0
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------
# end to end: --analysis and --plot_log


def fake_glue_dir(root):
    """root/STS-B/dev.tsv in the original GLUE layout: 10 of its 30 pairs scored 5.000."""
    (root / "STS-B").mkdir(parents=True)
    rows = ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"]
    for i, line in enumerate(make_text(30, seed=5)):
        score = "5.000" if i % 3 == 0 else "2.400"
        rows.append(f"{i}\tmain\tx\t2012\t{i}\tnone\tnone\t{line}\t{line.lower()}\t{score}")
    (root / "STS-B" / "dev.tsv").write_text("\n".join(rows) + "\n")
    return str(root)


def no_hub(monkeypatch):
    """Any hub download in these tests is a bug: the loader raises, as it does offline."""
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(A, "_hub_reachable", lambda *a, **k: True)  # so the loader itself is what fails
    monkeypatch.setattr(datasets, "load_dataset", offline)


@pytest.mark.slow
def test_run_analysis_five_models_writes_json_and_plots(tok, tmp_path, monkeypatch, capsys):
    no_hub(monkeypatch)
    names = ["mlm", "taco", "tacl", "coco_lm_small_with_a_long_run_name", "electra"]
    models = [save_model(tiny_bert(tok.get_vocab_size(), seed), tok, tmp_path / name) for seed, name in enumerate(names)]
    text = tmp_path / "held_out.txt"
    text.write_text("\r\n".join([" = Heading = "] + make_text(60, seed=9)) + "\r\n")
    out = tmp_path / "analysis"
    args = SimpleNamespace(model=models, out=str(out), text=str(text), num_sentences=80,
                           glue_dir=fake_glue_dir(tmp_path / "glue"))
    results = A.run_analysis(args)
    for name in ("analysis.json", "analysis_contextual.png", "analysis_self_similarity.png", "analysis_heatmap.png",
                 "analysis_sentence_similarity.png", "analysis_word_similarity.png"):
        assert (out / name).stat().st_size > 0, name
    assert not [p for p in os.listdir(out) if ".tmp" in p]  # written atomically
    saved = json.loads((out / "analysis.json").read_text())
    assert list(saved["models"]) == names == list(results["models"])
    r = saved["models"]["mlm"]
    assert r["num_sentences"] == 80
    assert len(r["self_similarity_per_layer"]) == 3  # embeddings + 2 layers
    assert r["wordsim353"]["pairs"] == 353 and r["simlex999"]["pairs"] == 999  # the embedded assets
    assert len(r["wordsim353"]["cooc_pairs"]) <= 20 and r["wordsim353"]["cooc_cos"] is not None
    s = r["sentence_similarity"]
    assert s["num_similar_pairs"] == 10 and s["num_random_pairs"] == A.RANDOM_SENTENCE_PAIRS
    assert s["cls_gap"] == pytest.approx(s["cls_similar"] - s["cls_random"])
    assert -1 <= r["contextual"]["contextual"] <= 2 and r["contextual"]["l1_ratio"] > 0
    assert set(A.TABLE9_MEASURES) == {"l1", "l2", "l10", "cos", "dot"}
    assert all(f"{m}_ratio" in r["contextual"] for m in A.TABLE9_MEASURES)
    printed = capsys.readouterr().out
    assert "intra/inter L10 distance" in printed and "STS-B skipped" not in printed  # full names, not abbreviations


def test_console_summary_says_which_way_is_better_and_what_each_number_rests_on(tok, tmp_path, monkeypatch, capsys):
    # the summary gave bare numbers: no direction beside Table 9's ratios, no count of the pairs a Spearman or a
    # sentence cosine rests on, the A.3 row called '20 related pairs' whatever the tokenizer kept, no training step
    no_hub(monkeypatch)
    good = tmp_path / "run"
    save_model(tiny_bert(tok.get_vocab_size()), tok, good, step=12)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(3, seed=1)))
    figures = {}
    monkeypatch.setattr(A, "_save_figure", lambda fig, path: figures.setdefault(os.path.basename(path), fig))
    monkeypatch.setattr(A._pyplot(), "close", lambda fig: None)
    r = A.run_analysis(SimpleNamespace(model=[str(good)], out=None, text=str(text)))["models"]["run"]
    words = [ax.get_title() for ax in figures["analysis_word_similarity.png"].axes]  # the plot counts its pairs too
    ws, sl = r["wordsim353"], r["simlex999"]
    assert not any(f"{A.COOC_PAIRS} related" in t for t in words) and f"{A.COOC_PAIRS} related" not in "".join(
        t.get_text() for t in figures["analysis_word_similarity.png"].axes[0].get_xticklabels())
    assert f"{ws['covered']}/353 WordSim353" in words[1].replace("\n", " ")
    assert f"{sl['covered']}/999 SimLex-999, {len(ws['cooc_pairs'])} A.3" in words[1].replace("\n", " ")
    # every plot names the step of the export it drew (run is a train.py export of step 12)
    for name, fig in figures.items():
        texts = [t.get_text() for ax in fig.axes for t in [ax.title] + (ax.get_legend().get_texts() if ax.get_legend()
                                                                        else [])] + [t.get_text() for l in fig.legends for t in l.get_texts()]
        assert any("run (step 12)" in t.replace("\n", " ") for t in texts), (name, texts)
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        name, _, value = line.rpartition(" ")
        rows[name.strip()] = value
    value = lambda start: next(v for name, v in rows.items() if name.startswith(start))
    assert value("training step") == "12"
    assert any("contextual score" in n and "higher" in n for n in rows)
    assert any("isotropy" in n and "lower" in n for n in rows) and any("self-similarity" in n and "lower" in n for n in rows)
    assert all("higher" in n for n in rows if "Spearman" in n)
    assert not any(f"{A.COOC_PAIRS} related pairs," in n for n in rows)
    assert value("n: related pairs") == str(len(r["wordsim353"]["cooc_pairs"])) and len(r["wordsim353"]["cooc_pairs"]) < 20
    assert value("n: of its 353 pairs") == str(r["wordsim353"]["covered"])
    assert value("n: of its 999 pairs") == str(r["simlex999"]["covered"])
    s = r["num_sentences"]
    assert value("n: random pairs") == str(s * (s - 1) // 2) and value("n: STS-B") == "-"
    assert value("n: tokens") == str(r["contextual"]["num_tokens"])


def test_analysis_json_is_written_last(tok, tmp_path, monkeypatch):
    # a run stopped while plotting leaves no analysis.json: its presence means the whole analysis is there
    no_hub(monkeypatch)
    model = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(10)))

    def stop(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(A, "plot_word_similarity", stop)
    with pytest.raises(KeyboardInterrupt):
        A.run_analysis(SimpleNamespace(model=[model], out=None, text=str(text)))
    assert (tmp_path / "run" / "analysis_contextual.png").exists() and not (tmp_path / "run" / "analysis.json").exists()


def test_every_model_is_checked_first_and_its_step_recorded(tok, tmp_path, monkeypatch, capsys):
    no_hub(monkeypatch)
    good = tmp_path / "run"
    save_model(tiny_bert(tok.get_vocab_size()), tok, good, step=12)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(10)))
    (tmp_path / "notes").mkdir()  # the second --model is no checkpoint: refused before the first is analysed
    with pytest.raises(ValueError, match="not a checkpoint"):
        A.run_analysis(SimpleNamespace(model=[str(good), str(tmp_path / "notes")], out=None, text=str(text)))
    assert capsys.readouterr().out == ""
    fcntl = pytest.importorskip("fcntl")
    with open(good / ".lock", "a+") as held:  # a train.py still writing the run: its export moves on
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        results = A.run_analysis(SimpleNamespace(model=[str(good)], out=None, text=str(text)))
    assert results["models"]["run"]["training_step"] == 12  # which export of the run was analysed
    assert f"note: {good} is still training" in capsys.readouterr().out
    # the run's next export lands after the check of every model, before this one is analysed: the note named the
    # step checked (12), analysis.json the step analysed (13)
    real_documents = A.held_out_documents

    def next_export_lands(*args):
        tiny_bert(tok.get_vocab_size(), seed=1).save_pretrained(str(good), step=13)
        return real_documents(*args)
    monkeypatch.setattr(A, "held_out_documents", next_export_lands)
    with open(good / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        results = A.run_analysis(SimpleNamespace(model=[str(good)], out=str(tmp_path / "out"), text=str(text)))
    assert results["models"]["run"]["training_step"] == 13
    assert "its step 13 export" in capsys.readouterr().out


def test_stsb_offline_is_one_line_and_the_rest_completes(tok, tmp_path, monkeypatch, capsys):
    no_hub(monkeypatch)
    model = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(10)))
    results = A.run_analysis(SimpleNamespace(model=[model], out=None, text=str(text)))
    lines = [l for l in capsys.readouterr().out.splitlines() if "skipped" in l]
    assert len(lines) == 1 and "ConnectionError" in lines[0], lines
    r = results["models"]["run"]
    s = r["sentence_similarity"]
    assert s["cls_gap"] is None and s["mean_gap"] is None and s["num_random_pairs"] > 0  # random pairs still there
    assert r["wordsim353"]["pairs"] == 353 and r["contextual"]["cos_ratio"] is not None
    assert (tmp_path / "run" / "analysis_sentence_similarity.png").stat().st_size > 0  # default out = the run dir
    # no network at all: a quick probe, the loader is never called
    monkeypatch.setattr(A, "_hub_reachable", lambda *a, **k: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(ValueError, match="unreachable"):
        A.read_stsb(None)
    with pytest.raises(ValueError, match="no STS-B/dev.tsv"):
        A.read_stsb(str(tmp_path))


def test_read_stsb_tsv(tmp_path):
    rows = A.read_stsb(fake_glue_dir(tmp_path))
    assert len(rows) == 30 and sum(score == 5.0 for _, _, score in rows) == 10
    assert rows[0][1] == rows[0][0].lower()
    # read as GLUE fine-tuning reads it: a short row or a bad score is an error naming the line, not a dropped pair
    path = tmp_path / "STS-B" / "dev.tsv"
    lines = path.read_text().splitlines()
    for bad in (lines[2].rsplit("\t", 1)[0], lines[2].rsplit("\t", 1)[0] + "\tnan"):
        path.write_text("\n".join(lines[:2] + [bad] + lines[3:]) + "\n")
        with pytest.raises(ValueError, match="dev.tsv:3"):
            A.read_stsb(str(tmp_path))


def write_log(path, seed, resumed=False):
    rng = random.Random(seed)
    lines = [json.dumps({"config": {"objective": "taco", "lr": 1e-4}})]
    steps = list(range(10, 110, 10)) + (list(range(60, 110, 10)) if resumed else [])
    for step in steps:
        lines.append(json.dumps({"step": step, "lr": 1e-4, "loss": 5 - step / 50 + rng.random() * 0.1,
                                 "mlm_loss": 4 - step / 50, "tc_loss": 1.0 - step / 500, "tokens_per_s": 1e4}))
        if step % 50 == 0:
            lines.append(json.dumps({"step": step, "val_mlm_loss": 4 - step / 60, "val_mlm_acc": step / 200,
                                     "contextual_score": 0.1 + step / 1000, "wordsim_cooc_sim": 0.2}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + '\n{"step": 110, "loss"')  # a run killed mid-write
    return str(path)


def test_plot_logs(tmp_path):
    a = write_log(tmp_path / "out" / "mlm" / "log.jsonl", 0)
    b = write_log(tmp_path / "out" / "taco" / "log.jsonl", 1, resumed=True)
    log = A.read_log(b)
    assert log["loss"][0] == list(range(10, 110, 10))  # resumed steps appear once
    assert set(log) == {"lr", "loss", "mlm_loss", "tc_loss", "tokens_per_s", "val_mlm_loss", "val_mlm_acc",
                        "contextual_score", "wordsim_cooc_sim"}
    path = A.plot_logs([a, b], str(tmp_path / "plots"))
    assert path == str(tmp_path / "plots" / "training_curves.png") and os.path.getsize(path) > 0
    # and the held-out numbers an ablation compares, each run's at its last evaluation (a table beside the plot)
    rows = (tmp_path / "plots" / "training_curves.md").read_text().split("\n\n")[0].splitlines()  # then the flags
    assert rows[0] == "| run | step | val_mlm_loss | val_mlm_acc | contextual_score | wordsim_cooc_sim |"
    assert rows[2:] == ["| mlm | 100 | 2.3333 | 0.5000 | 0.2000 | 0.2000 |", "| taco | 100 | 2.3333 | 0.5000 | 0.2000 | 0.2000 |"]
    assert A.plot_logs([a], str(tmp_path / "plots")) == path  # its own table is rewritten ...
    first = (tmp_path / "plots" / "training_curves.md").read_text()  # a run directory stands for its log.jsonl, as in
    assert A.plot_logs([os.path.dirname(a)], str(tmp_path / "plots")) == path  # --plot_log (an IsADirectoryError)
    assert (tmp_path / "plots" / "training_curves.md").read_text() == first
    # a run directory named in bytes the locale cannot decode (a run made under LC_ALL=C in out/caf\u00e9; latin-1
    # bytes): its surrogates were a matplotlib traceback in the legend, for --plot_log and --analysis alike
    odd = write_log(tmp_path / "out" / os.fsdecode(b"caf\xe9") / "log.jsonl", 2)
    assert A.plot_logs([a, odd], str(tmp_path / "plots")) == path
    assert "| caf\\xe9 | 100 |" in (tmp_path / "plots" / "training_curves.md").read_text()
    (tmp_path / "plots" / "notes.md").write_text("# my notes\n")  # ... a markdown file of the user's is not
    with pytest.raises(ValueError, match="notes.md exists and is not a table that --plot_log wrote"):
        A.plot_logs([a], str(tmp_path / "plots" / "notes.png"))
    assert (tmp_path / "plots" / "notes.md").read_text() == "# my notes\n"
    assert not (tmp_path / "plots" / "notes.png").exists()
    with open(b, "a") as f:  # records no run of ours writes: a step that is not an integer is skipped
        f.write('\n{"step": [1], "loss": 2}\n{"step": "x", "loss": 3}\n{"step": true, "loss": 4}\n')
        f.write(f'{{"step": 7, "loss": 1{"0" * 400}}}\n{{"step": 8, "loss": 1{"0" * 5000}}}\n')  # no float holds them
    assert A.read_log(b)["loss"][0] == list(range(10, 110, 10))
    (tmp_path / "binary.jsonl").write_bytes(b'{"step": 1, "loss": 2}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"binary.jsonl:2: not UTF-8"):
        A.read_log(str(tmp_path / "binary.jsonl"))



def start_record(commit="f609645abc", modules=None, diff_sha1=None, resumed_from_step=None, **config):
    record = {"config": {"objective": "taco", "lr": 1e-3, "taco_stop_grad": True, "out_dir": "o", **config},
              "provenance": {"git_commit": commit, "dirty": bool(diff_sha1), "diff_sha1": diff_sha1,
                             "modules": {"losses.py": "aaa", "train.py": "bbb", **(modules or {})}}}
    return {**record, "resumed_from_step": resumed_from_step} if resumed_from_step else record


def test_compared_runs_say_which_flags_and_code_each_ran_with(tmp_path):
    # an ablation compares runs that differ in a flag or in losses.py: the table beside the curves said neither, so
    # a run with --taco_stop_grad false and one with the detach deleted from losses.py read as two unnamed rows
    runs = {"base": [start_record(out_dir="out/base")],
            "flag": [start_record(taco_stop_grad=False, out_dir="out/flag")],
            "edit": [start_record(modules={"losses.py": "ccc"}, diff_sha1="90a97dd1234", out_dir="out/edit")],
            "mlm": [start_record(objective="mlm", out_dir="out/mlm", new_flag="")],
            "unread": [{**start_record(out_dir="out/unread"), "provenance": {  # git could not read the checkout
                **start_record()["provenance"], "dirty": None}}],
            "unowned": [{**start_record(out_dir="out/unowned"), "provenance": {  # nor its commit: not "no git"
                **start_record()["provenance"], "git_commit": None, "dirty": None}}],
            "resumed": [start_record(max_steps=300),
                        start_record(max_steps=400, modules={"losses.py": "ddd"}, diff_sha1="b838e8c", resume="r",
                                     resumed_from_step=300)]}
    for label, records in runs.items():  # a log written by train.py: its start records, then the steps
        path = write_log(tmp_path / label / "log.jsonl", 0)
        lines = open(path).read().splitlines()
        with open(path, "w") as f:
            f.write("\n".join([json.dumps(r) for r in records] + lines[1:]))
        assert A.read_starts(path) == records
    A.plot_logs([str(tmp_path / label / "log.jsonl") for label in runs], str(tmp_path / "plots"))
    table = (tmp_path / "plots" / "training_curves.md").read_text().split("\n\n")
    assert table[0].startswith("| run | step | val_mlm_loss |")  # the held-out numbers come first, as before
    assert table[1].splitlines() == [
        "| run | flags unlike base's | code |", "|---|---|---|",
        "| base |  | f609645 |",
        "| flag | --taco_stop_grad false | f609645 |",
        "| edit |  | f609645 + local changes 90a97dd (losses.py unlike base's) |",
        "| mlm | --objective mlm --new_flag '' | f609645 |",
        "| unread |  | f609645 + local changes unknown |",
        "| unowned |  | commit unknown |",
        "| resumed | --max_steps 400 | f609645; from step 300: f609645 + local changes b838e8c (losses.py unlike base's) |"]
    assert A.run_settings({"a": [start_record()]}) == "" and A.run_settings({"a": [], "b": [start_record()]}) == ""


def test_a_non_finite_held_out_value_is_shown_not_taken_for_missing(tmp_path):
    # a diverged TACO edit logged val_tc_loss Infinity at step 0: the table showed "–", which means "not logged"
    path = tmp_path / "run" / "log.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"step": 0, "val_mlm_loss": 9.05, "val_tc_loss": float("inf"),
                                "val_pos_cos": float("nan")}) + "\n" + json.dumps({"step": 10, "loss": 3.0}) + "\n")
    assert set(A.read_log(str(path))) == {"val_mlm_loss", "loss"}  # the curves leave them out
    A.plot_logs([str(path)], str(tmp_path / "plots"))
    rows = (tmp_path / "plots" / "training_curves.md").read_text().splitlines()
    assert rows[0] == "| run | step | val_mlm_loss | val_tc_loss | val_pos_cos |"
    assert rows[2] == "| run | 0 | 9.0500 | inf | nan |"


def test_a_run_with_no_logged_value_yet_is_a_row_not_a_crash(tmp_path):
    # found playing the scripter: --plot_log over a run that had written its start line only (still tokenizing, or
    # killed before its first evaluation) and another run was a KeyError: the legend's list of runs that drew a line
    # took the name of the list that pairs each run with its log, so the rest met a run that was not in it
    fresh = tmp_path / "fresh" / "log.jsonl"
    fresh.parent.mkdir()
    fresh.write_text(json.dumps(start_record()) + "\n")
    done = write_log(tmp_path / "done" / "log.jsonl", 0)
    A.plot_logs([str(fresh), done], str(tmp_path / "plots"))
    rows = (tmp_path / "plots" / "training_curves.md").read_text().splitlines()
    assert rows[2].startswith("| fresh | – |") and rows[3].startswith("| done | ")


def test_runs_sharing_a_directory_keep_their_own_labels(tmp_path):
    # found by a fuzz of eval.py's flags: two logs in one folder (or a run dir and its ckpt.pt) got one label, and the
    # legend, the table and analysis.json kept one of the two runs without a word
    a = write_log(tmp_path / "logs" / "mlm.jsonl", 0)
    b = write_log(tmp_path / "logs" / "taco.jsonl", 1)
    A.plot_logs([a, b], str(tmp_path / "plots"))
    rows = (tmp_path / "plots" / "training_curves.md").read_text().split("\n\n")[0].splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| {a}", f"| {b}"]
    run = tmp_path / "out" / "mlm"
    run.mkdir(parents=True)
    assert A._labels([str(run), str(run / "ckpt.pt")]) == [str(run), str(run / "ckpt.pt")]


@pytest.mark.slow
def test_cli_plot_log_and_analysis(tok, tmp_path):
    a = write_log(tmp_path / "mlm" / "log.jsonl", 0)
    model = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "mlm")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(10)))
    out = tmp_path / "cli"
    subprocess.run([sys.executable, os.path.join(HERE, "eval.py"), "--analysis", "--model", model,
                    "--plot_log", a, "--out", str(out), "--text", str(text), "--num_sentences", "20",
                    "--glue_dir", fake_glue_dir(tmp_path / "glue")], check=True, cwd=HERE, capture_output=True)
    assert (out / "training_curves.png").stat().st_size > 0 and (out / "analysis_contextual.png").stat().st_size > 0
    saved = json.loads((out / "analysis.json").read_text())
    assert saved["models"]["mlm"]["sentence_similarity"]["num_similar_pairs"] == 10  # --glue_dir reached it


def test_held_out_text_falls_back_to_the_run_validation_split(tok, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join("\n".join(make_text(3, seed)) for seed in range(40)) + "\n")
    run = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    config = dict(data=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer="", vocab_size=300, val_fraction=0.2)
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps({"config": config}) + "\n")
    monkeypatch.setattr(A.data, "SAMPLE_CORPUS", str(tmp_path / "no_sample.raw.xz"), raising=False)
    documents, source = A.held_out_documents(None, run)
    assert source.endswith("validation split") and len(A.load_sentences(documents, 1000)) > 5
    with pytest.raises(ValueError, match="--text"):
        A.held_out_documents(None, str(tmp_path))  # no log.jsonl, no sample corpus: a clear error
    with pytest.raises(ValueError, match="a directory; pass one text file"):
        A.held_out_documents(str(tmp_path), run)


def test_a_cased_models_held_out_split_is_the_one_decoded(tok, tmp_path, monkeypatch):
    # the split is decoded once and re-tokenized by every model: decoded by an uncased model's tokenizer it is
    # lowercased, accents stripped, and a cased model listed after it was scored on that text
    cased = data.train_tokenizer(make_text(200), vocab_size=300, cased=True)
    uncased_run = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "uncased")
    cased_run = save_model(tiny_bert(cased.get_vocab_size()), cased, tmp_path / "cased")
    asked = []
    class Chosen(Exception):
        pass
    def held_out_documents(text, model_path):
        asked.append(model_path)
        raise Chosen  # the choice is all this test needs
    monkeypatch.setattr(A, "held_out_documents", held_out_documents)
    for models in ([uncased_run, cased_run], [cased_run, uncased_run], [uncased_run, uncased_run]):
        with pytest.raises(Chosen):
            A.run_analysis(SimpleNamespace(model=models, out=str(tmp_path / "out"), text=None))
    assert asked == [cased_run, cased_run, uncased_run]


def test_a_cache_that_cannot_be_written_is_an_error_not_the_sample_corpus(tok, tmp_path):
    # corpus._cache_error's OSError (eval.py: one line, exit 1): --analysis analysed the shipped sample in the
    # validation split's place, exit 0, its source saying only "no validation split"
    import gzip
    corpus = tmp_path / "corpus.txt.gz"
    corpus.write_bytes(gzip.compress("\n".join(make_text(40, seed=1)).encode()))
    (tmp_path / "cache" / "hf").mkdir(parents=True)
    (tmp_path / "cache" / "hf" / "plain").write_text("")  # the folder of decompressed copies cannot be made
    run = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    config = dict(data=str(corpus), cache_dir=str(tmp_path / "cache"), vocab_size=300, val_fraction=0.2)
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps({"config": config}) + "\n")
    with pytest.raises(OSError, match="^cannot write the cache .*pass --cache_dir elsewhere"):
        A.held_out_documents(None, run)


def test_decoded_wikitext_loses_its_escapes_and_run_in_headings():
    # a run's validation split decoded by an uncased tokenizer: whole articles, headings run in, "@ - @" escapes
    doc = ("= robert boulter = robert boulter is an english film , television and theatre actor . he had a "
           "guest @ - @ starring role in 2000 . = = career = = = = = 2000 – 2005 = = = in 2006 , boulter "
           "starred in the play . it cost 1 @ , @ 000 pounds . the equation x = 5 holds .")
    assert A.split_sentences(doc) == [
        "robert boulter is an english film , television and theatre actor .", "he had a guest-starring role in 2000 .",
        "in 2006 , boulter starred in the play .", "it cost 1,000 pounds .", "the equation x = 5 holds ."]
    raw = "He had a guest @-@ starring role . It cost 1 @,@ 000 pounds ."  # the raw files' escapes, as before
    assert A.split_sentences(raw) == ["He had a guest-starring role .", "It cost 1,000 pounds ."]


def test_initials_abbreviations_and_decoded_decimals_do_not_end_a_sentence():
    # a validation split decoded by an uncased tokenizer spaces every period: "u. s.", "e. g.", "3. 4"; before the
    # fix 12% of the sentences sampled from decoded enwiki were such fragments ("s. government gave ...")
    decoded = ("the u. s. government gave usd 250 million in 1995. it grew by 3. 4 %, e. g. in st. louis. "
               "john m. smith ( smith et al. 2001 ) agreed. 2001 was dry. the prize was the hero ' s. it was gold.")
    assert A.split_sentences(decoded) == [
        "the u. s. government gave usd 250 million in 1995.", "it grew by 3. 4 %, e. g. in st. louis.",
        "john m. smith ( smith et al. 2001 ) agreed.", "2001 was dry.", "the prize was the hero ' s.", "it was gold."]
    cased = "Dr. Smith met John F. Kennedy in St. Louis. They talked. It ended ."
    assert A.split_sentences(cased) == ["Dr. Smith met John F. Kennedy in St. Louis.", "They talked.", "It ended ."]


def test_held_out_text_falls_back_to_the_sample_corpus(tmp_path, monkeypatch):
    import lzma
    sample = tmp_path / "sample.raw.xz"
    with lzma.open(sample, "wt", encoding="utf-8") as f:
        f.write("\r\n".join([" = Heading = "] + make_text(30, seed=2)) + "\r\n")
    monkeypatch.setattr(A.data, "SAMPLE_CORPUS", str(sample), raising=False)
    documents, source = A.held_out_documents(None, str(tmp_path))  # a directory without log.jsonl (HF export)
    assert "sample corpus" in source and documents[1] == make_text(30, seed=2)[0]
    assert not any(s.startswith("=") for s in A.load_sentences(documents, 1000))
    # a run whose --data is gone, or is a folder refused now (its files named a split and not): said why
    (tmp_path / "data").mkdir()
    for name in ("a.txt", "train_notes.txt"):
        (tmp_path / "data" / name).write_text("the river\n")
    for data, why in ((tmp_path / "gone.txt", "data path not found"), (tmp_path / "data", "ambiguous")):
        (tmp_path / "log.jsonl").write_text(json.dumps({"config": {"data": str(data), "cache_dir": str(tmp_path / "c"),
                                                                    "vocab_size": 100, "val_fraction": 0.1}}) + "\n")
        source = A.held_out_documents(None, str(tmp_path))[1]
        assert f"(sample corpus; no validation split of {tmp_path}: " in source and why in source, source


def test_shipped_sample_corpus():
    path = getattr(A.data, "SAMPLE_CORPUS", None)
    if not path or not os.path.isfile(path):
        pytest.skip("data.SAMPLE_CORPUS not defined or not shipped yet")
    assert not os.path.relpath(path, HERE).startswith("..")
    sentences = A.load_sentences(A.read_lines(path), num_sentences=10 ** 6)
    assert len(sentences) > 5000 and not any(s.startswith("= ") and s.endswith(" =") for s in sentences)


# ----------------------------------------------------------------------------------
# the real data files under ../shared/data (skipped when absent)


def shared(rel):
    path = os.path.join(HERE, "..", "shared", "data", rel)
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    return path


def test_embedded_assets_equal_the_shared_copies():
    for rel, embedded in (("wordsim353/combined.csv", A.WORDSIM353), ("simlex999/simlex999.txt", A.SIMLEX999)):
        with open(shared(rel), "rb") as f, open(embedded, "rb") as g:
            assert f.read() == g.read(), rel


def test_real_stsb_dev():
    rows = A.read_stsb(shared("glue"))
    assert len(rows) == 1500 and sum(score == 5.0 for _, _, score in rows) == 56


def test_a_tokenizer_larger_than_the_model_is_refused(tok, tmp_path):
    model = save_model(tiny_bert(tok.get_vocab_size() - 10), tok, tmp_path / "run")  # ids past its embedding
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(10)))
    with pytest.raises(ValueError, match=f"the tokenizer has {tok.get_vocab_size()} tokens"):
        A.run_analysis(SimpleNamespace(model=[model], out=None, text=str(text)))


def test_a_model_with_fewer_positions_than_max_len_is_analysed_at_its_own_length(tok, tmp_path, monkeypatch):
    """--max_len 128 (the default) on a model with 16 positions: cut to 16, as GLUE does, not refused; given, refused."""
    no_hub(monkeypatch)
    torch.manual_seed(0)
    short = Bert(BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_layers=2, num_heads=2,
                            intermediate_size=64, max_position_embeddings=16))
    model = save_model(short, tok, tmp_path / "run")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(" ".join(make_text(40)) for _ in range(10)))  # sentences far over 16 tokens
    results = A.run_analysis(SimpleNamespace(model=[model], out=None, text=str(text)))
    assert results["models"]["run"]["max_len"] == 16 and results["models"]["run"]["num_tokens"] > 0
    # asked for explicitly, a length beyond the model's positions is refused, as GLUE's --max_len is
    with pytest.raises(ValueError, match="--max_len 128: exceeds"):
        A.run_analysis(SimpleNamespace(model=[model], out=None, text=str(text), max_len=128))


def test_an_earlier_analysis_moves_aside_unless_redone(tok, tmp_path, monkeypatch):
    # another --analysis_seed (or text, or model) into the same --out keeps the earlier numbers as analysis.1.json;
    # the same measurement over a growing set of models (reproduce.py) replaces it
    no_hub(monkeypatch)
    a, b = (save_model(tiny_bert(tok.get_vocab_size(), seed), tok, tmp_path / name) for seed, name in enumerate("ab"))
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(20)))
    out = tmp_path / "out"
    for plot in ("contextual", "self_similarity", "heatmaps", "sentence_similarity", "word_similarity"):
        monkeypatch.setattr(A, f"plot_{plot}", lambda *args: open(args[-1], "wb").close())  # matplotlib is slow

    def analyse(models, seed):
        A.run_analysis(SimpleNamespace(model=models, out=str(out), text=str(text), num_sentences=20, seed=seed))
        return sorted(os.listdir(out))
    first = analyse([a], 0)
    assert analyse([a, b], 0) == first  # redone with one more model: replaced, nothing set aside
    assert len(json.loads((out / "analysis.json").read_text())["models"]) == 2
    names = analyse([a, b], 1)
    assert "analysis.1.json" in names and "analysis_contextual.1.png" in names
    assert json.loads((out / "analysis.1.json").read_text())["seed"] == 0
    assert json.loads((out / "analysis.json").read_text())["seed"] == 1
    names = analyse([b], 1)  # a model of the earlier one is missing: set aside too
    assert "analysis.2.json" in names and "analysis_word_similarity.2.png" in names
    (out / "analysis.2.json").unlink()  # number 2 still taken by its plots: the next goes to 3, none overwritten
    before = (out / "analysis_contextual.2.png").stat().st_mtime_ns
    names = analyse([a], 1)
    assert "analysis.3.json" in names and (out / "analysis_contextual.2.png").stat().st_mtime_ns == before
    # a redo without STS-B (offline, no --glue_dir) over one with its pairs: set aside, not its STS-B numbers lost
    glue = fake_glue_dir(tmp_path / "glue")
    A.run_analysis(SimpleNamespace(model=[a], out=str(out), text=str(text), num_sentences=20, seed=1, glue_dir=glue))
    assert "analysis.4.json" not in os.listdir(out)  # with STS-B over one without: the same numbers and more
    names = analyse([a], 1)
    assert "analysis.4.json" in names and json.loads((out / "analysis.4.json").read_text())["stsb"]


def test_an_earlier_analysis_of_other_sentences_moves_aside(tok, tmp_path, monkeypatch):
    # the same --text name, count, seed and model, other sentences: an earlier version's split_sentences (an
    # analysis.json of 20 commits back, found by a compatibility audit) or an edited --text. It was overwritten
    no_hub(monkeypatch)
    model = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    text, out = tmp_path / "t.txt", tmp_path / "out"
    for plot in ("contextual", "self_similarity", "heatmaps", "sentence_similarity", "word_similarity"):
        monkeypatch.setattr(A, f"plot_{plot}", lambda *args: open(args[-1], "wb").close())  # matplotlib is slow
    analyse = lambda: A.run_analysis(SimpleNamespace(model=[model], out=str(out), text=str(text), num_sentences=10))
    text.write_text("\n".join(make_text(20, seed=0)))
    first = analyse()
    text.write_text("\n".join(make_text(20, seed=1)))  # same name; 10 of more sentences: the same count
    second = analyse()
    assert first["num_sentences"] == second["num_sentences"] and first["text"] == second["text"]
    assert json.loads((out / "analysis.1.json").read_text())["heatmap_sentence"] == first["heatmap_sentence"]
    old = json.loads((out / "analysis.json").read_text())  # as a version before sentences_sha1 wrote it
    del old["sentences_sha1"]
    (out / "analysis.json").write_text(json.dumps(old))
    analyse()
    assert (out / "analysis.2.json").exists()


def test_an_analysis_moving_aside_cut_short_by_a_kill_is_finished_under_the_same_number(tmp_path, monkeypatch):
    # the plots move one by one, analysis.json last; a kill after two of them made the next call take the first
    # number free for every file, 2: analysis.2.json beside the other plots, and two of its plots left as .1.png
    out, head = tmp_path / "out", dict(text="t", num_sentences=20, seed=0, max_len=128)
    out.mkdir()
    for name in A.PLOTS:
        (out / A.plot_file(name)).write_text(name)
    (out / "analysis.json").write_text(json.dumps(dict(head, seed=1, models={})))

    moved = renames_then_killed(monkeypatch, 2)
    with pytest.raises(Killed):
        A.set_aside_earlier(str(out), head, [])
    monkeypatch.undo()
    assert len(moved) == 2 and (out / "analysis.json").exists()
    A.set_aside_earlier(str(out), head, [])  # the next call finishes the move
    assert sorted(os.listdir(out)) == sorted(["analysis.1.json"] + [A.plot_file(n, 1) for n in A.PLOTS])
    assert all((out / A.plot_file(n, 1)).read_text() == n for n in A.PLOTS)


def test_a_second_analysis_into_the_same_out_is_refused_while_the_first_writes_there(tok, tmp_path, monkeypatch):
    # two --analysis (other seeds) into one --out at once: their plots and analysis.json were written over each
    # other (the last analysis.json beside the other's plots), or one died on the other's temporary file
    no_hub(monkeypatch)
    model = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    text, out = tmp_path / "t.txt", tmp_path / "out"
    text.write_text("\n".join(make_text(20)))
    for plot in ("contextual", "self_similarity", "heatmaps", "sentence_similarity", "word_similarity"):
        monkeypatch.setattr(A, f"plot_{plot}", lambda *args: open(args[-1], "wb").close())  # matplotlib is slow
    analyse = lambda seed: A.run_analysis(SimpleNamespace(model=[model], out=str(out), text=str(text),
                                                          num_sentences=20, seed=seed))
    real_analyze, second = A.analyze_model, []

    def analyze_model(*args):
        if not second:  # while the first analyses its model, a second one starts
            with pytest.raises(ValueError) as refused:
                analyse(1)
            second.append(str(refused.value))
        return real_analyze(*args)
    monkeypatch.setattr(A, "analyze_model", analyze_model)
    analyse(0)
    assert f"output directory {out} is in use by process {os.getpid()}" in second[0] and ".analysis.lock" in second[0]
    assert json.loads((out / "analysis.json").read_text())["seed"] == 0 and not (out / "analysis.1.json").exists()
    assert not (out / ".analysis.lock").exists()


# ----------------------------------------------------------------------------------
# sentence similarity, word similarity and seeds of analyze_model, against explicit references


def last_states(model, tok, sentence):
    """Last-layer states of [CLS] sentence [SEP] run alone."""
    ids = [CLS] + tok.encode(sentence, add_special_tokens=False).ids + [SEP]
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def test_sentence_pair_similarity_matches_loop(tok):
    # COCO-LM Fig. 1: the STS-B pairs scored 5.0 (not 4.8), [CLS] and mean over the non-special tokens
    model = tiny_bert(tok.get_vocab_size()).eval()
    s = make_text(6, seed=3)
    rows = [(s[0], s[1], 5.0), (s[2], s[3], 4.8), (s[4], s[5], 5.0)]
    out = A.sentence_pair_similarity(model, tok, rows, 128, "cpu")
    assert out["num_similar_pairs"] == 2
    h = {i: last_states(model, tok, s[i]) for i in (0, 1, 4, 5)}
    assert out["cls_similar"] == pytest.approx([cos(h[a][0].tolist(), h[b][0].tolist()) for a, b in ((0, 1), (4, 5))],
                                               abs=1e-5)
    assert out["mean_similar"] == pytest.approx([cos(h[a][1:-1].mean(0).tolist(), h[b][1:-1].mean(0).tolist())
                                                 for a, b in ((0, 1), (4, 5))], abs=1e-5)


def test_random_sentence_pairs_are_two_distinct_sentences():
    g = torch.Generator().manual_seed(0)
    enc = dict(cls=torch.randn(2, 4, generator=g), mean=torch.randn(2, 4, generator=g))
    out = A.random_sentence_pairs(enc, 50)
    for pooling in ("cls", "mean"):  # with two sentences the one pair is the two of them, never one with itself
        assert out[f"{pooling}_random"] == pytest.approx([cos(*enc[pooling].tolist())], abs=1e-6)
    # counted once: the plot's 'n=' and analysis.json said 50 (1000 by default) pairs of 2 sentences
    assert out["num_random_pairs"] == 1


def test_analysis_json_is_strict_json(tmp_path):
    # a one-sentence context has no contextual score (NaN): json.dump wrote it bare, which jq and JSON.parse refuse
    path = tmp_path / "analysis.json"
    A._save_json({"contextual": {"intra": float("nan"), "ratios": [float("inf"), 0.5]}}, str(path))
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}")) == {
        "contextual": {"intra": None, "ratios": [None, 0.5]}}


def test_sentence_similarity_histograms_share_each_columns_axis(tmp_path, monkeypatch):
    # COCO-LM Fig. 1 compares how squeezed the models' sentence vectors are: each panel scaled to its own values made
    # an MLM's [CLS] cosines in 0.97-1 look like a TACO's in 0.80-1
    rng = np.random.default_rng(0)
    pairs = lambda low: {f"{p}_{k}": rng.uniform(low, 1.0, 50).tolist() for p in ("cls", "mean") for k in ("random", "similar")}
    raws = {"squeezed": {"sentence_pairs": pairs(0.97)}, "spread": {"sentence_pairs": pairs(0.2)}}
    figures = []
    monkeypatch.setattr(A, "_save_figure", lambda fig, path: figures.append(fig))
    monkeypatch.setattr(A._pyplot(), "close", lambda fig: None)
    A.plot_sentence_similarity(raws, str(tmp_path / "s.png"))
    axes = np.array(figures[0].axes).reshape(2, 2)
    for col in range(2):
        assert axes[0, col].get_xlim() == axes[1, col].get_xlim()
        assert axes[0, col].get_xlim()[0] < 0.21
        edges = [sorted({round(p.get_x(), 9) for p in ax.patches}) for ax in axes[:, col]]
        assert set(edges[0]) <= set(np.round(np.linspace(*axes[0, col].get_xlim(), 40), 9))  # one set of bins


def test_few_sentences_give_each_random_pair_once():
    g = torch.Generator().manual_seed(0)
    enc = dict(cls=torch.randn(10, 4, generator=g), mean=torch.randn(10, 4, generator=g))
    out = A.random_sentence_pairs(enc, 1000)  # 10 sentences make 45 pairs: each once, not 1000 draws of them
    assert out["num_random_pairs"] == 45 and len(out["cls_random"]) == 45
    expected = sorted(cos(enc["mean"][i].tolist(), enc["mean"][j].tolist()) for i in range(10) for j in range(i + 1, 10))
    assert sorted(out["mean_random"]) == pytest.approx(expected, abs=1e-6)
    assert sorted(A.random_sentence_pairs(enc, 45)["mean_random"]) == pytest.approx(expected, abs=1e-6)  # just 45
    enc = dict(cls=torch.randn(50, 4, generator=g), mean=torch.randn(50, 4, generator=g))
    assert A.random_sentence_pairs(enc, 1000)["num_random_pairs"] == 1000  # 1225 pairs: a seeded draw of 1000


def test_analyze_model_word_scores_heatmap_and_seeds(tok):
    model = tiny_bert(tok.get_vocab_size()).eval()
    sentences = A.load_sentences(make_text(20), 1000)
    result, raw = A.analyze_model(model, tok, sentences, 64, "cpu", 0, None, sentences[0])
    weight = model.embeddings.word.weight.tolist()
    for name, path in (("wordsim353", A.WORDSIM353), ("simlex999", A.SIMLEX999)):
        pairs = [(a, b, score) for a, b, score in A.read_word_pairs(path)
                 if A.single_token_id(tok, a) is not None and A.single_token_id(tok, b) is not None]
        cosines = [cos(weight[A.single_token_id(tok, a)], weight[A.single_token_id(tok, b)]) for a, b, _ in pairs]
        assert result[name]["spearman"] == pytest.approx(A.spearman(cosines, [score for _, _, score in pairs]), abs=1e-6)
        distinct = [c for c, (a, b, _) in zip(cosines, pairs) if a.lower() != b.lower()]  # tiger/tiger: 1 by construction
        assert result[name]["mean_cos"] == pytest.approx(np.mean(distinct), abs=1e-6)
    pieces = tok.encode(sentences[0], add_special_tokens=False).ids  # TaCL's heatmap: no [CLS]/[SEP]
    assert raw["heatmap_tokens"] == [tok.id_to_token(i) for i in pieces] and raw["heatmap"].shape == (len(pieces),) * 2
    # --analysis_seed draws the partners and the random sentence pairs
    other, _ = A.analyze_model(model, tok, sentences, 64, "cpu", 1, None, sentences[0])
    assert other["contextual"]["intra"] != result["contextual"]["intra"]
    assert other["sentence_similarity"]["cls_random"] != result["sentence_similarity"]["cls_random"]
    assert other["num_tokens"] == result["num_tokens"] and other["wordsim353"] == result["wordsim353"]
    # and the held-out sentences
    assert A.load_sentences(make_text(200), 20, seed=1) != A.load_sentences(make_text(200), 20, seed=0)


def test_chinese_japanese_and_hindi_sentences_are_found():
    # 。！？ and the danda end a sentence with no space after them; a CJK ideograph counts as a word (no spaces
    # between words): a Chinese --text was "fewer than 2 sentences of 5+ words", a Chinese validation split a
    # handful of whole documents
    text = "不要将用户添加到数据库。创建一个和用户同名的组！软件包的版本是相同的？"
    assert A.split_sentences(text) == ["不要将用户添加到数据库。", "创建一个和用户同名的组！", "软件包的版本是相同的？"]
    assert A.split_sentences("用 户 添 加 到 数 据 库 。 创 建 组") == ["用 户 添 加 到 数 据 库 。", "创 建 组"]  # decoded
    assert A.split_sentences("यह एक लंबा वाक्य है। यह दूसरा वाक्य है।") == ["यह एक लंबा वाक्य है।", "यह दूसरा वाक्य है।"]
    assert len(A.load_sentences([text, "この名前はすでに定義されています。"], 10)) == 4  # 名 前 定 義, 3 kana runs: 7 words
    # a closing quote or bracket after 。 closes that sentence: it started the next one ("」彼は去った。")
    assert A.split_sentences("「行きます。」彼は去った。") == ["「行きます。」", "彼は去った。"]
    assert A.split_sentences("他说：“我们走吧。”然后（他）离开了！』』") == ["他说：“我们走吧。”", "然后（他）离开了！』』"]
    assert A.split_sentences("我 们 走 吧 。 ” 然 后 。") == ["我 们 走 吧 。 ”", "然 后 。"]  # decoded


def test_glyphs_the_plot_font_lacks_are_one_note_not_a_warning_each(tmp_path, capsys, recwarn):
    # matplotlib's DejaVu Sans has no Devanagari: a Hindi model's heatmap warned twice per distinct character
    tokens = ["यह", "पंक्ति", "के", "बाद", "नया", "वाक्य"]
    raws = {"hi": {"heatmap": np.eye(len(tokens)), "heatmap_tokens": tokens}}
    A.plot_heatmaps(raws, " ".join(tokens), str(tmp_path / "heatmap.png"))
    assert (tmp_path / "heatmap.png").exists()
    assert not [w for w in recwarn if "missing from font" in str(w.message)]
    out = capsys.readouterr().out
    assert out.count("note: heatmap.png: its font has no glyph for") == 1, out


def test_a_hub_runs_split_is_read_from_its_token_cache_and_never_downloaded(tok, tmp_path, monkeypatch):
    # a run trained on a hub dataset, analysed where its token cache is not (handed over, copied to a laptop): the
    # analysis downloaded the whole corpus (English Wikipedia, by default) and tokenized it, for 1000 sentences
    import datasets
    rows = ["\n".join(make_text(3, seed)) for seed in range(40)]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict({"text": rows}))
    run = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    config = dict(data="someone/corpus:en", cache_dir=str(tmp_path / "cache"), vocab_size=300, val_fraction=0.2)
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps({"config": config}) + "\n")
    A.data.prepare_data(config["data"], config["cache_dir"], run, 300, 0.2)  # train.py's own preparation
    downloads = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: downloads.append(a))
    documents, source = A.held_out_documents(None, run)
    assert source.endswith("validation split") and len(A.load_sentences(documents, 1000)) > 5 and not downloads
    config["cache_dir"] = str(tmp_path / "elsewhere")  # the cache is not on this machine
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps({"config": config}) + "\n")
    documents, source = A.held_out_documents(None, run)
    assert not downloads and "sample corpus" in source, source
    assert "someone/corpus:en is not in its token cache" in source and "pass --text FILE" in source
