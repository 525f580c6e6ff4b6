"""
Pretraining objectives: MLM (Devlin et al., 2019), TACO (Fu et al., ACL 2022), TaCL (Su et al., NAACL Findings
2022), COCO-LM (Meng et al., NeurIPS 2021), ELECTRA (Clark et al., ICLR 2020). One nn.Module each, built as
LOSSES[name](model, cfg) (cfg: config.TrainConfig, with each hyperparameter's default and source) and called as
`loss, metrics = objective(model, batch, rng)`. Each docstring names its equations (or the paper's section); each
deviation from an official implementation is a comment here and a numbered "fidelity note N" in docs/fidelity.md.

- model is the Bert (or torch.compile(model): attributes pass through); an objective calls model(...) and
  model.mlm_logits(...) but never stores it, so the encoder's weights stay out of objective.state_dict(). What an
  objective owns (generator, heads, TaCL's teacher) is a submodule, in objective.parameters() and state_dict().
- Every draw (masks, negatives, samples; dropout is torch's own) uses the torch.Generator `rng`: seeding it makes
  them reproducible, and a test can replay them by calling the same sampling helpers with the same seed.
- Fixed shapes and no host syncs: masking selects exactly round(p * eligible) positions per row into
  M = ceil(p * T) slots (unused slots have label -100), so a compiled model never sees a new shape and metrics
  stay on the device until train.py logs them.
- train.py's packed blocks carry no attention_mask: the padding paths serve padded inputs (the tests, your data).
"""
import copy
import functools
import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Bert, Encoder, MLMHead

# ------------------------------------------------------------------------------------------
# helpers


def special_ids(config):
    return sorted({config.pad_token_id, config.unk_token_id, config.cls_token_id,
                   config.sep_token_id, config.mask_token_id})


def non_pad(input_ids, attention_mask=None):
    return torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()


def eligible_positions(input_ids, config, attention_mask=None):
    """(B, T) bool: positions that may be masked, i.e. neither a special token nor padding."""
    eligible = non_pad(input_ids, attention_mask)
    for s in special_ids(config):
        eligible = eligible & (input_ids != s)
    return eligible


def uniform_int(n, rng):
    """A uniform integer in [0, n) for each element of the integer tensor n (n >= 1)."""
    draw = (torch.rand(n.shape, generator=rng, device=n.device) * n).long()
    return torch.minimum(draw, (n - 1).clamp(min=0))  # float rounding can land on n itself


def random_real_tokens(shape, config, rng, device):
    """Uniform over the real vocabulary minus the special ids (bert-base-uncased: 0, 100-103).
    Hugging Face's collator draws over the whole vocabulary (fidelity note 7)."""
    tokens = torch.randint(config.vocab_size - len(special_ids(config)), shape, generator=rng, device=device)
    for s in special_ids(config):  # ascending: turn the rank among non-special ids into the id itself
        tokens = tokens + (tokens >= s).long()
    return tokens


def mask_tokens(input_ids, config, rng, mask_prob=0.15, mask_frac=0.8, random_frac=0.1, attention_mask=None):
    """BERT's dynamic masking with fixed shapes and no host sync.

    Eligible = not a special token ([CLS], [SEP], [PAD], [MASK], [UNK]) and not padding. Each row gets exactly
    round(mask_prob * its eligible count) positions, uniformly at random (the top-k of random scores, ineligible
    positions scored below all), written into M = ceil(mask_prob * T) slots; slots beyond a row's count are
    unused and labelled -100. Of the selected: mask_frac -> [MASK], random_frac -> a random real token, the rest
    unchanged (BERT 80/10/10; ELECTRA 85/0/15). The MLM head then runs on the M gathered slots only.
    Returns corrupted ids (B, T), positions (B, M) long, labels (B, M) long (-100 = unused)."""
    B, T = input_ids.shape
    device = input_ids.device
    eligible = eligible_positions(input_ids, config, attention_mask)
    num_masked = (eligible.sum(1) * mask_prob).round().long()  # (B,)
    num_slots = math.ceil(mask_prob * T)
    # choose positions: top-k of uniform scores, ineligible ones pushed below every eligible one
    # (HF's collator, used by TACO, draws Bernoulli(p) per token instead: same mean, varying count; note 6)
    scores = torch.rand(B, T, generator=rng, device=device).masked_fill(~eligible, -1.0)
    positions = scores.topk(num_slots, dim=1).indices  # (B, M), distinct within a row
    used = torch.arange(num_slots, device=device) < num_masked[:, None]  # (B, M)
    original = input_ids.gather(1, positions)  # (B, M)
    # one uniform per slot splits the selected into [MASK] / random / unchanged
    split = torch.rand(B, num_slots, generator=rng, device=device)
    random_tokens = random_real_tokens((B, num_slots), config, rng, device)
    new = torch.where(split < mask_frac, config.mask_token_id,
                      torch.where(split < mask_frac + random_frac, random_tokens, original))
    corrupted = input_ids.scatter(1, positions, torch.where(used, new, original))
    return corrupted, positions, original.masked_fill(~used, -100)


def gather_positions(h, positions):
    """h (B, T, D), positions (B, M) -> (B*M, D)."""
    return h.gather(1, positions[..., None].expand(-1, -1, h.size(-1))).flatten(0, 1)


def masked_mean(values, mask):
    # where, not a product: a NaN or inf at a masked-out position must not leak into the mean
    values = values if values.is_floating_point() else values.float()
    return torch.where(mask, values, 0).sum() / mask.sum().clamp(min=1)


def cross_entropy(logits, labels):
    """Mean CE over the labels that are not -100; 0 (not NaN) when a batch has none, as a batch
    of very short rows can (round(0.15 * 3) = 0 targets)."""
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return loss / (labels != -100).sum().clamp(min=1)


def accuracy(logits, labels):
    valid = labels != -100  # max().indices: argmax's first index, 3-4x faster on a CPU (docs/efficiency.md)
    return (((logits.max(-1).indices == labels) & valid).sum() / valid.sum().clamp(min=1)).detach()


def mlm_loss(model, h, input_ids, positions, labels, attention_mask=None, predict_all=False):
    """L_MLM: cross-entropy of the BERT head on the selected slots only.
    predict_all adds TACO's "MLM+TP" ablation (§5.2): the original token at every unmasked,
    non-special position, as a second mean CE term tp_loss (full-width head, so it costs more)."""
    logits = model.mlm_logits(gather_positions(h, positions))  # (B*M, V)
    loss = cross_entropy(logits, labels.flatten())
    metrics = dict(mlm_loss=loss.detach(), mlm_acc=accuracy(logits.detach(), labels.flatten()))
    if predict_all:
        selected = torch.zeros_like(input_ids, dtype=torch.bool).scatter(1, positions, labels != -100)  # (B, T)
        targets = input_ids.masked_fill(selected | ~eligible_positions(input_ids, model.config, attention_mask), -100)
        # our reading of §5.2 (its weighting is not in the official code): a second mean CE, added (fidelity note 12)
        tp_loss = cross_entropy(model.mlm_logits(h.flatten(0, 1)), targets.flatten())
        metrics["tp_loss"] = tp_loss.detach()
        loss = loss + tp_loss
    return loss, metrics


def upcast(t):
    """At least fp32 (float64 stays float64, for the tests)."""
    return t if t.dtype == torch.float64 else t.float()


def masked_bce(logits, targets, mask):
    bce = F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="none")
    return masked_mean(bce, mask)


def pool_size(negative_pool, batch_size, minimum=1):
    """Rows that share one pool of negatives (TACO) or one NT-Xent batch (COCO-LM's SCL): negative_pool consecutive
    rows of the per-process micro-batch, 0 = all of it (the official codes). A fixed pool keeps the pools alike on
    1 or 16 GPUs and any accumulation. TACO needs `minimum` 2 rows (config.pool_problem refuses 1 for both)."""
    if negative_pool < 0 or (negative_pool and batch_size % negative_pool):
        raise ValueError(f"negative_pool {negative_pool} must divide the per-process batch size {batch_size} "
                         f"(0 = the whole micro-batch)")
    pool = negative_pool or batch_size
    if pool < minimum:
        raise ValueError(f"the pool is {pool} sequence(s): TACO draws negatives from the other sequences of its "
                         f"pool, it needs batch size and negative_pool >= {minimum}")
    return pool


# ------------------------------------------------------------------------------------------
# objectives


class MLM(nn.Module):
    """Masked language modelling (Devlin et al., 2019; RoBERTa's dynamic masking, no NSP: fidelity note 5):
    L_MLM = mean over the selected 15% of CE(E head(h_i) + b, x_i): model.mlm_logits, E tied. No detach."""

    def __init__(self, model, cfg):
        super().__init__()
        self.mask_prob = cfg.mask_prob
        self.predict_all = cfg.mlm_predict_all

    def forward(self, model, batch, rng):
        x, attention_mask = batch["input_ids"], batch.get("attention_mask")
        corrupted, positions, labels = mask_tokens(x, model.config, rng, self.mask_prob, attention_mask=attention_mask)
        h = model(corrupted, attention_mask=attention_mask)
        return mlm_loss(model, h, x, positions, labels, attention_mask, self.predict_all)


def taco_samples(valid, window, num_negatives, rng, pool=0):
    """TACO's positive and negative draws (official sampler.py, batched and padding-aware).
    valid (B, T) bool = non-pad. Returns flat indices into the B*T positions: positive (B, T),
    negatives (B, T, num_negatives). Positive: same row, offset uniform over
    {-W//2..W//2} minus 0; if that leaves the row or lands on padding, a uniformly random other
    non-pad position of the row (none in a one-token row: TACO drops its anchor). Negatives: a row
    uniform among the other P-1 rows of the anchor's pool (P = pool consecutive rows, 0 = all B rows),
    then a position uniform among that row's non-pad positions (with replacement)."""
    # (the official sampler assumes unpadded rows: its columns are uniform over all T positions; fidelity note 10)
    B, T = valid.shape
    device = valid.device
    count = valid.sum(1)  # (B,) non-pad positions per row
    cum = valid.flatten().long().cumsum(0)  # (B*T,)
    row_start = count.cumsum(0) - count  # non-pad positions before each row

    def nth_valid(row, rank):  # flat index of the rank-th (0-based) non-pad position of `row`
        # clamp: a one-token row's fallback asks for a rank it lacks; TACO.forward drops that anchor
        return torch.searchsorted(cum, row_start[row] + rank + 1).clamp(max=B * T - 1)

    rows = torch.arange(B, device=device)[:, None].expand(B, T)
    cols = torch.arange(T, device=device).expand(B, T)
    # positive: a window offset, skipping 0
    half = window // 2
    draw = torch.randint(2 * half, (B, T), generator=rng, device=device)
    pos_col = cols + draw - half + (draw >= half).long()  # (B, T)
    inside = (pos_col >= 0) & (pos_col < T)
    pos_col = pos_col.clamp(0, T - 1)
    inside = inside & valid.gather(1, pos_col)
    # fallback: a uniform other non-pad position of the same row (skip the anchor's own rank)
    own_rank = cum.view(B, T) - row_start[:, None] - 1
    rank = uniform_int(count[:, None].expand(B, T) - 1, rng)  # (B, T), among the row's other positions
    fallback = nth_valid(rows, rank + (rank >= own_rank).long())
    positive = torch.where(inside, rows * T + pos_col, fallback)
    # negatives: another row of the anchor's pool (skip the anchor's own), then a non-pad position of it
    pool = pool or B
    pool_row = rows % pool  # the anchor's row within its pool; pool == B draws exactly as the official sampler
    neg_row = torch.randint(pool - 1, (B, T, num_negatives), generator=rng, device=device)  # (B, T, K)
    # a draw at or past the anchor's own row in the pool moves up one (skipping it); + the pool's first row
    neg_row = neg_row + (neg_row >= pool_row[..., None]).long() + (rows - pool_row)[..., None]
    negatives = nth_valid(neg_row, uniform_int(count[neg_row], rng))  # (B, T, K) flat indices
    return positive, negatives


class TACO(nn.Module):
    """Token-alignment contrastive objective (Fu et al., ACL 2022, Eq. 3, 6-11), on top of MLM.

    g = h - emb(x~) (out of place) is each token's global part. Anchors: every non-pad position (taco_anchors "all",
    the official default) or the masked ones ("masked", concentrated TACO). One positive per anchor from a +-W//2
    window of its own row, K negatives from the other rows of its pool (taco_samples; negative_pool consecutive rows,
    0 = the micro-batch as the official code). s = cos / tau; positives and negatives are detached (taco_stop_grad,
    as the official code; Eq. 6-10 have none: fidelity note 41): the gradient reaches h and the embeddings via the
    anchor. L_TC = mean over anchors of -log(e^{s+} / (e^{s+} + sum_k e^{s-_k})); L = L_MLM + lambda L_TC."""
    uses_negative_pool = True  # config.py gives each process whole pools and checks their size

    def __init__(self, model, cfg):
        super().__init__()
        self.mask_prob = cfg.mask_prob
        self.predict_all = cfg.mlm_predict_all
        self.window = cfg.taco_window
        self.num_negatives = cfg.taco_negatives
        self.temperature = cfg.taco_temperature
        self.weight = cfg.taco_weight
        self.anchors = cfg.taco_anchors
        self.stop_grad = cfg.taco_stop_grad
        self.negative_pool = cfg.negative_pool
        self.fused_scoring = cfg.compile  # on CUDA only, as train.py's compile
        if self.anchors not in ("all", "masked"):
            raise ValueError(f"taco_anchors must be 'all' or 'masked', got {self.anchors!r}")

    def forward(self, model, batch, rng):
        x, attention_mask = batch["input_ids"], batch.get("attention_mask")
        B = x.size(0)
        pool = pool_size(self.negative_pool, B, minimum=2)
        valid = non_pad(x, attention_mask)
        # MLM on the corrupted input, keeping the embedding layer's output for g: the paper's "static embedding" e
        # is that whole output of x~ (word + position + type, LayerNorm, dropout), as the official code has it (note 42)
        corrupted, positions, labels = mask_tokens(x, model.config, rng, self.mask_prob, attention_mask=attention_mask)
        h, emb = model(corrupted, attention_mask=attention_mask, return_embeddings=True)
        loss, metrics = mlm_loss(model, h, x, positions, labels, attention_mask, self.predict_all)
        # Eq. 3, 9, 10: global semantics g = h - e, out of place: the official in-place -= fails in fp32 (note 9)
        g = F.normalize(h - emb, dim=-1)  # (B, T, D)
        if self.anchors == "all":
            anchors = valid
        else:
            anchors = torch.zeros_like(valid).scatter(1, positions, labels != -100)
        anchors = anchors & (valid.sum(1, keepdim=True) >= 2)  # a one-token row (padded data) has no positive
        # draw one positive and K negatives per position; stop-gradient on both unless taco_stop_grad is off
        positive, negatives = taco_samples(valid, self.window, self.num_negatives, rng, pool)
        keys = (g.detach() if self.stop_grad else g).flatten(0, 1)  # (B*T, D), in g's dtype; upcast per chunk
        with torch.autocast(x.device.type, enabled=False):  # fp32: 1/tau = 14 magnifies bf16 rounding (note 11)
            g = upcast(g)
            pos_cos = (g * upcast(keys[positive])).sum(-1)  # (B, T)
            # = (g[:, :, None] * keys[negatives]).sum(-1), without that (B, T, K, D) tensor (3.4 GB at b256 s128)
            # (B, T, K); the compiled kernel on CUDA in training only (a held-out shape would compile it again)
            neg_cos = NegativeDots.apply(g, keys, negatives, self.fused_scoring and self.training and g.is_cuda)
            # Eq. 7: f = cos / tau; Eq. 6: InfoNCE with the positive at index 0 (the paper prints it without exp)
            logits = torch.cat([pos_cos[..., None], neg_cos], dim=-1) / self.temperature
            # Eq. 8 as the official code: a mean over all anchors (the paper averages per sequence first; note 25)
            tc_loss = masked_mean(torch.logsumexp(logits, -1) - logits[..., 0], anchors)
        metrics.update(tc_loss=tc_loss.detach(), pos_cos=masked_mean(pos_cos, anchors).detach(),
                       neg_cos=masked_mean(neg_cos.mean(-1), anchors).detach())
        return loss + self.weight * tc_loss, metrics  # Eq. 11 adds the two unweighted: lambda = 1 there


class TaCL(nn.Module):
    """Token-aware contrastive learning (Su et al., Findings of NAACL 2022; L_tc and L_TaCL of §2),
    continual pretraining from --init_from.

    Student = the model on the masked input x~; teacher = a frozen copy of the starting weights on the original
    x (no grad, eval mode, bf16 on GPUs with native bf16). For every masked position i (all 15%): s_ij =
    cos(student_i, teacher_j) / tau over the positions j of the same row, padding columns excluded;
    L_tc = mean over i of -log softmax_j(s_ij)[i]. L = L_MLM + L_tc (no NSP)."""

    def __init__(self, model, cfg):
        super().__init__()
        if not cfg.init_from:
            raise ValueError("TaCL continues pretraining from a trained model and needs --init_from: first "
                             "`python train.py --objective mlm ... --out_dir out/mlm`, then "
                             "`python train.py --objective tacl --init_from out/mlm ...`")
        self.mask_prob = cfg.mask_prob
        self.predict_all = cfg.mlm_predict_all
        self.temperature = cfg.tacl_temperature
        # kept in state_dict on purpose: a resumed run must get the starting weights back, not the current ones
        self.teacher = copy.deepcopy(model).requires_grad_(False).eval()

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()  # the official code leaves its dropout on; its maintainer agreed (#11; fidelity note 13)
        return self

    def forward(self, model, batch, rng):
        x, attention_mask = batch["input_ids"], batch.get("attention_mask")
        B = x.size(0)
        valid = non_pad(x, attention_mask)
        # student: MLM on the masked input (official TaCL: a fixed count min(0.25 max_len, max(1, round(0.15 len))),
        # len counting [CLS]/[SEP]; ours round(0.15 eligible): the same at 128 and 256 tokens (fidelity note 6)
        corrupted, positions, labels = mask_tokens(x, model.config, rng, self.mask_prob, attention_mask=attention_mask)
        h = model(corrupted, attention_mask=attention_mask)
        loss, metrics = mlm_loss(model, h, x, positions, labels, attention_mask, self.predict_all)
        # teacher: the original input, frozen; bf16 on GPUs with native bf16, else fp32 (ours, fidelity note 14)
        bf16 = x.is_cuda and torch.cuda.is_bf16_supported(including_emulation=False)
        with torch.no_grad(), torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
            teacher_hidden = self.teacher(x, attention_mask=attention_mask)
        with torch.autocast(x.device.type, enabled=False):  # fp32 (TF32 on CUDA): 1/tau = 100 magnifies bf16 rounding
            # every masked student position against every teacher position of its row
            student = F.normalize(upcast(gather_positions(h, positions)), dim=-1).view(B, -1, h.size(-1))  # (B, M, D)
            teacher = F.normalize(upcast(teacher_hidden), dim=-1).to(student.dtype)  # (B, T, D)
            scores = torch.einsum("bmd,btd->bmt", student, teacher) / self.temperature  # (B, M, T)
            # padding columns leave the softmax (official code keeps them; packed batches have none; fidelity note 14)
            scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
            # the positive is the teacher's own position i
            targets = positions.masked_fill(labels == -100, -100).flatten()
            tacl_loss = cross_entropy(scores.flatten(0, 1), targets)
        metrics.update(tacl_loss=tacl_loss.detach(), tacl_acc=accuracy(scores.flatten(0, 1).detach(), targets))
        return loss + tacl_loss, metrics


def sample_tokens(logits, rng):
    """One draw per row from softmax(logits) by Gumbel-max; integers, so no gradient (max().indices: see accuracy)."""
    u = torch.rand(logits.shape, generator=rng, device=logits.device)
    return (upcast(logits.detach()) - torch.log(-torch.log(u))).max(-1).indices


def generator_config(config, cfg):
    """The generator's BertConfig and depth for cfg.gen_shape; cfg.gen_layers > 0 overrides the depth.
    "cocolm": the main width, max(1, round(L/3)) layers (COCO-LM §4: 4 for base).
    "electra": L layers at 1/4 of the width (1/3 for base), heads = width/64, FFN = 4x width (ELECTRA §3.2 and
    Table 6; official get_generator_config). Not reproduced: ELECTRA-Small's factorised 128-wide embeddings; ours
    are the main width (fidelity note 19)."""
    shape = cfg.gen_shape
    if shape == "cocolm":  # released configs: 4 of 12 layers (base), 4 of 24 (large), 2 of 12 (small); fidelity note 31
        gen_config, num_layers = config, max(1, round(config.num_layers / 3))
    elif shape == "electra":
        width = round(config.hidden_size * (1 / 3 if config.hidden_size == 768 else 1 / 4))
        num_heads = max(1, width // 64)
        while width % num_heads:  # a width that is not a multiple of 64: the most heads that divide it
            num_heads -= 1
        gen_config = replace(config, hidden_size=width, num_heads=num_heads, intermediate_size=4 * width)
        num_layers = config.num_layers
    else:
        raise ValueError(f"gen_shape must be 'cocolm' or 'electra', got {shape!r}")
    return gen_config, cfg.gen_layers or num_layers


class Generator(nn.Module):
    """COCO-LM/ELECTRA's auxiliary MLM on the main model's embeddings (word/position/type + LayerNorm, shared,
    not copied), decoding with the shared word-embedding matrix; its shape is generator_config's. A narrower
    generator does as the official ELECTRA code: a linear layer projects the D-wide shared embeddings to its
    width (embeddings_project), and its head's dense layer maps back to D for the tied decoder.
    mask_frac / random_frac: the [MASK] / random split of mask_tokens (COCO-LM 0.8 / 0.1, ELECTRA 0.85 / 0).
    sample_dropout_off: sample from a second, dropout-off forward (COCO-LM's choice); otherwise from the
    training logits (official ELECTRA: one forward, stop_gradient on the samples) (fidelity notes 16, 18)."""

    def __init__(self, config, cfg, mask_frac, random_frac, sample_dropout_off):
        super().__init__()
        gen_config, num_layers = generator_config(config, cfg)
        width = gen_config.hidden_size
        self.mask_prob, self.mask_frac, self.random_frac = cfg.mask_prob, mask_frac, random_frac
        self.sample_dropout_off = sample_dropout_off
        self.project = nn.Linear(config.hidden_size, width) if width != config.hidden_size else nn.Identity()
        self.encoder = Encoder(gen_config, num_layers)
        self.head = MLMHead(config)
        self.head.dense = nn.Linear(width, config.hidden_size)  # width -> D, as the official generator head
        self.apply(Bert._init_weights)

    def logits(self, model, input_ids, attention_mask, positions):
        h = self.encoder(self.project(model.embeddings(input_ids)), attention_mask)
        return self.head(gather_positions(h, positions), model.embeddings.word.weight)  # (B*M, V)

    def forward(self, model, input_ids, attention_mask, rng):
        """Mask x, train the generator by MLM on it, and put its samples at the masked positions.
        Returns (x_mlm: the ids with the samples in, positions, labels, gen_loss, metrics)."""
        corrupted, positions, labels = mask_tokens(input_ids, model.config, rng, self.mask_prob, self.mask_frac,
                                                   self.random_frac, attention_mask)
        logits = self.logits(model, corrupted, attention_mask, positions)
        gen_loss = cross_entropy(logits, labels.flatten())
        sample_logits = logits  # sample_tokens detaches: the samples carry no gradient
        # with dropout 0 the training logits are the dropout-off logits already
        if self.sample_dropout_off and self.training and model.config.dropout > 0:
            embeddings_training = model.embeddings.training
            self.eval()
            model.embeddings.eval()
            with torch.no_grad():
                sample_logits = self.logits(model, corrupted, attention_mask, positions)
            self.train()
            model.embeddings.train(embeddings_training)
        sampled = sample_tokens(sample_logits, rng).view_as(positions)  # (B, M)
        original, used = input_ids.gather(1, positions), labels != -100
        x_mlm = input_ids.scatter(1, positions, torch.where(used, sampled, original))
        metrics = dict(gen_loss=gen_loss.detach(), gen_acc=accuracy(logits.detach(), labels.flatten()),
                       replaced_frac=masked_mean(sampled != original, used).detach())
        return x_mlm, positions, labels, gen_loss, metrics


def crop_views(input_ids, config, rng, fraction=0.9, attention_mask=None):
    """COCO-LM's second view: a uniformly placed contiguous crop of `fraction` of the tokens between each row's
    [CLS] and final [SEP] (rows are [CLS] ... [SEP] then right padding), re-wrapped as [CLS] crop [SEP] (note 27)
    and padded (attention mask 0) to T. Returns (ids, mask). Unpadded batches crop every row to the same length, so
    they are cut to it, with no mask: the same [CLS] output, and SDPA keeps its flash kernel (fidelity note 17)."""
    B, T = input_ids.shape
    inner = non_pad(input_ids, attention_mask).sum(1) - 2  # (B,) tokens between [CLS] and [SEP]
    keep = crop_lengths(T, fraction, input_ids.device)[inner]  # (B,) round(inner * fraction)
    start = uniform_int(inner - keep + 1, rng)  # (B,) crop start in [0, inner - keep]
    j = torch.arange(T, device=input_ids.device)[None, :]  # (1, T) output slot
    crop = input_ids.gather(1, (start[:, None] + j).clamp(max=T - 1))  # slot j <- position start + j
    end = keep[:, None] + 1  # slot of the closing [SEP]
    crop = torch.where(j == 0, config.cls_token_id, torch.where(j == end, config.sep_token_id,
                       torch.where(j > end, config.pad_token_id, crop)))
    if attention_mask is None:
        return crop[:, :2 + round((T - 2) * fraction)], None
    return crop, (j <= end).long()


@functools.lru_cache
def crop_lengths(T, fraction, device):  # round(n * fraction) for n = 0..T, in Python's float64 (MPS has none)
    return torch.tensor([round(n * fraction) for n in range(T + 1)], device=device)


def corrective_lm_loss(lm_logits, targets, copy_logit, is_original):
    """COCO-LM's L_LM per position: -log(orig * sg(p_copy(1)) + sg(p_copy(0)) * softmax(lm_logits)[target]),
    in log space: logaddexp(log p_copy(1) if orig else -inf, log p_copy(0) + log softmax[target])."""
    copy_logit = copy_logit.detach()  # stop-gradient on p_copy
    # unused slots (label -100) read index 0: the caller's mask drops them
    log_q = upcast(lm_logits).log_softmax(-1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    log_p1 = F.logsigmoid(copy_logit).masked_fill(~is_original, float("-inf"))
    return -torch.logaddexp(log_p1, F.logsigmoid(-copy_logit) + log_q)


def nt_xent(z1, z2, temperature, pool):
    """NT-Xent (SimCLR) over pools of P = pool consecutive rows: z1[i] and z2[i] (B, D) are each other's
    positive, the negatives are the other 2P-2 views of the same pool; mean over all 2B anchors."""
    B, D = z1.shape
    z = F.normalize(torch.cat([z1.view(-1, pool, D), z2.view(-1, pool, D)], 1), dim=-1)  # (B/P, 2P, D)
    n = 2 * pool
    self_pair = torch.eye(n, dtype=torch.bool, device=z.device)
    sim = (z @ z.transpose(1, 2) / temperature).masked_fill(self_pair, float("-inf"))  # (B/P, 2P, 2P)
    partner = (torch.arange(n, device=z.device) + pool) % n  # view i of a pool pairs with view i + P
    return F.cross_entropy(sim.flatten(0, 1), partner.repeat(B // pool))


class COCOLM(nn.Module):
    """COCO-LM (Meng et al., NeurIPS 2021, §3): corrective LM + sequence contrastive learning.

    1. A generator (gen_shape "cocolm": same width, max(1, round(L/3)) layers, shared embeddings) does MLM on x~
       (80/10/10 masking; 100% [MASK] with cocolm_mask_all): L_gen. Its samples at the masked positions M, drawn
       from a dropout-off forward, give x^MLM (no gradient).
    2. The main model on x^MLM -> h. Copy head p_copy(1|h_i) = sigmoid(w.h_i + b), "token is original":
       L_copy = mean BCE over non-pad positions, orig_i = 1[x^MLM_i = x_i].
    3. LM head = tied embeddings + bias, no transform, on M: L_LM = mean over M of
       -log(orig_i sg(p_copy(1|h_i)) + sg(p_copy(0|h_i)) softmax(LM(h_i))[x_i]), sg = stop-gradient.
       (The authors' issue-#2 skeleton instead weights a plain CE by sg(p_copy(0|h)); fidelity note 15.)
    4. SCL: x^MLM and a 90% contiguous crop of x, [CLS] through dense -> GELU -> LayerNorm, NT-Xent over the
       2B views at tau = 1: L_SCL (with negative_pool P > 0, over the 2P views of each P consecutive rows).
    L = L_gen + lambda_copy * L_copy + L_LM + L_SCL. The main model's own MLM head is unused.
    The official repository releases this forward and the heads, not the task and criterion (the masking
    recipe, the crop, the loss reduction): those are the paper's §3 as we read it (fidelity notes 27, 28)."""
    uses_negative_pool = True  # config.py gives each process whole pools and checks their size

    def __init__(self, model, cfg):
        super().__init__()
        config, D = model.config, model.config.hidden_size
        self.copy_weight = cfg.cocolm_copy_weight
        self.scl_temperature = cfg.cocolm_scl_temperature
        self.crop_fraction = cfg.cocolm_crop_fraction
        self.negative_pool = cfg.negative_pool
        # the generator's input masking is unreleased: BERT's 80/10/10 is our reading, 100% [MASK] the
        # reading of MC-BERT's task and a fairseq criterion for this model (--cocolm_mask_all; fidelity note 28)
        mask_frac, random_frac = (1.0, 0.0) if cfg.cocolm_mask_all else (0.8, 0.1)
        self.generator = Generator(config, cfg, mask_frac, random_frac, sample_dropout_off=True)
        self.copy_head = nn.Linear(D, 1)
        self.lm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        # released SCL head: LN eps 1e-5 (ours 1e-12: L_SCL moves <= 3.4e-6), 768 wide at every size (ours D); note 32
        self.scl_head = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D, eps=config.layer_norm_eps))
        self.copy_head.apply(Bert._init_weights)
        self.scl_head.apply(Bert._init_weights)
        model.head.requires_grad_(False)  # unused here: keep it out of the optimizer and DDP's reducer

    def forward(self, model, batch, rng):
        x, attention_mask = batch["input_ids"], batch.get("attention_mask")
        valid = non_pad(x, attention_mask)
        # generator: MLM on x~ (80/10/10, or all [MASK]), then its samples replace the masked tokens -> x^MLM
        x_mlm, positions, labels, gen_loss, metrics = self.generator(model, x, attention_mask, rng)
        is_original = x_mlm == x  # a sample equal to the original counts as original
        # main model on x^MLM
        h = model(x_mlm, attention_mask=attention_mask)
        # copy loss: is each non-pad token the original?
        copy_logit = upcast(self.copy_head(h).squeeze(-1))  # (B, T)
        copy_loss = masked_bce(copy_logit, is_original, valid)
        # corrective LM loss on M: tied embeddings + bias, no transform
        lm_logits = F.linear(gather_positions(h, positions), model.embeddings.word.weight[:model.config.vocab_size],
                             self.lm_bias)
        at_masked = lambda t: t.gather(1, positions).flatten()  # (B, T) -> (B*M,): the masked slots
        lm_loss = masked_mean(corrective_lm_loss(lm_logits, labels.flatten(), at_masked(copy_logit),
                                                 at_masked(is_original)),
                              (labels != -100).flatten())
        # SCL: second view = a cropped x; NT-Xent over the 2B [CLS] vectors
        crop_ids, crop_mask = crop_views(x, model.config, rng, self.crop_fraction, attention_mask)
        h_crop = model(crop_ids, attention_mask=crop_mask)
        B = x.size(0)
        cls = upcast(self.scl_head(torch.cat([h[:, 0], h_crop[:, 0]])))  # (2B, D): one GEMM for both views
        scl_loss = nt_xent(cls[:B], cls[B:], self.scl_temperature, pool_size(self.negative_pool, B))
        loss = gen_loss + self.copy_weight * copy_loss + lm_loss + scl_loss
        # the copy head scores "original", the detector metrics "replaced" (as ELECTRA's): flip both
        metrics.update(copy_loss=copy_loss.detach(), lm_loss=lm_loss.detach(), scl_loss=scl_loss.detach(),
                       **detector_metrics("copy", -copy_logit, ~is_original, x, model.config, attention_mask,
                                          self.training))
        return loss, metrics


class ELECTRA(nn.Module):
    """ELECTRA replaced-token detection (Clark et al., ICLR 2020, §2), COCO-LM's natural baseline.
    The generator (COCO-LM's code; gen_shape "electra" for ELECTRA's own narrow, full-depth one) does MLM on 85%
    [MASK] / 15% unchanged masking; its samples, drawn from the same training logits as the official code (one
    generator forward, no gradient), replace the masked tokens; the discriminator (main model + dense -> GELU ->
    linear(1)) labels every non-pad token replaced (sample != original) or not.
    L = L_gen + lambda * mean BCE (electra_disc_weight, 50 in App. A). The main model's MLM head is unused."""

    def __init__(self, model, cfg):
        super().__init__()
        config, D = model.config, model.config.hidden_size
        self.disc_weight = cfg.electra_disc_weight
        # TF ELECTRA draws round(0.15 x non-pad) positions with replacement, [UNK] but never [CLS]/[SEP]; ours
        # round(0.15 x eligible) distinct non-special ones: the same count at 128 and 256, not at 512 (fidelity note 29)
        self.generator = Generator(config, cfg, mask_frac=0.85, random_frac=0.0, sample_dropout_off=False)
        self.disc_head = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, 1))
        self.disc_head.apply(Bert._init_weights)
        model.head.requires_grad_(False)  # unused here: keep it out of the optimizer and DDP's reducer

    def forward(self, model, batch, rng):
        x, attention_mask = batch["input_ids"], batch.get("attention_mask")
        valid = non_pad(x, attention_mask)
        # generator: MLM on 85/0/15 masking, samples from its training logits replace the masked tokens
        x_mlm, positions, labels, gen_loss, metrics = self.generator(model, x, attention_mask, rng)
        replaced = x_mlm != x
        # discriminator: replaced or original, at every non-pad position
        disc_logit = upcast(self.disc_head(model(x_mlm, attention_mask=attention_mask)).squeeze(-1))  # (B, T)
        disc_loss = masked_bce(disc_logit, replaced, valid)
        metrics.update(disc_loss=disc_loss.detach(),
                       **detector_metrics("disc", disc_logit, replaced, x, model.config, attention_mask, self.training))
        return gen_loss + self.disc_weight * disc_loss, metrics


# ------------------------------------------------------------------------------------------
# detector metrics (COCO-LM's copy head, ELECTRA's discriminator): logged, not trained on


def binary_entropy(p):
    """The BCE of always predicting the rate p itself: a replaced-token detector's trivial baseline
    (accuracy at the majority rate says less: a detector can beat this BCE and still never cross 0.5)."""
    p = p.clamp(1e-6, 1 - 1e-6)
    return -(p * p.log() + (1 - p) * (1 - p).log())


def auc(logits, targets, mask):
    """ROC AUC of a detector over the masked-in positions (Mann-Whitney: the chance that a random positive scores
    above a random negative; ties count 1/2), as the official ELECTRA logs disc_auc: unlike accuracy it sees a
    detector that ranks well but never crosses 0.5. NaN without both classes. bf16 logits arrive rounded: ties."""
    scores, labels = upcast(logits[mask]), targets[mask]
    sorted_scores, order = scores.sort()
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ranks2 = torch.empty_like(order)  # twice each 1-based rank (tied scores share their mean): integers, exact in
    ranks2[order] = (2 * counts.cumsum(0) - (counts - 1))[inverse]  # int64 (MPS has no float64)
    n_pos = labels.sum()
    return (ranks2[labels].sum() - n_pos * (n_pos + 1)) / (2 * n_pos * (len(scores) - n_pos))  # 2U / 2(n+ n-)


def detector_metrics(name, logit, replaced, input_ids, config, attention_mask, training):
    """COCO-LM's copy and ELECTRA's discriminator logs, with replaced = positive: accuracy, the trivial BCE
    of predicting the replaced rate, and (held-out only: a sort of B*T scores) the AUC over the maskable
    tokens. Special tokens are never replaced: the official disc_auc counts them, which credits a detector
    for knowing that alone (fidelity note 20)."""
    valid = non_pad(input_ids, attention_mask)
    metrics = {f"{name}_acc": masked_mean((logit > 0) == replaced, valid).detach(),
               f"{name}_trivial": binary_entropy(masked_mean(replaced, valid)).detach()}
    if not training:
        metrics[f"{name}_auc"] = auc(logit.detach(), replaced, eligible_positions(input_ids, config, attention_mask))
    return metrics


# ------------------------------------------------------------------------------------------
# speed: TACO's negative scoring, (g[:, :, None] * keys[negatives]).sum(-1) without the (B, T, K, D) tensor


def gather_dot(anchor, targets, index):
    """anchor (B, T, D), targets (N, D), index (B, T, k) -> (B, T, k) fp32 dot products with targets[index]."""
    return torch.einsum("btd,btkd->btk", anchor, upcast(targets[index]))


@functools.cache
def fused_gather_dot():
    """gather_dot as one compiled kernel (CUDA, --compile): each negative read from `targets` and summed in fp32, never
    written out. targets are fp32 under autocast too (g comes from LayerNorms): 64 MB at b256 s128 on BERT-small,
    above an H100's 50 MB L2 (bf16 would fit, untried). Built on first use (the compiler's import costs seconds).
    A product and a sum, not an einsum the compiler could lower to a matmul of the gathered tensor."""
    return torch.compile(lambda anchor, targets, index: (anchor[:, :, None, :] * upcast(targets[index])).sum(-1),
                         dynamic=False)


NEGATIVE_CHUNK_FLOATS = 2 ** 20  # 4 MB of fp32 per chunk of gathered negatives (stays in cache), or one negative


class NegativeDots(torch.autograd.Function):
    """gather_dot for all K negatives without a (B, T, K, D) tensor (3.4 GB in fp32 at b256 s128 on BERT-small, K = 50,
    kept by autograd for backward). Forward: fused_gather_dot if `fused`, else K in chunks of NEGATIVE_CHUNK_FLOATS
    gathered floats (so the forward never holds it either). Backward: the anchor's gradient sum_k grad_k targets[n_k]
    is a weighted embedding bag; the targets' (taco_stop_grad=False only) an index_add per chunk. Same as gather_dot."""

    @staticmethod
    def forward(ctx, anchor, targets, negatives, fused=False):
        B, T, D = anchor.shape
        ctx.chunk = max(1, NEGATIVE_CHUNK_FLOATS // (B * T * D))
        ctx.save_for_backward(anchor, targets, negatives)
        if fused:
            return fused_gather_dot()(anchor, targets, negatives)
        return torch.cat([gather_dot(anchor, targets, index) for index in negatives.split(ctx.chunk, -1)], -1)

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, K)
        anchor, targets, negatives = ctx.saved_tensors
        K, D = negatives.size(-1), anchor.size(-1)
        grad_anchor = grad_targets = None
        if ctx.needs_input_grad[0]:
            grad_anchor = F.embedding_bag(negatives.reshape(-1, K), upcast(targets).to(grad.dtype), mode="sum",
                                          per_sample_weights=grad.reshape(-1, K)).view_as(anchor)
        if ctx.needs_input_grad[1]:
            grad_targets = grad.new_zeros(targets.shape)
            for index, g in zip(negatives.split(ctx.chunk, -1), grad.split(ctx.chunk, -1)):
                grad_targets.index_add_(0, index.flatten(), (g[..., None] * anchor[:, :, None]).reshape(-1, D))
            grad_targets = grad_targets.to(targets.dtype)
        return grad_anchor, grad_targets, None, None


LOSSES = {"mlm": MLM, "taco": TACO, "tacl": TaCL, "cocolm": COCOLM, "electra": ELECTRA}
