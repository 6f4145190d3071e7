"""The interface every self-attention variant implements (GQA, MLA, DSA), so a block never asks which one it holds.

forward(x (B, T, C), inputs: AttentionInputs, cache: LayerCache | None, extras: Extras | None) -> (B, T, C)
new_cache(batch, max_len, device, dtype) -> the variant's own cache layout
cache_elements_per_token() -> elements this layer caches per token (what `llmkit inspect` reports)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from llmkit.layers.attention.cache import LayerCache
from llmkit.layers.attention.mask import AttentionMask
from llmkit.layers.extras import Extras
from llmkit.layers.rope import RopeTables


@dataclass(frozen=True)
class AttentionInputs:
    """What a self-attention layer needs besides x: the mask over key slots, the RoPE tables of the new tokens'
    positions (None without RoPE), the cache slots (T,) the new tokens' keys go to (None without a cache), and the
    tables of sliding-window layers when they have a RoPE base of their own (Gemma 3)."""

    mask: AttentionMask
    rope: RopeTables | None = None
    slots: Tensor | None = None
    rope_local: RopeTables | None = None


class SelfAttention(nn.Module, abc.ABC):
    """Base class of self-attention variants. `packs_rows`: the variant attends to rows of different lengths packed
    into one (AttentionMask.ragged), so a serving step can run its rows as one forward. `attends_in_place`: given a
    cache that attends itself (cache.GroupedInPlace, cache.LatentInPlace), the variant hands it its queries and new
    keys."""

    packs_rows: ClassVar[bool] = False
    attends_in_place: ClassVar[bool] = False

    @abc.abstractmethod
    def forward(self, x: Tensor, inputs: AttentionInputs, cache: Any = None, extras: Extras | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C). With `extras.attention_weights`, appends the weights (B, H, T, S) to
        `extras.self_attention`."""

    @abc.abstractmethod
    def new_cache(
        self, batch: int, max_len: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> LayerCache:
        """A preallocated cache for `batch` sequences of up to `max_len` tokens."""

    @abc.abstractmethod
    def cache_elements_per_token(self) -> int:
        """Elements this layer stores in its cache per token."""


def wants_weights(extras: Extras | None) -> bool:
    return extras is not None and extras.attention_weights


def record_weights(extras: Extras | None, weights: Tensor | None) -> None:
    """Append a self-attention layer's weights to `extras` when they were asked for."""
    if extras is not None and extras.attention_weights and weights is not None:
        extras.self_attention.append(weights)
