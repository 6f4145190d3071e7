"""Batches of sentence pairs built by token count, from length buckets (the paper's "sentence pairs were batched
together by approximate sequence length; each training batch contained ... approximately 25000 source tokens and
25000 target tokens").

Pairs are sorted by (target length, source length), ties broken by a seeded shuffle, and cut into consecutive
batches whose padded size rows x longest side stays within `batch_tokens`: short sentences travel in large batches,
long ones in small batches, and little compute goes to padding. Every epoch visits all batches in a fresh seeded
order. Which batch micro-step g reads is a pure function of (seed, g), so a resumed run reads what an uninterrupted
one would, and under data parallelism process r of W reads global batch g * W + r.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from llmkit.data.bitexts import Side
from llmkit.errors import InputError
from llmkit.train.data import _seed


def length_batches(
    src_len: np.ndarray, tgt_len: np.ndarray, batch_tokens: int, max_len: int, seed: int
) -> tuple[list[np.ndarray], int]:
    """(batches of pair indices, pairs dropped for exceeding max_len on either side)."""
    if batch_tokens < 1:
        raise InputError(f"batch_tokens={batch_tokens} must be >= 1")
    keep = np.flatnonzero((src_len <= max_len) & (tgt_len <= max_len))
    dropped = len(src_len) - len(keep)
    if len(keep) == 0:
        raise InputError(f"no sentence pair fits within {max_len} tokens per side (data.seq_len)")
    longest = int(np.maximum(src_len[keep], tgt_len[keep]).max())
    if longest > batch_tokens:
        raise InputError(
            f"data.batch_tokens={batch_tokens} cannot hold one pair of {longest} tokens: raise it or lower data.seq_len"
        )
    rng = np.random.default_rng(_seed(seed, 0x5EED))
    shuffled = keep[rng.permutation(len(keep))]
    order = shuffled[np.lexsort((src_len[shuffled], tgt_len[shuffled]))]  # stable: ties keep the shuffle
    batches: list[np.ndarray] = []
    start, widest = 0, 0
    for i, idx in enumerate(order):
        own = max(int(src_len[idx]), int(tgt_len[idx]))
        width = max(widest, own)
        if (i - start + 1) * width > batch_tokens:  # this pair would overfill the batch: it starts the next one
            batches.append(order[start:i])
            start, width = i, own
        widest = width
    batches.append(order[start:])
    return batches, dropped


def pad_rows(side: Side, rows: np.ndarray, pad_id: int) -> tuple[Tensor, Tensor]:
    """Sentences `rows` of a side, right-padded: (tokens (B, L) long, mask (B, L) bool, True at real tokens)."""
    seqs = [side.sentence(int(i)) for i in rows]
    width = max(len(s) for s in seqs)
    tokens = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=bool)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = s
        mask[r, : len(s)] = True
    return torch.from_numpy(tokens), torch.from_numpy(mask)


@dataclass
class PairBatch:
    source: Tensor  # (B, S)
    source_mask: Tensor  # (B, S) bool
    target: Tensor  # (B, T), each sentence ending in </s>
    target_mask: Tensor  # (B, T) bool

    @property
    def tokens(self) -> int:
        """Real tokens, source and target."""
        return int(self.source_mask.sum()) + int(self.target_mask.sum())

    def to(self, device: torch.device) -> PairBatch:
        return PairBatch(
            *(t.to(device, non_blocking=True) for t in (self.source, self.source_mask, self.target, self.target_mask))
        )


class BucketedPairs:
    """The training batches of one split and the order they are read in."""

    def __init__(self, src: Side, tgt: Side, batch_tokens: int, max_len: int, seed: int, pad_id: int) -> None:
        self.src, self.tgt, self.seed, self.pad_id = src, tgt, seed, pad_id
        self.batches, self.dropped = length_batches(src.lengths, tgt.lengths, batch_tokens, max_len, seed)

    def __len__(self) -> int:
        return len(self.batches)

    def rows(self, g: int) -> np.ndarray:
        """Pair indices of global batch g (epoch g // len, a fresh permutation of the batches every epoch)."""
        epoch, k = divmod(g, len(self.batches))
        perm = np.random.default_rng(_seed(self.seed, epoch)).permutation(len(self.batches))
        return self.batches[int(perm[k])]

    def batch(self, g: int) -> PairBatch:
        return self.make(self.rows(g))

    def make(self, rows: np.ndarray) -> PairBatch:
        s, sm = pad_rows(self.src, rows, self.pad_id)
        t, tm = pad_rows(self.tgt, rows, self.pad_id)
        return PairBatch(s, sm, t, tm)
