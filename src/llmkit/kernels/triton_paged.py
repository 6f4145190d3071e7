"""The Triton kernel behind llmkit.kernels.paged_attention: attention that reads keys and values through each row's
block table where they lie in the pool (no gather), for decoding rows, prompt chunks and mixed steps alike.

One program computes one tile of a row: BLOCK_M of its queries times the G query heads that share one kv head,
flattened into BLOCK_M * BLOCK_G score rows, so each key a program loads serves every head that reads it (GQA's
saving, and MQA's and MLA's). It walks the tile's keys BLOCK_N at a time with the online softmax of FlashAttention
(Dao et al. 2022, alg. 1): a running maximum m, a running sum l, and an output rescaled by exp(m_old - m_new) as m
grows. A key tile's positions are looked up in the block table one by one, so any block size works.

    grid = (rows B, query tiles of the longest row, kv heads K x key chunks)

With `chunks` > 1, program (b, t, k * chunks + c) covers only the c-th of `chunks` equal runs of its row's keys
(each a whole number of key tiles) and writes its unnormalised output with its m and l; `_combine` then merges a
query head's chunks (flash-decoding). The runs are cut by the row's own length, so the grid (chunks fixed) does not
change with the keys, and a row's bits do not change with its neighbours. Programs past a row's queries return at
once, and empty chunks write an empty partial (m = -inf, l = 0), so a grid sized by fixed bounds (a captured CUDA
graph's) is correct for any rows inside them.

A quantized pool (--kv-dtype int8 or fp8) holds one-byte codes and a scale per (kv head, block, slot). The codes are
converted as they are loaded: a key's scale multiplies its column of scores (the codes, exact in the queries' dtype,
times the query), a value's codes are multiplied by their scale in fp32 and rounded to the queries' dtype. Nothing is
dequantized in memory: a tile's values exist in the model's dtype only in registers.

Under TRITON_INTERPRET=1 the same code runs on CPU tensors (numpy underneath): the tests check it against the
reference there, in fp32 and fp16 (the interpreter's bf16 products are wrong as of Triton 3.9: the GPU check covers
bf16).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from llmkit.kernels.paged_rows import PagedRows

BLOCK_N = 32  # key positions per inner step


@triton.jit
def _attend_tile(
    q_ptr, k_ptr, r_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, ml_ptr, sel_ptr,
    table_ptr, q_start_ptr, q_len_ptr, start_ptr, scale, softcap, window, group, n_chunks, block_size, first_key,
    n_select,
    s_qn, s_qh, s_kh, s_kb, s_ks, s_rh, s_rb, s_rs, s_vh, s_vb, s_vs,  # strides: q; the pools (head, block, slot)
    s_xh, s_xb, s_xs,  # the scales' strides (head, block, slot), a quantized pool's
    s_on, s_oh, s_oc, s_mn, s_mh, s_tb, s_sn,  # out (query, head, chunk), m and l (query, head), table, selection
    D: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr, SELECT: tl.constexpr, SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    row, tile = tl.program_id(0), tl.program_id(1)
    kv_head = (tl.program_id(2) // n_chunks).to(tl.int64)  # (a pool past 2^31 elements: 64-bit offsets)
    chunk = tl.program_id(2) % n_chunks
    q_len = tl.load(q_len_ptr + row)
    if tile * BLOCK_M >= q_len:
        return
    q0 = tl.load(q_start_ptr + row)
    start = tl.load(start_ptr + row)

    # the tile's score rows: query i of the tile (BLOCK_M) x query head g of the group (BLOCK_G)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    qi = tile * BLOCK_M + r // BLOCK_G  # the query's index in its row
    g = r % BLOCK_G
    live = (qi < q_len) & (g < group)
    head = kv_head * group + g
    q_pos = start + qi  # (M,) each score row's query position
    q_row = (q0 + qi) * s_qn + head * s_qh  # (M,) offsets of each score row's query vector
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0)  # (M, D)
    dr = tl.arange(0, BLOCK_DR)  # MLA: the rope part of the key, after the latent (DR = 0: none, nothing read)
    q_rope = tl.load(q_ptr + q_row[:, None] + D + dr[None, :], mask=live[:, None] & (dr[None, :] < DR), other=0.0)
    dv = tl.arange(0, BLOCK_DV)

    if SELECT:  # the tile's one query sees the positions chosen for it (-1: none), BLOCK_N at a time
        lo, hi = 0, 0
        first, last = 0, n_select
    else:
        lo, hi = _key_range(start, q_len, tile, chunk, n_chunks, window, first_key, BLOCK_M, BLOCK_N, WINDOW, SPLIT)
        first, last = (lo // BLOCK_N) * BLOCK_N, hi  # key tiles at fixed positions (multiples of BLOCK_N)

    m, l = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(first, last, BLOCK_N):
        if SELECT:
            j = n0 + tl.arange(0, BLOCK_N)
            pos = tl.load(sel_ptr + (q0 + tile) * s_sn + j, mask=j < n_select, other=-1)
            inside = (pos >= first_key) & (pos <= start + tile)  # (-1 pads; a position past the query is not read)
        else:
            pos = n0 + tl.arange(0, BLOCK_N)
            inside = (pos >= lo) & (pos < hi)
        page = tl.load(table_ptr + row * s_tb + pos // block_size, mask=inside, other=0).to(tl.int64)
        x_slot = kv_head * s_xh + page * s_xb + (pos % block_size) * s_xs  # (N,) the keys' scales, when SCALED
        # the key tile's scores (M, N) in fp32
        s = _scores(
            q, q_rope, k_ptr + kv_head * s_kh + page * s_kb + (pos % block_size) * s_ks,
            r_ptr + kv_head * s_rh + page * s_rb + (pos % block_size) * s_rs, ks_ptr + x_slot, inside, pos, q_pos,
            scale, softcap, window, D, DR, BLOCK_D, BLOCK_DR, SOFTCAP, WINDOW, SCALED, PRECISION,
        )  # fmt: skip
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays empty
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        v_at = v_ptr + kv_head * s_vh + page * s_vb + (pos % block_size) * s_vs
        pv = _weighted_values(p, v_at, vs_ptr + x_slot, inside, q.dtype, DV, BLOCK_DV, SCALED, PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new

    keep = live[:, None] & (dv[None, :] < DV)
    if SPLIT:  # the chunk's unnormalised output, with its m and l, for _combine
        tl.store(out_ptr + ((q0 + qi) * s_on + head * s_oh + chunk * s_oc)[:, None] + dv[None, :], acc, mask=keep)
        ml = ml_ptr + ((q0 + qi) * s_mn + head * s_mh + chunk * 2)[:, None] + tl.arange(0, 2)[None, :]
        tl.store(ml, tl.join(m, l), mask=live[:, None])
    else:
        out = (acc / tl.where(l > 0.0, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + ((q0 + qi) * s_on + head * s_oh)[:, None] + dv[None, :], out, mask=keep)


@triton.jit
def _key_range(
    start, q_len, tile, chunk, n_chunks, window, first_key,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """The positions [lo, hi) of the keys a tile's queries see: up to its last query's, from first_key and its
    first query's window on, within the chunk-th of n_chunks runs of the row's keys (each whole key tiles)."""
    hi = start + tl.minimum(q_len, (tile + 1) * BLOCK_M)
    lo = first_key
    if WINDOW:
        lo = tl.maximum(start + tile * BLOCK_M - window + 1, first_key)
    if SPLIT:
        run = tl.cdiv(tl.cdiv(start + q_len, n_chunks), BLOCK_N) * BLOCK_N
        lo = tl.maximum(lo, chunk * run)
        hi = tl.minimum(hi, (chunk + 1) * run)
    return lo, hi


@triton.jit
def _scores(
    q, q_rope, k_at, r_at, x_at, inside, pos, q_pos, scale, softcap, window,
    D: tl.constexpr, DR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SCALED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile's scores (M, N) in fp32: q . k (plus the rope parts' product), scaled, soft-capped, and -inf where
    a query does not see the key. k_at, r_at, x_at (N,): where each key's first element lies (in the key pool, the
    rope pool) and, when SCALED, its scale (a quantized pool's codes are read in the queries' dtype)."""
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_at[None, :] + d[:, None], mask=inside[None, :] & (d[:, None] < D), other=0.0)  # (D, N)
    if SCALED:
        s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION)
        s = s * tl.load(x_at, mask=inside, other=0.0)[None, :]
    else:
        s = tl.dot(q.to(k.dtype), k, input_precision=PRECISION)
    if DR > 0:
        dr = tl.arange(0, BLOCK_DR)
        kr = tl.load(r_at[None, :] + dr[:, None], mask=inside[None, :] & (dr[:, None] < DR), other=0.0)  # (DR, N)
        s += tl.dot(q_rope.to(kr.dtype), kr, input_precision=PRECISION)
    s = s * scale
    if SOFTCAP:  # cap * tanh(s / cap), with tanh(x) = 2 sigmoid(2x) - 1
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    seen = inside[None, :] & (pos[None, :] <= q_pos[:, None])
    if WINDOW:
        seen = seen & (q_pos[:, None] - pos[None, :] < window)
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _weighted_values(
    p, v_at, x_at, inside, dtype: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, SCALED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """p (M, N) times the key tile's values (N, DV), in fp32. v_at, x_at (N,): where each value's first element lies
    and, when SCALED, its scale: then each value is its codes times its scale, in fp32, rounded to `dtype` (the
    queries'). (Not the scale on the probabilities: in fp16 a small scale times a small probability falls below the
    normal numbers.)"""
    dv = tl.arange(0, BLOCK_DV)
    v = tl.load(v_at[:, None] + dv[None, :], mask=inside[:, None] & (dv[None, :] < DV), other=0.0)  # (N, DV)
    if SCALED:
        v = (v.to(tl.float32) * tl.load(x_at, mask=inside, other=0.0)[:, None]).to(dtype)
    return tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def _combine(
    part_ptr, ml_ptr, out_ptr, n_chunks,
    s_pn, s_ph, s_pc, s_mn, s_mh, s_on, s_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One query head's chunks merged: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, M = max_c m_c."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    dv = tl.arange(0, BLOCK_DV)
    has = c < n_chunks
    m = tl.load(ml_ptr + n * s_mn + h * s_mh + c * 2, mask=has, other=float("-inf"))
    l = tl.load(ml_ptr + n * s_mn + h * s_mh + c * 2 + 1, mask=has, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)))  # (C,)
    acc = tl.load(
        part_ptr + n * s_pn + h * s_ph + c[:, None] * s_pc + dv[None, :],
        mask=has[:, None] & (dv[None, :] < DV),
        other=0.0,
    )  # fmt: skip  (C, DV)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + n * s_on + h * s_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


@functools.cache
def _shared_memory(device_index: int) -> int:
    """The shared memory one program may use on this GPU (bytes: 227 KiB on an H100), as Triton checks it."""
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def _options(
    device: torch.device, score_rows: int, dims: tuple[int, int, int], size: int, split: bool
) -> dict[str, int]:
    """num_warps and num_stages for a launch of `score_rows` x (BLOCK_D, BLOCK_DR, BLOCK_DV) tiles of `size`-byte
    elements. A tile's queries stay in shared memory and each pipeline stage holds a key tile: as many stages as fit
    in 85% of the card's shared memory, up to Triton's default 3 (an estimate: Triton places the tiles itself; MLA's
    128 heads x 576 dims fit one). Large accumulators get 8 warps (fewer registers spilled), except where a split's
    fp32 partial output would not fit the shared memory 8 warps convert it through in one piece (MLA's 128 heads x
    512: 256 KiB, measured on compiles for sm_90)."""
    d, dr, dv = dims
    warps = 8 if score_rows * dv >= 32768 else 4
    if device.type != "cuda":
        return {"num_warps": warps}
    budget = 0.85 * _shared_memory(device.index if device.index is not None else torch.cuda.current_device())
    if split and score_rows * dv * 4 > budget:
        warps = 4
    fixed, per_stage = score_rows * (d + dr) * size, BLOCK_N * (d + dr + dv) * size
    return {"num_warps": warps, "num_stages": int(max(1, min(3, (budget - fixed) // per_stage)))}


def _scales(
    k_scale: Tensor | None, v_scale: Tensor | None, k_rope: Tensor | None, unused: Tensor
) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """A quantized pool's scales (K, NB, bs) and their strides, or, for a pool without them, `unused` in their place
    and zero strides."""
    if k_scale is None or v_scale is None:
        assert k_scale is None and v_scale is None, "a quantized pool has both scales"
        return unused, unused, (0, 0, 0)
    assert k_rope is None and k_scale.stride() == v_scale.stride(), "scales (K, NB, bs) of one layout"
    return k_scale, v_scale, k_scale.stride()


def launch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rows: PagedRows,
    scale: float,
    softcap: float | None,
    window: int | None,
    k_rope: Tensor | None,
    chunks: int,
    tile_rows: int | None = None,
    select: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """paged_attention's kernel launch: q (N, H, D + dr), k (K, NB, bs, D), v (K, NB, bs, Dv), select (N, n) or None,
    a quantized pool's scales k_scale, v_scale (K, NB, bs) or None -> (N, H, Dv)."""
    N, H, Dq = q.shape
    K, _, bs, D = k.shape
    DV = v.shape[-1]
    DR = 0 if k_rope is None else k_rope.shape[-1]
    assert Dq == D + DR, f"queries of {Dq} dims against keys of {D} + {DR}"
    q = q if q.stride(-1) == 1 else q.contiguous()
    for t in (k, v, *([k_rope] if k_rope is not None else [])):
        assert t.stride(-1) == 1, "the pools' last dim must be contiguous"
    group = H // K
    BLOCK_G = _pow2(group, least=1)
    # decoding tiles hold one query (its group's heads, padded to the 16 rows a product needs); prompt tiles 64 rows;
    # `tile_rows` fixes them whatever the rows (the batch-invariant mode)
    rows_wanted = tile_rows or (16 if rows.max_q_len == 1 else 64)
    # with a selection each query has keys of its own: a tile is one query, and its keys are few (no runs)
    BLOCK_M = 1 if select is not None else max(1, rows_wanted // BLOCK_G)
    chunks = 1 if select is not None else chunks
    sel = select.to(torch.int32).contiguous() if select is not None else rows.q_len  # (unused without a selection)
    out = torch.empty(N, H, DV, device=q.device, dtype=q.dtype)
    if chunks > 1:
        part = torch.empty(N, H, chunks, DV, device=q.device, dtype=torch.float32)
        ml = torch.empty(N, H, chunks, 2, device=q.device, dtype=torch.float32)
        dest, s_o = part, (part.stride(0), part.stride(1), part.stride(2))
    else:
        ml = out  # unused
        dest, s_o = out, (out.stride(0), out.stride(1), 0)
    rope = k if k_rope is None else k_rope
    scaled = k_scale is not None
    k_scale, v_scale, s_x = _scales(k_scale, v_scale, k_rope, rows.q_len)
    BLOCK_D, BLOCK_DR, BLOCK_DV = _pow2(D), _pow2(max(DR, 1)), _pow2(DV)
    dims = (BLOCK_D, BLOCK_DR, BLOCK_DV)
    launch_options = _options(q.device, BLOCK_M * BLOCK_G, dims, q.element_size(), chunks > 1)
    grid = (rows.table.shape[0], triton.cdiv(rows.max_q_len, BLOCK_M), K * chunks)
    _attend_tile[grid](
        q, k, rope, v, k_scale, v_scale, dest, ml, sel,
        rows.table, rows.q_start, rows.q_len, rows.start,
        scale, softcap or 0.0, window or 0, group, chunks, bs, rows.first_key,
        select.shape[1] if select is not None else 0,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        rope.stride(0), rope.stride(1), rope.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *s_x,
        *s_o,
        ml.stride(0) if chunks > 1 else 0, ml.stride(1) if chunks > 1 else 0,
        rows.table.stride(0), sel.stride(0),
        D=D, DR=DR, DV=DV,
        BLOCK_D=BLOCK_D, BLOCK_DR=BLOCK_DR, BLOCK_DV=BLOCK_DV,
        BLOCK_M=BLOCK_M, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N,
        SOFTCAP=softcap is not None, WINDOW=window is not None, SPLIT=chunks > 1, SELECT=select is not None,
        SCALED=scaled,
        # fp32 products exactly (tf32 applies only to fp32 inputs): the products are in the pool's dtype, or the
        # queries' where the pool holds codes
        PRECISION="ieee" if (q.dtype if scaled else k.dtype) == torch.float32 else "tf32",
        **launch_options,
    )  # fmt: skip
    if chunks > 1:
        _combine[(N, H)](
            part, ml, out, chunks,
            part.stride(0), part.stride(1), part.stride(2), ml.stride(0), ml.stride(1), out.stride(0), out.stride(1),
            DV=DV, BLOCK_DV=_pow2(DV), BLOCK_C=_pow2(chunks, least=2),
        )  # fmt: skip
    return out
