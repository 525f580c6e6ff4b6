"""model.py against Hugging Face transformers.BertForMaskedLM on the same random weights."""

import pytest
import torch

from model import MODEL_PRESETS, Bert, BertConfig

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
            max_position_embeddings=40)


def hf_tiny(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=40,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg).eval()


def save_hf(hf, path):
    hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("with_mask", [False, True])
def test_hf_import_logits_match(tmp_path, with_mask):
    hf = hf_tiny()
    ours = Bert.from_pretrained(save_hf(hf, str(tmp_path))).eval()
    assert ours.config.padded_vocab_size == 128 and ours.config.vocab_size == 100
    x = torch.randint(5, 100, (3, 17))
    mask = torch.ones_like(x)
    if with_mask:
        mask[1, 10:] = 0
        mask[2, 4:] = 0
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).logits
        h = ours(x, attention_mask=mask if with_mask else None)
        got = ours.mlm_logits(h)
    real = mask.bool()  # padded positions' outputs are meaningless in both models
    assert got.shape == ref.shape
    assert torch.allclose(got[real], ref[real], atol=1e-4), (got - ref)[real].abs().max()


def hf_large_float64(path):
    """hf_tiny with large random weights on every tensor, in float64, and ours imported from it. At init (std
    0.02, zero biases) small differences hide under atol 1e-4: the tanh GELU, a dropped MLM bias, LayerNorm eps
    1e-5 for 1e-12. Large weights (small embeddings, so their LayerNorm input variance ~1e-5 meets eps) and
    float64 make any such change a large error."""
    hf = hf_tiny()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # cls.predictions.bias included: nonzero
            p.normal_(0, 0.003 if "embeddings" in name and "LayerNorm" not in name else 0.3)
            if "LayerNorm.weight" in name:
                p.add_(1)
            p.copy_(p.float())  # float32-exact, so our float32 load then .double() holds HF's values
    hf.double()
    return hf, Bert.from_pretrained(save_hf(hf, path)).double().eval()  # the import path, config.json too


def test_hf_import_matches_exactly_in_float64_with_large_weights(tmp_path):
    hf, ours = hf_large_float64(str(tmp_path))
    x = torch.randint(5, 100, (3, 17))
    tt, mask = torch.zeros_like(x), torch.ones_like(x)
    tt[:, 9:], mask[2, 11:] = 1, 0
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
        layers = ours(x, attention_mask=mask, token_type_ids=tt, all_layers=True)
        got = ours.mlm_logits(layers[-1])
    real = mask.bool()
    assert ref.logits[real].std() > 0.1 and layers[1][real].std() > 0.5  # not a degenerate comparison
    assert len(layers) == len(ref.hidden_states) == 3
    for ours_h, ref_h in zip(layers, ref.hidden_states):  # embeddings, then each layer
        torch.testing.assert_close(ours_h[real], ref_h[real], rtol=0, atol=1e-9)
    torch.testing.assert_close(got[real], ref.logits[real], rtol=0, atol=1e-9)


def test_token_types_and_bertmodel_names(tmp_path):
    torch.manual_seed(1)
    hf = transformers.BertModel(hf_tiny().config).eval()
    hf.save_pretrained(str(tmp_path))  # BertModel: no "bert." prefix, has a pooler
    ours = Bert.from_pretrained(str(tmp_path)).eval()
    assert torch.equal(ours.pooler.weight, hf.pooler.dense.weight)
    x = torch.randint(5, 100, (2, 9))
    tt = torch.zeros_like(x)
    tt[:, 5:] = 1
    with torch.no_grad():
        ref = hf(input_ids=x, token_type_ids=tt).last_hidden_state
        got = ours(x, token_type_ids=tt)
    assert torch.allclose(got, ref, atol=1e-4)


def test_return_embeddings_and_all_layers():
    torch.manual_seed(0)
    m = Bert(BertConfig(**TINY, dropout=0.0)).eval()
    x = torch.randint(5, 100, (2, 7))
    h, emb = m(x, return_embeddings=True)
    layers = m(x, all_layers=True)
    assert len(layers) == 3 and torch.equal(layers[0], emb) and torch.equal(layers[-1], h)
    # the embeddings come with their graph: TACO's g = h - e trains the embeddings through the -e term too
    assert torch.equal(emb, m.embeddings(x))
    (emb * torch.randn_like(emb)).sum().backward()  # a plain sum through LayerNorm has zero gradient
    assert m.embeddings.word.weight.grad.abs().sum() > 1e-3


def test_every_dropout_runs_in_training(monkeypatch):
    # BERT drops the embeddings' output, each layer's attention output and FFN output (nn.Dropout) and the
    # attention probabilities (SDPA's dropout_p): a model missing one still trains, just not as BERT
    m = Bert(BertConfig(**TINY, dropout=0.1))
    drops, attn_p = [], []
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.register_forward_hook(lambda mod, args, out: drops.append(mod.p))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        attn_p.append(kwargs["dropout_p"])
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    x = torch.randint(5, 100, (2, 7))
    m.train()(x)
    assert drops == [0.1] * (1 + 2 * TINY["num_layers"]) and attn_p == [0.1] * TINY["num_layers"]
    attn_p.clear()
    m.eval()(x)
    assert attn_p == [0.0] * TINY["num_layers"]  # and none at evaluation


def test_dropout_sites_match_hf_in_training(tmp_path, monkeypatch):
    """Where dropout acts in a training forward, against HF's BERT: on the embeddings after their LayerNorm, and
    on each sublayer's output before the residual sum (not on the sum). Every nn.Dropout becomes a deterministic
    x * 0.5 (no scale survives a LayerNorm it precedes); attention-prob dropout is p = 0 in both (its site:
    test_every_dropout_runs_in_training), so the train-mode hidden states must agree layer by layer."""
    hf, ours = hf_large_float64(str(tmp_path))
    x = torch.randint(5, 100, (2, 9))
    with torch.no_grad():
        off = ours(x, all_layers=True)  # eval mode, unpatched: no dropout
        monkeypatch.setattr(torch.nn.Dropout, "forward", lambda self, x: x * 0.5)
        ref = hf.train()(input_ids=x, output_hidden_states=True).hidden_states
        layers = ours.train()(x, all_layers=True)
    assert len(layers) == len(ref) == 3
    for ours_h, ref_h, off_h in zip(layers, ref, off):  # embeddings, then each layer
        torch.testing.assert_close(ours_h, ref_h, rtol=0, atol=1e-9)
        assert (ours_h - off_h).abs().max() > 0.1  # the stand-in dropout changed something at every site


def test_bert_initialisation():
    # BERT's init, which pretraining from scratch starts from (and the export's initializer_range 0.02 claims):
    # N(0, 0.02) matrices and embeddings, zero Linear biases and MLM bias, unit-weight zero-bias LayerNorm
    torch.manual_seed(0)
    m = Bert(BertConfig(**MODEL_PRESETS["small"]))
    big = {n: p for n, p in m.named_parameters() if p.dim() == 2 and p.numel() >= 2 ** 16}
    assert len(big) == 2 + 4 * 4 + 1  # word, position; qkv, proj, up, down per layer; the head's dense
    for name, p in big.items():
        assert abs(p.std().item() - 0.02) < 0.001 and abs(p.mean().item()) < 0.001, name
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear):
            assert torch.all(mod.bias == 0), name
        if isinstance(mod, torch.nn.LayerNorm):
            assert torch.all(mod.weight == 1) and torch.all(mod.bias == 0), name
    assert torch.all(m.head.bias == 0)


def test_padded_vocab_rows_never_predicted():
    m = Bert(BertConfig(**TINY))
    assert m.embeddings.word.weight.shape[0] == 128
    assert m.mlm_logits(torch.randn(5, 32)).shape == (5, 100)


def test_padded_vocab_rounds_up_to_a_multiple_of_64():
    # padded up, never down: an embedding with fewer rows than the vocabulary would lose its last tokens
    for vocab, padded in ((64, 64), (65, 128), (80, 128), (100, 128), (30522, 30528)):
        assert BertConfig(vocab_size=vocab).padded_vocab_size == padded


def test_too_long_sequence_is_a_clear_error():
    m = Bert(BertConfig(**TINY))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m(torch.zeros(1, 41, dtype=torch.long))
