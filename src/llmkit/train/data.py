"""Batches from prepared token shards (see `llmkit prepare`), memory-mapped.

Training batches are random windows of seq_len + 1 tokens: inputs are the first seq_len, targets the last seq_len
(the same stream shifted by one: teacher forcing). Which windows step s reads is a pure function of (seed, s,
micro-step), not of any state, so a run resumed at step s reads exactly what an uninterrupted run would. Under data
parallelism every process draws the same global batch and takes its own rows, so N processes compute the same
gradient as one process with the whole batch.

Evaluation reads evenly spaced windows over the whole validation split, the same ones at every evaluation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llmkit.errors import InputError

META = "meta.json"


@dataclass
class Split:
    tokens: np.ndarray  # (N,) memory-mapped
    chars: int

    @property
    def chars_per_token(self) -> float:
        return self.chars / max(len(self.tokens), 1)


class TokenData:
    """The train and validation token streams of a prepared data folder."""

    def __init__(self, directory: str | Path) -> None:
        d = Path(directory)
        meta_path = d / META
        if not d.is_dir():
            raise InputError(f"data folder {str(d)!r} does not exist: run `llmkit prepare` first")
        if not meta_path.is_file():
            raise InputError(f"{d} has no {META}: not a prepared data folder (run `llmkit prepare`)")
        try:
            self.meta: dict[str, Any] = json.loads(meta_path.read_text())
            dtype = np.dtype(self.meta["dtype"])
            self.vocab_size = int(self.meta["vocab_size"])
            self.eot_id = int(self.meta["eot_id"])
            splits = self.meta["splits"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{meta_path} is not valid: {e}") from None
        self.dir = d
        self.splits: dict[str, Split] = {}
        for name in ("train", "val"):
            info = splits.get(name)
            if info is None:
                continue
            parts = []
            for f in info["files"]:
                path = d / f
                if not path.is_file():
                    raise InputError(f"{path} is missing: the data folder is incomplete, run `llmkit prepare` again")
                if path.stat().st_size:
                    parts.append(np.memmap(path, dtype=dtype, mode="r"))
            tokens = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype)
            if len(tokens) != info["tokens"]:
                raise InputError(f"{d}: the {name} split has {len(tokens)} tokens, {META} says {info['tokens']}")
            self.splits[name] = Split(tokens, int(info["chars"]))
        if "train" not in self.splits:
            raise InputError(f"{meta_path} has no train split")

    def split(self, name: str) -> Split:
        if name not in self.splits or len(self.splits[name].tokens) == 0:
            raise InputError(f"{self.dir} has no {name} tokens")
        return self.splits[name]

    def check_window(self, seq_len: int, split: str = "train") -> None:
        n = len(self.split(split).tokens)
        if n < seq_len + 1:
            raise InputError(f"the {split} split has {n} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")


def _seed(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p + 0x632BE59BD9B4E019 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def window_batch(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each (len(offsets), seq_len) long: windows tokens[o : o + seq_len + 1]."""
    rows = np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets])
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def train_batch(
    data: TokenData, seq_len: int, batch_size: int, seed: int, step: int, micro: int, rank: int = 0, world: int = 1
) -> tuple[Tensor, Tensor]:
    """This process's rows of the global batch of (step, micro-step): batch_size rows of the batch_size * world the
    whole job reads."""
    tokens = data.split("train").tokens
    high = len(tokens) - seq_len - 1
    g = torch.Generator().manual_seed(_seed(seed, step, micro))
    offsets = torch.randint(0, high + 1, (batch_size * world,), generator=g).numpy()
    return window_batch(tokens, offsets[rank * batch_size : (rank + 1) * batch_size], seq_len)


def eval_offsets(n_tokens: int, seq_len: int, budget_tokens: int) -> np.ndarray:
    """Evenly spaced window starts covering a split, about budget_tokens in all (non-overlapping when it fits)."""
    high = n_tokens - seq_len - 1
    count = max(1, min(math.ceil(budget_tokens / seq_len), high // seq_len + 1))
    return np.linspace(0, high, count).astype(np.int64)
