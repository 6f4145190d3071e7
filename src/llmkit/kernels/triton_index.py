"""The Triton kernel behind llmkit.kernels.index_scores: the lightning indexer's scores for a step's queries against
every index key their rows hold, read through the block tables where they lie.

One program scores a tile of a row's queries (BLOCK_M queries x the J indexer heads, flattened into score rows, so
each key loaded serves every head) against every `n_split`-th tile of BLOCK_N key positions: a score is written
once, for one (query, position), so the key tiles of a row can be dealt out among programs with nothing to combine
after (a long context's decoding row fills the GPU that way). Per key tile: ReLU(q . k) * scale, weighted by each
head's w and summed over the heads, -inf where a query does not see the position; positions past the tile's last
query are never visited (the output starts as -inf).

    grid = (rows B, query tiles of the longest row, n_split)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llmkit.kernels.paged_rows import PagedRows

BLOCK_N = 32  # key positions per step


@triton.jit
def _index_tile(
    q_ptr, w_ptr, k_ptr, out_ptr, table_ptr, q_start_ptr, q_len_ptr, start_ptr,
    scale, heads, block_size, n_split, first_key,
    s_qn, s_qj, s_wn, s_kb, s_ks, s_on, s_tb,
    DI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    row, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(q_len_ptr + row)
    if tile * BLOCK_M >= q_len:
        return
    q0 = tl.load(q_start_ptr + row)
    start = tl.load(start_ptr + row)

    r = tl.arange(0, BLOCK_M * BLOCK_J)  # score rows: query r // BLOCK_J of the tile, head r % BLOCK_J
    qi = tile * BLOCK_M + r // BLOCK_J
    j = r % BLOCK_J
    live = (qi < q_len) & (j < heads)
    d = tl.arange(0, BLOCK_DI)
    q_at = q_ptr + (q0 + qi).to(tl.int64)[:, None] * s_qn + j[:, None] * s_qj + d[None, :]
    q = tl.load(q_at, mask=live[:, None] & (d[None, :] < DI), other=0.0)  # (MJ, DI)
    w = tl.load(w_ptr + (q0 + qi).to(tl.int64) * s_wn + j, mask=live, other=0.0).to(tl.float32)  # (MJ,)

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # the tile's queries
    q_pos = start + m
    hi = start + tl.minimum(q_len, (tile + 1) * BLOCK_M)  # positions the tile's last query sees
    for n0 in range(split * BLOCK_N, hi, n_split * BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        inside = pos < hi
        page = tl.load(table_ptr + row * s_tb + pos // block_size, mask=inside, other=0).to(tl.int64)
        k_at = k_ptr + page[None, :] * s_kb + (pos % block_size)[None, :] * s_ks + d[:, None]
        k = tl.load(k_at, mask=inside[None, :] & (d[:, None] < DI), other=0.0)  # (DI, N)
        s = tl.maximum(tl.dot(q.to(k.dtype), k, input_precision=PRECISION), 0.0) * scale * w[:, None]  # (MJ, N)
        index = tl.sum(tl.reshape(s, (BLOCK_M, BLOCK_J, BLOCK_N)), axis=1)  # (M, N): summed over the heads
        seen = inside[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= first_key)
        at = out_ptr + (q0 + m).to(tl.int64)[:, None] * s_on + pos[None, :]
        tl.store(at, tl.where(seen, index, float("-inf")), mask=(m < q_len)[:, None] & inside[None, :])


def launch(
    q: Tensor, w: Tensor, keys: Tensor, rows: PagedRows, scale: float, programs: int, tile_rows: int | None
) -> Tensor:
    """index_scores' kernel launch: q (N, J, Di), w (N, J), keys (NB, bs, Di) -> (N, S) fp32."""
    N, J, DI = q.shape
    bs = keys.shape[1]
    q, w = q if q.stride(-1) == 1 else q.contiguous(), w.contiguous()
    assert keys.stride(-1) == 1, "the index-key pool's last dim must be contiguous"
    out = torch.full((N, rows.max_keys), float("-inf"), device=q.device, dtype=torch.float32)
    BLOCK_J = max(1, triton.next_power_of_2(J))
    BLOCK_M = max(1, (tile_rows or (16 if rows.max_q_len == 1 else 64)) // BLOCK_J)  # score rows per tile
    B, tiles = rows.table.shape[0], triton.cdiv(rows.max_q_len, BLOCK_M)
    # deal a row's key tiles out among programs where its queries alone would leave the GPU idle
    n_split = max(1, min(triton.cdiv(rows.max_keys, 256), programs // max(1, B * tiles)))
    _index_tile[(B, tiles, n_split)](
        q, w, keys, out, rows.table, rows.q_start, rows.q_len, rows.start,
        scale, J, bs, n_split, rows.first_key,
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), keys.stride(1), out.stride(0), rows.table.stride(0),
        DI=DI, BLOCK_DI=max(16, triton.next_power_of_2(DI)), BLOCK_M=BLOCK_M, BLOCK_J=BLOCK_J, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if keys.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
