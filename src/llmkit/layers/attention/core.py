"""Scaled dot-product attention (Vaswani et al. 2017, eq. 1), dense and over selected keys.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

The 1/sqrt(d_k) keeps the logits' variance near 1 when q and k have unit-variance entries, so the softmax does not
saturate. Two dense paths compute the same thing:
- PyTorch's fused SDPA (flash / memory-efficient kernels), used by default;
- an explicit path that also returns the attention weights, for inspection and plots.
A layer may also hold a faster kernel for a prompt's plain causal attention (PrefillKernel: llmkit.quant gives the
layers it quantizes its CPU one, on bf16 dot-product units), which `attend` hands the chunks it takes.

Shapes: B batch, H query heads, K key/value heads (H % K == 0; group G = H / K), T queries, S keys, n selected keys
per query, D query/key dim, Dv value dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.layers.attention.mask import AttentionMask
from llmkit.layers.softcap import soft_cap

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# A kernel for a prompt's causal attention: (q (H, T, D), k (K, S, D), v (K, S, Dv), offset, scale) -> (H, T, Dv), for
# queries at positions offset .. offset + T - 1 that see the keys up to their own; None where it declines the call.
PrefillKernel = Callable[[Tensor, Tensor, Tensor, int, float], "Tensor | None"]

# from this many queries on, a prompt's chunk goes to a layer's prefill kernel (which may read every key once a call)
PREFILL_QUERIES = 16


def _softmax_rows(scores: Tensor, allowed: Tensor | None) -> Tensor:
    """Softmax over the last dim in fp32; rows with no allowed key give zeros instead of NaN."""
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1)
    if allowed is not None:
        weights = weights.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    return weights


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask | None,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    softcap: float | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> tuple[Tensor, Tensor | None]:
    """q (B, H, T, D), k (B, K, S, D), v (B, K, S, Dv) -> out (B, H, T, Dv), weights (B, H, T, S) or None.
    softcap: scores soft-capped before the softmax (Gemma 2), which SDPA cannot do: the explicit paths compute it.
    prefill_kernel: a faster kernel for a prompt's plain causal attention, which a layer may have been given
    (llmkit.quant gives the layers it quantizes its CPU one); it returns None where it does not apply."""
    mask = mask or AttentionMask()
    fusable = not need_weights and dropout_p == 0.0 and softcap is None
    if prefill_kernel is not None and fusable and (out := _prefill(prefill_kernel, q, k, v, mask, scale)) is not None:
        return out, None
    if mask.ragged is not None:
        assert not need_weights and dropout_p == 0.0, "packed rows of different lengths are an inference path"
        return _attend_ragged(q, k, v, mask, scale, softcap, prefill_kernel), None
    B, H, T, _ = q.shape
    K, S = k.shape[1], k.shape[2]
    one_query_path = torch.compiler.is_compiling() or _heads_first(k) or softcap is not None
    if T == 1 and not need_weights and dropout_p == 0.0 and one_query_path:
        return _one_query(q, k, v, mask, scale, softcap), None
    if not need_weights and softcap is None:
        if T > 1 and (plain := mask.trimmed(T)) is not None:  # an unpadded prefill: the first T keys, causal
            k, v, mask, S = k[:, :, :T], v[:, :, :T], plain, T
        attn_mask, is_causal = mask.for_sdpa(T, S, q.device)
        if H != K and not _SDPA_GQA:  # torch < 2.5: expand the shared heads
            k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        extra = {"enable_gqa": True} if H != K and _SDPA_GQA else {}
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
        )
        return out, None
    # explicit path: group the H query heads by the K kv heads they share, (B, K, G, T, D)
    qg = q.view(B, K, H // K, T, -1)
    scores = soft_cap((qg @ k.unsqueeze(2).transpose(-1, -2)) * scale, softcap)  # (B, K, G, T, S)
    allowed = mask.dense(T, S, q.device)
    weights = _softmax_rows(scores, None if allowed is None else allowed.unsqueeze(2))  # (B, K, G, T, S)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = dropped.to(v.dtype) @ v.unsqueeze(2)  # (B, K, G, T, Dv)
    return out.reshape(B, H, T, -1), weights.reshape(B, H, T, S)


def _prefill(
    kernel: PrefillKernel, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float
) -> Tensor | None:
    """The rows' prompt chunks through `kernel`, one row at a time, or None: fewer than PREFILL_QUERIES queries,
    training (autograd needs torch's kernels), tracing, or a mask other than the plain causal one of chunks that sit
    in the same slots in every row (a batch of unpadded prompts of one length, evaluation windows)."""
    if q.shape[2] < PREFILL_QUERIES or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    offset = mask.causal_offset(q.shape[2], k.shape[2])
    if offset is None or (first := kernel(q[0], k[0], v[0], offset, scale)) is None:
        return None
    if q.shape[0] == 1:
        return first[None]
    rest = [kernel(q[b], k[b], v[b], offset, scale) for b in range(1, q.shape[0])]
    return torch.stack([first, *rest])  # type: ignore[list-item]  # it took row 0: it takes the same shapes


def _attend_ragged(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    scale: float,
    softcap: float | None,
    prefill_kernel: PrefillKernel | None,
) -> Tensor:
    """Packed rows of different lengths (mask.ragged): q (1, H, N, D), k (R, K, S, D), v (R, K, S, Dv) ->
    (1, H, N, Dv). A run of one-query rows attends as a batch (G, H, 1, D); a longer row alone (1, H, T, D)."""
    outs = []
    for rows, queries, sub in mask.row_groups():
        G = rows.stop - rows.start
        qg = q[:, :, queries]  # (1, H, G T, D)
        if G > 1:
            qg = qg.transpose(0, 2)  # (G, H, 1, D)
        out, _ = attend(
            qg, k[rows], v[rows], sub, scale, softcap=softcap, prefill_kernel=prefill_kernel
        )  # (G, H, T, Dv)
        outs.append(out.transpose(0, 2) if G > 1 else out)  # (1, H, G T, Dv)
    return torch.cat(outs, dim=2)


def _heads_first(k: Tensor) -> bool:
    """Keys stored (K, B', S, D) and viewed as (B, K, S, D), B <= B' (a paged cache's gather, or some of its rows):
    each (row, head) pair's slots are one run of memory, and rows lie closer together than heads."""
    B, K, S, D = k.shape
    return B > 1 and K > 1 and k.stride(3) == 1 and k.stride(2) == D and k.stride(0) == S * D < k.stride(1)


def _one_query(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, softcap: float | None = None
) -> Tensor:
    """Decoding: one query per row attends to every cached key it may see, with two small grouped matmuls. They
    trace into the compiled decode step as one graph, where SDPA with shared kv heads does not (BENCHMARKS.md has
    the measurement), and they read a paged cache's heads-first keys without a copy. Eager decoding otherwise takes
    SDPA, one call instead of about a dozen (178 -> 46 us a layer at one row and 100 keys on the 2-core CPU).
    q (B, H, 1, D), k (B, K, S, D), v (B, K, S, Dv) -> (B, H, 1, Dv)."""
    B, H, _, D = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, H // K, D)  # (B, K, G, D): the query heads that share each kv head
    allowed = mask.dense(1, S, q.device)  # (B | 1, 1, 1, S) or None
    visible = None if allowed is None else allowed[:, :, 0, :].unsqueeze(2)  # (B | 1, 1, 1, S)
    heads_first = _heads_first(k)
    if heads_first:  # keys stored (K, B, S, D) (a paged cache's gather): attend in that order, copying no key
        qg, k, v = qg.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        visible = None if visible is None else visible.transpose(0, 1)
    scores = soft_cap((qg @ k.transpose(-1, -2)).float() * scale, softcap)  # (B, K, G, S), or (K, B, G, S)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if visible is not None:  # a row with no visible key gives zeros, as SDPA does
        weights = weights.masked_fill(~visible.any(-1, keepdim=True), 0.0)
    out = weights.to(v.dtype) @ v  # (B, K, G, Dv), or (K, B, G, Dv)
    return (out.transpose(0, 1) if heads_first else out).reshape(B, H, 1, -1)


def gather_keys(x: Tensor, index: Tensor) -> Tensor:
    """Per query, gather its selected key slots. x (B, K, S, D), index (B, T, n) -> (B, K, T, n, D)."""
    B, K, _, D = x.shape
    _, T, n = index.shape
    flat = index.reshape(B, 1, T * n, 1).expand(B, K, T * n, D)
    return x.gather(2, flat).view(B, K, T, n, D)


def attend_selected(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    valid: Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Attention of each query over its own n selected keys only (gathered, not masked out of all S).

    q (B, H, T, D), k (B, K, S, D), v (B, K, S, Dv), index (B, T, n) long key slots, valid (B, T, n) bool
    -> out (B, H, T, Dv), weights (B, H, T, n) over the selected keys.
    """
    B, H, T, _ = q.shape
    K = k.shape[1]
    k_sel, v_sel = gather_keys(k, index), gather_keys(v, index)  # (B, K, T, n, D), (B, K, T, n, Dv)
    qg = q.view(B, K, H // K, T, -1)  # (B, K, G, T, D)
    scores = torch.einsum("bkgtd,bktnd->bkgtn", qg, k_sel) * scale  # (B, K, G, T, n)
    weights = _softmax_rows(scores, valid[:, None, None])
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = torch.einsum("bkgtn,bktnd->bkgtd", dropped.to(v.dtype), v_sel)  # (B, K, G, T, Dv)
    return out.reshape(B, H, T, -1), weights.reshape(B, H, T, -1)
