"""Transformer blocks: a self-attention sub-layer and a feed-forward sub-layer, each inside residual wiring
(pre- or post-norm, see residual.py), plus the encoder-decoder's decoder block with cross-attention between them.

    TransformerBlock (decoder-only LM, encoder, MTP)     CrossAttentionBlock (decoder of an encoder-decoder)
        x ─► [self-attention] ─► [feed-forward] ─►           x ─► [masked self-attention] ─► [cross-attention
                                                                   over encoder memory] ─► [feed-forward] ─►

The attention, feed-forward (dense or MoE) and residual modules are chosen by configuration; the blocks never branch
on which variant they hold. Shapes: x (B, T, C) -> (B, T, C); memory (B, S, C).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.layers.attention import AttentionInputs, build_attention
from llmkit.layers.attention.cross import CrossAttention, CrossCache
from llmkit.layers.attention.mask import AttentionMask
from llmkit.layers.extras import Extras
from llmkit.layers.mlp import build_ffn
from llmkit.layers.moe import MoE
from llmkit.layers.residual import build_residual


def build_block_ffn(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: MoE from moe.first_dense_layers on when `moe` is set, the dense ffn otherwise."""
    if cfg.is_moe_layer(layer):
        assert cfg.moe is not None
        return MoE(cfg.d_model, cfg.moe, layer)
    f = cfg.ffn
    return build_ffn(f.kind, cfg.d_model, cfg.ffn_hidden_dim, f.activation, f.bias)


class TransformerBlock(nn.Module):
    """Self-attention then feed-forward, each with a residual connection. x (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn = build_attention(cfg, layer)
        self.ffn = build_block_ffn(cfg, layer)
        self.attn_residual = build_residual(cfg.norm, cfg.d_model, cfg.dropout)
        self.ffn_residual = build_residual(cfg.norm, cfg.d_model, cfg.dropout)

    def forward(self, x: Tensor, inputs: AttentionInputs, cache: Any = None, extras: Extras | None = None) -> Tensor:
        x = self.attn_residual(x, lambda h: self.attn(h, inputs, cache, extras))
        return self.ffn_residual(x, lambda h: self.ffn(h, extras))


class CrossAttentionBlock(nn.Module):
    """Masked self-attention, cross-attention over the encoder memory, feed-forward. x (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn = build_attention(cfg, layer)
        self.cross = CrossAttention(cfg)
        self.ffn = build_block_ffn(cfg, layer)
        self.attn_residual = build_residual(cfg.norm, cfg.d_model, cfg.dropout)
        self.cross_residual = build_residual(cfg.norm, cfg.d_model, cfg.dropout)
        self.ffn_residual = build_residual(cfg.norm, cfg.d_model, cfg.dropout)

    def forward(
        self,
        x: Tensor,
        inputs: AttentionInputs,
        memory: Tensor,
        memory_mask: AttentionMask | None,
        cache: Any = None,
        cross_cache: CrossCache | None = None,
        extras: Extras | None = None,
    ) -> Tensor:
        x = self.attn_residual(x, lambda h: self.attn(h, inputs, cache, extras))
        x = self.cross_residual(x, lambda h: self.cross(h, memory, memory_mask, cross_cache, extras))
        return self.ffn_residual(x, lambda h: self.ffn(h, extras))
