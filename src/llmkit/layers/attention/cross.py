"""Cross-attention: the bridge between encoder and decoder (Vaswani et al. 2017 §3.2.3).

Queries come from the decoder's states; keys and values come from the encoder's output ("memory"), so each target
position can look at every source position. The memory's keys and values do not change while decoding, so they are
computed once per source sentence and kept in a `CrossCache`.

Shapes: B batch, T target tokens, S source tokens, C model dim, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import check_features
from llmkit.layers.attention.core import attend
from llmkit.layers.attention.mask import AttentionMask


@dataclass
class CrossCache:
    """Keys and values of the encoder memory for one layer, (B, K, S, D) each; filled on first use."""

    k: Tensor | None = None
    v: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def reorder(self, index: Tensor) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class CrossAttention(nn.Module):
    """Decoder queries x (B, T, C) attend to encoder memory (B, S, C) -> (B, T, C)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        out_bias: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.dropout = n_heads, n_kv_heads, head_dim, dropout
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.keep_weights = False
        self.last_weights: Tensor | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> CrossAttention:
        a = cfg.attention
        assert a.n_kv_heads is not None
        return cls(cfg.d_model, a.n_heads, a.n_kv_heads, cfg.head_dim, a.qkv_bias, a.out_bias, a.dropout)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """memory (B, S, C) -> k, v (B, K, S, D)."""
        B, S, _ = memory.shape
        k = self.wk(memory).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(memory).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(
        self, x: Tensor, memory: Tensor, memory_mask: AttentionMask | None, cache: CrossCache | None = None
    ) -> Tensor:
        check_features(x, self.wq.in_features, "CrossAttention")
        check_features(memory, self.wk.in_features, "CrossAttention memory")
        B, T, _ = x.shape
        if cache is not None and cache.k is not None and cache.v is not None:
            k, v = cache.k, cache.v
        else:
            k, v = self.memory_kv(memory)
            if cache is not None:
                cache.k, cache.v = k, v
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        out, weights = attend(
            q,
            k,
            v,
            memory_mask,
            scale=self.head_dim**-0.5,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=self.keep_weights,
        )
        self.last_weights = weights
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"
