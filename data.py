"""
What a pretraining batch is, and how text becomes one, in the file's order: BlockLoader (the batches), text
-> one token stream (prepare_data) and the train/validation split, the WordPiece tokenizer.

A batch is a (B, T) int64 tensor of token ids, T = seq_len (128 by default). Each row is [CLS], then T-2
consecutive tokens of the stream, then [SEP]. Rows are packed: a row may span several documents (one [SEP]
between two) and nothing is padded, so there is no attention mask (RoBERTa's full-sentence packing; the official
TACO's windows are not re-wrapped, fidelity note 5). Rows are the stream cut into non-overlapping windows of
T-2, read in one seeded permutation per epoch.

- Stream: the corpus's documents one after another, one [SEP] between two; a document's lines are
  concatenated, blank lines dropped. Validation = the tail of the stream: val_fraction of the tokens, but
  at least VAL_MIN_TOKENS or 10% of the corpus, whichever is fewer; its start moves back to a document
  start when one lies within that many tokens (else, as in a one-document corpus, it cuts a document).
- Tokenizer: uncased BERT WordPiece from the `tokenizers` package (accents and other combining marks stripped,
  as BERT-uncased; cased=True keeps case and marks, as multilingual BERT cased), specials in BERT order
  [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4. A Hugging Face vocab.txt / tokenizer dir loads too
  (bert-base-uncased keeps its own ids 0/100/101/102/103: always go through special_token_ids).
  Training is deterministic: the same text gives the same vocabulary, ids included (see train_tokenizer).

The machinery lives in support modules that the algorithm does not need: corpus.py reads --data (files,
globs, compressed files, hub datasets; where documents start; one clear error per bad file), and token_files.py
fixes the tokenizer's alphabet, reads and writes tokenizer files and tokenizes the corpus once into
cache_dir, reusing that cache only once it has checked it.
"""
import math
import sys

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import token_files
from corpus import SAMPLE_CORPUS

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# The papers pretrain on English Wikipedia + BookCorpus; BookCorpus is no longer openly
# distributed, so the hub default is English Wikipedia alone ("name:config" for load_dataset; fidelity note 2).
HUB_CORPUS = "wikimedia/wikipedia:20231101.en"
DEFAULT_DATA = SAMPLE_CORPUS  # WikiText-2's test split in assets/: smoke runs and tests need no network
VAL_MIN_TOKENS = 16384  # 32 blocks at seq_len 512, 130 at the smoke preset's 128 (each holds seq_len - 2)
LIMIT_ALPHABET = 1000  # as HF's BertWordPieceTokenizer: rarer characters map to [UNK] (Chinese BERT keeps ~8,000)

# ----------------------------------------------------------------------------- batches

class BlockLoader:
    """Batches (B, T) = (batch_size, seq_len) of packed rows [CLS] + T-2 consecutive stream tokens + [SEP],
    in a seeded order.

    All processes read one global stream of blocks: epoch e is the permutation
    default_rng([seed, e]).permutation(num_blocks), the epochs one after another (a batch may
    straddle two; no block is ever skipped). The state is N, the sequences consumed so far by all
    ranks together: next_batch() on rank r takes stream positions [N + r*B, N + (r+1)*B), B =
    batch_size, then advances N by B*world_size. So the ranks' batches concatenated equal one
    process's batch of B*world_size, and a run resumed with any batch_size or world_size continues
    at exactly sequence N. Every rank holds the same N: save one state, not one per rank.
    """

    def __init__(self, tokens, seq_len, batch_size, cls_id, sep_id, rank=0, world_size=1,
                 seed=0, device="cpu"):
        if seq_len < 3:
            raise ValueError(f"seq_len must be >= 3 (room for [CLS] and [SEP]), got {seq_len}")
        self.tokens, self.seq_len, self.block_len = tokens, seq_len, seq_len - 2
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.cls_id, self.sep_id, self.device = cls_id, sep_id, torch.device(device)
        self.num_blocks = len(tokens) // self.block_len  # sequences per epoch
        global_batch = batch_size * world_size
        if self.num_blocks < global_batch:
            raise ValueError(f"token stream has {len(tokens):,} tokens but one batch of {global_batch}"
                             f" x {seq_len} needs {global_batch * self.block_len:,}")
        self.sequences = 0
        self._epoch, self._order = None, None  # the permutation of the epoch read last

    def state_dict(self):
        return {"sequences": self.sequences}

    def rewind(self):
        self.sequences = 0

    def load_state_dict(self, state):
        if "sequences" not in state:
            raise ValueError(f"data loader state {state!r} has no 'sequences' count")
        sequences = int(state["sequences"])
        if sequences < 0:
            raise ValueError(f"data loader state {state!r}: negative position")
        self.sequences = sequences

    def _blocks(self, start, count):
        """Block indices at stream positions [start, start + count)."""
        positions = np.arange(start, start + count)
        epochs, offsets = np.divmod(positions, self.num_blocks)
        blocks = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # at most two: a batch is never longer than an epoch
            if epoch != self._epoch:  # the order depends on (seed, epoch) only: any position is exact
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_blocks)
            blocks[epochs == epoch] = self._order[offsets[epochs == epoch]]
        return blocks

    def next_batch(self):
        """The next (B, T) int64 batch on `device`; no attention mask is needed, as no row is padded."""
        blocks = self._blocks(self.sequences + self.rank * self.batch_size, self.batch_size)  # (B,)
        self.sequences += self.batch_size * self.world_size
        rows = np.empty((self.batch_size, self.seq_len), dtype=np.int64)  # (B, T)
        rows[:, 0], rows[:, -1] = self.cls_id, self.sep_id
        for i, block in enumerate(blocks):  # (T-2,) consecutive stream tokens, document [SEP]s included
            rows[i, 1:-1] = self.tokens[block * self.block_len:(block + 1) * self.block_len]
        batch = torch.from_numpy(rows)  # (B, T) int64, no padding: every position is a real token
        if self.device.type == "cuda":  # pinned memory lets the copy overlap with compute
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)

# ----------------------------------------------------------------------------- text -> token stream

def prepare_data(data=DEFAULT_DATA, cache_dir="cache", tokenizer=None, vocab_size=30522,
                 val_fraction=0.005, cased=False, limit_alphabet=LIMIT_ALPHABET):
    """Return (tok, train_tokens, val_tokens): 1-D np.memmap token streams.

    Without a tokenizer path, one is trained on the corpus (cased, limit_alphabet: see train_tokenizer). Both
    are made once and kept in cache_dir (token_files.CorpusCache: the corpus is read only when a cache misses)."""
    cache = token_files.CorpusCache(data, cache_dir)  # a bad path fails here, before any work
    if tokenizer is None:  # train_tokenizer(texts, vocab_size, save_dir, cased, limit_alphabet)
        tokenizer = cache.tokenizer(vocab_size, train_tokenizer, cased=cased, limit_alphabet=limit_alphabet)
    tok = load_tokenizer(tokenizer)
    sep = special_token_ids(tok)["sep"]
    tokens = cache.tokens(tok, sep)  # (N,) the whole corpus, one [SEP] between documents
    train, val = split_train_val(tokens, val_fraction, sep)
    return tok, train, val

def split_train_val(tokens, val_fraction, sep_id):
    """Hold out the tail of the stream (deterministic), starting at a document start if one is near."""
    n = len(tokens)
    if val_fraction <= 0:
        return tokens, tokens[n:]
    n_val = max(math.ceil(val_fraction * n), min(VAL_MIN_TOKENS, n // 10))
    cut = n - n_val
    # move the cut back to just after a [SEP] (at most n_val tokens) so no document is split
    seps = np.flatnonzero(np.asarray(tokens[max(cut - n_val, 0):cut]) == sep_id)
    if len(seps):
        cut = max(cut - n_val, 0) + int(seps[-1]) + 1
    return tokens[:cut], tokens[cut:]

# ----------------------------------------------------------------------------- tokenizer

def _bert_pipeline(tok, lowercase=True, strip_accents=None, chinese_chars=True):
    # strip_accents None follows lowercase, as in HF BertTokenizer
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=chinese_chars,
                                                strip_accents=lowercase if strip_accents is None else strip_accents,
                                                lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")

def _add_template(tok):
    # tok.encode(text) gives [CLS] text [SEP] like HF; the stream encoder passes add_special_tokens=False
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])

def train_tokenizer(texts, vocab_size=30522, save_dir=None, cased=False, limit_alphabet=LIMIT_ALPHABET):
    """Train a BERT WordPiece tokenizer, uncased unless cased=True, deterministically.

    texts: a list of strings, or a function returning a fresh iterator over strings or lists of
    strings; it is read twice (the alphabet, then the training).
    Uncased strips accents and every other combining mark (NFD), as BERT-uncased: ü -> u, but also й -> и,
    で -> て and Devanagari's vowel signs; cased=True keeps case and marks (multilingual BERT cased). Only the
    limit_alphabet most frequent characters are kept (0: all), rarer ones become [UNK].
    """
    texts = texts if callable(texts) else list(texts)  # a generator could be read only once
    read = texts if callable(texts) else lambda: iter(texts)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    _bert_pipeline(tok, lowercase=not cased)
    # `tokenizers` trains non-deterministically: it gives the "##x" tokens ids in the iteration order
    # of a randomly seeded Rust HashMap, merges of equal count are then ordered by those ids, and the
    # alphabet limit drops characters of equal count in hash order. Fixing the alphabet ourselves
    # (initial_alphabet with limit_alphabet = its size) and the "##x" ids (passed as leading special
    # tokens, demoted to ordinary vocabulary below) makes every id reproducible. (Two trainings by
    # `tokenizers` alone on the bundled sample gave 964 of 8,192 ids differently; fidelity note 8.)
    alphabet, continuing = token_files.alphabet(read(), tok.normalizer, limit_alphabet or None)  # says what is lost
    if not alphabet:
        raise ValueError("no text")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, continuing_subword_prefix="##",
                                        special_tokens=SPECIAL_TOKENS + ["##" + c for c in continuing],
                                        initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                        show_progress=sys.stderr.isatty())  # in a log file: blank lines
    tok.train_from_iterator(read(), trainer)
    tok = Tokenizer(models.WordPiece(tok.get_vocab(), unk_token="[UNK]"))  # "##x" as plain tokens again
    _bert_pipeline(tok, lowercase=not cased)
    tok.add_special_tokens(SPECIAL_TOKENS)
    _add_template(tok)
    if save_dir is not None:
        save_tokenizer(tok, save_dir)
    return tok

def load_tokenizer(path):
    """Load tokenizer.json, a WordPiece vocab.txt, a directory holding either, or a hub name (bert-base-uncased,
    the papers' vocabulary). An empty, truncated or otherwise unreadable file is one ValueError naming it."""
    tok, options = token_files.read_tokenizer(path)
    if options is not None:  # a bare vocab.txt: the BERT pipeline around it
        _bert_pipeline(tok, **options)
        tok.add_special_tokens(SPECIAL_TOKENS)  # tokens already in the vocab keep their ids
        _add_template(tok)
    tok.no_truncation()  # some hub tokenizer.json files enable it; the stream encoder must not cut
    tok.no_padding()
    return tok

def save_tokenizer(tok, dir, model_max_length=512):
    """Write tokenizer.json + vocab.txt + HF configs (each atomically), so transformers.AutoTokenizer loads dir."""
    token_files.write_tokenizer(tok, dir, model_max_length)

def special_token_ids(tok):
    """dict(pad=, unk=, cls=, sep=, mask=) ids: 0..4 for ours, 0/100/101/102/103 for bert-base."""
    ids = {name: tok.token_to_id(f"[{name.upper()}]") for name in ("pad", "unk", "cls", "sep", "mask")}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens: {missing}")
    return ids

