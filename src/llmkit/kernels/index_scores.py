"""The lightning indexer's scores over a paged cache (DeepSeek-V3.2's sparse attention, llmkit.layers.attention.sparse),
read where the index keys lie: the definition (a PyTorch reference that gathers each row's keys) and the dispatch to
the Triton kernel (llmkit.kernels.triton_index).

    I(t, s) = sum_j  w(t, j) * ReLU(q(t, j) . k(s)) * scale       for every position s that query t sees
                                                                   (rows.first_key <= s <= t)

The queries are packed as paged_attention's are (PagedRows: row b's q_len[b] queries at positions start[b] ..);
position p of row b lives at block table[b, p // bs], slot p % bs of the index-key pool. The result has a column per
position up to rows.max_keys, -inf where the query does not see the position: what a top-k over it needs.

Shapes: N packed queries, J indexer heads, Di index head dim, NB blocks in the pool, bs block size, S = max_keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.kernels.paged_rows import PagedRows


def index_scores_reference(q: Tensor, w: Tensor, keys: Tensor, rows: PagedRows, scale: float) -> Tensor:
    """The definition, in fp32: q (N, J, Di), w (N, J), keys (NB, bs, Di) -> (N, S)."""
    bs = keys.shape[1]
    out = torch.full((q.shape[0], rows.max_keys), float("-inf"), device=q.device)
    for b, (q0, n, s0) in enumerate(zip(rows.q_start.tolist(), rows.q_len.tolist(), rows.start.tolist(), strict=True)):
        pos = torch.arange(s0 + n, device=q.device)
        k = keys[rows.table[b, pos // bs].long(), pos % bs].float()  # (S_b, Di)
        scores = F.relu(torch.einsum("tjd,sd->tjs", q[q0 : q0 + n].float(), k)) * scale  # (T, J, S_b)
        index = torch.einsum("tjs,tj->ts", scores, w[q0 : q0 + n].float())  # (T, S_b)
        seen = (pos[None, :] <= (s0 + torch.arange(n, device=q.device))[:, None]) & (pos[None, :] >= rows.first_key)
        out[q0 : q0 + n, : s0 + n] = index.masked_fill(~seen, float("-inf"))
    return out


def index_scores(
    q: Tensor,
    w: Tensor,
    keys: Tensor,
    rows: PagedRows,
    scale: float,
    programs: int = 264,
    tile_rows: int | None = None,
) -> Tensor:
    """The Triton kernel: index_scores_reference's arguments and result. `programs`: about how many programs fill
    the GPU (each row's key tiles are dealt out among that many where its queries alone would not; a score is
    computed whole by one program, so this changes no bits). `tile_rows`: score rows (queries x heads) per
    program, a power of two from 16; None: 16 for a step of decoding rows, 64 with prompt chunks."""
    from llmkit.kernels.triton_index import launch

    return launch(q, w, keys, rows, scale, programs, tile_rows)
