"""losses.py against slow, obviously correct references (explicit loops over anchors, negatives
and positions, explicit softmax), plus invariants, gradient routing, masking statistics and a
short training loop per objective. Random draws are replayed by re-seeding the generator and
calling the same sampling helpers in the same order."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import losses
from losses import (LOSSES, NegativeDots, corrective_lm_loss, crop_views, generator_config, mask_tokens, pool_size,
                    random_real_tokens, sample_tokens, taco_samples)
from config import TrainConfig
from model import MODEL_PRESETS, Bert, BertConfig

AUC = losses.auc  # the real one, kept before a test patches it

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
TINY = dict(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
            max_position_embeddings=32, dropout=0.0)
NAMES = {
    "mlm": {"mlm_loss", "mlm_acc"},
    "taco": {"mlm_loss", "mlm_acc", "tc_loss", "pos_cos", "neg_cos"},
    "tacl": {"mlm_loss", "mlm_acc", "tacl_loss", "tacl_acc"},
    "cocolm": {"gen_loss", "copy_loss", "lm_loss", "scl_loss", "gen_acc", "replaced_frac", "copy_acc", "copy_trivial"},
    "electra": {"gen_loss", "disc_loss", "gen_acc", "disc_acc", "replaced_frac", "disc_trivial"},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (10x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed=0, double=True, **overrides):
    torch.manual_seed(seed)
    model = Bert(BertConfig(**{**TINY, **overrides}))
    return model.double() if double else model


def make_cfg(**kw):  # the objectives read their hyperparameters from train.py's config
    return TrainConfig(**{"init_from": "out/mlm", **kw})


def build(name, model, double=True, **kw):
    objective = LOSSES[name](model, make_cfg(**kw))
    return objective.double() if double else objective


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def make_batch(B=4, T=16, seed=0, lengths=None, vocab=50):
    """Rows [CLS] tokens [SEP] (an internal [SEP] too, like packed documents); with `lengths`,
    right-padded with [PAD] and an attention mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(5, vocab, (B, T), generator=g)
    x[:, 0] = CLS
    x[:, T // 2] = SEP
    lengths = lengths or [T] * B
    for b, n in enumerate(lengths):
        x[b, n - 1] = SEP
        x[b, n:] = PAD
    batch = dict(input_ids=x)
    if any(n < T for n in lengths):
        batch["attention_mask"] = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return batch


PADDED = dict(lengths=[16, 11, 16, 7])


def ref_log_softmax_at(scores, index):
    """-log softmax(scores)[index] by explicit exp / sum (scores: a list of 0-d tensors)."""
    return -(scores[index] - torch.log(sum(torch.exp(s) for s in scores)))


def ref_mlm(model, h, input_ids, positions, labels):
    """Dense head on every position, then a loop over the used slots."""
    logits = model.mlm_logits(h)  # (B, T, V): all positions, as a naive implementation would
    terms = []
    for b in range(positions.size(0)):
        for k in range(positions.size(1)):
            if labels[b, k] != -100:
                row = logits[b, positions[b, k]]
                assert labels[b, k] == input_ids[b, positions[b, k]]
                terms.append(ref_log_softmax_at(list(row), labels[b, k]))
    return sum(terms) / len(terms)


def ref_tp(model, h, input_ids, positions, labels):
    """MLM+TP's second term: every unmasked real token (padding holds [PAD]), predicted from the corrupted
    input, mean CE."""
    logits = model.mlm_logits(h)
    selected = {(b, p.item()) for b in range(positions.size(0)) for p, l in zip(positions[b], labels[b]) if l != -100}
    terms = [ref_log_softmax_at(list(logits[b, t]), input_ids[b, t]) for b in range(input_ids.size(0))
             for t in range(input_ids.size(1)) if input_ids[b, t] > MASK and (b, t) not in selected]
    return sum(terms) / len(terms)


def ref_head(head, v):
    """ELECTRA's disc_head (dense, GELU, dense to 1) or COCO-LM's scl_head (dense, GELU, LayerNorm) on one vector,
    written out from its weights, so that a change to the head's layers cannot move its reference too."""
    dense, last = head[0], head[2]
    a = dense.weight @ v + dense.bias
    a = 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))  # BERT's exact GELU
    if isinstance(last, nn.LayerNorm):
        return (a - a.mean()) / torch.sqrt(a.var(unbiased=False) + 1e-12) * last.weight + last.bias
    return last.weight @ a + last.bias


def close(a, b):
    """float64 against a float64 reference: only summation order differs (~1e-15), a bug shows far above"""
    return torch.allclose(a, b, rtol=0, atol=1e-10)


def assert_same_gradients(loss, expected, named_parameters):
    """loss and its reference have the same gradient w.r.t. every trainable parameter: equal values say nothing
    of a stop-gradient too many or too few. Float64 on both sides: only summation order differs."""
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    got, want = (torch.autograd.grad(l, [p for _, p in named], retain_graph=True, allow_unused=True)
                 for l in (loss, expected))
    for (name, p), a, b in zip(named, got, want):
        a, b = (torch.zeros_like(p) if g is None else g for g in (a, b))
        assert torch.allclose(a, b, rtol=0, atol=1e-10 * max(b.abs().max().item(), 1e-3)), name


def entropy(rate):  # BCE of always guessing `rate`, in nats: the detectors' trivial baseline
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def replaced_at_masked(x, x_mlm, positions, labels):
    """Share of the masked slots whose sample differs from the original token."""
    flags = [float(x_mlm[b, p] != x[b, p]) for b in range(x.size(0)) for p, l in zip(positions[b], labels[b])
             if l != -100]
    return sum(flags) / len(flags)


def cos(a, b):
    return (a * b).sum() / (a.norm() * b.norm())


# ------------------------------------------------------------------------------------------
# masking


def test_random_real_tokens_uniform_and_never_special():
    config = BertConfig(vocab_size=120, pad_token_id=0, unk_token_id=100, cls_token_id=101, sep_token_id=102,
                        mask_token_id=103)  # bert-base-uncased's layout, scaled down
    tokens = random_real_tokens((200_000,), config, seeded(), "cpu")
    counts = torch.bincount(tokens, minlength=120)
    assert counts.numel() == 120
    assert counts[[0, 100, 101, 102, 103]].sum() == 0
    real = counts[[i for i in range(120) if i not in (0, 100, 101, 102, 103)]].double()
    assert (real > 0).all() and (real / real.mean() - 1).abs().max() < 0.1


@pytest.mark.parametrize("fracs", [(0.8, 0.1), (0.85, 0.0)])
def test_mask_tokens_statistics(fracs):
    mask_frac, random_frac = fracs
    g = torch.Generator().manual_seed(1)
    B, T = 256, 64
    x = torch.randint(5, 50, (B, T), generator=g)
    x[torch.rand(B, T, generator=g) < 0.05] = UNK  # specials sprinkled inside the rows
    x[:, 0], x[:, 20], x[:, 40] = CLS, SEP, MASK
    lengths = torch.randint(30, T + 1, (B,), generator=g)
    attention_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    x[attention_mask == 0] = PAD
    x[torch.arange(B), lengths - 1] = SEP
    config = BertConfig(**TINY)
    corrupted, positions, labels = mask_tokens(x, config, seeded(2), 0.15, mask_frac, random_frac, attention_mask)
    assert positions.shape == labels.shape == (B, math.ceil(0.15 * T))
    used = labels != -100
    eligible = (x > MASK) & attention_mask.bool()
    # exactly round(p * eligible) per row, all eligible, distinct, labels = original tokens
    assert torch.equal(used.sum(1), (eligible.sum(1) * 0.15).round().long())
    assert eligible.gather(1, positions)[used].all()
    assert torch.equal(labels[used], x.gather(1, positions)[used])
    selected = torch.zeros_like(eligible).scatter(1, positions, used)
    assert selected.sum() == used.sum()
    # everything not selected (specials, padding included) is untouched
    assert torch.equal(corrupted[~selected], x[~selected])
    new, old = corrupted[selected], x[selected]
    frac_mask = (new == MASK).double().mean()
    frac_random = ((new != MASK) & (new != old)).double().mean()
    assert abs(frac_mask - mask_frac) < 0.02 and abs(frac_random - random_frac) < 0.02
    assert (new[new != MASK] > MASK).all()  # random replacements are real, non-special tokens


def test_masked_positions_are_uniform_over_the_row():
    """Each eligible column is selected equally often: the right count per row (checked above) is not enough,
    a top-k that favoured the end of the row (or its start) would still select round(p * eligible)."""
    B, T = 20000, 20
    x = torch.randint(5, 50, (B, T), generator=seeded(0))
    x[:, 0], x[:, -1] = CLS, SEP
    _, positions, labels = mask_tokens(x, BertConfig(**TINY), seeded(1))
    hits = torch.zeros(B, T).scatter(1, positions, (labels != -100).float()).sum(0)
    assert hits[0] == hits[-1] == 0
    # round(0.15 * 18) = 3 of the 18 eligible columns per row: 1/6 each, sd 1.6% of that (20 seeds: within 5.5%)
    assert ((hits[1:-1] / B * 6 - 1).abs() < 0.1).all(), hits / B


def test_padding_is_never_masked_whatever_id_it_holds():
    """Padding is what the attention mask says, not the [PAD] id: padding that holds real ids (a collator
    padding with another id, or stale tokens) is neither eligible nor counted in round(p * eligible)."""
    batch = make_batch(**PADDED)
    x, am = batch["input_ids"].clone(), batch["attention_mask"]
    x[am == 0] = 7
    config = BertConfig(**TINY)
    eligible = (x > MASK) & am.bool()
    assert torch.equal(losses.eligible_positions(x, config, am), eligible)
    for seed in range(10):
        _, positions, labels = mask_tokens(x, config, seeded(seed), 0.15, attention_mask=am)
        used = labels != -100
        assert torch.equal(used.sum(1), (eligible.sum(1) * 0.15).round().long())
        assert am.gather(1, positions)[used].all()


class Recorder(nn.Module):
    """Wraps Bert and keeps the ids of each forward: the input the objective's encoder actually saw (the
    generators read the shared embeddings directly, so those are not recorded)."""

    def __init__(self, bert):
        super().__init__()
        self.bert, self.config, self.embeddings, self.seen = bert, bert.config, bert.embeddings, []

    def forward(self, input_ids, **kw):
        self.seen.append(input_ids)
        return self.bert(input_ids, **kw)

    def mlm_logits(self, h):
        return self.bert.mlm_logits(h)


@pytest.mark.parametrize("name", ["mlm", "taco", "tacl"])
def test_mlm_objectives_mask_with_mask_prob_and_the_bert_split(name):
    """MLM, TACO and TaCL corrupt their input with cfg.mask_prob and BERT's 80/10/10: the reference tests run at
    the default 0.15, which a hard-coded 0.15 would pass, so 0.3 here, and the replay names every value (a
    replay with mask_tokens' defaults would follow those defaults wherever they moved). The split itself is
    test_mask_tokens_statistics'."""
    bert = tiny_model()
    model = Recorder(bert)
    objective = build(name, bert, mask_prob=0.3, taco_negatives=3)
    x = make_batch(B=32, T=32)["input_ids"]
    objective(model, dict(input_ids=x), seeded(4))
    expected = mask_tokens(x, bert.config, seeded(4), 0.3, 0.8, 0.1)[0]
    assert torch.equal(model.seen[0], expected)
    # the batch tells the split and the rate apart: ELECTRA's 85/0/15 or p = 0.15 would corrupt differently
    assert not torch.equal(mask_tokens(x, bert.config, seeded(4), 0.3, 0.85, 0.0)[0], expected)
    assert not torch.equal(mask_tokens(x, bert.config, seeded(4), 0.15, 0.8, 0.1)[0], expected)


def test_mask_tokens_deterministic_and_global_rng_untouched():
    x = make_batch(**PADDED)
    state = torch.get_rng_state()
    a = mask_tokens(x["input_ids"], BertConfig(**TINY), seeded(5), attention_mask=x["attention_mask"])
    b = mask_tokens(x["input_ids"], BertConfig(**TINY), seeded(5), attention_mask=x["attention_mask"])
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(state, torch.get_rng_state())


# ------------------------------------------------------------------------------------------
# every objective: interface, names, state_dict, global RNG


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("padded", [False, True])
def test_interface(name, padded):
    model = tiny_model(double=False)
    objective = LOSSES[name](model, make_cfg())
    batch = make_batch(**(PADDED if padded else {}))
    state = torch.get_rng_state()
    loss, metrics = objective(model, batch, seeded())
    assert torch.equal(state, torch.get_rng_state())  # every draw came from rng
    assert loss.dim() == 0 and torch.isfinite(loss)
    # an objective you add runs here too: its log names need only include a loss term until listed in NAMES
    assert set(metrics) == NAMES[name] if name in NAMES else any(k.endswith("_loss") for k in metrics)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad and torch.isfinite(v)
               for v in metrics.values())
    # the main model's weights are never part of the objective's state
    own = set(objective.state_dict())
    assert not any(k.startswith(("embeddings.", "encoder.", "head.")) for k in own)
    loss.backward()


# ------------------------------------------------------------------------------------------
# MLM


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("predict_all", [False, True])
def test_mlm_matches_reference(padded, predict_all):
    model = tiny_model()
    objective = build("mlm", model, mlm_predict_all=predict_all)
    batch = make_batch(**(PADDED if padded else {}))
    x, am = batch["input_ids"], batch.get("attention_mask")
    loss, metrics = objective(model, batch, seeded(3))
    corrupted, positions, labels = mask_tokens(x, model.config, seeded(3), 0.15, 0.8, 0.1, am)
    h = model(corrupted, attention_mask=am)
    expected = ref_mlm(model, h, x, positions, labels)
    assert close(metrics["mlm_loss"], expected)
    logits = model.mlm_logits(h)
    hits = [float(logits[b, p].argmax() == l) for b in range(x.size(0)) for p, l in zip(positions[b], labels[b])
            if l != -100]
    assert abs(metrics["mlm_acc"].item() - sum(hits) / len(hits)) < 1e-6  # a float32 ratio, as every accuracy
    if predict_all:
        tp = ref_tp(model, h, x, positions, labels)
        assert close(metrics["tp_loss"], tp)
        expected = expected + tp
    assert close(loss, expected)


def test_token_prediction_ignores_padding_whatever_its_ids():
    # padding is told by the attention mask, not by [PAD]'s id: the same rows padded with another id score the same
    model = tiny_model()
    objective = build("mlm", model, mlm_predict_all=True)
    batch = make_batch(**PADDED)
    other = {k: v.clone() for k, v in batch.items()}
    other["input_ids"][other["attention_mask"] == 0] = 7
    first, second = objective(model, batch, seeded(3))[1], objective(model, other, seeded(3))[1]
    assert close(first["tp_loss"], second["tp_loss"]) and close(first["mlm_loss"], second["mlm_loss"])


def test_mlm_decodes_with_the_word_embeddings():
    # tied decoder: with tokens 5..20 only in the input, rows 21..49 of the word embeddings learn through the head
    model = tiny_model()
    loss, _ = build("mlm", model)(model, make_batch(vocab=21), seeded())
    loss.backward()
    assert (model.embeddings.word.weight.grad[21:50].abs().sum(-1) > 0).all()


def test_masked_mean_ignores_nan_and_inf_at_masked_out_positions():
    # masked_mean's contract (a where, not a product): a NaN or inf where the mask is off never reaches the mean
    values = torch.tensor([1.0, float("nan"), float("inf"), 3.0])
    assert losses.masked_mean(values, torch.tensor([True, False, False, True])) == 2.0


class EchoModel(nn.Module):
    """Predicts each position's visible token (h = its one-hot, logits = 10 h): right exactly at the
    selected slots that masking left unchanged, so an accuracy over the wrong slots shows."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, input_ids, attention_mask=None):
        return F.one_hot(input_ids, self.config.vocab_size).double()

    def mlm_logits(self, h):
        return 10 * h


def test_mlm_accuracy_is_over_the_selected_slots():
    model = EchoModel(BertConfig(**TINY))
    x = make_batch(B=32, T=32)["input_ids"]
    _, metrics = build("mlm", model)(model, dict(input_ids=x), seeded(3))
    corrupted, positions, labels = mask_tokens(x, model.config, seeded(3))
    used = labels != -100
    unchanged = (corrupted.gather(1, positions) == labels)[used].double().mean()
    assert 0 < unchanged < 0.3 and abs(metrics["mlm_acc"] - unchanged) < 1e-6


@pytest.mark.parametrize("name", ["mlm", "tacl", "electra"])
def test_no_targets_gives_zero_not_nan(name):
    model = tiny_model(double=False)
    x = torch.tensor([[CLS, MASK + 1, MASK + 2, SEP]] * 2)  # 2 eligible tokens: round(0.3) = 0 targets
    loss, metrics = LOSSES[name](model, make_cfg())(model, {"input_ids": x}, seeded())
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    loss.backward()


# ------------------------------------------------------------------------------------------
# TACO


class ShiftedModel(nn.Module):
    """Wraps Bert so that h - emb is whatever `global_part(h, emb)` returns (for TACO invariants)."""

    def __init__(self, bert, global_part):
        super().__init__()
        self.bert, self.config, self.global_part = bert, bert.config, global_part

    def forward(self, input_ids, attention_mask=None, return_embeddings=False):
        h, emb = self.bert(input_ids, attention_mask=attention_mask, return_embeddings=True)
        return emb + self.global_part(h, emb), emb

    def mlm_logits(self, h):
        return self.bert.mlm_logits(h)


def test_taco_samples_follow_the_official_sampler():
    batch = make_batch(B=4, T=12, lengths=[12, 9, 12, 5])
    valid = batch["attention_mask"].bool()
    B, T = valid.shape
    rng = seeded(7)
    offsets, edge_hits, neg_hits = torch.zeros(5), torch.zeros(B, T), torch.zeros(B * T)
    for _ in range(300):
        positive, negatives = taco_samples(valid, 5, 20, rng)
        pos_row, pos_col = positive // T, positive % T
        assert torch.equal(pos_row, torch.arange(B)[:, None].expand(B, T))  # same sequence
        assert valid.flatten()[positive][valid].all()  # never padding (for real anchors)
        assert (pos_col != torch.arange(T))[valid].all()  # never the anchor itself
        interior = valid.clone()
        interior[:, :2] = False
        for b, n in enumerate(valid.sum(1).tolist()):
            interior[b, n - 2:] = False
        d = (pos_col - torch.arange(T))[interior]
        offsets += torch.stack([(d == o).sum() for o in (-2, -1, 0, 1, 2)])
        edge_hits[0] += torch.bincount(pos_col[0, 0:1], minlength=T)  # anchor (0, 0): -1, -2 fall outside
        assert (negatives // T != torch.arange(B)[:, None, None]).all()  # other sequences only
        assert valid.flatten()[negatives].all()  # never padding
        neg_hits += torch.bincount(negatives[2, 3].flatten(), minlength=B * T).double()  # anchor in row 2
    # interior anchors: offsets uniform over {-2, -1, 1, 2}, never 0
    assert offsets[2] == 0 and ((offsets[[0, 1, 3, 4]] / offsets.sum() - 0.25).abs() < 0.03).all()
    # anchor at t=0: half the draws are +1/+2, the other half fall back uniformly on positions 1..11
    probs = edge_hits[0] / 300
    assert probs[0] == 0 and abs(probs[1] - (0.25 + 0.5 / 11)) < 0.08 and abs(probs[5] - 0.5 / 11) < 0.05
    # negatives of row 2: a row uniform among rows 0, 1, 3, then a position uniform among its non-pad ones
    hits = neg_hits.view(B, T)
    assert hits[2].sum() == 0 and hits[~valid].sum() == 0
    for row, n in ((0, 12), (1, 9), (3, 5)):
        assert ((hits[row, :n] / (300 * 20 / 3 / n) - 1).abs() < 0.3).all()


@pytest.mark.parametrize("window", [3, 9])
def test_taco_positive_window_follows_taco_window(window):
    """Windows other than the default 5: an interior anchor's positive is at an offset uniform over
    {-W//2, ..., W//2} minus 0 (3: +-1 only; 9: up to +-4)."""
    valid = torch.ones(4, 64, dtype=torch.bool)
    half, rng, hits = window // 2, seeded(1), torch.zeros(window)
    for _ in range(100):
        positive, _ = taco_samples(valid, window, 2, rng)
        d = (positive % 64 - torch.arange(64))[:, half:64 - half]  # anchors whose whole window is in the row
        assert (d.abs() <= half).all() and (d != 0).all()
        hits += torch.bincount((d + half).flatten(), minlength=window).double()
    share = hits[[i for i in range(window) if i != half]] / hits.sum()
    assert ((share * (window - 1) - 1).abs() < 0.1).all(), share  # sd 1.8% (W=9), 0.6% (W=3); 20 seeds: within 5%


def test_taco_negative_pool_draws():
    valid = make_batch(B=6, T=10, lengths=[10, 9, 10, 5, 10, 8])["attention_mask"].bool()
    B, T = valid.shape
    # a pool of the whole batch draws exactly what the official per-batch sampler draws
    for pool in (B, 0):
        same = taco_samples(valid, 5, 8, seeded(3), pool)
        assert all(torch.equal(a, b) for a, b in zip(taco_samples(valid, 5, 8, seeded(3)), same))
    # pools of 2 and 3 rows: negatives stay in the anchor's pool, rows uniform among its other rows
    for pool in (2, 3):
        rng, hits = seeded(5), torch.zeros(B, B)
        for _ in range(200):
            positive, negatives = taco_samples(valid, 5, 8, rng, pool)
            neg_row = negatives // T
            anchor_row = torch.arange(B)[:, None, None]
            assert (neg_row // pool == anchor_row // pool).all() and (neg_row != anchor_row).all()
            assert valid.flatten()[negatives].all()
            hits += torch.zeros(B, B).index_put_((anchor_row.expand_as(neg_row).flatten(), neg_row.flatten()),
                                                 torch.ones(neg_row.numel()), accumulate=True)
        for row in range(B):
            others = [r for r in range(B) if r // pool == row // pool and r != row]
            share = hits[row, others] / hits[row].sum()
            assert ((share * (pool - 1) - 1).abs() < 0.1).all(), (pool, row, share)


def test_negative_pool_must_divide_the_batch():
    assert pool_size(0, 12) == 12 and pool_size(4, 12) == 4
    for bad in (5, -1):
        with pytest.raises(ValueError, match="negative_pool"):
            pool_size(bad, 12)
    model = tiny_model(double=False)
    with pytest.raises(ValueError, match="negative_pool 3 must divide"):
        LOSSES["taco"](model, make_cfg(negative_pool=3))(model, make_batch(B=4), seeded())
    with pytest.raises(ValueError, match="negative_pool >= 2"):
        LOSSES["taco"](model, make_cfg(negative_pool=1))(model, make_batch(B=4), seeded())
    with pytest.raises(ValueError, match="negative_pool 3 must divide"):
        LOSSES["cocolm"](model, make_cfg(negative_pool=3))(model, make_batch(B=4), seeded())


def dense_negative_dots(anchor, targets, negatives, fused=False):
    """The readable version: gather every negative vector at once, (B, T, K, D) floats, kept for backward."""
    return torch.einsum("btd,btkd->btk", anchor, losses.upcast(targets[negatives]))


@pytest.mark.parametrize("chunk", [1, 3, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_dots_match_the_dense_gather(monkeypatch, chunk, dtype):
    torch.manual_seed(0)
    B, T, K, D = 3, 5, 7, 8
    monkeypatch.setattr(losses, "NEGATIVE_CHUNK_FLOATS", chunk * B * T * D)
    anchor = torch.randn(B, T, D, requires_grad=True)
    targets = torch.randn(B * T, D).to(dtype).requires_grad_()  # with gradient: the taco_stop_grad=False ablation
    negatives = torch.randint(B * T, (B, T, K))
    weights = torch.randn(B, T, K)
    results = []
    for fn in (NegativeDots.apply, dense_negative_dots):
        anchor.grad = targets.grad = None
        scores = fn(anchor, targets, negatives)
        (scores * weights).sum().backward()
        results.append((scores.detach(), anchor.grad.clone(), targets.grad.clone()))
    (scores, anchor_grad, targets_grad), (ref_scores, ref_anchor_grad, ref_targets_grad) = results
    assert scores.dtype == anchor_grad.dtype == torch.float32  # accumulated in fp32 whatever the targets' dtype
    assert torch.allclose(scores, ref_scores, atol=1e-5) and torch.allclose(anchor_grad, ref_anchor_grad, atol=1e-5)
    # the targets' own gradient has their dtype: chunks add up in bf16, within bf16 rounding
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(targets_grad.float(), ref_targets_grad.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fused_negative_dots_match_the_dense_gather(dtype):
    """The compiled kernel TACO scores its negatives with on CUDA, compiled here for the CPU: the same scores
    and gradients as the readable gather, accumulated in fp32 (float64 stays float64)."""
    torch.manual_seed(0)
    B, T, K, D = 3, 5, 7, 8
    anchor = losses.upcast(torch.randn(B, T, D, dtype=dtype)).requires_grad_()
    targets, negatives = torch.randn(B * T, D, dtype=dtype), torch.randint(B * T, (B, T, K))
    weights = torch.randn(B, T, K)
    results = []
    for fn in (lambda *args: NegativeDots.apply(*args, True), dense_negative_dots):
        anchor.grad = None
        scores = fn(anchor, targets, negatives)
        (scores * weights.to(scores.dtype)).sum().backward()
        results.append((scores.detach(), anchor.grad.clone()))
    (scores, anchor_grad), (ref_scores, ref_anchor_grad) = results
    assert scores.dtype == anchor.dtype and not torch.equal(scores, torch.zeros_like(scores))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(scores, ref_scores, atol=tol) and torch.allclose(anchor_grad, ref_anchor_grad, atol=tol)


@pytest.mark.parametrize("name", ["taco", "tacl"])
def test_similarities_stay_fp32_under_bf16_autocast(name, monkeypatch):
    """TACO's cosines and TaCL's scores, divided by tau (1/tau = 14 and 100), are computed in fp32 under bf16 autocast
    (fidelity note 11), CPU autocast standing in for CUDA's: in bf16 the einsums keep ~3 digits. On the smoke TaCL
    (300 MLM + 100 TaCL steps, CUDA's autocast rules emulated on the CPU), dropping that fp32 block moved tacl_loss
    7.4e-3 (relative) from float64 and the gradient 1.9e-2, against 1.0e-3 and 5.9e-3 with it."""
    seen = []  # the dtype of each cross-entropy's logits: MLM's (bf16), then TaCL's scores
    real = losses.cross_entropy
    monkeypatch.setattr(losses, "cross_entropy", lambda logits, y: seen.append(logits.dtype) or real(logits, y))
    model = tiny_model(double=False)
    with torch.autocast("cpu", torch.bfloat16):
        _, metrics = build(name, model, double=False, taco_negatives=7)(model, make_batch(), seeded(1))
    assert seen[0] == torch.bfloat16  # autocast is on: the MLM head's logits are bf16
    if name == "taco":
        assert metrics["pos_cos"].dtype == metrics["neg_cos"].dtype == metrics["tc_loss"].dtype == torch.float32
    else:
        assert seen[1] == torch.float32


def test_negative_dots_keep_no_gathered_tensor_for_backward():
    B, T, K, D = 3, 5, 7, 8
    anchor, targets = torch.randn(B, T, D, requires_grad=True), torch.randn(B * T, D)
    negatives = torch.randint(B * T, (B, T, K))
    for fn, largest in ((NegativeDots.apply, B * T * D), (dense_negative_dots, B * T * K * D)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            fn(anchor, targets, negatives).sum().backward()
        assert max(saved) == largest  # the inputs only (already in memory), vs the K-fold gather


@pytest.mark.parametrize("stop_grad", [True, False])
@pytest.mark.parametrize("double", [True, False])
def test_taco_gradients_match_the_dense_gather(monkeypatch, stop_grad, double):
    """Chunks of 2 negatives against the unchunked (B, T, K, D) gather: same loss, same gradients, to float64
    precision. In fp32 both are 2.2e-5 (of each gradient's scale) from float64, so 3e-5 apart at most."""
    monkeypatch.setattr(losses, "NEGATIVE_CHUNK_FLOATS", 2 * 4 * 16 * 16)
    grads = []
    for fn in (NegativeDots.apply, dense_negative_dots):
        monkeypatch.setattr(losses.NegativeDots, "apply", fn)
        model = tiny_model(double=double)
        loss, _ = build("taco", model, double=double, taco_negatives=7, taco_stop_grad=stop_grad)(
            model, make_batch(**PADDED), seeded(1))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, fast), (expected, slow) = grads
    assert torch.allclose(loss, expected, atol=1e-12 if double else 1e-5) and fast.keys() == slow.keys()
    tol = 1e-12 if double else 3e-5
    for name in fast:
        assert torch.allclose(fast[name], slow[name], rtol=0, atol=tol * slow[name].abs().max()), name


@pytest.mark.parametrize("padded,anchors,W,tau,pool,predict_all", [
    (False, "all", 5, 0.07, 0, False), (True, "all", 5, 0.07, 0, False),
    (False, "masked", 5, 0.07, 0, False), (True, "masked", 5, 0.07, 0, False),
    # the other hyperparameters off their defaults (W 5, tau 0.07, the whole batch, MLM alone): each reaches the loss
    (True, "all", 3, 0.2, 2, True),
    # a row of one token (padded data) has no positive: its anchor is left out; a row of two keeps both
    ("one", "all", 5, 0.07, 0, False)])
def test_taco_matches_reference(padded, anchors, W, tau, pool, predict_all):
    """Value and gradient: positives and negatives are detached (taco_stop_grad), so the gradient reaches h and
    the embeddings through the anchor (and MLM) only."""
    model = tiny_model()
    K = 6
    objective = build("taco", model, taco_window=W, taco_negatives=K, taco_temperature=tau, taco_anchors=anchors,
                      taco_weight=0.7, negative_pool=pool, mlm_predict_all=predict_all)
    batch = make_batch(**(dict(B=5, lengths=[16, 1, 16, 7, 2]) if padded == "one" else PADDED if padded else {}))
    x, am = batch["input_ids"], batch.get("attention_mask")
    B, T = x.shape
    valid = am.bool() if padded else torch.ones_like(x, dtype=torch.bool)
    loss, metrics = objective(model, batch, seeded(4))
    # replay the draws: masking, then TACO's positives and negatives
    rng = seeded(4)
    corrupted, positions, labels = mask_tokens(x, model.config, rng, 0.15, 0.8, 0.1, am)
    positive, negatives = taco_samples(valid, W, K, rng, pool)
    assert (negatives // T // (pool or B) == torch.arange(B)[:, None, None] // (pool or B)).all()  # the anchor's pool
    h, emb = model(corrupted, attention_mask=am, return_embeddings=True)
    g = (h - emb).reshape(-1, h.size(-1))
    masked = {(b, p.item()) for b in range(B) for p, l in zip(positions[b], labels[b]) if l != -100}
    terms, pos_cos, neg_cos = [], [], []
    for b in range(B):
        for t in range(T):
            if not valid[b, t] or (anchors == "masked" and (b, t) not in masked) or valid[b].sum() < 2:
                continue
            anchor = g[b * T + t]
            scores = [cos(anchor, g[n].detach()) / tau for n in [positive[b, t], *negatives[b, t]]]
            terms.append(ref_log_softmax_at(scores, 0))
            pos_cos.append(scores[0] * tau)
            neg_cos.append(sum(scores[1:]) * tau / K)
    tc = sum(terms) / len(terms)
    mlm = ref_mlm(model, h, x, positions, labels)
    if predict_all:
        tp = ref_tp(model, h, x, positions, labels)
        assert close(metrics["tp_loss"], tp)
        mlm = mlm + tp
    assert close(metrics["tc_loss"], tc)
    assert close(metrics["pos_cos"], sum(pos_cos) / len(pos_cos))
    assert close(metrics["neg_cos"], sum(neg_cos) / len(neg_cos))
    assert close(loss, mlm + 0.7 * tc)
    assert_same_gradients(loss, mlm + 0.7 * tc, model.named_parameters())


def test_taco_invariants():
    bert = tiny_model()
    batch = make_batch()
    K = 7
    objective = build("taco", bert, taco_negatives=K)
    # all g equal: every score is 1/tau, so L_TC = log(K + 1)
    constant = ShiftedModel(bert, lambda h, emb: torch.ones_like(h) * torch.linspace(-1, 1, h.size(-1)).double())
    _, metrics = objective(constant, batch, seeded())
    assert torch.allclose(metrics["tc_loss"], torch.tensor(math.log(K + 1)).double(), atol=1e-6)
    # cosine scores ignore the scale of g
    results = [objective(ShiftedModel(bert, lambda h, emb, s=s: s * (h - emb)), batch, seeded())[1]
               for s in (1.0, 9.5)]
    for key in ("tc_loss", "pos_cos", "neg_cos"):
        assert torch.allclose(results[0][key], results[1][key], atol=1e-8)


class LeafModel(nn.Module):
    """h and emb as leaf tensors, to read TACO's gradient routing position by position."""

    def __init__(self, bert, h, emb):
        super().__init__()
        self.bert, self.config, self.h, self.emb = bert, bert.config, h, emb

    def forward(self, input_ids, attention_mask=None, return_embeddings=False):
        return self.h, self.emb

    def mlm_logits(self, h):
        return self.bert.mlm_logits(h)


@pytest.mark.parametrize("stop_grad", [True, False])
def test_taco_gradient_routing(stop_grad):
    bert = tiny_model()
    batch = make_batch()
    B, T = batch["input_ids"].shape
    h = torch.randn(B, T, 16, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(B, T, 16, dtype=torch.float64, requires_grad=True)
    # anchors = the masked positions, where MLM also reads h: any other position gets gradient
    # only by serving as a positive or negative
    objective = build("taco", bert, taco_anchors="masked", taco_stop_grad=stop_grad)
    loss, _ = objective(LeafModel(bert, h, emb), batch, seeded())
    loss.backward()
    _, positions, labels = mask_tokens(batch["input_ids"], bert.config, seeded())
    anchor = torch.zeros(B, T, dtype=torch.bool).scatter(1, positions, labels != -100)
    assert (emb.grad[anchor].abs().sum(-1) > 0).all() and (h.grad[anchor].abs().sum(-1) > 0).all()
    if stop_grad:  # positives and negatives are detached
        assert (emb.grad[~anchor] == 0).all() and (h.grad[~anchor] == 0).all()
    else:
        assert (emb.grad[~anchor].abs().sum(-1) > 0).any() and (h.grad[~anchor].abs().sum(-1) > 0).any()


def test_taco_gradient_reaches_encoder_and_embeddings():
    grads = {}
    for weight in (0.0, 1.0):
        model = tiny_model()
        loss, _ = build("taco", model, taco_weight=weight)(model, make_batch(), seeded())
        loss.backward()
        grads[weight] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name in ("embeddings.ln.weight", "embeddings.position.weight", "encoder.layers.0.up.weight",
                 "encoder.layers.1.attn.qkv.weight"):
        assert not torch.allclose(grads[0.0][name], grads[1.0][name]), name


# ------------------------------------------------------------------------------------------
# TaCL


@pytest.mark.parametrize("padded", [False, True])
def test_tacl_matches_reference(padded):
    """Value and gradient: L_tc trains the student through h; the teacher is a frozen copy of the start."""
    model = tiny_model()
    teacher_init = copy.deepcopy(model)
    objective = build("tacl", model, tacl_temperature=0.05)
    with torch.no_grad():  # the student drifts away from the teacher, as after some training
        for p in model.encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = make_batch(**(PADDED if padded else {}))
    x, am = batch["input_ids"], batch.get("attention_mask")
    valid = am.bool() if padded else torch.ones_like(x, dtype=torch.bool)
    loss, metrics = objective(model, batch, seeded(2))
    corrupted, positions, labels = mask_tokens(x, model.config, seeded(2), 0.15, 0.8, 0.1, am)
    # all 15% are positions, the random and unchanged slots too: this draw has some (seed 6 had none)
    assert (corrupted.gather(1, positions)[labels != -100] != MASK).any()
    h = model(corrupted, attention_mask=am)
    with torch.no_grad():
        teacher = teacher_init(x, attention_mask=am)
    terms, hits = [], []
    for b in range(x.size(0)):
        for k in range(positions.size(1)):
            if labels[b, k] == -100:
                continue
            i = positions[b, k].item()
            columns = [j for j in range(x.size(1)) if valid[b, j]]
            scores = [cos(h[b, i], teacher[b, j]) / 0.05 for j in columns]
            terms.append(ref_log_softmax_at(scores, columns.index(i)))
            hits.append(float(columns[int(torch.stack(scores).argmax())] == i))
    tacl = sum(terms) / len(terms)
    assert close(metrics["tacl_loss"], tacl)
    assert abs(metrics["tacl_acc"].item() - sum(hits) / len(hits)) < 1e-6
    expected = ref_mlm(model, h, x, positions, labels) + tacl
    assert close(loss, expected)
    assert_same_gradients(loss, expected, model.named_parameters())  # L_tc trains the student through h


class OrthogonalModel(nn.Module):
    """Position t -> the t-th basis vector, whatever the input: student = teacher, tokens orthogonal."""

    def __init__(self, bert):
        super().__init__()
        self.bert, self.config = bert, bert.config

    def forward(self, input_ids, attention_mask=None):
        B, T = input_ids.shape
        return torch.eye(T, self.config.hidden_size, dtype=torch.float64).expand(B, T, -1)

    def mlm_logits(self, h):
        return self.bert.mlm_logits(h)


def test_tacl_loss_vanishes_when_student_matches_teacher_on_orthogonal_tokens():
    model = OrthogonalModel(tiny_model())
    _, metrics = build("tacl", model)(model, make_batch(), seeded())  # tau = 0.01: e^{-100} per negative
    assert metrics["tacl_loss"] < 1e-30 and metrics["tacl_acc"] == 1


def test_tacl_teacher_frozen_in_eval_mode_and_gets_no_gradient():
    model = tiny_model(double=False, dropout=0.5)
    objective = LOSSES["tacl"](model, make_cfg())
    objective.train(), model.train()
    assert not objective.teacher.training and all(not m.training for m in objective.teacher.modules())
    assert not any(p.requires_grad for p in objective.parameters())  # nothing for the optimizer
    x = make_batch()["input_ids"]
    with torch.no_grad():  # eval mode: dropout off, deterministic
        assert torch.equal(objective.teacher(x), objective.teacher(x))
    loss, _ = objective(model, make_batch(), seeded())
    loss.backward()
    assert all(p.grad is None for p in objective.teacher.parameters())
    assert model.encoder.layers[0].up.weight.grad is not None
    # the teacher is a copy: training the student leaves it at the starting weights
    with torch.no_grad():
        model.encoder.layers[0].up.weight.add_(1.0)
    assert not torch.equal(objective.teacher.encoder.layers[0].up.weight, model.encoder.layers[0].up.weight)
    assert any(k.startswith("teacher.") for k in objective.state_dict())  # restored on resume


def test_tacl_requires_init_from():
    with pytest.raises(ValueError, match=r"--init_from.*--objective mlm.*--objective tacl --init_from out/mlm"):
        LOSSES["tacl"](tiny_model(), make_cfg(init_from=""))


# ------------------------------------------------------------------------------------------
# COCO-LM and ELECTRA


def replay_generator(objective, model, x, am, seed, mask_frac, random_frac):
    """Re-run the generator's draws: masking, generator logits, Gumbel samples. A second generator forward,
    as the two-forward version did at dropout 0 (ELECTRA now samples from its one training forward)."""
    rng = seeded(seed)
    corrupted, positions, labels = mask_tokens(x, model.config, rng, 0.15, mask_frac, random_frac, am)
    logits = objective.generator.logits(model, corrupted, am, positions)
    sampled = sample_tokens(logits, rng).view_as(positions)
    x_mlm = x.clone()
    for b in range(x.size(0)):
        for k in range(positions.size(1)):
            if labels[b, k] != -100:
                x_mlm[b, positions[b, k]] = sampled[b, k]
    gen_terms = [ref_log_softmax_at(list(logits[i]), l) for i, l in enumerate(labels.flatten()) if l != -100]
    return rng, x_mlm, positions, labels, sum(gen_terms) / len(gen_terms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_tokens_follow_the_softmax(dtype):
    """sample_tokens against the law it must follow: 200k draws of softmax(logits) over 6 tokens (one at
    -inf, never drawn) match its probabilities within 5 standard errors, in every row."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5], [0.0, 0.0, 0.0, 0.0, 0.0, float("-inf")]])
    n = 100_000
    draws = sample_tokens(logits.to(dtype).repeat_interleave(n, 0), seeded(0)).view(2, n)
    probs = logits.to(dtype).float().softmax(-1)
    for row in range(2):
        freq = torch.bincount(draws[row], minlength=6).double() / n
        stderr = (probs[row].double() * (1 - probs[row].double()) / n).sqrt()
        assert torch.all((freq - probs[row]).abs() <= 5 * stderr + 1e-12), (freq, probs[row])
    assert not (draws == 4)[0].any() and not (draws == 5)[1].any()


@pytest.mark.parametrize("padded,negative_pool", [(False, 0), (True, 0), (True, 2), (False, 1)])
def test_cocolm_matches_reference(padded, negative_pool):
    model = tiny_model()
    objective = build("cocolm", model, negative_pool=negative_pool, cocolm_scl_temperature=0.1)
    with torch.no_grad():  # non-trivial heads
        objective.lm_bias.normal_()
        objective.copy_head.bias.fill_(0.3)
        g = seeded(1)  # and distinct [CLS] states: at init they are alike, and every pairing scores the same
        for p in model.encoder.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    batch = make_batch(**(PADDED if padded else {}))
    x, am = batch["input_ids"], batch.get("attention_mask")
    valid = am.bool() if padded else torch.ones_like(x, dtype=torch.bool)
    loss, metrics = objective(model, batch, seeded(8))
    rng, x_mlm, positions, labels, gen_loss = replay_generator(objective, model, x, am, 8, 0.8, 0.1)
    crop_ids, crop_mask = crop_views(x, model.config, rng, 0.9, am)
    h = model(x_mlm, attention_mask=am)
    B, T = x.shape
    copy_terms, rows = [], []
    for b in range(B):
        for t in range(T):
            if valid[b, t]:
                p1, orig = sigmoid(objective.copy_head(h[b, t])[0]), float(x_mlm[b, t] == x[b, t])
                copy_terms.append(-(orig * torch.log(p1) + (1 - orig) * torch.log(1 - p1)))
                rows.append((orig, p1.item()))
    copy_loss, lm_loss = sum(copy_terms) / len(copy_terms), ref_corrective_lm(objective, model, h, x, x_mlm, positions,
                                                                               labels)
    # SCL: the x^MLM view and the crop view, NT-Xent over the 2P views of each pool (P = B: all 2B)
    h_crop = model(crop_ids, attention_mask=crop_mask)
    s = [ref_head(objective.scl_head, v) for v in list(h[:, 0]) + list(h_crop[:, 0])]
    pool_of = lambda view: (view % B) // (negative_pool or B)  # view i is of sequence i mod B
    scl_terms = []
    for i in range(2 * B):
        others = [j for j in range(2 * B) if j != i and pool_of(j) == pool_of(i)]
        scores = [cos(s[i], s[j]) / 0.1 for j in others]
        scl_terms.append(ref_log_softmax_at(scores, others.index((i + B) % (2 * B))))
    scl_loss = sum(scl_terms) / len(scl_terms)
    if negative_pool != 1:  # a pool of 1 has one candidate, the partner: the loss is 0 whatever the pairing
        assert abs(scl_loss - math.log(2 * (negative_pool or B) - 1)) > 0.05  # not the uniform log(2P - 1)
    for key, value in dict(gen_loss=gen_loss, copy_loss=copy_loss, lm_loss=lm_loss, scl_loss=scl_loss).items():
        assert close(metrics[key], value), key
    expected = gen_loss + 50 * copy_loss + lm_loss + scl_loss
    assert close(loss, expected)
    # every term trains the encoder (and its own head); only p_copy inside L_LM is detached
    assert_same_gradients(loss, expected, [*model.named_parameters(), *objective.named_parameters()])
    # the logged detector numbers, over the non-pad tokens; replaced_frac over the masked slots
    assert abs(metrics["copy_acc"] - sum(float((p > 0.5) == (o == 1)) for o, p in rows) / len(rows)) < 1e-6
    assert abs(metrics["copy_trivial"] - entropy(1 - sum(o for o, _ in rows) / len(rows))) < 1e-6
    assert abs(metrics["replaced_frac"] - replaced_at_masked(x, x_mlm, positions, labels)) < 1e-6


def sigmoid(z):
    return 1 / (1 + torch.exp(-z))


def ref_corrective_lm(objective, model, h, x, x_mlm, positions, labels):
    """COCO-LM's L_LM, slot by slot: -log(orig sg(p_copy(1)) + sg(p_copy(0)) softmax(E h + b)[x]), sg = detach:
    L_LM trains the LM head and the encoder, never the copy head through p_copy."""
    terms = []
    for b in range(x.size(0)):
        for k in range(positions.size(1)):
            if labels[b, k] != -100:
                t = positions[b, k]
                p1, orig = sigmoid(objective.copy_head(h[b, t])[0]).detach(), float(x_mlm[b, t] == x[b, t])
                lm = model.embeddings.word.weight[:model.config.vocab_size] @ h[b, t] + objective.lm_bias
                q = torch.exp(lm[x[b, t]]) / torch.exp(lm).sum()
                terms.append(-torch.log(orig * p1 + (1 - p1) * q))
    return sum(terms) / len(terms)


def sevens_in_rows_0_and_2(batch):
    """Rows 0 and 2: every real token is 7 (a sampled 7 there is the original); rows 1 and 3 hold no 7."""
    x = batch["input_ids"]
    real = x > MASK
    x[[0, 2]] = torch.where(real[[0, 2]], 7, x[[0, 2]])
    x[[1, 3]] = torch.where(x[[1, 3]] == 7, 8, x[[1, 3]])
    return x


def test_cocolm_a_sample_equal_to_the_original_counts_as_original(monkeypatch):
    """The generator is right in rows 0 and 2 (every sample is the original token) and wrong in rows 1 and 3:
    L_LM takes its orig * p_copy(1) branch exactly there, and replaced_frac counts only rows 1 and 3's masked
    slots (padded rows: 2, 1, 2, 1 of their 3 slots used, so a rate over every slot would read 1/2, not 1/3)."""
    monkeypatch.setattr(losses, "sample_tokens", lambda logits, rng: torch.full(logits.shape[:-1], 7))
    model = tiny_model()
    objective = build("cocolm", model)
    with torch.no_grad():
        objective.copy_head.bias.fill_(0.3)
    batch = make_batch(**PADDED)
    x, am = sevens_in_rows_0_and_2(batch), batch["attention_mask"]
    _, metrics = objective(model, batch, seeded(8))
    _, positions, labels = mask_tokens(x, model.config, seeded(8), 0.15, 0.8, 0.1, am)
    x_mlm = x.scatter(1, positions, torch.where(labels != -100, 7, x.gather(1, positions)))
    used = labels != -100
    assert abs(metrics["replaced_frac"] - used[[1, 3]].sum() / used.sum()) < 1e-6
    h = model(x_mlm, attention_mask=am)
    assert close(metrics["lm_loss"], ref_corrective_lm(objective, model, h, x, x_mlm, positions, labels))


def test_cocolm_copy_weight_and_crop_fraction_reach_the_loss():
    """cocolm_copy_weight and cocolm_crop_fraction off their defaults (the reference tests use 50 and 0.9): the
    loss weights L_copy by the config's 7, and SCL's second view keeps round(0.5 * 14) = 7 of the 14 tokens
    between [CLS] and [SEP], contiguous (unpadded rows: cut to [CLS] + 7 + [SEP])."""
    bert = tiny_model()
    model = Recorder(bert)
    loss, m = build("cocolm", bert, cocolm_copy_weight=7.0, cocolm_crop_fraction=0.5)(model, make_batch(), seeded())
    assert close(loss, m["gen_loss"] + 7 * m["copy_loss"] + m["lm_loss"] + m["scl_loss"])
    x, crop = make_batch()["input_ids"], model.seen[1]  # main model on x^MLM, then on the crop
    assert crop.shape == (4, 9)
    for b in range(4):
        row, inner = crop[b].tolist(), x[b, 1:-1].tolist()
        assert row[0] == CLS and row[-1] == SEP and any(inner[i:i + 7] == row[1:-1] for i in range(8))


def test_electra_disc_weight_reaches_the_loss():
    model = tiny_model()
    loss, m = build("electra", model, electra_disc_weight=20.0)(model, make_batch(), seeded())
    assert close(loss, m["gen_loss"] + 20 * m["disc_loss"])  # the reference test uses the default 50


def test_crop_views():
    config = BertConfig(**TINY)
    lengths = [22, 12, 7, 16]  # 14 inner tokens: 12.6 rounds up to 13
    batch = make_batch(B=4, T=22, lengths=lengths)
    x, am = batch["input_ids"], batch["attention_mask"]
    starts = set()
    for seed in range(30):
        crop, mask = crop_views(x, config, seeded(seed), 0.9, am)
        for b, n in enumerate(lengths):
            keep = round((n - 2) * 0.9)
            row = crop[b, :keep + 2].tolist()
            assert row[0] == CLS and row[-1] == SEP and mask[b].sum() == keep + 2
            assert (crop[b, keep + 2:] == PAD).all()
            inner = x[b, 1:n - 1].tolist()
            start = next(i for i in range(len(inner) - keep + 1) if inner[i:i + keep] == row[1:-1])  # contiguous
            starts.add((b, start))
    assert {s for b, s in starts if b == 0} == {0, 1, 2}  # 20 inner tokens, crops of 18: every start drawn
    # unpadded rows: cut to the common length instead of padding, same [CLS] output; T = 16: [CLS] 13 [SEP]
    model = tiny_model()
    x = make_batch(B=3, T=16)["input_ids"]
    cut, none = crop_views(x, config, seeded(1), 0.9)
    padded, mask = crop_views(x, config, seeded(1), 0.9, torch.ones_like(x))
    assert none is None and torch.equal(cut, padded[:, :cut.size(1)]) and (padded[:, cut.size(1):] == PAD).all()
    assert cut.shape == (3, 15)
    for b in range(3):
        row, inner = cut[b].tolist(), x[b, 1:-1].tolist()
        assert row[0] == CLS and row[-1] == SEP and any(inner[i:i + 13] == row[1:-1] for i in range(2))
    assert torch.allclose(model(cut)[:, 0], model(padded, attention_mask=mask)[:, 0], atol=1e-10)


def test_corrective_lm_loss_reduces_to_cross_entropy():
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 50, dtype=torch.float64), torch.randint(0, 50, (6,))
    ce = F.cross_entropy(logits, targets, reduction="none")
    never_copy = torch.full((6,), -1e4, dtype=torch.float64)  # p_copy(1|h) = 0
    assert torch.allclose(corrective_lm_loss(logits, targets, never_copy, torch.ones(6, dtype=torch.bool)), ce)
    # replaced tokens: -log p_copy(0) - log softmax[x], whatever p_copy
    copy_logit = torch.randn(6, dtype=torch.float64)
    assert torch.allclose(corrective_lm_loss(logits, targets, copy_logit, torch.zeros(6, dtype=torch.bool)),
                          ce - F.logsigmoid(-copy_logit))
    # sg(p_copy): L_LM trains the LM head only; the copy head learns from L_copy alone
    logits.requires_grad_(), copy_logit.requires_grad_()
    corrective_lm_loss(logits, targets, copy_logit, torch.arange(6) % 2 == 0).sum().backward()
    assert copy_logit.grad is None and logits.grad.abs().sum() > 0


def test_generator_accuracy_is_its_argmax_over_the_used_masked_slots(monkeypatch):
    # gen_acc scores the generator's argmax against the original token at the used slots only: not its samples'
    # hit rate, not the unused slots that padded rows leave (here: argmax 7, samples 8; used slots 2, 1, 2, 1 of 3)
    monkeypatch.setattr(losses, "sample_tokens", lambda logits, rng: torch.full(logits.shape[:-1], 8))
    model = tiny_model()
    generator = build("electra", model).generator
    with torch.no_grad():
        generator.head.bias[7] = 100.0
    batch = make_batch(**PADDED)
    x = sevens_in_rows_0_and_2(batch)
    _, _, labels, _, metrics = generator(model, x, batch["attention_mask"], seeded(8))
    used = labels != -100
    assert abs(metrics["gen_acc"] - (labels == 7)[used].double().mean()) < 1e-6  # 4/6: rows 0 and 2


def test_electra_a_sample_equal_to_the_original_is_not_replaced(monkeypatch):
    """As COCO-LM's: the generator is right in rows 0 and 2 (every sample is the original token) and wrong in
    rows 1 and 3. The discriminator's target is sample != original (official), not "was masked": replaced only
    at rows 1 and 3's masked slots, and replaced_frac counts only those."""
    monkeypatch.setattr(losses, "sample_tokens", lambda logits, rng: torch.full(logits.shape[:-1], 7))
    model = tiny_model()
    objective = build("electra", model)
    batch = make_batch()
    x = sevens_in_rows_0_and_2(batch)
    _, metrics = objective(model, batch, seeded(8))
    _, positions, labels = mask_tokens(x, model.config, seeded(8), 0.15, 0.85, 0.0)
    used = labels != -100
    x_mlm = x.scatter(1, positions, torch.where(used, 7, x.gather(1, positions)))
    assert abs(metrics["replaced_frac"] - used[[1, 3]].sum() / used.sum()) < 1e-6
    replaced = (x_mlm != x).double()
    assert replaced[[0, 2]].sum() == 0 and replaced.sum() == used[[1, 3]].sum() > 0
    p = sigmoid(objective.disc_head(model(x_mlm))[..., 0])
    assert close(metrics["disc_loss"], -(replaced * torch.log(p) + (1 - replaced) * torch.log(1 - p)).mean())


@pytest.mark.parametrize("padded,gen_shape", [(False, "cocolm"), (True, "cocolm"), (True, "electra")])
def test_electra_matches_reference(padded, gen_shape):
    model = tiny_model()
    objective = build("electra", model, gen_shape=gen_shape)
    batch = make_batch(**(PADDED if padded else {}))
    x, am = batch["input_ids"], batch.get("attention_mask")
    valid = am.bool() if padded else torch.ones_like(x, dtype=torch.bool)
    loss, metrics = objective(model, batch, seeded(9))
    _, x_mlm, positions, labels, gen_loss = replay_generator(objective, model, x, am, 9, 0.85, 0.0)
    h = model(x_mlm, attention_mask=am)
    terms, rows = [], []
    for b in range(x.size(0)):
        for t in range(x.size(1)):
            if valid[b, t]:
                p = 1 / (1 + torch.exp(-ref_head(objective.disc_head, h[b, t])[0]))
                replaced = float(x_mlm[b, t] != x[b, t])
                terms.append(-(replaced * torch.log(p) + (1 - replaced) * torch.log(1 - p)))
                rows.append((replaced, p.item()))
    disc_loss = sum(terms) / len(terms)
    assert close(metrics["gen_loss"], gen_loss)
    assert close(metrics["disc_loss"], disc_loss)
    assert close(loss, gen_loss + 50 * disc_loss)
    assert_same_gradients(loss, gen_loss + 50 * disc_loss, [*model.named_parameters(), *objective.named_parameters()])
    assert abs(metrics["disc_acc"] - sum(float((p > 0.5) == (r == 1)) for r, p in rows) / len(rows)) < 1e-6
    assert abs(metrics["disc_trivial"] - entropy(sum(r for r, _ in rows) / len(rows))) < 1e-6
    assert abs(metrics["replaced_frac"] - replaced_at_masked(x, x_mlm, positions, labels)) < 1e-6


@pytest.mark.parametrize("name,gen_shape", [("cocolm", "cocolm"), ("electra", "cocolm"), ("electra", "electra")])
def test_generator_gradient_routing(name, gen_shape):
    model = tiny_model()
    objective = build(name, model, gen_layers=1, gen_shape=gen_shape)
    assert len(objective.generator.encoder.layers) == 1
    assert not any(p.requires_grad for p in model.head.parameters())  # unused: frozen
    batch = make_batch(**PADDED)
    x, am = batch["input_ids"], batch["attention_mask"]
    loss, metrics = objective(model, batch, seeded(2))
    loss.backward()
    full = {n: p.grad.clone() for n, p in objective.generator.named_parameters()}
    full_embedding = model.embeddings.word.weight.grad.clone()
    assert all(g.abs().sum() > 0 for g in full.values())  # the generator learns from its own MLM loss
    assert all(p.grad is None for p in model.head.parameters())
    # ... and only from it: sampled tokens carry no gradient from the main model's losses
    objective.zero_grad()
    model.zero_grad()
    mask_frac, random_frac = (0.8, 0.1) if name == "cocolm" else (0.85, 0.0)
    *_, gen_loss = replay_generator(objective, model, x, am, 2, mask_frac, random_frac)
    gen_loss.backward()
    for n, p in objective.generator.named_parameters():
        assert torch.allclose(full[n], p.grad, atol=1e-10), n
    # shared, not copied: the generator reads the main model's embeddings, which learn from both models
    assert not any("embeddings" in k for k in objective.state_dict())
    generator_part = model.embeddings.word.weight.grad
    assert generator_part.abs().sum() > 0 and (full_embedding - generator_part).abs().sum() > 0
    # through its input, not only through its tied decoder: position embeddings and LayerNorm too
    assert model.embeddings.position.weight.grad.abs().sum() > 0 and model.embeddings.ln.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["cocolm", "electra"])
def test_objective_modules_start_from_bert_initialisation(name):
    """What COCO-LM and ELECTRA add (generator, copy / SCL / discriminator heads, LM bias) starts from BERT's
    initialisation, as the main model does (test_model.py): N(0, 0.02) matrices, zero biases, unit-weight
    zero-bias LayerNorm. PyTorch's default Linear init has nonzero biases (and std 0.072 at D = 64)."""
    model = tiny_model(double=False, hidden_size=64, intermediate_size=256)
    objective = build(name, model, double=False)
    matrices = 0
    for module_name, module in objective.named_modules():
        if isinstance(module, nn.Linear):
            assert torch.all(module.bias == 0), module_name
            if module.weight.numel() >= 4096:  # std estimated within 1.1%, mean within 0.0003 (sd)
                w = module.weight
                assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002, module_name
                matrices += 1
        if isinstance(module, nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0), module_name
    assert matrices == 6  # the generator layer's qkv, proj, up, down; its head's dense; SCL's or the disc head's
    assert torch.all(objective.generator.head.bias == 0)
    if name == "cocolm":
        assert torch.all(objective.lm_bias == 0)


def test_generator_shapes():
    # ELECTRA's official generator widths: 1/4 (small), 1/3 (base); heads = width / 64, FFN = 4 x width
    for size, (width, heads) in dict(tiny=(32, 1), small=(128, 2), base=(256, 4)).items():
        config = BertConfig(**MODEL_PRESETS[size])
        gen_config, num_layers = generator_config(config, make_cfg(gen_shape="electra"))
        assert (gen_config.hidden_size, gen_config.num_heads, gen_config.intermediate_size) == (width, heads, 4 * width)
        assert num_layers == config.num_layers and gen_config.vocab_size == config.vocab_size
        gen_config, num_layers = generator_config(config, make_cfg())  # COCO-LM's: same width, L/3 layers
        assert gen_config == config and num_layers == max(1, round(config.num_layers / 3))
        assert generator_config(config, make_cfg(gen_shape="electra", gen_layers=3))[1] == 3
    assert generator_config(BertConfig(**{**TINY, "num_layers": 8}), make_cfg())[1] == 3  # round(8 / 3), not 8 // 3
    with pytest.raises(ValueError, match="gen_shape"):
        generator_config(BertConfig(**TINY), make_cfg(gen_shape="large"))


@pytest.mark.parametrize("gen_shape", ["cocolm", "electra"])
def test_generator_parameter_count(gen_shape):
    model = tiny_model(hidden_size=64, intermediate_size=256, num_layers=3)
    generator = build("electra", model, gen_shape=gen_shape).generator
    D, F, V = 64, 256, model.config.padded_vocab_size

    def layer(d, f):  # qkv, proj, up, down weights; their biases; two LayerNorms
        return 4 * d * d + 2 * d * f + 3 * d + d + f + d + 4 * d

    head = 2 * D + V  # LayerNorm at the embedding width, decoder bias (the decoder matrix is shared)
    if gen_shape == "cocolm":  # 1 layer at the main width, no projection
        expected = layer(D, F) + (D * D + D) + head
        assert isinstance(generator.project, nn.Identity)
    else:  # 3 layers at width 16: project 64 -> 16, head dense 16 -> 64
        d = 16
        expected = 3 * layer(d, 4 * d) + (D * d + d) + (d * D + D) + head
        assert generator.project.weight.shape == (d, D) and generator.head.dense.weight.shape == (D, d)
    assert sum(p.numel() for p in generator.parameters()) == expected


@pytest.mark.parametrize("name", ["cocolm", "electra"])
def test_generator_forwards_and_sampling_logits(monkeypatch, name):
    """ELECTRA: one generator forward per step, samples drawn from its (dropout-on) training logits, as the
    official code. COCO-LM: a second, dropout-off forward to sample from."""
    model = tiny_model(dropout=0.3)
    objective = build(name, model)
    objective.train(), model.train()
    with torch.no_grad():  # peaked logits, so that dropout changes the samples
        objective.generator.head.ln.weight.mul_(50)
    calls, head_outputs = [], []
    encoder_forward = objective.generator.encoder.forward
    monkeypatch.setattr(objective.generator.encoder, "forward",
                        lambda *args, **kw: calls.append(1) or encoder_forward(*args, **kw))
    objective.generator.head.register_forward_hook(lambda module, inputs, output: head_outputs.append(output))
    objective(model, make_batch(), seeded(4))
    assert len(calls) == (1 if name == "electra" else 2)
    # replay the sampling from the training logits and from dropout-off logits
    x = make_batch()["input_ids"]
    mask_frac, random_frac = (0.8, 0.1) if name == "cocolm" else (0.85, 0.0)
    head_outputs.clear()
    x_mlm, positions, labels, *_ = objective.generator(model, x, None, seeded(4))
    assert objective.generator.training and model.embeddings.training  # modes restored
    assert not x_mlm.is_floating_point()  # token ids: no gradient path back into the generator
    training_logits = head_outputs[0]
    assert training_logits.requires_grad  # the forward that gen_loss trains on
    used = labels != -100
    rng = seeded(4)
    mask_tokens(x, model.config, rng, 0.15, mask_frac, random_frac)
    state = rng.get_state()
    from_training = sample_tokens(training_logits, rng).view_as(positions)[used]
    objective.eval(), model.eval()
    with torch.no_grad():
        dropout_off = objective.generator.logits(model, mask_tokens(x, model.config, seeded(4), 0.15, mask_frac,
                                                                    random_frac)[0], None, positions)
    from_dropout_off = sample_tokens(dropout_off, rng.set_state(state)).view_as(positions)[used]
    assert not torch.equal(from_training, from_dropout_off)  # the test can tell the two apart
    assert torch.equal(x_mlm.gather(1, positions)[used], from_training if name == "electra" else from_dropout_off)


@pytest.mark.parametrize("name,fracs,flags", [("cocolm", (0.8, 0.1), {}), ("electra", (0.85, 0.0), {}),
                                              ("cocolm", (1.0, 0.0), {"cocolm_mask_all": True})])
def test_generator_masking_split(monkeypatch, name, fracs, flags):
    # [MASK] / random / unchanged: COCO-LM's BERT 80/10/10 (ours), or 100% [MASK] with --cocolm_mask_all (MC-BERT's
    # reading), ELECTRA's 85/0/15 (official mask_prob split)
    seen, inputs, real = [], [], losses.mask_tokens
    monkeypatch.setattr(losses, "mask_tokens", lambda *args: seen.append(args[3:6]) or real(*args))
    logits = losses.Generator.logits
    monkeypatch.setattr(losses.Generator, "logits", lambda self, model, ids, *args: inputs.append(ids) or
                        logits(self, model, ids, *args))
    model = tiny_model()
    build(name, model, mask_prob=0.3, **flags)(model, make_batch(B=8, T=32), seeded())
    assert seen == [(0.3, *fracs)]  # and --mask_prob reaches the generator
    x, generator_input = make_batch(B=8, T=32)["input_ids"], inputs[0]
    changed = generator_input != x
    assert changed.sum() > 0 and (generator_input[changed] == MASK).all() == (fracs[1] == 0.0)  # no random tokens


@pytest.mark.parametrize("gen_shape", ["cocolm", "electra"])
def test_generator_ignores_padding(gen_shape):
    # a padded row's logits are those of the row alone, unpadded
    model = tiny_model()
    generator = build("electra", model, gen_shape=gen_shape).generator
    batch = make_batch(**PADDED)
    positions = torch.tensor([[1, 2, 4]] * 4)
    padded = generator.logits(model, batch["input_ids"], batch["attention_mask"], positions).view(4, 3, -1)
    for row, n in enumerate(PADDED["lengths"]):
        alone = generator.logits(model, batch["input_ids"][row:row + 1, :n], None, positions[row:row + 1])
        assert close(padded[row], alone), row


def test_generator_decodes_with_the_word_embeddings():
    # tokens 5..20 only: rows 21..49 of the shared matrix learn from the generator's decoder alone
    model = tiny_model()
    generator = build("electra", model).generator
    gen_loss = generator(model, make_batch(vocab=21)["input_ids"], None, seeded())[3]
    gen_loss.backward()
    assert (model.embeddings.word.weight.grad[21:50].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_trainable_parameter_gets_a_gradient(name):
    # no loss term cut off by a stray detach: whatever the optimizer updates has a gradient
    model = tiny_model()
    objective = build(name, model)
    loss, _ = objective(model, make_batch(**PADDED), seeded())
    loss.backward()
    params = list(model.named_parameters()) + list(objective.named_parameters())
    dead = [n for n, p in params if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not dead, dead


def test_cocolm_held_out_forward_leaves_eval_mode():
    # the dropout-off sampling forward switches modes and back, only when training
    model = tiny_model(dropout=0.3)
    objective = build("cocolm", model)
    objective.eval(), model.eval()
    objective(model, make_batch(), seeded())
    assert not objective.generator.training and not model.embeddings.training


# ------------------------------------------------------------------------------------------
# a short training run per objective: the loss falls


@pytest.mark.parametrize("name,extra", [(name, {}) for name in LOSSES] + [("electra", dict(gen_shape="electra")),
                                                                         ("taco", dict(negative_pool=4))])
def test_loss_falls(name, extra):
    torch.manual_seed(0)
    model = Bert(BertConfig(**{**TINY, "hidden_size": 32, "intermediate_size": 64}))
    objective = LOSSES[name](model, make_cfg(taco_negatives=10, **extra))
    # structured data: each row repeats a short random pattern
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(5, 50, (8, 4), generator=g)
    x = torch.cat([torch.full((8, 1), CLS), patterns.repeat(1, 5)[:, :22], torch.full((8, 1), SEP)], 1)
    params = [p for p in list(model.parameters()) + list(objective.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    rng, history = seeded(0), []
    for step in range(40):
        loss, _ = objective(model, dict(input_ids=x), rng)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(loss.item())
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert last < 0.8 * first, (name, history)


@pytest.mark.parametrize("name", list(LOSSES))
def test_compiled_wrapper(name):
    """train.py hands the objective torch.compile(model): attributes pass through, losses agree."""
    model = tiny_model(double=False)
    objective = LOSSES[name](model, make_cfg())
    expected, _ = objective(model, make_batch(), seeded())
    compiled = torch.compile(model, backend="eager", dynamic=False)
    for _ in range(2):
        loss, _ = objective(compiled, make_batch(), seeded())
        assert torch.allclose(loss, expected, atol=1e-5)


def test_detector_trivial_baseline_is_the_entropy_of_the_replaced_rate():
    # the logged disc_trivial / copy_trivial are what a constant predictor of the batch's replaced rate scores
    p = torch.tensor([0.0, 0.15, 0.5, 0.85])
    constant = [F.binary_cross_entropy(q.clamp(1e-6, 1 - 1e-6).expand(1000), (torch.arange(1000) < 1000 * q).float())
                for q in p]
    assert torch.allclose(losses.binary_entropy(p), torch.stack(constant), atol=1e-4)


def test_auc_matches_the_pairwise_definition():
    # AUC = P(score of a random positive > score of a random negative), ties 1/2: every pair, counted slowly
    g = seeded(3)
    scores = (torch.randn(3, 40, generator=g) * 2).round() / 2  # coarse values: many ties
    targets, mask = torch.rand(3, 40, generator=g) < 0.2, torch.rand(3, 40, generator=g) < 0.9
    pos = [float(s) for s, t, m in zip(scores.flatten(), targets.flatten(), mask.flatten()) if m and t]
    neg = [float(s) for s, t, m in zip(scores.flatten(), targets.flatten(), mask.flatten()) if m and not t]
    pairs = [1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg]
    assert abs(losses.auc(scores, targets, mask).item() - sum(pairs) / len(pairs)) < 1e-6
    assert losses.auc(targets.float(), targets, mask).item() == 1.0  # a perfect ranking
    assert losses.auc(torch.zeros(3, 40), targets, mask).item() == 0.5  # a constant detector


@pytest.mark.parametrize("name,key,acc", [("electra", "disc_auc", "disc_acc"), ("cocolm", "copy_auc", "copy_acc")])
def test_detector_auc_is_held_out_only_and_scores_replaced_as_positive(monkeypatch, name, key, acc):
    model = tiny_model()
    objective = build(name, model)
    assert key not in objective(model, make_batch(), seeded())[1]  # training steps skip the sort
    objective.eval()
    seen = []
    monkeypatch.setattr(losses, "auc", lambda *args: seen.append(args) or AUC(*args))
    metrics = objective(model, make_batch(), seeded())[1]
    logits, targets, mask = seen[0]
    assert 0 <= metrics[key] <= 1
    ids = make_batch()["input_ids"]
    assert torch.equal(mask, losses.eligible_positions(ids, model.config))  # no [CLS]/[SEP]: never replaced
    # orientation: a positive score means "replaced" (ELECTRA's disc logit, minus COCO-LM's copy logit),
    # so thresholding it at 0 gives the logged detector accuracy, not 1 minus it
    assert torch.allclose(((logits > 0) == targets).float().mean(), metrics[acc])  # unpadded: acc is over all
    assert abs(metrics[acc] - 0.5) > 1e-3  # else both orientations would pass


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_float32_step_makes_no_float64_tensor(name):
    """Apple's MPS has no float64: crop_views' lengths and the detectors' AUC computed in float64 on the device, so
    COCO-LM and ELECTRA stopped at their first step there (auto picks MPS on a Mac). Checked here on the CPU: no op
    of a float32 training step or held-out forward returns a float64 tensor."""
    from torch.overrides import TorchFunctionMode

    class NoFloat64(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                assert not (isinstance(t, torch.Tensor) and t.dtype == torch.float64), func
            return out
    model = tiny_model(double=False)
    objective = build(name, model, double=False, taco_negatives=7)
    for batch in (make_batch(), make_batch(**PADDED)):
        with NoFloat64():
            loss, _ = objective(model, batch, seeded())
            loss.backward()
            objective.eval()
            objective(model, batch, seeded())  # held out: the detectors' AUC
            objective.train()


@pytest.mark.parametrize("name", sorted(LOSSES))
# COCO-LM's crop_lengths is lru_cached: dynamo traces its body (Python ints into a constant tensor), as wanted here
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`-wrapped function")
def test_a_training_forward_has_no_host_sync(name):
    """docs/efficiency.md's "no host-device sync inside the step": traced whole by torch._dynamo, each objective's
    training forward breaks only at its seeded torch.Generator draws, never at a .item(), a shape that
    depends on the data or a Python branch on a tensor (each of those would wait for the GPU)."""
    import linecache
    model = tiny_model(double=False)
    objective = build(name, model, double=False, taco_negatives=7)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda batch, rng: objective(model, batch, rng))(make_batch(**PADDED), seeded())
    assert explained.graph_count >= 1
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1]
        assert "generator=" in linecache.getline(frame.filename, frame.lineno), (frame, reason.reason)
