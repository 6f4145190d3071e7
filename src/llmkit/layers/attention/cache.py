"""Per-layer caches, one layout per attention variant, preallocated to a fixed maximum length.

    GQA / MHA / MQA   k, v          (B, K, S_max, D)      2 * K * D elements per token per layer
    MLA               c_kv, k_pe    (B, S_max, r), (B, S_max, d_rope)   r + d_rope per token per layer
    DSA               + index keys  (B, S_max, d_index)

MLA stores only the joint latent and the shared rope key (576 elements at DeepSeek-V3 sizes instead of
2 * 128 heads * 128 dims): at inference it works like MQA with a single 576-dim key. `update` writes the new tokens at
slots [start, start + T) and returns views of every filled slot.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.errors import InputError


def _check_room(start: int, T: int, max_len: int) -> None:
    if start + T > max_len:
        raise InputError(
            f"the cache holds max_len={max_len} tokens; writing {T} new tokens at slot {start} would need "
            f"{start + T}. Create the cache with a larger max_len"
        )


class KVCache:
    """Keys and values of grouped-query attention: k (B, K, S_max, D), v (B, K, S_max, Dv)."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        v_head_dim: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.max_len = max_len
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, max_len, v_head_dim, device=device, dtype=dtype)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k (B, K, T, D), v (B, K, T, Dv) -> all filled slots (B, K, start + T, D), (B, K, start + T, Dv)."""
        T = k.shape[2]
        _check_room(start, T, self.max_len)
        self.k[:, :, start : start + T] = k
        self.v[:, :, start : start + T] = v
        return self.k[:, :, : start + T], self.v[:, :, : start + T]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` (B',) of the batch, in that order (beam search)."""
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class LatentCache:
    """Multi-head latent attention: latent c_kv (B, S_max, r) and shared rope key k_pe (B, S_max, d_rope)."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.max_len = max_len
        self.c_kv = torch.zeros(batch, max_len, kv_lora_rank, device=device, dtype=dtype)
        self.k_pe = torch.zeros(batch, max_len, rope_dim, device=device, dtype=dtype)

    def update(self, start: int, c_kv: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
        """c_kv (B, T, r), k_pe (B, T, d_rope) -> all filled slots (B, start + T, r), (B, start + T, d_rope)."""
        T = c_kv.shape[1]
        _check_room(start, T, self.max_len)
        self.c_kv[:, start : start + T] = c_kv
        self.k_pe[:, start : start + T] = k_pe
        return self.c_kv[:, : start + T], self.k_pe[:, : start + T]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.c_kv, self.k_pe))

    def reorder(self, index: Tensor) -> None:
        self.c_kv, self.k_pe = self.c_kv.index_select(0, index), self.k_pe.index_select(0, index)


class SparseLatentCache(LatentCache):
    """DeepSeek sparse attention: the MLA latent cache plus the lightning indexer's keys (B, S_max, d_index)."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        index_dim: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(batch, max_len, kv_lora_rank, rope_dim, device, dtype)
        self.index_k = torch.zeros(batch, max_len, index_dim, device=device, dtype=dtype)

    def update_index(self, start: int, index_k: Tensor) -> Tensor:
        """index_k (B, T, d_index) -> all filled slots (B, start + T, d_index)."""
        T = index_k.shape[1]
        _check_room(start, T, self.max_len)
        self.index_k[:, start : start + T] = index_k
        return self.index_k[:, : start + T]

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.index_k.numel() * self.index_k.element_size()

    def reorder(self, index: Tensor) -> None:
        super().reorder(index)
        self.index_k = self.index_k.index_select(0, index)


LayerCache = KVCache | LatentCache
