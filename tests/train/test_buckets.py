"""Token-count batches from length buckets."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.data.bitexts import Side
from llmkit.errors import InputError
from llmkit.train.buckets import BucketedPairs, length_batches, pad_rows


def lengths(n=500, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 60, n)
    tgt = np.clip(src + rng.integers(-5, 6, n), 1, None)
    return src, tgt


def test_every_pair_once_within_the_token_budget():
    src, tgt = lengths()
    batches, dropped = length_batches(src, tgt, batch_tokens=400, max_len=50, seed=3)
    kept = np.concatenate(batches)
    assert dropped == int(((src > 50) | (tgt > 50)).sum())
    assert sorted(kept.tolist()) == sorted(np.flatnonzero((src <= 50) & (tgt <= 50)).tolist())
    for b in batches:
        width = int(np.maximum(src[b], tgt[b]).max())
        assert len(b) * width <= 400  # padded size within budget
    # buckets: batches hold similar lengths, so padding is a small share
    padded = sum(len(b) * int(np.maximum(src[b], tgt[b]).max()) for b in batches)
    assert int(np.maximum(src[kept], tgt[kept]).sum()) / padded > 0.85
    short = [b for b in batches if np.maximum(src[b], tgt[b]).max() <= 10]
    long = [b for b in batches if np.maximum(src[b], tgt[b]).min() >= 40]
    assert min(len(b) for b in short) > max(len(b) for b in long)  # short sentences travel in larger batches


def test_batches_are_deterministic_and_each_epoch_reorders_them():
    src, tgt = lengths()
    a, _ = length_batches(src, tgt, 400, 60, seed=1)
    b, _ = length_batches(src, tgt, 400, 60, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    tokens = np.arange(int(src.sum()))
    side_s = Side(tokens % 50, np.concatenate([[0], np.cumsum(src)]))
    side_t = Side(tokens % 50, np.concatenate([[0], np.cumsum(src)]))
    pairs = BucketedPairs(side_s, side_t, 400, 60, seed=1, pad_id=0)
    n = len(pairs)
    epoch0 = [tuple(pairs.rows(g)) for g in range(n)]
    epoch1 = [tuple(pairs.rows(g)) for g in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert sorted(i for rows in epoch0 for i in rows) == list(range(len(src)))
    assert [tuple(pairs.rows(g)) for g in range(n)] == epoch0  # a pure function of the index


def test_padding_and_errors():
    side = Side(np.array([5, 6, 7, 8, 9, 10]), np.array([0, 3, 4, 6]))
    tokens, mask = pad_rows(side, np.array([1, 0, 2]), pad_id=0)
    assert tokens.tolist() == [[8, 0, 0], [5, 6, 7], [9, 10, 0]]
    assert mask.tolist() == [[True, False, False], [True, True, True], [True, True, False]]
    with pytest.raises(InputError, match="no sentence pair fits"):
        length_batches(np.array([10]), np.array([10]), 100, 5, 0)
    with pytest.raises(InputError, match="cannot hold one pair"):
        length_batches(np.array([10]), np.array([10]), 5, 50, 0)
