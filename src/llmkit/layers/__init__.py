"""Building blocks: positions, attention variants, norms, residual wiring, feed-forward, MoE, MTP, blocks."""

from llmkit.layers.attention import (
    AttentionInputs,
    AttentionMask,
    CrossAttention,
    DeepSeekSparseAttention,
    GroupedQueryAttention,
    LightningIndexer,
    MultiHeadLatentAttention,
    SelfAttention,
    build_attention,
)
from llmkit.layers.block import CrossAttentionBlock, TransformerBlock
from llmkit.layers.mlp import MLP, SwiGLU, build_ffn
from llmkit.layers.moe import MoE, Router, update_router_bias
from llmkit.layers.mtp import MTPModule
from llmkit.layers.norm import LayerNorm, RMSNorm, build_norm
from llmkit.layers.position import LearnedPositions, SinusoidalPositions
from llmkit.layers.residual import PostNorm, PreNorm
from llmkit.layers.rope import RotaryEmbedding, apply_rope, rope_frequencies

__all__ = [
    "MLP",
    "AttentionInputs",
    "AttentionMask",
    "CrossAttention",
    "CrossAttentionBlock",
    "DeepSeekSparseAttention",
    "GroupedQueryAttention",
    "LayerNorm",
    "LearnedPositions",
    "LightningIndexer",
    "MTPModule",
    "MoE",
    "MultiHeadLatentAttention",
    "PostNorm",
    "PreNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "SelfAttention",
    "SinusoidalPositions",
    "SwiGLU",
    "TransformerBlock",
    "apply_rope",
    "build_attention",
    "build_ffn",
    "build_norm",
    "rope_frequencies",
    "update_router_bias",
]
