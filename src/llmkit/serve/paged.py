"""The paged KV cache's tensors: one pool of blocks per layer, in that layer's own cache layout, and per-step views
that let an unchanged attention layer write its new keys into the blocks and read back its sequences' keys.

    GQA / MHA / MQA   KVPool       k, v           (K, N, block, D)     heads first (see _rows)
    MLA               LatentPool   c_kv, k_pe     (N, block, r), (N, block, d_rope)
    DSA               LatentPool   + index_k      (N, block, d_index)

Each pool starts as its attention variant's own `new_cache(batch=N, max_len=block_size)`, so a variant's per-token
layout is written down once, and MLA's 576-element latent takes 576 elements per token here too: more blocks, so
more concurrent sequences, in the same memory. With kv_dtype "int8" or "fp8" a grouped-query pool holds one-byte
codes and a scale per (token, kv head) (k_scale, v_scale (K, N, bs); llmkit.layers.attention.cache.quantize_kv):
3.8x the blocks of an fp32 pool at D = 64, which the C++ step (int8) and the paged-attention kernel (both) read in
place and the PyTorch paths dequantize as they gather.

A step's view gathers each row's blocks into one contiguous (B, .., S, ..) tensor of S = blocks x block_size slots
and writes the new tokens at (physical block, offset); the attention mask hides the slots a row has not filled.
The kernel views (KernelKV, KernelLatent) instead attend where the blocks lie (llmkit.kernels.paged_attention):
the layer hands them its queries, and nothing is gathered. Shapes: B rows, T new tokens per row, nb blocks per row,
N blocks in the pool, n a step's new tokens (packed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.kernels.paged_attention import PagedRows
from llmkit.layers.attention import SelfAttention
from llmkit.layers.attention.cache import (
    KV_CODES,
    GroupedInPlace,
    IndexQueries,
    KVCache,
    LatentCache,
    SelectedInPlace,
    dequantize_kv,
    quantize_kv,
)
from llmkit.models.decoder import DecoderLM

# paged attention over pools read in place: paged_attention's arguments (q, k, v, rows, scale, softcap, window,
# k_rope, select) -> (n, H, Dv); llmkit.kernels.paged_attention's kernel or its reference
PagedAttention = Callable[..., Tensor]
# a lightning indexer's scores over an index-key pool read in place: index_scores' arguments (q, w, keys, rows,
# scale) -> (n, S); llmkit.kernels.index_scores' kernel or its reference
IndexScores = Callable[[Tensor, Tensor, Tensor, PagedRows, float], Tensor]


@dataclass(frozen=True)
class Pages:
    """Where a step's rows live in the pool: table (B, nb) physical blocks of each row (padded with any valid
    block), and for each new token (B, T) its physical block and the offset inside it."""

    table: Tensor
    block: Tensor
    offset: Tensor

    @classmethod
    def of(cls, table: Tensor, slots: Tensor, block_size: int) -> Pages:
        """table (B, nb) and the new tokens' logical slots (B, T) -> where they go."""
        return cls(table, table.gather(1, slots // block_size), slots % block_size)


@dataclass
class KVPool:
    """A grouped-query layer's blocks: k (K, N, bs, D), v (K, N, bs, Dv). Heads come first, unlike KVCache's
    (batch, K, S, D): a step's gather of whole blocks then lays each kv head's rows out contiguously (see _rows).
    A quantized pool's k and v are codes (int8 or fp8), with a scale each in k_scale, v_scale (K, N, bs)."""

    k: Tensor
    v: Tensor
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    @classmethod
    def of(cls, cache: KVCache) -> KVPool:
        """The pool whose blocks are the rows of `cache` (batch = N blocks, max_len = block size)."""
        return cls(cache.k.transpose(0, 1).contiguous(), cache.v.transpose(0, 1).contiguous())

    @classmethod
    def empty(cls, like: KVCache, device: torch.device, codes: torch.dtype | None = None) -> KVPool:
        """An empty pool of `like`'s shape (batch = N blocks, max_len = block size; `like` may be on the meta
        device: only its shapes and dtype are read), allocated once on `device`: in like's dtype or, with `codes`
        (torch.int8 or torch.float8_e4m3fn), of those codes (zero bytes: +0) and their scales."""
        N, K, bs, D = like.k.shape
        if codes is None:
            return cls(*(torch.zeros(K, N, bs, d, device=device, dtype=like.k.dtype) for d in (D, like.v.shape[-1])))
        k, v = (torch.zeros(K, N, bs, d, device=device, dtype=torch.uint8).view(codes) for d in (D, like.v.shape[-1]))
        return cls(k, v, torch.zeros(K, N, bs, device=device), torch.zeros(K, N, bs, device=device))

    @property
    def nbytes(self) -> int:
        return _nbytes(*self.parts)

    @property
    def scales(self) -> tuple[Tensor, Tensor] | None:
        """A quantized pool's key and value scales (K, N, bs); None for a pool of the model's dtype."""
        return (self.k_scale, self.v_scale) if self.k_scale is not None and self.v_scale is not None else None

    @property
    def parts(self) -> list[Tensor]:
        """The pool's tensors (K, N, bs, ..): keys, values (and their scales)."""
        return [self.k, self.v, *(self.scales or ())]

    def write(self, block: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
        """New keys (K, ..., D) and values (K, ..., Dv) into (block, offset) (..., each the same shape)."""
        if self.scales is None:
            self.k[:, block, offset] = k.to(self.k.dtype)
            self.v[:, block, offset] = v.to(self.v.dtype)
            return
        for codes, scales, x in zip((self.k, self.v), self.scales, (k, v), strict=True):
            c, scales[:, block, offset] = quantize_kv(x, codes.dtype)
            codes.view(torch.uint8)[:, block, offset] = c.view(torch.uint8)  # (bytes: PyTorch seldom indexes fp8)

    def rows(self, table: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Each row's slots (B, K, nb * bs, D) and (B, K, nb * bs, Dv) through block table (B, nb), in `dtype`."""
        if self.scales is None:
            return _rows(self.k, table), _rows(self.v, table)
        k_scale, v_scale = self.scales
        return (
            dequantize_kv(_code_rows(self.k, table), _rows(k_scale[..., None], table)[..., 0], dtype),
            dequantize_kv(_code_rows(self.v, table), _rows(v_scale[..., None], table)[..., 0], dtype),
        )


@dataclass
class LatentPool:
    """A latent-attention layer's blocks: c_kv (N, bs, r), k_pe (N, bs, d_rope), and the indexer's keys index_k
    (N, bs, d_index) when the layer has one (LatentCache's layout with batch = N blocks)."""

    c_kv: Tensor
    k_pe: Tensor
    index_k: Tensor | None = None

    @classmethod
    def of(cls, cache: LatentCache) -> LatentPool:
        return cls(cache.c_kv, cache.k_pe, cache.index_k)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.c_kv, self.k_pe, *([self.index_k] if self.index_k is not None else []))


Pool = KVPool | LatentPool


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PagedKV:
    """A grouped-query layer's view of the pool for one step (what KVCache.update is to a contiguous cache)."""

    def __init__(self, store: KVPool, pages: Pages) -> None:
        self.store, self.pages = store, pages

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k (B, K, T, D), v (B, K, T, Dv) -> each row's slots (B, K, S, D), (B, K, S, Dv): views of (K, B, S, D)
        tensors (see heads_first)."""
        p = self.pages
        self.store.write(p.block, p.offset, k.transpose(0, 1), v.transpose(0, 1))  # (K, B, T, D)
        return self.store.rows(p.table, k.dtype)


class PagedLatent:
    """A latent-attention layer's view of the pool for one step (what LatentCache is to a contiguous cache)."""

    def __init__(self, store: LatentPool, pages: Pages) -> None:
        self.store, self.pages = store, pages

    def update(self, slots: Tensor, c_kv: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
        """c_kv (B, T, r), k_pe (B, T, d_rope) -> each row's slots (B, S, r), (B, S, d_rope)."""
        p = self.pages
        self.store.c_kv[p.block, p.offset] = c_kv.to(self.store.c_kv.dtype)
        self.store.k_pe[p.block, p.offset] = k_pe.to(self.store.k_pe.dtype)
        return _latent_rows(self.store.c_kv, p.table), _latent_rows(self.store.k_pe, p.table)

    def update_index(self, slots: Tensor, index_k: Tensor) -> Tensor:
        """index_k (B, T, d_index) -> each row's slots (B, S, d_index)."""
        store = self.store.index_k
        assert store is not None, "this pool was made for a layer without an indexer"
        store[self.pages.block, self.pages.offset] = index_k.to(store.dtype)
        return _latent_rows(store, self.pages.table)


def _rows(pool: Tensor, table: Tensor) -> Tensor:
    """pool (K, N, bs, D), table (B, nb) -> (B, K, nb * bs, D), a view of a contiguous (K, B, nb * bs, D) gather:
    one copy of whole blocks, and each (head, row) pair's slots lie in one run of memory, so attention multiplies
    them without copying them again (llmkit.layers.attention.core attends in that order)."""
    B, nb = table.shape
    K, _, bs, D = pool.shape
    return pool.index_select(1, table.reshape(-1)).view(K, B, nb * bs, D).transpose(0, 1)


def _code_rows(pool: Tensor, table: Tensor) -> Tensor:
    """_rows of a pool of one-byte codes, gathered as bytes (PyTorch's index_select takes fp8 on few devices)."""
    return _rows(pool.view(torch.uint8), table).view(pool.dtype)


def _latent_rows(pool: Tensor, table: Tensor) -> Tensor:
    """pool (N, bs, r), table (B, nb) -> (B, nb * bs, r)."""
    B, nb = table.shape
    return pool.index_select(0, table.reshape(-1)).view(B, nb * pool.shape[1], pool.shape[2])


@dataclass(frozen=True)
class Placement:
    """A packed step's rows for the kernel views: `rows` (PagedRows) for attention, and for each new token (n,) its
    physical block and the offset inside it."""

    rows: PagedRows
    block: Tensor
    offset: Tensor


class KernelKV(GroupedInPlace):
    """A grouped-query layer's pool for one step, attended in place by `attention`."""

    def __init__(self, store: KVPool, at: Placement, attention: PagedAttention) -> None:
        self.store, self.at, self.attention = store, at, attention

    def attend_grouped(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None, window: int | None
    ) -> Tensor:
        """q (B, T, H, D), k (B, T, K, D), v (B, T, K, Dv), B T = n packed row after row -> (B, T, H, Dv)."""
        B, T, H, D = q.shape
        pool, at = self.store, self.at
        pool.write(at.block, at.offset, k.flatten(0, 1).transpose(0, 1), v.flatten(0, 1).transpose(0, 1))  # (K, n, D)
        q = q.reshape(B * T, H, D)
        if pool.scales is None:  # the queries in the pool's dtype
            out = self.attention(q.to(pool.k.dtype), pool.k, pool.v, at.rows, scale, softcap, window)
        else:  # a quantized pool's codes, read in the queries' dtype
            k_scale, v_scale = pool.scales
            out = self.attention(q, pool.k, pool.v, at.rows, scale, softcap, window, k_scale=k_scale, v_scale=v_scale)
        return out.view(B, T, H, -1).to(q.dtype)


class KernelLatent(SelectedInPlace):
    """A latent-attention layer's pool for one step, attended in place by `attention` (one key head: the latent and
    the rope key; the latent its value); with an indexer's queries, over the keys `scores` rank highest."""

    def __init__(self, store: LatentPool, at: Placement, attention: PagedAttention, scores: IndexScores) -> None:
        self.store, self.at, self.attention, self.scores = store, at, attention, scores

    def attend_latent(self, q: Tensor, c_kv: Tensor, k_pe: Tensor, scale: float) -> Tensor:
        """q (B, T, H, r + dr), c_kv (B, T, r), k_pe (B, T, dr) -> (B, T, H, r)."""
        return self._attend(q, c_kv, k_pe, scale, None)

    def attend_selected(self, q: Tensor, c_kv: Tensor, k_pe: Tensor, scale: float, index: IndexQueries) -> Tensor:
        """The step's index keys written, every key a query sees scored (n, S), its index.topk best kept (a stable
        sort: ties go to the earlier key, as DeepSeekSparseAttention.select breaks them), and attended."""
        B, T, J, Di = index.q.shape
        pool, at = self.store.index_k, self.at
        assert pool is not None, "this pool was made for a layer without an indexer"
        pool[at.block, at.offset] = index.k.reshape(B * T, Di).to(pool.dtype)
        scores = self.scores(index.q.reshape(B * T, J, Di), index.w.reshape(B * T, J), pool, at.rows, index.scale)
        best = scores.sort(dim=-1, descending=True, stable=True)
        keep = min(index.topk, scores.shape[1])
        chosen = torch.where(best.values[:, :keep] > float("-inf"), best.indices[:, :keep], -1)  # (n, topk)
        return self._attend(q, c_kv, k_pe, scale, chosen)

    def _attend(self, q: Tensor, c_kv: Tensor, k_pe: Tensor, scale: float, select: Tensor | None) -> Tensor:
        B, T, H, _ = q.shape
        pool, at = self.store, self.at
        pool.c_kv[at.block, at.offset] = c_kv.reshape(B * T, -1).to(pool.c_kv.dtype)
        pool.k_pe[at.block, at.offset] = k_pe.reshape(B * T, -1).to(pool.k_pe.dtype)
        latent = pool.c_kv.unsqueeze(0)  # (1, N, bs, r): one kv head
        out = self.attention(
            q.reshape(B * T, H, -1).to(latent.dtype),
            latent,
            latent,
            at.rows,
            scale,
            k_rope=pool.k_pe.unsqueeze(0),
            **({"select": select} if select is not None else {}),
        )  # (n, H, r)
        return out.view(B, T, H, -1).to(q.dtype)


class PagedCache:
    """Every layer's pool of `n_blocks` blocks of `block_size` slots (and a scratch block, when asked for)."""

    def __init__(
        self,
        model: DecoderLM,
        n_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        scratch: bool = False,
        kv_dtype: str | None = None,
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise InputError(f"kv_dtype must be one of {', '.join(map(str, KV_DTYPES))}, not {kv_dtype!r}")
        codes = KV_CODES[kv_dtype][0] if kv_dtype is not None else None
        if codes is not None and not all(isinstance(_attention(b).new_cache(1, 1, torch.device("meta")), KVCache)
                                         for b in model.blocks):  # fmt: skip
            raise InputError(
                f"an {kv_dtype} KV cache is for grouped-query attention (MHA, GQA, MQA); latent attention's cache "
                "(MLA, DSA) is kept in the model's dtype"
            )
        self.n_blocks, self.block_size, self.kv_dtype = n_blocks, block_size, kv_dtype
        # `scratch`: one block more, never handed out, that the padding rows of a captured step write to
        self.scratch = n_blocks if scratch else None
        total = n_blocks + int(scratch)
        self.layers: list[Pool] = [_pool(_attention(b), total, block_size, device, dtype, codes) for b in model.blocks]

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype, kv_dtype: str | None = None) -> int:
        """What one block of every layer's pool takes (counted on the meta device: nothing is allocated)."""
        return PagedCache(model, 1, block_size, torch.device("meta"), dtype, kv_dtype=kv_dtype).nbytes

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def views(self, pages: Pages) -> list[object]:
        """Each layer's view of its pool for one step over `pages`."""
        return [PagedKV(c, pages) if isinstance(c, KVPool) else PagedLatent(c, pages) for c in self.layers]

    def kernel_views(self, at: Placement, attention: PagedAttention, scores: IndexScores) -> list[object]:
        """Each layer's pool attended in place by `attention` for one step placed `at` (sparse attention's keys
        ranked by `scores`)."""
        return [
            KernelKV(c, at, attention) if isinstance(c, KVPool) else KernelLatent(c, at, attention, scores)
            for c in self.layers
        ]

    def _block_parts(self, block: int) -> list[Tensor]:
        """Every tensor's slice for one block, in a fixed order (the layers', then each pool's fields)."""
        parts = []
        for c in self.layers:
            if isinstance(c, KVPool):
                parts += [t[:, block] for t in c.parts]
            else:
                parts += [c.c_kv[block], c.k_pe[block]] + ([c.index_k[block]] if c.index_k is not None else [])
        return parts

    @property
    def layout(self) -> str:
        """What a block's bytes are: each part's dtype and shape (a prefix-cache tier's blocks must agree)."""
        return ";".join(f"{t.dtype}{tuple(t.shape)}" for t in self._block_parts(0))

    def read_block(self, block: int) -> Tensor:
        """One block's keys and values, every layer's, as bytes (uint8, on the CPU): what a prefix-cache tier keeps."""
        parts = [t.contiguous().view(torch.uint8).reshape(-1) for t in self._block_parts(block)]
        return torch.cat(parts).cpu()

    def write_block(self, block: int, data: Tensor) -> None:
        """Put bytes that read_block gave (of a pool with the same layout) back into `block`."""
        at = 0
        for t in self._block_parts(block):
            n = t.numel() * t.element_size()
            t.copy_(data[at : at + n].clone().view(t.dtype).reshape(t.shape))  # (clone: the view's bytes aligned)
            at += n
        assert at == data.numel(), f"a block of {data.numel()} bytes for a layout of {at}"

    def grouped_query(self) -> list[KVPool] | None:
        """Every layer's pool when all the layers are grouped-query (what the C++ step reads), else None."""
        if not all(isinstance(c, KVPool) for c in self.layers):
            return None
        return cast(list[KVPool], self.layers)


# what a pool's keys and values may be kept as (None: the model's dtype)
KV_DTYPES = (None, *KV_CODES)


def _pool(
    attention: SelfAttention,
    n: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    codes: torch.dtype | None,
) -> Pool:
    """One layer's pool of n blocks: a grouped-query one allocated in its own layout at once (no cache in the
    model's dtype and a copy of it first: an int8 pool of an fp32 model briefly took nine times its bytes), a
    latent one as its cache."""
    shape = attention.new_cache(n, block_size, torch.device("meta"), dtype)
    if isinstance(shape, KVCache):
        return KVPool.empty(shape, device, codes)
    return LatentPool.of(cast(LatentCache, attention.new_cache(n, block_size, device, dtype)))


def _attention(block: torch.nn.Module) -> SelfAttention:
    return cast(SelfAttention, block.attn)
