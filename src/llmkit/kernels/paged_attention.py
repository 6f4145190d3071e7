"""Attention over a paged cache, read where it lies: the definition (a PyTorch reference that gathers each row's
keys, written for reading) and the dispatch to the Triton kernel (llmkit.kernels.triton_paged) that computes the
same thing without copying a key.

A step's queries are packed, row after row, into q (N, H, Dq); row b's q_len[b] queries sit at positions
start[b] .. start[b] + q_len[b] - 1 and see the keys at positions 0 .. their own (causal; from rows.first_key
instead of 0 where given), or only the `window` most recent of them (a sliding window: position(q) - position(k) <
window). Position p of row b lives in the cache at
block table[b, p // bs], slot p % bs. A decoding row is a row with q_len 1; a prompt chunk one with q_len > 1; a
mixed step has both.

Keys may come in two parts, concatenated along the head dim: grouped-query attention's keys (K, NB, bs, D) alone,
or multi-head latent attention's latent c_kv (1, NB, bs, r) and shared rope key k_pe (1, NB, bs, dr), whose
values are the latent itself (MLA's absorbed form: MQA with one r + dr key, mla.py). Query head h reads kv head
h // G, G = H / K. Scores are scaled, then soft-capped (Gemma 2: cap * tanh(s / cap)) when a cap is given.

With `select` (N, n) a query sees only the positions listed for it (DeepSeek's sparse attention: its indexer's top-k
keys; -1 pads a list), still causally: each such query is a tile of its own in the kernel.

A quantized pool (the serving engine's --kv-dtype int8 or fp8) holds codes k, v (int8 or float8_e4m3fn) with a scale
per (kv head, block, slot) in k_scale, v_scale (K, NB, bs): the key or value is its codes times its scale
(llmkit.layers.attention.cache.quantize_kv), computed in the queries' dtype.

A row's keys may be reduced in `chunks` runs (flash-decoding: a long context's keys spread over more programs, then
the runs' partial softmaxes combined). The runs are cut by the row's own length, so a query's result does not
depend on the other rows of its step: what the batch-invariant mode needs, with a fixed `chunks` and tile.

Shapes: N packed queries, B rows, H query heads, K kv heads, G = H / K, Dq = D (+ dr) query/key dim, Dv value dim,
NB blocks in the pool, bs block size, nb blocks in a row's table.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.kernels.paged_rows import PagedRows

__all__ = ["PagedRows", "chunks_for", "paged_attention", "paged_attention_reference"]


def paged_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rows: PagedRows,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    k_rope: Tensor | None = None,
    select: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """The definition: each row's keys gathered through its table, then softmax(q k^T) v in fp32.
    q (N, H, Dq), k (K, NB, bs, D), v (K, NB, bs, Dv), k_rope (K, NB, bs, dr) or None (Dq = D + dr), select (N, n)
    or None, a quantized pool's scales k_scale, v_scale (K, NB, bs) or None -> (N, H, Dv)."""
    N, H, _ = q.shape
    K, _, bs, _ = k.shape
    out = q.new_zeros(N, H, v.shape[-1])
    for b, (q0, n, s0) in enumerate(zip(rows.q_start.tolist(), rows.q_len.tolist(), rows.start.tolist(), strict=True)):
        S = s0 + n
        pos = torch.arange(S, device=q.device)
        page = rows.table[b, pos // bs].long()  # (S,)
        keys = _at(k, page, pos % bs).float()  # (K, S, D)
        if k_rope is not None:
            keys = torch.cat((keys, k_rope[:, page, pos % bs].float()), dim=-1)  # (K, S, D + dr)
        values = _at(v, page, pos % bs).float()  # (K, S, Dv)
        if k_scale is not None and v_scale is not None:  # codes times their scales
            keys = keys * k_scale[:, page, pos % bs, None]
            values = values * v_scale[:, page, pos % bs, None]
        qb = q[q0 : q0 + n].float().view(n, K, H // K, -1)  # (T, K, G, Dq)
        scores = torch.einsum("tkgd,ksd->tkgs", qb, keys) * scale  # (T, K, G, S)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = (s0 + torch.arange(n, device=q.device))[:, None]  # (T, 1)
        visible = (pos[None, :] <= qpos) & (pos[None, :] >= rows.first_key)
        if window is not None:
            visible &= qpos - pos[None, :] < window
        if select is not None:  # (T, S): the positions listed for each query
            visible &= (select[q0 : q0 + n, :, None].long() == pos[None, None, :]).any(dim=1)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # (T, K, G, S)
        weights = weights.masked_fill(~visible.any(-1)[:, None, None, None], 0.0)  # a query seeing nothing: zeros
        out[q0 : q0 + n] = torch.einsum("tkgs,ksd->tkgd", weights, values).reshape(n, H, -1).to(out.dtype)
    return out


def _at(pool: Tensor, page: Tensor, slot: Tensor) -> Tensor:
    """pool[:, page, slot], a pool of one-byte codes indexed as bytes (PyTorch indexes fp8 on few devices)."""
    if pool.element_size() != 1:
        return pool[:, page, slot]
    return pool.view(torch.uint8)[:, page, slot].view(pool.dtype)


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rows: PagedRows,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    k_rope: Tensor | None = None,
    chunks: int = 1,
    tile_rows: int | None = None,
    select: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Attention over the paged pools in place (the Triton kernel): the same arguments and result as
    paged_attention_reference. `chunks`: reduce each row's keys in that many runs, combined after (1: one pass; a
    query with a selection reads its keys in one pass whatever `chunks` says: they are few).
    `tile_rows`: score rows (queries x heads of a group) per program, a power of two from 16; None: 16 for a step
    of decoding rows, 64 for one with prompt chunks. With both fixed, a query's bits depend on its own row alone."""
    if chunks < 1:
        raise InputError(f"chunks must be at least 1, not {chunks}")
    if tile_rows is not None and (tile_rows < 16 or tile_rows & (tile_rows - 1)):
        raise InputError(f"tile_rows must be a power of two from 16, not {tile_rows}")
    if q.shape[1] % k.shape[0]:
        raise InputError(f"{q.shape[1]} query heads cannot share {k.shape[0]} kv heads evenly")
    if (k_scale is None) != (v_scale is None) or (k_scale is not None and k_rope is not None):
        raise InputError("a quantized pool gives both k_scale and v_scale, for grouped-query keys (no k_rope)")
    from llmkit.kernels.triton_paged import launch

    return launch(q, k, v, rows, scale, softcap, window, k_rope, chunks, tile_rows, select, k_scale, v_scale)


def chunks_for(rows: int, kv_heads: int, max_keys: int, programs: int = 264) -> int:
    """How many runs to cut each row's keys into so that rows x kv heads x runs fill about `programs` programs (two
    waves on an H100's 132 multiprocessors), no run shorter than 256 keys (each run costs a write and a read of its
    partial output): 1 for short contexts or batches that fill the GPU already."""
    by_length = max(1, max_keys // 256)
    return max(1, min(by_length, programs // max(1, rows * kv_heads)))
