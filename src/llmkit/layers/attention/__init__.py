"""Attention variants, each a class with the same forward signature, chosen by `attention.kind`."""

from __future__ import annotations

from llmkit.config import ModelConfig
from llmkit.layers.attention.base import AttentionInputs, SelfAttention
from llmkit.layers.attention.cache import KVCache, LatentCache
from llmkit.layers.attention.core import attend, attend_selected
from llmkit.layers.attention.cross import CrossAttention, CrossCache
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.layers.attention.mask import AttentionMask, causal_tril, padding_mask
from llmkit.layers.attention.mla import MLAResult, MultiHeadLatentAttention, Selection
from llmkit.layers.attention.sparse import DeepSeekSparseAttention, LightningIndexer

ATTENTION: dict[str, type[GroupedQueryAttention] | type[MultiHeadLatentAttention]] = {
    "gqa": GroupedQueryAttention,
    "mla": MultiHeadLatentAttention,
    "dsa": DeepSeekSparseAttention,
}


def build_attention(cfg: ModelConfig, layer: int = 0) -> SelfAttention:
    """The self-attention layer named by `cfg.attention.kind`, as layer `layer` of the stack has it (a window or
    not, where full_every alternates them)."""
    return ATTENTION[cfg.attention.kind].from_config(cfg, layer)


__all__ = [
    "ATTENTION",
    "AttentionInputs",
    "AttentionMask",
    "CrossAttention",
    "CrossCache",
    "DeepSeekSparseAttention",
    "GroupedQueryAttention",
    "KVCache",
    "LatentCache",
    "LightningIndexer",
    "MLAResult",
    "MultiHeadLatentAttention",
    "Selection",
    "SelfAttention",
    "attend",
    "attend_selected",
    "build_attention",
    "causal_tril",
    "padding_mask",
]
