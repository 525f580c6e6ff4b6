"""eval.py: GLUE metrics against naive references, the TSV readers on the real GLUE files, batching,
and end-to-end fine-tuning of a tiny model on tiny TSVs (CPU, seconds)."""
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import eval as ev
from model import Bert, BertConfig

GLUE_DIR = Path(__file__).resolve().parent.parent / "shared/data/glue"


@pytest.fixture(autouse=True)
def one_thread():
    # tiny models run several times faster on one thread, more so on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ----------------------------------------------------------------------------------------------
# metrics vs slow references


def ref_mcc(y, p):  # binary, the explicit confusion-matrix formula
    tp = sum(a == 1 and b == 1 for a, b in zip(y, p))
    tn = sum(a == 0 and b == 0 for a, b in zip(y, p))
    fp = sum(a == 0 and b == 1 for a, b in zip(y, p))
    fn = sum(a == 1 and b == 0 for a, b in zip(y, p))
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denom if denom else 0.0


def ref_f1(y, p):
    tp = sum(a == 1 and b == 1 for a, b in zip(y, p))
    precision = tp / max(1, sum(b == 1 for b in p))
    recall = tp / max(1, sum(a == 1 for a in y))
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def ref_pearson(x, y):
    n = len(x)
    sx, sy, sxy = sum(x), sum(y), sum(a * b for a, b in zip(x, y))
    sxx, syy = sum(a * a for a in x), sum(b * b for b in y)
    return (n * sxy - sx * sy) / math.sqrt((n * sxx - sx * sx) * (n * syy - sy * sy))


def ref_ranks(x):  # average rank of ties, by a naive loop
    return [sum(b < a for b in x) + (sum(b == a for b in x) + 1) / 2 for a in x]


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_references(seed):
    rng = np.random.default_rng(seed)
    y, p = rng.integers(0, 2, 60), rng.integers(0, 2, 60)
    assert ev.matthews_corr(y, p) == pytest.approx(ref_mcc(y, p))
    assert ev.f1_binary(y, p) == pytest.approx(ref_f1(y, p))
    assert ev.accuracy(y, p) == pytest.approx(np.mean([a == b for a, b in zip(y, p)]))
    x, z = rng.normal(size=50), rng.normal(size=50)
    assert ev.pearson(x, z) == pytest.approx(ref_pearson(x, z))
    xt, zt = rng.integers(0, 6, 50).astype(float), np.round(rng.uniform(0, 5, 50), 0)  # many ties
    assert list(ev.average_ranks(xt)) == pytest.approx(ref_ranks(list(xt)))
    assert ev.spearman(xt, zt) == pytest.approx(ref_pearson(ref_ranks(list(xt)), ref_ranks(list(zt))))


def test_metric_edge_cases():
    assert ev.matthews_corr(np.array([1, 1, 0]), np.array([1, 1, 1])) == 0.0  # one predicted class: 0, as sklearn
    assert ev.matthews_corr(np.array([0, 1, 2, 2]), np.array([0, 1, 2, 2])) == pytest.approx(1.0)  # multiclass
    assert ev.f1_binary(np.array([0, 0]), np.array([0, 0])) == 0.0
    assert ev.pearson([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == 0.0  # constant prediction
    assert ev.score("corr", [1.0, 2.0, 3.0], [1.0, 2.0, 4.0])["spearman"] == pytest.approx(100.0)
    assert ev.score("f1_acc", [1, 0], [1, 1]) == pytest.approx({"f1": 100 * 2 / 3, "acc": 50.0})


# ----------------------------------------------------------------------------------------------
# the real GLUE TSVs (counts from shared/data/SOURCES.md)

REAL = {  # task: (train rows, dev rows, {label id: train count})
    "cola": (8551, 1043, {1: 6023, 0: 2528}), "sst2": (67349, 872, {1: 37569, 0: 29780}),
    "mrpc": (3668, 408, {1: 2474, 0: 1194}), "stsb": (5749, 1500, None),
    "rte": (2490, 277, {0: 1249, 1: 1241}), "wnli": (635, 71, {0: 323, 1: 312}),
}


@pytest.mark.skipif(not GLUE_DIR.is_dir(), reason="shared/data/glue not present")
@pytest.mark.parametrize("name", REAL)
def test_real_glue_tsvs(name):
    data = ev.load_task(ev.TASKS[name], str(GLUE_DIR))
    n_train, n_dev, counts = REAL[name]
    assert len(data["train"]) == n_train and len(data["dev"][""]) == n_dev
    labels = np.asarray(data["train"]["label"])
    if counts:
        assert {int(k): int(v) for k, v in zip(*np.unique(labels, return_counts=True))} == counts
    else:
        assert labels.dtype.kind == "f" and 0 <= labels.min() and labels.max() <= 5
    assert ("text_b" in data["train"].column_names) == (len(ev.TASKS[name].tsv_text) == 2)
    assert all(isinstance(t, str) and t for t in data["dev"][""]["text_a"][:50])


@pytest.mark.skipif(not GLUE_DIR.is_dir(), reason="shared/data/glue not present")
def test_real_glue_quirks():
    mrpc = ev.load_task(ev.TASKS["mrpc"], str(GLUE_DIR))["dev"][""]
    assert mrpc[0]["text_b"].startswith('" The foodservice')  # a bare quote survives (quoting off)
    with pytest.raises(ev.TaskMissing, match="train.tsv"):  # QNLI has a dev set only here
        ev.load_task(ev.TASKS["qnli"], str(GLUE_DIR))
    with pytest.raises(ev.TaskMissing):
        ev.load_task(ev.TASKS["mnli"], str(GLUE_DIR))


# ----------------------------------------------------------------------------------------------
# tokenization and batching

SENTENCES = ["a good film , really good .", "a bad film , truly bad .", "the cat sat on the mat .",
             "it is a charming and often affecting journey .", "the sailors rode the breeze clear of the rocks ."]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(SENTENCES * 3, trainers.WordPieceTrainer(vocab_size=120, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(  # only the truncation reference test uses it
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (d / "vocab.txt").write_text("".join(t + "\n" for t, _ in vocab))
    return d


def test_pair_truncation_matches_tokenizers(tokenizer_dir):
    from datasets import Dataset
    from tokenizers import Tokenizer
    rng = np.random.default_rng(0)
    words = "good bad film cat sat mat the journey rocks".split()
    a = [" ".join(rng.choice(words, rng.integers(1, 14))) for _ in range(40)]
    b = [" ".join(rng.choice(words, rng.integers(1, 14))) for _ in range(40)]
    for max_len in (8, 11, 16, 64):
        ref = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        ref.enable_truncation(max_len, strategy="longest_first")
        enc = ev.encode_task(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")),
                        Dataset.from_dict(dict(text_a=a, text_b=b, label=[0] * 40)), max_len, 2, 3)
        for i, e in enumerate(ref.encode_batch(list(zip(a, b)))):
            assert enc.input_ids[i].tolist() == e.ids
            types = [int(t >= enc.segment_b[i]) for t in range(enc.lengths[i])]
            assert types == e.type_ids


def test_batches_and_collate():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 40, 1000)
    batches = ev.length_grouped_batches(lengths, 16, rng, chunk_batches=5)
    assert sorted(np.concatenate(batches).tolist()) == list(range(1000))  # every row once per epoch
    assert len(batches) == math.ceil(1000 / 16)
    chunked = np.mean([lengths[b].max() - lengths[b].min() for b in batches])
    shuffled = np.mean([np.ptp(lengths[rng.permutation(1000)[:16]]) for _ in range(50)])
    assert chunked < shuffled / 3  # length grouping cuts padding
    enc = ev.Encoded([np.array([2, 7, 3]), np.array([2, 7, 8, 3, 9, 3])], np.array([3, 4]), np.array([3, 6]),
                     np.array([0, 1]))
    b = ev.collate(enc, np.array([0, 1]), 0, torch.device("cpu"))
    assert b["input_ids"].tolist() == [[2, 7, 3, 0, 0, 0], [2, 7, 8, 3, 9, 3]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert b["token_type_ids"].tolist() == [[0] * 6, [0, 0, 0, 0, 1, 1]]


def test_glue_model_pooler_and_dropout():
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, dropout=0.0)
    bert = Bert(cfg)
    bert.pooler = torch.nn.Linear(16, 16)
    kept = bert.pooler.weight.clone()
    model = ev.GlueModel(bert, 3, dropout=0.1)
    assert torch.equal(model.bert.pooler.weight, kept)  # the checkpoint's own pooler is kept
    fresh = ev.GlueModel(Bert(cfg), 1, dropout=0.1)
    assert fresh.bert.pooler is not None and fresh.classifier.out_features == 1
    # a checkpoint pretrained without dropout still fine-tunes with it, attention probabilities included
    assert model.bert.encoder.layers[0].attn.dropout == 0.1 and model.bert.embeddings.drop.p == 0.1
    x = torch.randint(5, 50, (2, 7))
    logits = model(x, torch.ones_like(x, dtype=torch.bool), torch.zeros_like(x))
    assert logits.shape == (2, 3)


# ----------------------------------------------------------------------------------------------
# end to end on a tiny model and tiny TSVs


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    from tokenizers import Tokenizer
    vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    model = Bert(BertConfig(vocab_size=vocab_size, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                            max_position_embeddings=64))
    d = tmp_path_factory.mktemp("model")
    model.save_pretrained(str(d), tokenizer_dir=str(tokenizer_dir))
    return d


def write_glue(root, n=48):
    """Tiny TSVs in the GLUE layout: CoLA (no header), MRPC (BOM, quotes), STS-B, all keyword-learnable."""
    rng = np.random.default_rng(0)
    for task, header, row in [
        ("CoLA", None, lambda y: f"gj04\t{y}\t\t{'a good film .' if y else 'a bad film .'}"),
        ("MRPC", "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
         lambda y: f'{y}\t1\t2\t" the cat sat .\t{"the cat sat" if y else "the journey rocks"} .'),
        ("STS-B", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
         lambda y: f"0\tg\tf\t2012\t0\tnone\tnone\tthe cat sat .\t{'the cat sat' if y else 'a bad film'} ."
                   f"\t{4.5 * y:.3f}"),
    ]:
        os.makedirs(root / task, exist_ok=True)
        for split, size in (("train", n), ("dev", n // 2)):
            lines = ([header] if header else []) + [row(int(y)) for y in rng.integers(0, 2, size)]
            (root / task / f"{split}.tsv").write_text("\n".join(lines))  # no trailing newline, as some GLUE files
    return root


def test_end_to_end(tmp_path, tiny_model_dir, capsys):
    glue = write_glue(tmp_path / "glue")
    out = tmp_path / "out"
    report = ev.run_glue(ev.build_parser().parse_args([
        "--model", str(tiny_model_dir), "--glue_dir", str(glue), "--tasks", "all", "--seeds", "1,2",
        "--epochs", "6", "--batch_size", "8", "--lr", "5e-3", "--warmup", "0.1", "--out", str(out), "--compare"]))
    saved = json.loads((out / "glue.json").read_text())
    assert saved["seeds"] == [1, 2] and saved["hparams"]["lr"] == 5e-3 and saved["recipe"] == "small"
    tasks = saved["tasks"]
    assert set(tasks) == set(ev.TASKS)
    assert {n for n, t in tasks.items() if t["status"] == "ok"} == {"cola", "mrpc", "stsb"}
    assert set(saved["missing"]) == {"sst2", "qqp", "mnli", "qnli", "rte", "wnli"}
    assert set(tasks["mrpc"]["seeds"]["1"]) == {"f1", "acc"} and set(tasks["stsb"]["mean"]) == {"pearson", "spearman"}
    assert len(tasks["cola"]["history"]["2"]) == 6 and tasks["cola"]["n_train"] == 48
    # keyword tasks: the tiny model learns them
    assert tasks["cola"]["mean"]["mcc"] > 50 and tasks["mrpc"]["mean"]["acc"] > 80
    assert tasks["stsb"]["mean"]["pearson"] > 50
    expected_avg = np.mean([tasks["cola"]["mean"]["mcc"], tasks["stsb"]["mean"]["spearman"],
                            tasks["mrpc"]["mean"]["f1"]])
    assert saved["avg"]["mean"] == pytest.approx(expected_avg)
    table = (out / "glue.md").read_text()
    assert f"{expected_avg:.1f}" in table and "Missing: qnli" in table and "paper: BERT-small TACO, 250k" in table
    assert "mean of 2 seeds" in table and "median of 2 seeds" in table
    assert report["tasks"]["cola"]["status"] == "ok"


def test_max_samples_and_default_out(tmp_path, tiny_model_dir):
    glue = write_glue(tmp_path / "glue")
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    for f in tiny_model_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    ev.main(["--model", str(model_dir), "--glue_dir", str(glue), "--tasks", "sts-b", "--epochs", "1",
             "--max_train_samples", "10", "--max_eval_samples", "7"])
    saved = json.loads((model_dir / "glue.json").read_text())
    assert saved["tasks"]["stsb"]["n_train"] == 10 and saved["tasks"]["stsb"]["n_dev"] == {"": 7}
    assert list(saved["tasks"]) == ["stsb"]


# ----------------------------------------------------------------------------------------------
# errors: one line on stderr, exit status 2


def run_main_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ev.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_error_unknown_task(tmp_path, tiny_model_dir, capsys):
    err = run_main_error(["--model", str(tiny_model_dir), "--glue_dir", str(tmp_path), "--tasks", "cola,squad"], capsys)
    assert "unknown task 'squad'" in err


def test_error_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    err = run_main_error(["--model", str(tmp_path), "--glue_dir", str(tmp_path)], capsys)
    assert "not a checkpoint" in err


def test_error_malformed_rows(tmp_path, tiny_model_dir, capsys):
    glue = write_glue(tmp_path / "glue")
    path = glue / "CoLA" / "train.tsv"
    lines = path.read_text().split("\n")
    path.write_text("\n".join(lines[:4] + ["gj04\t1\tonly three columns"] + lines[4:]))
    err = run_main_error(["--model", str(tiny_model_dir), "--glue_dir", str(glue), "--tasks", "cola"], capsys)
    assert f"{path}:5: expected 4 tab-separated columns, got 3" in err
    path = glue / "MRPC" / "dev.tsv"
    lines = path.read_text().split("\n")
    lines[3] = "yes" + lines[3][1:]
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"dev.tsv:4: bad label 'yes'"):
        ev.read_tsv(str(path), ev.TASKS["mrpc"])


def test_error_nothing_to_score(tmp_path, tiny_model_dir, capsys):
    err = run_main_error(["--model", str(tiny_model_dir), "--glue_dir", str(tmp_path), "--tasks", "rte"], capsys)
    assert "no GLUE task could be scored" in err and "RTE/train.tsv" in err


def test_error_several_models_for_glue(tmp_path, tiny_model_dir, capsys):
    err = run_main_error(["--model", str(tiny_model_dir), str(tiny_model_dir), "--glue_dir", str(tmp_path)], capsys)
    assert "one --model" in err
    assert "--model is required" in run_main_error(["--tasks", "rte"], capsys)
