"""
BERT written from scratch: the original architecture (post-LayerNorm, GELU, learned
positions, token types) so that Hugging Face BERT checkpoints load unchanged.

Notable choices:
- Attention runs through F.scaled_dot_product_attention. Packed pretraining batches have
  no padding, so they pass no mask at all and SDPA can take its flash kernel.
- Q, K and V are one fused Linear (one GEMM instead of three); hf_io.hf_weight_names() maps it
  to and from Hugging Face's separate query/key/value tensors.
- The MLM head is applied only to the positions being predicted (mlm_logits takes the
  selected hidden states): at 15% masking this skips ~85% of the head's vocab GEMM
  (measured: 91 ms per training step against 321 ms with the head everywhere, tiny model,
  CPU, b16 s128).
- Embedding rows are padded to a multiple of 64 (30522 -> 30528) so the vocab GEMM
  gets tensor-core friendly shapes. Padded rows are sliced off the logits, so they are
  never predicted, never a target and never sampled.
SDPA, the fused QKV and the padding, each turned off in turn (bench.py --ablate, CPU, fp32, one thread, b8 s128):
step time without SDPA 0.97-0.99x, with three QKV Linears 1.00x, unpadded 0.92-1.03x (on a CPU the slice off the
padded logits costs passes); they are meant for the GPU, where they are not measured yet (docs/efficiency.md).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_io


@dataclass
class BertConfig:
    vocab_size: int = 30522  # real vocabulary: the tokenizer's size
    hidden_size: int = 768  # model width D (BERT-base's; MODEL_PRESETS below has smaller)
    num_layers: int = 12  # transformer layers (BERT-base: 12)
    num_heads: int = 12  # attention heads; head size = hidden_size / num_heads, 64 in every preset
    intermediate_size: int = 3072  # FFN width, 4x hidden in every BERT size
    max_position_embeddings: int = 512  # longest sequence the model accepts
    type_vocab_size: int = 2  # segment A/B embeddings, used by GLUE sentence pairs
    dropout: float = 0.1  # hidden and attention dropout, as in BERT
    layer_norm_eps: float = 1e-12  # BERT's value; HF checkpoints expect it
    pad_vocab_to: int = 64  # embedding rows padded to a multiple of this for fast GEMMs
    # special token ids belong to the vocabulary the model was trained with (data.py's; bert-base-uncased's differ)
    pad_token_id: int = 0  # [PAD]: fills short sequences; packed pretraining blocks have none
    unk_token_id: int = 1  # [UNK]: words the vocabulary cannot spell
    cls_token_id: int = 2  # [CLS]: GLUE classifies from its hidden state
    sep_token_id: int = 3  # [SEP]: ends each segment
    mask_token_id: int = 4  # [MASK]: what most MLM targets are replaced with

    def __post_init__(self):  # every field checked: a corrupt config.json is one clear ValueError, not a crash
        hf_io.check_config(self)

    @property
    def padded_vocab_size(self):
        return math.ceil(self.vocab_size / self.pad_vocab_to) * self.pad_vocab_to


# sizes from the TACO paper (small, base); tiny is for tests and CPU smoke runs
MODEL_PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
    "small": dict(num_layers=4, hidden_size=512, num_heads=8, intermediate_size=2048),
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),
}


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids, token_type_ids=None):
        T = input_ids.size(1)
        x = self.word(input_ids) + self.position.weight[:T]  # (B, T, D) + (T, D)
        # all-zero token types (every pretraining batch) need no lookup
        x = x + (self.token_type.weight[0] if token_type_ids is None else self.token_type(token_type_ids))
        return self.drop(self.ln(x))


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, attn_mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)  # (B, T, 3D) -> 3 x (B, T, D)
        # (B, T, D) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, D)  # (B, nh, T, hs) -> (B, T, D)
        return self.proj(y)


class Layer(nn.Module):
    """Post-LN transformer layer: x = LN(x + Attn(x)); x = LN(x + FFN(x)), as in BERT."""

    def __init__(self, config):
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x, attn_mask=None):
        x = self.ln1(x + self.drop(self.attn(x, attn_mask)))
        return self.ln2(x + self.drop(self.down(F.gelu(self.up(x)))))  # exact (erf) GELU, as BERT


class Encoder(nn.Module):
    """A stack of layers. The COCO-LM/ELECTRA generator builds its own, shallower or narrower, on shared embeddings."""

    def __init__(self, config, num_layers=None):
        super().__init__()
        self.layers = nn.ModuleList(Layer(config) for _ in range(num_layers or config.num_layers))

    def forward(self, x, attention_mask=None, all_layers=False):
        # attention_mask (B, T): 1 = token, 0 = padding. None = no padding: SDPA's flash path
        attn_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
        hidden = [x]
        for layer in self.layers:
            x = layer(x, attn_mask)
            hidden.append(x)
        return hidden if all_layers else x


class MLMHead(nn.Module):
    """BERT's head: dense -> GELU -> LayerNorm -> decoder tied to the word embeddings, plus a bias."""

    def __init__(self, config):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))

    def forward(self, h, decoder_weight):
        x = self.ln(F.gelu(self.dense(h)))
        return F.linear(x, decoder_weight, self.bias)[..., :self.vocab_size]  # drop the padded rows


class Bert(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.head = MLMHead(config)
        self.pooler = None  # only kept when a loaded checkpoint has one (eval.py adds a fresh one)
        self.fresh_head = False  # from_pretrained: the checkpoint holds no MLM head its run trained
        self.training_step = None  # from_pretrained: the step these weights were saved at, if this project saved them
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        # BERT's initialisation: N(0, 0.02) weights, zero biases (LayerNorms keep torch's ones and zeros)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, return_embeddings=False, all_layers=False):
        """Last hidden states (B, T, D); with return_embeddings also the embedding layer's
        output emb(x) (TACO's h - emb(x)); with all_layers the list [emb, layer 1, ..., layer L]."""
        T = input_ids.size(1)
        if T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds the model's max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        emb = self.embeddings(input_ids, token_type_ids)
        hidden = self.encoder(emb, attention_mask, all_layers=all_layers)
        if all_layers:
            return hidden
        return (hidden, emb) if return_embeddings else hidden

    def mlm_logits(self, h):
        """MLM logits (..., vocab_size) for the given hidden states: pass only the predicted positions."""
        return self.head(h, self.embeddings.word.weight)

    # ----------------------------------------------------------------------------------
    # Hugging Face import / export: plumbing the algorithm does not need, in hf_io.py

    @classmethod
    def from_pretrained(cls, path, mlm_head=True):
        """Load a Hugging Face BERT directory (BertForMaskedLM or BertModel weights, in
        model.safetensors or pytorch_model.bin), a run directory of this project (same
        format), or a training checkpoint file ckpt.pt of this project; mlm_head=False: the encoder alone."""
        return hf_io.from_pretrained(cls, path, mlm_head)

    def load_hf_state_dict(self, state, source="checkpoint"):
        """Copy weights under Hugging Face's names into this model; True if they hold an MLM head."""
        return hf_io.load_hf_state_dict(self, state, source)

    def hf_state_dict(self):
        """Weights under Hugging Face BertForMaskedLM names, vocab padding removed."""
        return hf_io.hf_state_dict(self)

    def save_pretrained(self, out_dir, tokenizer_dir=None, mlm_head=True, step=None):
        """Write a directory that transformers.AutoModelForMaskedLM.from_pretrained loads, each file
        atomically; mlm_head=False writes the encoder alone, step goes into both weights and config.json."""
        hf_io.save_pretrained(self, out_dir, tokenizer_dir, mlm_head, step)

