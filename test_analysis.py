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
from model import Bert, BertConfig

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


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator(make_text(200), trainer)
    assert [tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def tiny_bert(vocab_size, seed=0):
    torch.manual_seed(seed)
    return Bert(BertConfig(vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                           max_position_embeddings=128))


def save_model(model, tok, path):
    model.save_pretrained(str(path))
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
    hidden, context = torch.randn(40, 8), torch.randint(0, 5, (40,))
    stats = A.context_similarity(hidden, context, torch.Generator().manual_seed(7))
    intra, inter = A.sample_context_partners(context, torch.Generator().manual_seed(7))
    h = hidden.tolist()
    kept = [i for i in range(40) if intra[i] >= 0 and inter[i] >= 0]
    ref_intra = sum(cos(h[i], h[intra[i]]) for i in kept) / len(kept)
    ref_inter = sum(cos(h[i], h[inter[i]]) for i in kept) / len(kept)
    l1 = lambda a, b: sum(abs(x - y) for x, y in zip(a, b))
    l2 = lambda a, b: math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    ref_l1 = sum(l1(h[i], h[inter[i]]) for i in kept) / sum(l1(h[i], h[intra[i]]) for i in kept)
    ref_l2 = sum(l2(h[i], h[inter[i]]) for i in kept) / sum(l2(h[i], h[intra[i]]) for i in kept)
    assert stats["num_tokens"] == len(kept)
    assert stats["intra"] == pytest.approx(ref_intra, abs=1e-5)
    assert stats["inter"] == pytest.approx(ref_inter, abs=1e-5)
    assert stats["contextual"] == pytest.approx(ref_intra - ref_inter, abs=1e-5)
    assert stats["l1_ratio"] == pytest.approx(ref_l1, rel=1e-5)
    assert stats["l2_ratio"] == pytest.approx(ref_l2, rel=1e-5)


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
    non_identical = [expected[0], expected[2], expected[3]]
    assert A.wordsim_similarity(model, tok, str(path)) == pytest.approx(sum(non_identical) / 3, abs=1e-5)
    assert A.wordsim_similarity(model, tok, str(tmp_path / "missing.csv")) is None
    assert A.wordsim_similarity(model, tok, None) is None


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
    real = os.path.join(A.ANALYSIS_DATA, "wordsim353", "combined.csv")
    path = real if os.path.isfile(real) else str(tmp_path / "ws.csv")
    if path != real:
        (tmp_path / "ws.csv").write_text("Word 1,Word 2,Human (mean)\ntiger,cat,7.35\n")
    ids = blocks(8, 128, vocab=tok.get_vocab_size())
    A.contextual_score(model, ids, torch.Generator().manual_seed(0), [0, 1, 2, 3, 4])  # warm-up
    start = time.perf_counter()
    A.contextual_score(model, ids, torch.Generator().manual_seed(0), [0, 1, 2, 3, 4])
    A.wordsim_similarity(model, tok, path)
    assert time.perf_counter() - start < 1.0


# ----------------------------------------------------------------------------------
# end to end: --analysis and --plot_log


def fake_data_dir(root):
    (root / "wordsim353").mkdir(parents=True)
    (root / "wordsim353" / "combined.csv").write_text(
        "Word 1,Word 2,Human (mean)\r\ntiger,cat,7.35\r\nking,queen,8.58\r\nmoney,bank,8.5\r\nbank,river,3.1\r\n"
        "computer,keyboard,7.62\r\nbread,butter,6.19\r\ncar,train,6.31\r\n")
    (root / "simlex999").mkdir()
    (root / "simlex999" / "simlex999.txt").write_text(
        "# comment\n# Word 1\tWord 2\tHuman (mean)\ncoast\tshore\t9.0\ndoctor\tnurse\t5.0\n"
        "book\tpaper\t3.2\nstreet\tavenue\t8.5\n")
    (root / "glue" / "STS-B").mkdir(parents=True)
    rows = ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"]
    for i, line in enumerate(make_text(30, seed=5)):
        score = "5.000" if i % 3 == 0 else "2.400"
        rows.append(f"{i}\tmain\tx\t2012\t{i}\tnone\tnone\t{line}\t{line.lower()}\t{score}")
    (root / "glue" / "STS-B" / "train.tsv").write_text("\n".join(rows) + "\n")
    return str(root)


def test_run_analysis_writes_json_and_plots(tok, tmp_path):
    models = [save_model(tiny_bert(tok.get_vocab_size(), seed), tok, tmp_path / name)
              for seed, name in [(0, "mlm"), (1, "taco")]]
    text = tmp_path / "held_out.txt"
    text.write_text("\r\n".join([" = Heading = "] + make_text(60, seed=9)) + "\r\n")
    out = tmp_path / "analysis"
    args = SimpleNamespace(model=models, out=str(out), text=str(text), num_sentences=80,
                           analysis_data=fake_data_dir(tmp_path / "data"))
    results = A.run_analysis(args)
    for name in ("analysis.json", "analysis_contextual.png", "analysis_self_similarity.png", "analysis_heatmap.png",
                 "analysis_sentence_similarity.png", "analysis_word_similarity.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "analysis.json").read_text())
    assert list(saved["models"]) == ["mlm", "taco"] == list(results["models"])
    r = saved["models"]["mlm"]
    assert r["num_sentences"] == 80
    assert len(r["self_similarity_per_layer"]) == 3  # embeddings + 2 layers
    assert r["wordsim353"]["pairs"] == 7 and r["simlex999"]["pairs"] == 4
    assert r["sentence_similarity"]["num_similar_pairs"] == 10
    assert -1 <= r["contextual"]["contextual"] <= 2 and r["contextual"]["l1_ratio"] > 0


def test_run_analysis_without_data_files(tok, tmp_path):
    model = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(10)))
    results = A.run_analysis(SimpleNamespace(model=[model], out=None, text=str(text), analysis_data=str(tmp_path / "none")))
    r = results["models"]["run"]
    assert r["wordsim353"] is None and r["simlex999"] is None and r["sentence_similarity"] is None
    assert (tmp_path / "run" / "analysis_word_similarity.png").stat().st_size > 0  # default out = the run dir


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


def test_cli_plot_log_and_analysis(tok, tmp_path):
    a = write_log(tmp_path / "mlm" / "log.jsonl", 0)
    model = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "mlm")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(make_text(10)))
    out = tmp_path / "cli"
    subprocess.run([sys.executable, os.path.join(HERE, "eval.py"), "--analysis", "--model", model,
                    "--plot_log", a, "--out", str(out), "--text", str(text), "--num_sentences", "20",
                    "--analysis_data", str(tmp_path / "none")], check=True, cwd=HERE, capture_output=True)
    assert (out / "training_curves.png").stat().st_size > 0 and (out / "analysis_contextual.png").stat().st_size > 0


def test_held_out_text_falls_back_to_the_run_validation_split(tok, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join("\n".join(make_text(3, seed)) for seed in range(40)) + "\n")
    run = save_model(tiny_bert(tok.get_vocab_size()), tok, tmp_path / "run")
    config = dict(data=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer="", vocab_size=300, val_fraction=0.2)
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps({"config": config}) + "\n")
    monkeypatch.setattr(A, "ANALYSIS_DATA", str(tmp_path / "no_shared_data"))
    documents, source = A.held_out_documents(None, run)
    assert source.endswith("validation split") and len(A.load_sentences(documents, 1000)) > 5
    with pytest.raises(ValueError, match="--text"):
        A.held_out_documents(None, str(tmp_path))  # no log.jsonl: a clear error


# ----------------------------------------------------------------------------------
# the real data files under ../shared/data (skipped when absent)


def shared(rel):
    path = os.path.join(A.ANALYSIS_DATA, rel)
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    return path


def test_real_word_similarity_files():
    ws = A.read_word_pairs(shared("wordsim353/combined.csv"))
    assert len(ws) == 353 and ws[0] == ("love", "sex", 6.77)
    sl = A.read_word_pairs(shared("simlex999/simlex999.txt"))
    assert len(sl) == 999 and sl[0] == ("old", "new", 1.58)


def test_real_stsb_and_held_out_text():
    rows = A.read_stsb(shared("glue/STS-B"))
    assert len(rows) == 5749 + 1500 and sum(score == 5.0 for _, _, score in rows) == 322
    with open(shared(A.HELD_OUT_TEXT), encoding="utf-8") as f:
        sentences = A.load_sentences(f.read().splitlines(), num_sentences=10 ** 6)
    assert len(sentences) > 5000 and not any(s.startswith("= ") and s.endswith(" =") for s in sentences)
