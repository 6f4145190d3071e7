"""Per-layer caches, one layout per attention variant, preallocated to a fixed number of slots.

    GQA / MHA / MQA   k, v          (B, K, S_max, D)                      2 * K * D elements per token per layer
    MLA               c_kv, k_pe    (B, S_max, r), (B, S_max, d_rope)     r + d_rope per token per layer
    DSA               + index keys  (B, S_max, d_index)

MLA stores only the joint latent and the shared rope key (576 elements at DeepSeek-V3 sizes instead of
2 * 128 heads * 128 dims): at inference it works like MQA with a single 576-dim key.

`update` writes the new tokens into the slots given as a tensor and returns the whole buffers: shapes never change
while decoding, so a compiled decode step is compiled once, and no count of filled slots is read back from the
device. Which slots hold tokens, and which of them a query may see, is the attention mask's business (the cache's
`SequenceState`, in llmkit.models.state).

QuantizedKVCache keeps the keys and values of grouped-query attention as one-byte codes with one fp32 scale per
(token, kv head): a quarter of fp32's memory plus 4 bytes per D. The codes are int8 (KV_CODES["int8"]: a uniform grid
of 255 steps of max |x| / 127) or fp8 (KV_CODES["fp8"]: E4M3 numbers, 3 bits of mantissa at every magnitude, scaled
so that max |x| is 448, E4M3's largest). It is the serving engine's --kv-dtype int8 / fp8 (llmkit.serve.paged keeps
its pools the same way; the C++ decode step reads int8 pools, the GPU's paged-attention kernel both) and
`llmkit eval --kv-dtype`, which measures what each costs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, max_len, v_head_dim, device=device, dtype=dtype)

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """slots (T,) long, k (B, K, T, D), v (B, K, T, Dv) -> every slot (B, K, S_max, D), (B, K, S_max, Dv)."""
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))
        return self.k, self.v

    def first(self, n: int) -> KVCache:
        """A cache over this one's first n slots: views, so updates land in this cache's buffers (an eager step
        attends over the slots filled so far rather than every preallocated one)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, :, :n], self.v[:, :, :n]
        return view

    @property
    def nbytes(self) -> int:
        return _nbytes(self.k, self.v)

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` (B',) of the batch, in that order (beam search)."""
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


# the codes a cache's keys and values may be kept as, by name: their dtype and the largest code a scale maps max |x| to
KV_CODES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
_LARGEST = dict(KV_CODES.values())  # codes' dtype -> the largest code


def quantize_kv(x: Tensor, codes: torch.dtype) -> tuple[Tensor, Tensor]:
    """x (..., D) -> codes (..., D) of dtype `codes` (int8 or float8_e4m3fn) and scales (...) fp32: symmetric, one
    scale per vector, scale = max |x| / largest code, codes x / scale rounded to the nearest code (ties to even; 0 for
    a vector of zeros). For int8 the C++ decode step's KVLayout::put computes the same codes from the same values."""
    top = _LARGEST[codes]
    x = x.float()
    scale = x.abs().amax(-1) / top
    scaled = (x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp(-top, top)
    return (scaled.round() if codes == torch.int8 else scaled).to(codes), scale


def dequantize_kv(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """quantize_kv's codes (..., D) and scales (...) -> values (..., D) in `dtype`."""
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)


class QuantizedKVCache(KVCache):
    """KVCache's keys and values as codes k, v (B, K, S_max, D) of dtype `codes` with scales k_scale, v_scale
    (B, K, S_max) (quantize_kv). `update` returns every slot dequantized into the new keys' dtype: attention reads the
    keys and values the cache kept, its own token's too."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, v_head_dim: int,
                 codes: torch.dtype, device: torch.device | None = None) -> None:  # fmt: skip
        super().__init__(batch, n_kv_heads, max_len, head_dim, v_head_dim, device, codes)
        self.k_scale = torch.zeros(batch, n_kv_heads, max_len, device=device)
        self.v_scale = torch.zeros(batch, n_kv_heads, max_len, device=device)

    @classmethod
    def like(cls, cache: KVCache, codes: torch.dtype) -> QuantizedKVCache:
        """An empty cache of `codes` of `cache`'s shape and device."""
        B, K, S, D = cache.k.shape
        return cls(B, K, S, D, cache.v.shape[-1], codes, cache.k.device)

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            c, s = quantize_kv(x, codes.dtype)
            codes.view(torch.uint8).index_copy_(2, slots, c.view(torch.uint8))  # (as bytes: PyTorch has no fp8 copy)
            scales.index_copy_(2, slots, s)
        return dequantize_kv(self.k, self.k_scale, k.dtype), dequantize_kv(self.v, self.v_scale, v.dtype)

    def first(self, n: int) -> QuantizedKVCache:
        view = QuantizedKVCache.__new__(QuantizedKVCache)
        view.k, view.v = self.k[:, :, :n], self.v[:, :, :n]
        view.k_scale, view.v_scale = self.k_scale[:, :, :n], self.v_scale[:, :, :n]
        return view

    @property
    def nbytes(self) -> int:
        return _nbytes(self.k, self.v, self.k_scale, self.v_scale)

    def reorder(self, index: Tensor) -> None:
        self.k, self.v = (c.view(torch.uint8).index_select(0, index).view(c.dtype) for c in (self.k, self.v))
        self.k_scale, self.v_scale = self.k_scale.index_select(0, index), self.v_scale.index_select(0, index)


class LatentCache:
    """Multi-head latent attention: latent c_kv (B, S_max, r) and shared rope key k_pe (B, S_max, d_rope), plus
    the lightning indexer's keys index_k (B, S_max, d_index) when the layer has an indexer (sparse attention)."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        index_dim: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.c_kv = torch.zeros(batch, max_len, kv_lora_rank, device=device, dtype=dtype)
        self.k_pe = torch.zeros(batch, max_len, rope_dim, device=device, dtype=dtype)
        self.index_k = torch.zeros(batch, max_len, index_dim, device=device, dtype=dtype) if index_dim else None

    def update(self, slots: Tensor, c_kv: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
        """slots (T,), c_kv (B, T, r), k_pe (B, T, d_rope) -> every slot (B, S_max, r), (B, S_max, d_rope)."""
        self.c_kv.index_copy_(1, slots, c_kv.to(self.c_kv.dtype))
        self.k_pe.index_copy_(1, slots, k_pe.to(self.k_pe.dtype))
        return self.c_kv, self.k_pe

    def update_index(self, slots: Tensor, index_k: Tensor) -> Tensor:
        """slots (T,), index_k (B, T, d_index) -> every slot (B, S_max, d_index)."""
        assert self.index_k is not None, "this cache was made for a layer without an indexer"
        self.index_k.index_copy_(1, slots, index_k.to(self.index_k.dtype))
        return self.index_k

    def first(self, n: int) -> LatentCache:
        """A cache over this one's first n slots, as views (see KVCache.first)."""
        view = LatentCache.__new__(LatentCache)
        view.c_kv, view.k_pe = self.c_kv[:, :n], self.k_pe[:, :n]
        view.index_k = None if self.index_k is None else self.index_k[:, :n]
        return view

    @property
    def nbytes(self) -> int:
        return _nbytes(self.c_kv, self.k_pe, *([self.index_k] if self.index_k is not None else []))

    def reorder(self, index: Tensor) -> None:
        self.c_kv, self.k_pe = self.c_kv.index_select(0, index), self.k_pe.index_select(0, index)
        if self.index_k is not None:
            self.index_k = self.index_k.index_select(0, index)


LayerCache = KVCache | LatentCache


class GroupedInPlace(ABC):
    """A grouped-query layer's cache that attends itself: it stores a step's new keys and computes the attention over
    every key it holds (a serving engine's paged pool read in place by a kernel: llmkit.serve.paged.KernelKV). A
    layer given one hands it its queries and new keys instead of reading keys back and masking them; the cache knows
    each query's row and position, so the layer's mask is not consulted."""

    @abstractmethod
    def attend_grouped(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None, window: int | None
    ) -> Tensor:
        """q (B, T, H, D), new k (B, T, K, D), v (B, T, K, Dv) -> (B, T, H, Dv)."""


class LatentInPlace(ABC):
    """A latent-attention layer's cache that attends itself (llmkit.serve.paged.KernelLatent), as GroupedInPlace."""

    @abstractmethod
    def attend_latent(self, q: Tensor, c_kv: Tensor, k_pe: Tensor, scale: float) -> Tensor:
        """The absorbed form (one key head of r + dr dims, the latent its value): q (B, T, H, r + dr), new c_kv
        (B, T, r), k_pe (B, T, dr) -> (B, T, H, r)."""


@dataclass(frozen=True)
class IndexQueries:
    """What a lightning indexer (DeepSeek sparse attention, llmkit.layers.attention.sparse) brings to a step: its
    queries q (B, T, J, Di), the step's new index keys k (B, T, Di), per-head weights w (B, T, J) (already scaled by
    J^-1/2) and the score scale (Di^-1/2), for I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)) * scale; and topk, how
    many of the highest-scoring keys each query attends to."""

    q: Tensor
    k: Tensor
    w: Tensor
    scale: float
    topk: int


class SelectedInPlace(LatentInPlace):
    """A latent cache that attends itself over the keys an indexer picks for each query (llmkit.serve.paged's
    KernelLatent): it stores the step's new index keys, scores every key a query sees, keeps the top-k (ties to the
    earlier key) and attends over those."""

    @abstractmethod
    def attend_selected(self, q: Tensor, c_kv: Tensor, k_pe: Tensor, scale: float, index: IndexQueries) -> Tensor:
        """As attend_latent, each query over its index.topk best keys (all it sees, where it sees no more):
        q (B, T, H, r + dr) -> (B, T, H, r)."""
