"""hf_io.py: Hugging Face directories in and out (into transformers, and back into ours bit for bit), one clear
ValueError for each kind of bad file, pickles refused, and what a run's export says about its step. The logits
against transformers are test_model.py's."""
import json
import os
import re

import pytest
import torch

from hf_io import load_checkpoint_file
from model import Bert, BertConfig

transformers = pytest.importorskip("transformers")
from test_model import TINY, hf_tiny, save_hf  # noqa: E402  (after the skip: test_model needs transformers too)


def test_export_loads_back_into_transformers(tmp_path):
    torch.manual_seed(0)
    ours = Bert(BertConfig(**TINY, dropout=0.1)).eval()
    ours.save_pretrained(str(tmp_path))
    mode = lambda name: (tmp_path / name).stat().st_mode & 0o777
    assert mode("model.safetensors") == mode("config.json")  # not safetensors' 0600: shareable like the rest
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path)).eval()
    # one dropout here, both of BERT's there (fine-tuning from the export trains with them)
    assert hf.config.hidden_dropout_prob == hf.config.attention_probs_dropout_prob == 0.1
    assert hf.config.layer_norm_eps == 1e-12 and hf.config.hidden_act == "gelu"
    x = torch.randint(5, 100, (2, 12))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=x).logits, ours.mlm_logits(ours(x)), atol=1e-4)
    # and back into ours, through the same path
    again = Bert.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(again.mlm_logits(again(x)), ours.mlm_logits(ours(x)))


def test_the_same_weights_export_to_the_same_bytes(tmp_path):
    """safetensors writes its metadata in a randomly seeded Rust HashMap's order: 4 of 8 saves of one model
    came out in different bytes (the same command, a different sha256 of model.safetensors). Sorted now."""
    import hashlib
    from safetensors import safe_open
    torch.manual_seed(0)
    ours = Bert(BertConfig(**TINY))
    digests = set()
    for _ in range(8):
        ours.save_pretrained(str(tmp_path), step=3)
        raw = (tmp_path / "model.safetensors").read_bytes()
        digests.add(hashlib.sha1(raw).hexdigest())
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    assert len(digests) == 1
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # still a valid file, metadata and tensors
        assert f.metadata()["training_step"] == "3" and f.metadata()["format"] == "pt"
    assert Bert.from_pretrained(str(tmp_path)).training_step == 3  # loading checks weights_sha1 against the tensors
    assert transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path)) is not None


def test_loaded_weights_leave_the_padded_vocab_rows_zero(tmp_path):
    # the checkpoint holds vocab_size rows: the padding rows are zeros, not this process's random init
    m = Bert.from_pretrained(save_hf(hf_tiny(), str(tmp_path)))
    assert m.embeddings.word.weight.shape[0] == 128 and m.head.bias.shape[0] == 128
    assert not m.embeddings.word.weight[100:].any() and not m.head.bias[100:].any()
    assert m.embeddings.word.weight[:100].any()


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no such"):
        Bert.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not a checkpoint"):
        Bert.from_pretrained(str(tmp_path))
    ours = Bert(BertConfig(**TINY))
    ours.save_pretrained(str(tmp_path))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        Bert.from_pretrained(str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    ours.save_pretrained(str(tmp_path))
    cfg["hidden_size"] = 64
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="shape|missing|but the weights have"):
        Bert.from_pretrained(str(tmp_path))
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        Bert.from_pretrained(str(bad))
    torch.save({"model": {}}, str(bad))  # a dict of the right kind, but no model_config
    with pytest.raises(ValueError, match="not a checkpoint of this project"):
        Bert.from_pretrained(str(bad))
    assert os.path.isfile(tmp_path / "model.safetensors")  # nothing saved was removed
    ours.save_pretrained(str(tmp_path))
    for name in ("model.safetensors", "config.json"):  # one file of the directory, where the directory was meant
        with pytest.raises(ValueError, match=f"{name} is one file of a model directory: pass the directory"):
            Bert.from_pretrained(str(tmp_path / name))


def test_weights_the_user_may_not_read_are_not_called_corrupt(tmp_path, monkeypatch):
    # safetensors says "No such file or directory" of a file it may not read: "corrupt weights file (FileNotFoundError"
    # with a hint to rewrite it, for a file that is there and whole. (Root reads any file: open is refused here.)
    import builtins
    Bert(BertConfig(**TINY)).save_pretrained(str(tmp_path))
    weights, real_open = str(tmp_path / "model.safetensors"), builtins.open

    def refusing_open(file, *args, **kwargs):
        if str(file) == weights:
            raise PermissionError(13, "Permission denied", weights)
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", refusing_open)
    with pytest.raises(ValueError) as info:
        Bert.from_pretrained(str(tmp_path))
    assert str(info.value) == f"{tmp_path}: cannot read its weights (Permission denied: {weights})"


def test_bytes_flipped_inside_a_checkpoint_tensor_are_refused(tmp_path):
    """torch.load never checks the zip records' CRC-32: a flipped byte in a tensor loaded as a garbled weight."""
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.arange(4096, dtype=torch.float32)}, "model_config": {}}, str(path))
    data = bytearray(path.read_bytes())
    at = data.find(torch.arange(4096, dtype=torch.float32).numpy().tobytes()[4000:4016])
    data[at:at + 16] = bytes(b ^ 0x5A for b in data[at:at + 16])
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"ckpt.pt: corrupt file \(.*data/0 fails its CRC check"):
        load_checkpoint_file(str(path))
    # a file saved without CRCs (torch.serialization.set_crc32_options(False) records 0s) still loads
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"model": {"w": torch.arange(4096, dtype=torch.float32)}, "model_config": {}}, str(path))
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.equal(load_checkpoint_file(str(path))["model"]["w"], torch.arange(4096, dtype=torch.float32))


@pytest.mark.parametrize("edit,problem", [
    (lambda s: s.pop("bert.pooler.dense.bias"), "bert.pooler.dense.bias is missing"),
    (lambda s: s.update({"bert.pooler.dense.weight": s["bert.pooler.dense.weight"][:4]}), "is (4, 32)"),
    (lambda s: s.update({"bert.embeddings.LayerNorm.weight": torch.ones(32, dtype=torch.int64)}), "holds torch.int64"),
    # the vocabulary rows are stored unpadded: exactly vocab_size of them, not fewer (zero-padded up) or more
    (lambda s: s.update({"bert.embeddings.word_embeddings.weight": s["bert.embeddings.word_embeddings.weight"][:99]}),
     "vocab_size, hidden_size = (100, 32), but the weights have (99, 32)"),
    (lambda s: s.update({"cls.predictions.bias": torch.zeros(101)}), "has shape (101,), expected (100,)"),
    (lambda s: s.pop("bert.encoder.layer.1.attention.self.key.weight"),
     "missing weight bert.encoder.layer.1.attention.self.key.weight"),
    # one of the fused q/k/v of another width: was torch.cat's RuntimeError, a traceback from every command
    (lambda s: s.update({"bert.encoder.layer.0.attention.self.query.weight": torch.zeros(32, 16)}),
     "bert.encoder.layer.0.attention.self.query.weight has shape (32, 16), expected (32, 32)"),
])
def test_weights_of_the_wrong_kind_are_clear_errors(tmp_path, edit, problem):
    from safetensors.torch import load_file, save_file
    ours = Bert(BertConfig(**TINY))
    ours.pooler = torch.nn.Linear(32, 32)
    ours.save_pretrained(str(tmp_path))
    state = load_file(tmp_path / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(problem)):
        Bert.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("edit,problem", [
    ([], "expected a JSON object"), ({"hidden_size": "32"}, "hidden_size = '32'"),
    ({"num_hidden_layers": None}, "num_layers = None"), ({"num_attention_heads": 3}, "not a multiple of num_heads 3"),
    ({"hidden_dropout_prob": 1.5}, "dropout = 1.5"), ({"vocab_size": True}, "vocab_size = True"), ("{", "Expecting"),
    ({"pad_token_id": 99999}, "pad_token_id = 99999, must be < vocab_size"),
    ({"pad_token_id": 100}, "pad_token_id = 100, must be < vocab_size 100"),  # one past the last row
    ({"num_attention_heads": 0}, "num_heads = 0, expected an integer >= 1")])
def test_a_corrupt_config_is_one_clear_error(tmp_path, edit, problem):
    Bert(BertConfig(**TINY)).save_pretrained(str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    text = edit if isinstance(edit, str) else json.dumps({**cfg, **edit} if isinstance(edit, dict) else edit)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="not a valid BERT config") as info:
        Bert.from_pretrained(str(tmp_path))
    assert problem in str(info.value) and "\n" not in str(info.value)
    # a training checkpoint's model_config is checked the same way
    torch.save({"model": {}, "model_config": dict(TINY, num_heads=3)}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="not a valid model config"):
        Bert.from_pretrained(str(tmp_path / "ckpt.pt"))


@pytest.mark.parametrize("edit,problem", [
    ({"vocab_size": 10 ** 12}, "vocab_size, hidden_size = (1000000000000, 32), but the weights have (100, 32)"),
    ({"num_hidden_layers": 10 ** 6}, "num_hidden_layers = 1000000, but the weights have 2"),
    ({"intermediate_size": 10 ** 9}, "intermediate_size = (1000000000, 32), but the weights have (64, 32)"),
    ({"max_position_embeddings": 10 ** 9}, "max_position_embeddings = (1000000000, 32), but the weights have (40, 32)"),
    ({"type_vocab_size": 3}, "type_vocab_size = (3, 32), but the weights have (2, 32)")])
def test_a_config_that_does_not_fit_its_weights_is_refused_before_the_model_is_built(tmp_path, edit, problem):
    # built first, a config.json edited to a huge size failed allocating the model (a traceback, or the OOM killer)
    Bert(BertConfig(**TINY)).save_pretrained(str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    json.dump({**cfg, **edit}, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError) as info:
        Bert.from_pretrained(str(tmp_path))
    assert str(info.value) == f"{tmp_path / 'config.json'}: {problem}: an edited config or another model's weights"


@pytest.mark.parametrize("edit,problem", [
    ({"vocab_size": 10 ** 10}, "vocab_size, pad_vocab_to, hidden_size = (10000000000, 32), but the weights have (128, 32)"),
    ({"pad_vocab_to": 10 ** 12}, "vocab_size, pad_vocab_to, hidden_size = (1000000000000, 32)"),
    ({"num_layers": 10 ** 6}, "num_layers = 1000000, but the weights have 2"),
    ({"hidden_size": 2 ** 20, "num_heads": 1}, "hidden_size = (128, 1048576), but the weights have (128, 32)"),
    ({"intermediate_size": 10 ** 9}, "intermediate_size = (1000000000, 32), but the weights have (64, 32)")])
def test_a_checkpoint_whose_model_config_its_weights_do_not_have_is_refused_before_the_model_is_built(
        tmp_path, edit, problem):
    # a ckpt.pt (from_pretrained, --init_from, --resume) built its model_config's model before loading the weights:
    # edited to these sizes, a failed allocation of terabytes (a traceback), or a million layers the OOM killer ended
    ours = Bert(BertConfig(**TINY))
    torch.save({"model": ours.state_dict(), "model_config": {**ours.config.__dict__, **edit}}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError) as info:
        Bert.from_pretrained(str(tmp_path / "ckpt.pt"))
    assert str(info.value).startswith(f"{tmp_path / 'ckpt.pt'}: ") and problem in str(info.value)


def test_weights_that_lack_the_tensor_showing_a_size_or_hold_nan_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    ours = Bert(BertConfig(**TINY))
    ours.save_pretrained(str(tmp_path))
    # copies: safetensors 0.4 maps the file's pages, so rewriting it in place below ended the run in a bus error
    state = {k: v.clone() for k, v in load_file(tmp_path / "model.safetensors").items()}
    cfg = json.load(open(tmp_path / "config.json"))
    # the size check skipped a missing tensor, so the model of the edited config was built before it was missed
    for name, key in (("bert.embeddings.word_embeddings.weight", "vocab_size"),
                      ("bert.encoder.layer.0.intermediate.dense.weight", "intermediate_size")):
        save_file({k: v for k, v in state.items() if k != name}, tmp_path / "model.safetensors")
        json.dump({**cfg, key: 10 ** 10}, open(tmp_path / "config.json", "w"))
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: missing weight {name}")):
            Bert.from_pretrained(str(tmp_path))
    # NaN or inf weights (no weights_sha1 to catch them: safetensors written by another tool) loaded and scored as NaN
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    state["bert.encoder.layer.1.output.dense.bias"][3] = float("nan")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="weight bert.encoder.layer.1.output.dense.bias holds NaN or inf"):
        Bert.from_pretrained(str(tmp_path))
    weights = ours.state_dict()
    weights["embeddings.ln.weight"][0] = float("inf")
    torch.save({"model": weights, "model_config": ours.config.__dict__}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="weight embeddings.ln.weight holds NaN or inf"):
        Bert.from_pretrained(str(tmp_path / "ckpt.pt"))


def test_hf_checkpoints_this_bert_cannot_hold_are_refused(tmp_path):
    # an untied decoder, a causal decoder, an extra layer: each would load silently wrong, so each is refused
    def cfg(**kw):
        return transformers.BertConfig(**{**hf_tiny().config.to_dict(), **kw})
    untied = transformers.BertForMaskedLM(cfg(tie_word_embeddings=False))
    with pytest.raises(ValueError, match="untied MLM decoder"):
        Bert.from_pretrained(save_hf(untied, str(tmp_path / "untied")))
    # ... unless only the encoder is wanted (GLUE fine-tuning): then it loads, its head fresh
    encoder = Bert.from_pretrained(str(tmp_path / "untied"), mlm_head=False)
    assert encoder.fresh_head
    assert torch.equal(encoder.embeddings.word.weight[:untied.config.vocab_size],
                       untied.bert.embeddings.word_embeddings.weight)
    with pytest.raises(ValueError, match="is_decoder"):
        Bert.from_pretrained(save_hf(transformers.BertForMaskedLM(cfg(is_decoder=True)), str(tmp_path / "decoder")))
    for kw, needle in ((dict(hidden_act="gelu_new"), "hidden_act 'gelu_new'"),
                       (dict(position_embedding_type="relative_key"), "position_embedding_type 'relative_key'")):
        with pytest.raises(ValueError, match=needle):
            Bert.from_pretrained(save_hf(transformers.BertForMaskedLM(cfg(**kw)), str(tmp_path / "variant")))
    # RoBERTa's weights carry BERT's names (its positions start after the padding id): refused by its model_type
    rcfg = {k: v for k, v in hf_tiny().config.to_dict().items() if k not in ("model_type", "architectures")}
    roberta = transformers.RobertaModel(transformers.RobertaConfig(**{**rcfg, "max_position_embeddings": 66}))
    with pytest.raises(ValueError, match="model_type 'roberta': not a BERT"):
        Bert.from_pretrained(save_hf(roberta, str(tmp_path / "roberta")))
    deeper = save_hf(transformers.BertForMaskedLM(cfg(num_hidden_layers=3)), str(tmp_path / "deeper"))
    config = json.load(open(os.path.join(deeper, "config.json")))
    json.dump({**config, "num_hidden_layers": 2}, open(os.path.join(deeper, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"num_hidden_layers = 2, but the weights have 3"):
        Bert.from_pretrained(deeper)
    # what HF ties or this model has no use for still loads: a tied decoder in a transformers 4 .bin (which
    # save_pretrained 5 no longer writes: built by hand), a position_ids buffer, NSP, task heads
    hf = transformers.BertForPreTraining(cfg())
    state = {**hf.state_dict(), "bert.embeddings.position_ids": torch.arange(40)[None]}
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    (tmp_path / "tied_bin").mkdir()
    torch.save(state, str(tmp_path / "tied_bin" / "pytorch_model.bin"))
    hf.config.to_json_file(str(tmp_path / "tied_bin" / "config.json"))
    assert Bert.from_pretrained(str(tmp_path / "tied_bin")).pooler is not None
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"] + 1
    torch.save(state, str(tmp_path / "tied_bin" / "pytorch_model.bin"))
    with pytest.raises(ValueError, match="decoder.bias differs"):
        Bert.from_pretrained(str(tmp_path / "tied_bin"))
    for head in (transformers.BertForSequenceClassification, transformers.BertForQuestionAnswering):
        Bert.from_pretrained(save_hf(head(cfg()), str(tmp_path / head.__name__)))


def test_sharded_checkpoint_and_special_ids_from_tokenizer_json(tmp_path):
    hf = hf_tiny()
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    ours = Bert.from_pretrained(str(tmp_path)).eval()
    x = torch.randint(5, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours.mlm_logits(ours(x)), hf(input_ids=x).logits, atol=1e-5, rtol=0)
    # transformers 5 saves tokenizer.json without vocab.txt: the special ids come from it, not a guess
    vocab = {f"w{i}": i for i in range(100)}
    vocab.update({"[PAD]": 0, "[UNK]": 50, "[CLS]": 51, "[SEP]": 52, "[MASK]": 53})
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": vocab}}))
    config = Bert.from_pretrained(str(tmp_path)).config
    assert (config.unk_token_id, config.cls_token_id, config.sep_token_id, config.mask_token_id) == (50, 51, 52, 53)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json: not a shard index"):
        Bert.from_pretrained(str(tmp_path))


def test_a_sharded_pytorch_model_bin_loads(tmp_path):
    # older transformers (< 5) shard pytorch_model.bin: the same weights as the sharded safetensors above
    from safetensors.torch import load_file
    hf = hf_tiny()
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    renamed = {shard: shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
               for shard in set(index["weight_map"].values())}
    assert len(renamed) > 1
    for shard, name in renamed.items():
        torch.save(load_file(str(tmp_path / shard)), str(tmp_path / name))
        (tmp_path / shard).unlink()
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (tmp_path / "model.safetensors.index.json").unlink()
    ours = Bert.from_pretrained(str(tmp_path)).eval()
    x = torch.randint(5, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours.mlm_logits(ours(x)), hf(input_ids=x).logits, atol=1e-5, rtol=0)


def test_an_export_with_its_ids_in_config_json_does_not_read_the_tokenizer(tmp_path):
    Bert(BertConfig(**TINY)).save_pretrained(str(tmp_path))
    (tmp_path / "vocab.txt").write_bytes(b"\xff\xfe")  # damaged, and not needed: config.json holds every id
    assert Bert.from_pretrained(str(tmp_path)).config.cls_token_id == BertConfig.cls_token_id


def test_an_export_keeps_every_config_field_for_transformers_and_for_us(tmp_path):
    # no field at its default: one written as a constant, or read back as its default, shows here
    config = BertConfig(**TINY, type_vocab_size=3, dropout=0.25, layer_norm_eps=1e-7, pad_token_id=5, unk_token_id=6,
                        cls_token_id=7, sep_token_id=8, mask_token_id=9)
    Bert(config).save_pretrained(str(tmp_path))
    assert Bert.from_pretrained(str(tmp_path)).config == config
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert (hf.type_vocab_size, hf.hidden_dropout_prob, hf.attention_probs_dropout_prob, hf.layer_norm_eps,
            hf.pad_token_id) == (3, 0.25, 0.25, 1e-7, 5)


def test_special_ids_come_from_config_json_then_the_vocabulary_then_bert_base_uncased(tmp_path):
    save_hf(hf_tiny(), str(tmp_path))  # transformers' config.json holds none of our four ids
    tokens = [f"w{i}" for i in range(100)]
    tokens[50:54] = ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n")  # a token's id is its line number, from 0
    ids = lambda c: (c.unk_token_id, c.cls_token_id, c.sep_token_id, c.mask_token_id)
    assert ids(Bert.from_pretrained(str(tmp_path)).config) == (50, 51, 52, 53)
    config = json.load(open(tmp_path / "config.json"))
    json.dump({**config, "mask_token_id": 9}, open(tmp_path / "config.json", "w"))  # one id given: the rest still read
    assert ids(Bert.from_pretrained(str(tmp_path)).config) == (50, 51, 52, 9)
    from hf_io import config_from_hf  # no vocabulary, bert-base-uncased's size: its ids
    assert ids(config_from_hf({**config, "vocab_size": 30522})) == (100, 101, 102, 103)


def test_old_google_layernorm_names_gamma_and_beta_load(tmp_path):
    hf = hf_tiny()
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in hf.state_dict().items()}
    assert sum("LayerNorm.gamma" in k for k in state) == 6  # embeddings, head, two per layer
    (tmp_path / "old").mkdir()
    torch.save(state, str(tmp_path / "old" / "pytorch_model.bin"))
    hf.config.to_json_file(str(tmp_path / "old" / "config.json"))
    old = Bert.from_pretrained(str(tmp_path / "old")).state_dict()
    new = Bert.from_pretrained(save_hf(hf, str(tmp_path / "new"))).state_dict()
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in new)


def test_a_training_checkpoint_loads_the_pooler_it_carries(tmp_path):
    # a run started from a Hugging Face BertModel carries its pooler into ckpt.pt (eval.py --model .../ckpt.pt)
    from dataclasses import asdict
    model = Bert(BertConfig(**TINY))
    model.pooler = torch.nn.Linear(32, 32)
    torch.save(dict(model=model.state_dict(), model_config=asdict(model.config)), str(tmp_path / "ckpt.pt"))
    loaded = Bert.from_pretrained(str(tmp_path / "ckpt.pt"))
    assert torch.equal(loaded.pooler.weight, model.pooler.weight) and torch.equal(loaded.pooler.bias, model.pooler.bias)


def test_pickled_files_are_refused_on_a_torch_without_safe_loading(tmp_path, monkeypatch):
    import hf_io
    torch.save({"model": {}, "model_config": {}}, str(tmp_path / "ckpt.pt"))
    monkeypatch.setattr(torch, "__version__", "2.5.1")  # weights_only=True can be bypassed before 2.6
    with pytest.raises(ValueError, match="cannot load a pickled file safely; use torch >= 2.6"):
        hf_io.load_checkpoint_file(str(tmp_path / "ckpt.pt"))


def test_a_first_day_checkpoint_with_numpy_rng_state_is_refused_with_the_way_out(tmp_path):
    import numpy as np
    import hf_io
    torch.save({"model": {}, "model_config": {}, "rng": {"numpy": np.random.get_state()}}, str(tmp_path / "ckpt.pt"))
    with pytest.raises(ValueError, match=r"refused: it holds a Python object \(numpy[\w.]*\).*re-save it without "
                       r"'rng' for --init_from and eval.py; --resume cannot continue it"):
        hf_io.load_checkpoint_file(str(tmp_path / "ckpt.pt"))


def test_a_detector_run_checkpoint_says_its_mlm_head_is_untrained(tmp_path):
    from dataclasses import asdict
    model = Bert(BertConfig(**TINY))
    for objective, fresh in (("electra", True), ("cocolm", True), ("mlm", False)):
        torch.save(dict(model=model.state_dict(), model_config=asdict(model.config), config={"objective": objective}),
                   str(tmp_path / "ckpt.pt"))
        assert Bert.from_pretrained(str(tmp_path / "ckpt.pt")).fresh_head is fresh, objective
    for objective, trained in (("half_mlm", True), ("frozen_head", False), ("electra", False)):  # the run's own word
        torch.save(dict(model=model.state_dict(), model_config=asdict(model.config), config={"objective": objective},
                        mlm_head_trained=trained), str(tmp_path / "ckpt.pt"))
        assert Bert.from_pretrained(str(tmp_path / "ckpt.pt")).fresh_head is not trained, objective
    torch.save(dict(model=model.state_dict(), model_config=asdict(model.config), step=9), str(tmp_path / "ckpt.pt"))
    assert Bert.from_pretrained(str(tmp_path / "ckpt.pt")).training_step == 9  # eval.py --model .../ckpt.pt


def test_an_export_read_while_its_run_saves_the_next_one_records_the_step_of_its_weights(tmp_path, monkeypatch):
    """eval.py or --init_from reading a run that is still training: train.py's next export (weights, then
    config.json) landed between the reader's config.json and its weights, and the step of the config was
    reported (glue.json, analysis.json) for the weights of the next one."""
    import hf_io
    run = tmp_path / "run"
    torch.manual_seed(0)
    Bert(BertConfig(**TINY)).save_pretrained(str(run), step=7)
    newer, read_weights = Bert(BertConfig(**TINY)), hf_io._read_weights

    def next_checkpoint_lands(path, *args):  # config.json of step 7 is read: now train.py exports step 8
        newer.save_pretrained(str(run), step=8)
        return read_weights(path, *args)
    monkeypatch.setattr(hf_io, "_read_weights", next_checkpoint_lands)
    loaded = Bert.from_pretrained(str(run))
    assert all(torch.equal(v, newer.hf_state_dict()[k]) for k, v in loaded.hf_state_dict().items())
    assert loaded.training_step == 8


def test_an_export_says_its_step_and_whether_its_run_is_still_training(tmp_path):
    fcntl = pytest.importorskip("fcntl")  # POSIX: Windows runs take no flock
    from hf_io import still_training
    run = tmp_path / "run"
    Bert(BertConfig(**TINY)).save_pretrained(str(run), step=7)
    assert Bert.from_pretrained(str(run)).training_step == 7 and not still_training(str(run))
    with open(run / ".lock", "a+") as held:  # what train.py's take_lock holds while it writes there
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert still_training(str(run)) and still_training(str(run / "ckpt.pt"))
    assert not still_training(str(run))  # released, however its holder ended
    # a run that ends (and deletes its .lock) between the look for the file and its opening: eval.py stopped with
    # "error: [Errno 2] No such file or directory: '.../.lock'" before any fine-tuning
    (run / ".lock").unlink()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(os.path, "isfile", lambda path: True)  # the .lock seen an instant before it went
        assert not still_training(str(run))
    # a torn export of a run that has its ckpt.pt: the error says how to rewrite it (without one, nothing can)
    (run / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt weights file") as info:
        Bert.from_pretrained(str(run))
    assert "--resume" not in str(info.value)
    (run / "ckpt.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"corrupt weights file .*train.py --resume .* rewrites it from ckpt.pt"):
        Bert.from_pretrained(str(run))
