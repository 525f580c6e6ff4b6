"""
Hugging Face import/export and checkpoint files for model.py's Bert. The algorithm does not need this
module: Bert trains and evaluates without it, and its from_pretrained, load_hf_state_dict, hf_state_dict
and save_pretrained are one-line calls into here.

What it guarantees:
- Hugging Face-compatible directories in and out: a BertForMaskedLM or BertModel directory (model.safetensors
  or pytorch_model.bin, sharded or not) loads with transformers' logits, and what save_pretrained writes loads
  in transformers.AutoModelForMaskedLM. hf_weight_names() is the one mapping between the two sets of names.
- Every file is written atomically (atomic.py: a temporary file, fsynced, then os.replace): neither a kill nor a
  power cut leaves a partial file.
- The same weights export to the same model.safetensors bytes (its metadata keys sorted).
- Loading a checkpoint never runs code from it: weights come through safetensors or
  torch.load(weights_only=True) (torch >= 2.6); a file holding any other Python object is refused.
- A bad file, config or weight is one ValueError that names the file and the problem (check_config: every
  field of a BertConfig, wherever one is made; a config.json whose sizes its weights do not have, before
  the model is built).

Tests that hold it to this: test_hf_io.py (directories in and out, the error for each bad file, pickles
refused on an unsafe torch; test_the_same_weights_export_to_the_same_bytes), test_model.py (logits against
transformers through from_pretrained), and in test_reliability.py test_a_pickle_payload_is_refused_and_never_runs
and test_kill_between_checkpoint_and_export_leaves_a_loadable_run (a kill between the export's files).
"""
import errno
import hashlib
import json
import math
import os
import re
from dataclasses import fields

import torch
import torch.nn as nn

from atomic import replace_atomic, write_atomic


# ----------------------------------------------------------------------------------
# Bert's Hugging Face methods (model.py calls these)

def check_config(config):
    """Every field of a BertConfig checked (model.py calls this): a corrupt config.json or checkpoint is one clear
    ValueError, not a crash in a layer. Floats are made floats (config.json's "dropout": 0)."""
    for f in fields(config):
        v = getattr(config, f.name)
        if f.type is int:
            least = 0 if f.name.endswith("_id") else 1
            ok, allowed = type(v) is int and v >= least, f"an integer >= {least}"
        else:  # a float; NaN fails every comparison
            top = 1 if f.name == "dropout" else math.inf
            ok, allowed = type(v) in (int, float) and 0 <= v < top, f"a number in [0, {top})"
        if not ok:
            raise ValueError(f"model config: {f.name} = {v!r}, expected {allowed}")
        if f.type is float:
            setattr(config, f.name, float(v))  # config.json's "dropout": 0 is a float from here on
    if config.hidden_size % config.num_heads:
        raise ValueError(f"model config: hidden_size {config.hidden_size} is not a multiple of num_heads {config.num_heads}")
    for name in [f.name for f in fields(config) if f.name.endswith("_token_id")]:
        if getattr(config, name) >= config.vocab_size:  # an IndexError in the embedding otherwise
            raise ValueError(f"model config: {name} = {getattr(config, name)}, must be < vocab_size {config.vocab_size}")


def from_pretrained(cls, path, mlm_head=True):
    """Load a Hugging Face BERT directory (BertForMaskedLM or BertModel weights, in
    model.safetensors or pytorch_model.bin), a run directory of this project (same
    format), or a training checkpoint file ckpt.pt of this project. mlm_head=False reads
    the encoder alone (fine-tuning never uses the MLM head, so an untied one is no obstacle)."""
    if os.path.isfile(path):
        return _load_project_checkpoint(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such checkpoint file or directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        if os.path.isfile(os.path.join(path, "ckpt.pt")):
            return _load_project_checkpoint(os.path.join(path, "ckpt.pt"))
        raise ValueError(f"{path}: not a checkpoint (no config.json or ckpt.pt)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
        ids = ("unk_token_id", "cls_token_id", "sep_token_id", "mask_token_id")
        config = config_from_hf(hf, vocab=None if all(k in hf for k in ids) else _read_vocab(path))
    except KeyError as e:
        raise ValueError(f"{cfg_path}: not a valid BERT config (no {e} key)") from None
    except ValueError as e:  # not JSON, not UTF-8, or a value BertConfig refuses
        raise ValueError(f"{cfg_path}: not a valid BERT config ({_last_line(e)})") from None
    metadata = {}
    state = _read_weights(path, metadata)
    _check_sizes(config, state, cfg_path, path)
    _check_finite(state, path)
    model = cls(config)
    if not mlm_head:
        state = {k: v for k, v in state.items() if not k.startswith("cls.")}
    model.fresh_head = not model.load_hf_state_dict(state, source=path)
    # an export of this project says which step it holds; the weights' own record wins: config.json is written
    # after them, so one read while a train.py exports (or after a kill between the two) is of the step before
    step = metadata.get("training_step")
    model.training_step = int(step) if isinstance(step, str) and step.isdigit() else hf.get("training_step")
    return model


def _check_sizes(config, state, source, weights, ours=False):
    """config's sizes against its weights' (Hugging Face names; ours: this project's, a ckpt.pt's), before a model
    of that config is built: one edited to a vocab_size of 10**12 (or a million layers), or whose weights lack the
    tensor that would show it, is this error, not a failed allocation or the OOM killer."""
    c, D = config, config.hidden_size
    if ours:
        prefix, layer = "", r"encoder\.layers\.(\d+)\."
        checks = (("vocab_size, pad_vocab_to, hidden_size", "embeddings.word.weight", (c.padded_vocab_size, D)),
                  ("max_position_embeddings", "embeddings.position.weight", (c.max_position_embeddings, D)),
                  ("type_vocab_size", "embeddings.token_type.weight", (c.type_vocab_size, D)),
                  ("intermediate_size", "encoder.layers.0.up.weight", (c.intermediate_size, D)))
    else:  # BertForMaskedLM's "bert." names or BertModel's bare ones
        prefix, layer = "bert." if any(k.startswith("bert.") for k in state) else "", r"(?:bert\.)?encoder\.layer\.(\d+)\."
        checks = (("vocab_size, hidden_size", "embeddings.word_embeddings.weight", (c.vocab_size, D)),
                  ("max_position_embeddings", "embeddings.position_embeddings.weight", (c.max_position_embeddings, D)),
                  ("type_vocab_size", "embeddings.token_type_embeddings.weight", (c.type_vocab_size, D)),
                  ("intermediate_size", "encoder.layer.0.intermediate.dense.weight", (c.intermediate_size, D)))
    layers = {m[1] for k in state if (m := re.match(layer, k))}
    for names, name, expected in (*checks, ("num_layers" if ours else "num_hidden_layers", None, c.num_layers)):
        tensor = state.get(prefix + name) if name else None
        if name and not torch.is_tensor(tensor):
            raise ValueError(f"{weights}: missing weight {prefix + name} (not a BERT checkpoint of this shape?)")
        found = tuple(tensor.shape) if name else len(layers)
        if found != expected:
            raise ValueError(f"{source}: {names} = {expected}, but the weights have {found}: an edited config "
                             f"or another model's weights")


def checkpoint_config(ckpt, path):
    """The BertConfig of a training checkpoint (load_checkpoint_file's), checked against its weights' sizes and
    values before a model is built (from_pretrained, --init_from, --resume): a model_config edited to a huge size is
    one ValueError, not an allocation the OOM killer ends; NaN or inf weights (never saved by train.py) one too."""
    from model import BertConfig  # here, not at the top: model imports this module
    names = {f.name for f in fields(BertConfig)}
    try:
        config = BertConfig(**{k: v for k, v in ckpt["model_config"].items() if k in names})
    except (AttributeError, TypeError, ValueError) as e:  # model_config not a dict, or a value BertConfig refuses
        raise ValueError(f"{path}: not a valid model config ({_last_line(e)})") from None
    _check_sizes(config, ckpt["model"], path, path, ours=True)
    _check_finite(ckpt["model"], path)
    return config


def _check_finite(state, source):
    """NaN or inf in a weight: a diverged or damaged model, which would load and score (or train) as NaN."""
    for name, tensor in state.items():  # a finite sum has no NaN or inf (0.05 s for BERT-base; the check alone 0.5)
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor.sum()) \
                and not torch.isfinite(tensor).all():
            raise ValueError(f"{source}: weight {name} holds NaN or inf values (a diverged or damaged model)")


def load_hf_state_dict(model, state, source="checkpoint"):
    """Copy weights under Hugging Face's names (BertForMaskedLM, BertModel or a task model) into model, the
    padded vocab rows zeroed, a pooler kept if there is one. True if they hold an MLM head. Anything this
    BERT cannot hold is one ValueError naming source."""
    # old Google checkpoints name LayerNorm parameters gamma/beta
    state = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
             for k, v in state.items()}
    if not any(k.startswith("bert.") for k in state):  # BertModel: no "bert." prefix, no head
        state = {"bert." + k: v for k, v in state.items()}
    own = model.state_dict()
    names = hf_weight_names(model.config)
    has_head = "cls.predictions.transform.dense.weight" in state
    used = {t for ours, theirs in names.items() if has_head or not ours.startswith("head.") for t in theirs}
    tied = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias"}
    for key in sorted(set(state) - used):
        if key in tied:
            if tied[key] in state and not torch.equal(state[key], state[tied[key]]):  # this model ties them
                raise ValueError(f"{source}: {key} differs from {tied[key]}: an untied MLM decoder, which this "
                                 f"BERT cannot hold (its decoder is the word embeddings)")
        elif not (key.startswith(("bert.pooler.", "cls.seq_relationship.", "classifier.", "qa_outputs."))
                  or key.endswith(("position_ids", "token_type_ids"))):  # NSP and task heads are not used
            raise ValueError(f"{source}: unexpected weight {key} (not a BERT of this config's shape?)")
    for ours, theirs in names.items():
        if ours.startswith("head.") and not has_head:
            continue  # a BertModel checkpoint: the MLM head keeps its fresh init
        missing = [t for t in theirs if t not in state]
        if missing:
            raise ValueError(f"{source}: missing weight {missing[0]} (not a BERT checkpoint of this shape?)")
        target = own[ours]
        vocab_rows = ours in ("embeddings.word.weight", "head.bias")  # stored unpadded: vocab_size rows
        expected = (model.config.vocab_size,) + target.shape[1:] if vocab_rows else target.shape
        # each of query, key, value checked alone: a bad one made torch.cat's RuntimeError, a traceback
        expected = (expected[0] // len(theirs),) + tuple(expected[1:])
        for t in theirs:
            if not state[t].is_floating_point():  # copy_ would cast integers silently
                raise ValueError(f"{source}: {t} holds {state[t].dtype}, not floating-point weights")
            if state[t].shape != expected:
                raise ValueError(f"{source}: {t} has shape {tuple(state[t].shape)}, expected {tuple(expected)}")
        tensor = torch.cat([state[t] for t in theirs]) if len(theirs) > 1 else state[theirs[0]]
        target[len(tensor):] = 0  # the padded vocab rows (an empty slice elsewhere)
        target[:len(tensor)].copy_(tensor)
    if "bert.pooler.dense.weight" in state:
        model.pooler = nn.Linear(model.config.hidden_size, model.config.hidden_size)
        for name, target in model.pooler.named_parameters():
            tensor = state.get(f"bert.pooler.dense.{name}")
            if tensor is None or tensor.shape != target.shape or not tensor.is_floating_point():
                found = "missing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
                raise ValueError(f"{source}: bert.pooler.dense.{name} is {found}, expected {tuple(target.shape)}")
            target.data.copy_(tensor)
    return has_head


def hf_state_dict(model):
    """Weights under Hugging Face BertForMaskedLM names, vocab padding removed."""
    own, V = model.state_dict(), model.config.vocab_size
    out = {}
    for ours, theirs in hf_weight_names(model.config).items():
        tensor = own[ours]
        if ours in ("embeddings.word.weight", "head.bias"):
            tensor = tensor[:V]
        out.update(zip(theirs, tensor.chunk(len(theirs))))  # the fused qkv splits back into query, key, value
    if model.pooler is not None:
        out["bert.pooler.dense.weight"], out["bert.pooler.dense.bias"] = model.pooler.weight, model.pooler.bias
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def save_pretrained(model, out_dir, tokenizer_dir=None, mlm_head=True, step=None):
    """Write a directory that transformers.AutoModelForMaskedLM.from_pretrained loads,
    with the tokenizer files copied from tokenizer_dir. Each file is written atomically.
    mlm_head=False writes the encoder alone under BertModel's names (for objectives that
    never train this head: COCO-LM, ELECTRA). step: the training step, recorded in both
    the weights' metadata and config.json ("training_step"), so a reader can tell that
    the two files (and train.py's ckpt.pt) belong together."""
    state, hf_config = model.hf_state_dict(), config_to_hf(model.config)
    metadata = {"format": "pt"}
    if step is not None:
        hf_config["training_step"], metadata["training_step"] = step, str(step)
    if not mlm_head:
        state = {k[len("bert."):]: v for k, v in state.items() if k.startswith("bert.")}
        hf_config["architectures"] = ["BertModel"]
    write_hf_dir(out_dir, state, hf_config, metadata, tokenizer_dir)


# ----------------------------------------------------------------------------------
# Names, configs and files

def hf_weight_names(config):
    """Our parameter name -> its Hugging Face BertForMaskedLM names (three for the fused qkv, else one)."""
    names = {
        "embeddings.word.weight": ["bert.embeddings.word_embeddings.weight"],
        "embeddings.position.weight": ["bert.embeddings.position_embeddings.weight"],
        "embeddings.token_type.weight": ["bert.embeddings.token_type_embeddings.weight"],
        "embeddings.ln.weight": ["bert.embeddings.LayerNorm.weight"],
        "embeddings.ln.bias": ["bert.embeddings.LayerNorm.bias"],
        "head.dense.weight": ["cls.predictions.transform.dense.weight"],
        "head.dense.bias": ["cls.predictions.transform.dense.bias"],
        "head.ln.weight": ["cls.predictions.transform.LayerNorm.weight"],
        "head.ln.bias": ["cls.predictions.transform.LayerNorm.bias"],
        "head.bias": ["cls.predictions.bias"],
    }
    for i in range(config.num_layers):
        ours, hf = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        for p in ("weight", "bias"):
            names[ours + f"attn.qkv.{p}"] = [hf + f"attention.self.{n}.{p}" for n in ("query", "key", "value")]
            names[ours + f"attn.proj.{p}"] = [hf + f"attention.output.dense.{p}"]
            names[ours + f"ln1.{p}"] = [hf + f"attention.output.LayerNorm.{p}"]
            names[ours + f"up.{p}"] = [hf + f"intermediate.dense.{p}"]
            names[ours + f"down.{p}"] = [hf + f"output.dense.{p}"]
            names[ours + f"ln2.{p}"] = [hf + f"output.LayerNorm.{p}"]
    return names


def config_to_hf(config):
    return {
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_act": "gelu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings, "type_vocab_size": config.type_vocab_size,
        "hidden_dropout_prob": config.dropout, "attention_probs_dropout_prob": config.dropout,
        "layer_norm_eps": config.layer_norm_eps, "initializer_range": 0.02,
        "pad_token_id": config.pad_token_id, "position_embedding_type": "absolute",
        # extra keys, ignored by transformers, so this project knows its special tokens
        "unk_token_id": config.unk_token_id, "cls_token_id": config.cls_token_id,
        "sep_token_id": config.sep_token_id, "mask_token_id": config.mask_token_id,
    }


def config_from_hf(hf, vocab=None):
    """BertConfig of a Hugging Face config.json; the special token ids from its own keys (this project's
    exports), else from vocab (token -> id, the directory's tokenizer), else bert-base-uncased's at 30,522."""
    if not isinstance(hf, dict):
        raise ValueError(f"expected a JSON object, got {type(hf).__name__}")
    if hf.get("model_type", "bert") != "bert":  # RoBERTa's weights have BERT's names but offset positions
        raise ValueError(f"model_type {hf['model_type']!r}: not a BERT (this project loads BERT weights only)")
    for key, ours in (("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
        if hf.get(key, ours) != ours:
            raise ValueError(f"unsupported BERT variant ({key} {hf[key]!r}; this model has {ours!r})")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):  # a causal mask / cross-attention: not this model
        raise ValueError("unsupported BERT variant (is_decoder or add_cross_attention)")
    values = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], type_vocab_size=hf.get("type_vocab_size", 2),
        dropout=hf.get("hidden_dropout_prob", 0.1), layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        pad_token_id=hf.get("pad_token_id") or 0)
    from model import BertConfig  # here, not at the top: model imports this module
    specials = dict(unk_token_id="[UNK]", cls_token_id="[CLS]", sep_token_id="[SEP]", mask_token_id="[MASK]")
    for key, token in specials.items():
        if key in hf:
            values[key] = hf[key]
        elif vocab is not None and token in vocab:
            values[key] = vocab[token]
        elif values["vocab_size"] == 30522:  # bert-base-uncased's layout
            values[key] = {"[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}[token]
    return BertConfig(**values)  # checks every value


def _read_vocab(path):
    """token -> id of the tokenizer saved beside the weights (vocab.txt, else tokenizer.json), or None."""
    try:
        if os.path.isfile(os.path.join(path, "vocab.txt")):
            with open(os.path.join(path, "vocab.txt"), encoding="utf-8") as f:
                return {line.rstrip("\n"): i for i, line in enumerate(f)}
        if os.path.isfile(os.path.join(path, "tokenizer.json")):  # transformers 5 saves no vocab.txt
            with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
                vocab = json.load(f).get("model", {}).get("vocab")
            return vocab if isinstance(vocab, dict) else None
    except (UnicodeDecodeError, ValueError, AttributeError):
        raise ValueError(f"{path}: its vocab.txt / tokenizer.json is not a readable vocabulary") from None
    return None


def _read_weights(path, metadata=None):
    """The state dict of model.safetensors or pytorch_model.bin, or of the shards their .index.json lists;
    metadata (a dict) receives the safetensors files' metadata."""
    safetensors = lambda file: load_safetensors(file, metadata)
    for name, load in (("model.safetensors", safetensors), ("pytorch_model.bin", _load_tensors)):
        file, index = os.path.join(path, name), os.path.join(path, name + ".index.json")
        try:
            if os.path.isfile(file):
                return load(file)
            if os.path.isfile(index):  # a sharded checkpoint (save_pretrained's max_shard_size)
                try:
                    with open(index, encoding="utf-8") as f:
                        shards = sorted(set(json.load(f)["weight_map"].values()))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ValueError(f"{index}: not a shard index ({type(e).__name__}: {_last_line(e)})") from None
                return {k: v for shard in shards for k, v in load(os.path.join(path, shard)).items()}
        except ValueError:
            raise
        except PermissionError as e:  # not corrupt: the user may not read it
            raise ValueError(f"{path}: cannot read its weights ({e.strerror}: {e.filename})") from None
        except Exception as e:
            fix = _rewrite_hint(path) if name == "model.safetensors" else ""
            raise ValueError(f"{path}: corrupt weights file ({type(e).__name__}: {_last_line(e)}){fix}") from None
    raise ValueError(f"{path}: no model.safetensors or pytorch_model.bin (or their .index.json)")


def _weights_sha1(state):
    """sha1 over the names and bytes of a state dict's tensors (write_hf_dir records it in the weights' metadata)."""
    h = hashlib.sha1()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def load_safetensors(path, metadata=None):
    """safetensors' load_file, checked against the weights_sha1 an export of this project records: the format
    has no checksum of its own, so bytes changed on disk would load as garbled weights. metadata (a dict)
    receives the file's metadata, read from the same open file as the weights (training_step: their step)."""
    from safetensors import safe_open
    open(path, "rb").close()  # safetensors words a file it may not read "No such file or directory"
    with safe_open(path, "pt") as f:
        found = f.metadata() or {}
        expected = found.get("weights_sha1")
        state = {k: f.get_tensor(k) for k in f.keys()}
    if metadata is not None:
        metadata.update(found)
    if expected is not None and _weights_sha1(state) != expected:
        raise ValueError(f"{os.path.dirname(path) or '.'}: corrupt weights file (the tensors of model.safetensors do not "
                         f"match the weights_sha1 saved with them){_rewrite_hint(os.path.dirname(path) or '.')}")
    return state


def _rewrite_hint(path):
    """How to mend a damaged export of a run of this project (its ckpt.pt holds the weights)."""
    return (f"; python train.py --resume {path} rewrites it from ckpt.pt"
            if os.path.isfile(os.path.join(path, "ckpt.pt")) else "")


def _load_tensors(path):
    """torch.load with the weights-only unpickler: a file holding any other Python object is refused, never
    unpickled, so no code in it runs (safe from torch 2.6 on: CVE-2025-32434). Every failure is a ValueError."""
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
        raise ValueError(f"{path}: torch {torch.__version__} cannot load a pickled file safely; use torch >= 2.6")
    try:
        _check_zip_crcs(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except ValueError:
        raise
    except Exception as e:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch's weights-only unpickler refused a global
        if unsafe:
            hint = (" (checkpoints of train.py before safe loading pickled numpy's RNG state: retrain, or load it "
                    "once with torch.load(weights_only=False) if you trust it and re-save it without 'rng' for "
                    "--init_from and eval.py; --resume cannot continue it: its loader state predates exact resume)"
                    if unsafe.group(1).startswith("numpy") else "")
            raise ValueError(f"{path}: refused: it holds a Python object ({unsafe.group(1)}) that only an unsafe "
                             f"load would run; weights and checkpoints hold tensors and plain values{hint}") from None
        raise ValueError(f"{path}: corrupt or unreadable file ({type(e).__name__}: {_last_line(e)}){_dir_hint(path)}"
                         ) from None


def _check_zip_crcs(path):
    """torch.save's zip records carry a CRC-32 that torch.load never checks: bytes flipped inside a tensor load
    as garbled weights (a resume trains on them until the loss is NaN). Check them first (~1 s per GB)."""
    import zipfile
    if not zipfile.is_zipfile(path):
        return  # torch's legacy format, or not a checkpoint: torch.load says which
    with zipfile.ZipFile(path) as z:
        for record in z.infolist():
            if record.CRC == 0 and record.file_size:  # torch.serialization.set_crc32_options(False) records none
                continue
            try:
                with z.open(record) as f:  # zipfile compares the CRC at the end of the read
                    while f.read(1 << 24):
                        pass
            except zipfile.BadZipFile:
                raise ValueError(f"{path}: corrupt file ({record.filename} fails its CRC check: bytes changed on "
                                 f"disk)") from None


def _dir_hint(path):
    """A file of a model directory given where the directory (or its ckpt.pt) was meant."""
    names = ("model.safetensors", "config.json", "pytorch_model.bin", "tokenizer.json", "vocab.txt", "log.jsonl")
    if os.path.basename(str(path)) in names:
        return f"; {os.path.basename(str(path))} is one file of a model directory: pass the directory, " \
               f"{os.path.dirname(str(path)) or '.'}"
    return ""


def load_checkpoint_file(path):
    """Read a training checkpoint with torch's safe loader (tensors, numbers, strings, lists, dicts):
    a file that holds any other Python object is refused, never unpickled, so no code in it runs.
    Every failure is one clear ValueError."""
    ckpt = _load_tensors(path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or "model_config" not in ckpt:
        raise ValueError(f"{path}: not a checkpoint of this project (no model / model_config){_dir_hint(path)}")
    return ckpt


def _last_line(e):
    lines = [line for line in str(e).splitlines() if line.strip() and "documentation" not in line]
    line = lines[-1] if lines else ""
    return line if len(line) <= 200 else line[:line.rfind(". ", 0, 200) + 1 or 200]  # whole sentences


def _load_project_checkpoint(path):
    from model import Bert  # here, not at the top: model imports this module
    ckpt = load_checkpoint_file(path)
    config = checkpoint_config(ckpt, path)
    model = Bert(config)
    if "pooler.weight" in ckpt["model"]:
        model.pooler = nn.Linear(model.config.hidden_size, model.config.hidden_size)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not match the model config ({' '.join(str(e).split())[:300]})") from None
    run = ckpt.get("config")  # the run's own word on its MLM head; before it was saved, the objectives that freeze it
    trained = ckpt.get("mlm_head_trained", not (isinstance(run, dict) and run.get("objective") in ("electra", "cocolm")))
    model.fresh_head = trained is not True
    model.training_step = ckpt.get("step")
    return model


def still_training(path):
    """True while a train.py holds the .lock of the run directory `path` is in (or is): its export and
    ckpt.pt move on at each checkpoint, so a score made now is of one step of an unfinished run."""
    lock = os.path.join(path if os.path.isdir(path) else os.path.dirname(path) or ".", ".lock")
    if os.name == "nt":
        return False
    import fcntl
    if not os.path.isfile(lock):  # none, or a FIFO put there (whose open would wait for a writer forever)
        return False
    try:
        f = open(lock, encoding="utf-8")
    except OSError:  # no run there, or one that ended (and deleted its .lock) since it was looked for
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:  # held; any other error is a file system without locks, where no run holds one
            return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    return False  # closing the file released the shared lock


def write_hf_dir(out_dir, state, hf_config, metadata, tokenizer_dir=None):
    """A Hugging Face model directory: model.safetensors, config.json and the tokenizer files copied
    from tokenizer_dir, each written atomically (Bert.save_pretrained, eval.py's fine-tuned models)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)

    metadata = {**metadata, "weights_sha1": _weights_sha1(state)}  # checked on loading

    def write_weights(tmp):
        try:
            save_file(state, tmp, metadata=metadata)
            sort_safetensors_metadata(tmp)
        except SafetensorError as e:  # its own error for a write the disk refused, which eval.py's OSError line catches
            raise OSError(f"safetensors could not write {os.path.join(out_dir, 'model.safetensors')}: {e}") from None
        os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600; the other files get the umask's mode
    replace_atomic(os.path.join(out_dir, "model.safetensors"), write_weights)
    write_atomic(os.path.join(out_dir, "config.json"), json.dumps(hf_config, indent=2))
    if tokenizer_dir and os.path.abspath(tokenizer_dir) != os.path.abspath(out_dir):
        for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                with open(src, encoding="utf-8") as f:
                    write_atomic(os.path.join(out_dir, name), f.read())


def sort_safetensors_metadata(path):
    """safetensors writes `__metadata__` in the order of a randomly seeded Rust HashMap, so saving the same
    weights gave another model.safetensors (another sha256) in most saves, in one process or two. Its keys
    sorted, the header keeps its length, so it is rewritten in place: the same weights, the same bytes."""
    with open(path, "rb+") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        metadata = header.pop("__metadata__", None)
        if not metadata:
            return
        header = {"__metadata__": dict(sorted(metadata.items())), **header}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) <= size:  # always: the same keys and values, reordered
            f.seek(8)
            f.write(text + b" " * (size - len(text)))  # safetensors pads its header with spaces too
