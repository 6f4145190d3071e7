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
from llmkit.layers.extras import Extras


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
    """Decoder queries x (B, T, C) attend to encoder memory (B, S, C) -> (B, T, C). Heads, widths and biases are the
    model's self-attention's (attention.*), as in the paper."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        a, d_model = cfg.attention, cfg.d_model
        self.n_heads, self.n_kv_heads, self.head_dim, self.dropout = a.n_heads, cfg.n_kv_heads, cfg.head_dim, a.dropout
        self.wq = nn.Linear(d_model, self.n_heads * self.head_dim, bias=a.qkv_bias)
        self.wk = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=a.qkv_bias)
        self.wv = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, d_model, bias=a.out_bias)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """memory (B, S, C) -> k, v (B, K, S, D)."""
        B, S, _ = memory.shape
        k = self.wk(memory).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(memory).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_mask: AttentionMask | None,
        cache: CrossCache | None = None,
        extras: Extras | None = None,
    ) -> Tensor:
        """x (B, T, C), memory (B, S, C) -> (B, T, C). With `extras.attention_weights`, appends the weights
        (B, H, T, S) to `extras.cross_attention`."""
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
            need_weights=extras is not None and extras.attention_weights,
        )
        if extras is not None and weights is not None:
            extras.cross_attention.append(weights)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"
