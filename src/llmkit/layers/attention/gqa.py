"""Grouped-query attention (Ainslie et al. 2023), which is multi-head attention (Vaswani et al. 2017) when every
query head has its own key/value head and multi-query attention (Shazeer 2019) when all share one.

    query heads   q0 q1 │ q2 q3 │ q4 q5 │ q6 q7        H = 8 query heads
    kv heads       kv0  │  kv1  │  kv2  │  kv3         K = 4: GQA-4    K = H: MHA    K = 1: MQA

Each head projects x into its own low-dimensional subspace, attends there, and the heads' outputs are concatenated
and mixed by wo: MultiHead(x) = Concat(head_1, .., head_H) Wo. Sharing key/value heads shrinks the KV cache by H / K
with little loss in quality.

Shapes: B batch, T new tokens, S key slots, C model dim, H query heads, K kv heads, D head dim, R rotated dims.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit.config import Layout, ModelConfig, NormConfig
from llmkit.errors import check_features
from llmkit.layers.attention.base import AttentionInputs, SelfAttention, record_weights, wants_weights
from llmkit.layers.attention.cache import GroupedInPlace, KVCache
from llmkit.layers.attention.core import PrefillKernel, attend
from llmkit.layers.extras import Extras
from llmkit.layers.norm import build_norm
from llmkit.layers.rope import RopeTables, apply_rope


def rotate_prefix(x: Tensor, rope: RopeTables, rope_dim: int, layout: Layout) -> Tensor:
    """Apply RoPE to the first `rope_dim` dims of each head of x (B, T, H, D); pass the rest through."""
    if rope_dim == x.shape[-1]:
        return apply_rope(x, rope, layout)
    return torch.cat((apply_rope(x[..., :rope_dim], rope, layout), x[..., rope_dim:]), dim=-1)


class GroupedQueryAttention(SelfAttention):
    """Self-attention with H query heads sharing K key/value heads. x (B, T, C) -> (B, T, C).

    qk_norm: a norm (one gain of D per projection, shared by the heads) applied to every query and key head before
    RoPE (Qwen3, Gemma 3); None for none. scale: the factor on q.k (D^-0.5 when None); softcap: scores soft-capped
    before the softmax (Gemma 2). prefill_kernel: a faster kernel for a prompt's causal attention (see attend), given
    by llmkit.quant to the layers whose projections it quantizes: its CPU kernel on bf16 units."""

    prefill_kernel: PrefillKernel | None = None
    packs_rows = True  # attend() splits a ragged mask's rows (core._attend_ragged)
    attends_in_place = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        out_bias: bool = False,
        dropout: float = 0.0,
        rope_dim: int = 0,
        rope_layout: Layout = "half",
        sliding_window: int | None = None,
        qk_norm: NormConfig | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.sliding_window = sliding_window
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope_dim, self.rope_layout, self.dropout = rope_dim, rope_layout, dropout
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.q_norm = None if qk_norm is None else build_norm(qk_norm, head_dim)
        self.k_norm = None if qk_norm is None else build_norm(qk_norm, head_dim)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer: int = 0) -> GroupedQueryAttention:
        a = cfg.attention
        return cls(
            cfg.d_model,
            a.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            a.qkv_bias,
            a.out_bias,
            a.dropout,
            cfg.rope_dim,
            cfg.position.layout,
            a.window_of(layer),
            cfg.norm if a.qk_norm else None,
            a.scale,
            a.softcap,
        )

    def forward(
        self, x: Tensor, inputs: AttentionInputs, cache: KVCache | None = None, extras: Extras | None = None
    ) -> Tensor:
        check_features(x, self.wq.in_features, "GroupedQueryAttention")
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, D)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # each head normalised over its D dims
        rope = inputs.rope_local if self.sliding_window is not None and inputs.rope_local is not None else inputs.rope
        if rope is not None and self.rope_dim:
            q = rotate_prefix(q, rope, self.rope_dim, self.rope_layout)
            k = rotate_prefix(k, rope, self.rope_dim, self.rope_layout)
        if isinstance(cache, GroupedInPlace):  # a paged pool whose kernel reads the keys where they lie
            out = cache.attend_grouped(q, k, v, self.scale, self.softcap, self.sliding_window)  # (B, T, H, D)
            return self.wo(out.reshape(B, T, self.n_heads * self.head_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        if cache is not None:
            assert inputs.slots is not None, "a cached call needs the slots its tokens go to"
            k, v = cache.update(inputs.slots, k, v)  # (B, K, S_max, D)
        out, weights = attend(
            q,
            k,
            v,
            inputs.mask.with_window(self.sliding_window),
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=wants_weights(extras),
            softcap=self.softcap,
            prefill_kernel=self.prefill_kernel,
        )
        record_weights(extras, weights)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, C)

    def new_cache(
        self, batch: int, max_len: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        return KVCache(batch, self.n_kv_heads, max_len, self.head_dim, self.head_dim, device, dtype)

    def cache_elements_per_token(self) -> int:
        return 2 * self.n_kv_heads * self.head_dim

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"
