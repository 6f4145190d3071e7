"""The interface every self-attention variant implements (GQA, MLA, DSA), so a block never asks which one it holds.

forward(x (B, T, C), inputs: AttentionInputs, cache: LayerCache | None) -> (B, T, C)
new_cache(batch, max_len, device, dtype) -> the variant's own cache layout
cache_elements_per_token() -> elements this layer caches per token (what `llmkit inspect` reports)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.layers.attention.cache import LayerCache
from llmkit.layers.attention.mask import AttentionMask
from llmkit.layers.rope import RopeTables


@dataclass(frozen=True)
class AttentionInputs:
    """What a self-attention layer needs besides x: the mask over key slots, the RoPE tables of the new tokens'
    positions (None without RoPE), and the cache slot where the new tokens go."""

    mask: AttentionMask
    rope: RopeTables | None = None
    cache_start: int = 0


class SelfAttention(nn.Module, abc.ABC):
    """Base class of self-attention variants. Set `keep_weights = True` to take the explicit path and keep the
    attention weights of the last call in `last_weights` (B, H, T, S), for inspection."""

    def __init__(self) -> None:
        super().__init__()
        self.keep_weights = False
        self.last_weights: Tensor | None = None

    @abc.abstractmethod
    def forward(self, x: Tensor, inputs: AttentionInputs, cache: Any = None) -> Tensor:
        """(B, T, C) -> (B, T, C)."""

    @abc.abstractmethod
    def new_cache(
        self, batch: int, max_len: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> LayerCache:
        """A preallocated cache for `batch` sequences of up to `max_len` tokens."""

    @abc.abstractmethod
    def cache_elements_per_token(self) -> int:
        """Elements this layer stores in its cache per token."""
