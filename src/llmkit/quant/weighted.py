"""Quantizing with an importance matrix, by llama.cpp's rules (ggml-quants.c's quantize_row_*_impl, which
`llama-quantize --imatrix` runs): the same block formats, but each weight's error counts in proportion to how large
its input is on real text (llmkit.interop.imatrix collects that), so the scales fit the weights that matter.

The importance of input column j, qw[j], is the mean of x_j^2 over the calibration tokens. A weight's own weight in
a fit is qw[j] sqrt(sigma2 + w^2), sigma2 a mean square of the weights around it (2/256 of the super-block's sum
of squares for the K-quants and IQ4_XS, 2/32 of the block's for IQ4_NL, 1/K of the whole row's for the 32-weight
types). Per type:

- Q4_K / Q5_K: each sub-block of 32 by make_qkx3_quants (kquants._scale_and_min with those weights, finer grids:
  37 steps of 0.05 from -0.9), then the 8 sub-block scales and the 8 mins by make_qp_quants (`_qp`, below: 6-bit
  codes against one scale, each weighted by its sub-block's summed weights, refined one code at a time), where the
  plain rule takes the largest over 63.
- Q6_K: make_qx_quants weighted by qw itself (no sigma2: ggml's line is commented out), the rest as without.
- IQ4_NL / IQ4_XS: the plain search (iquants.py) with those weights in place of x^2.
- Q4_0 / Q5_0: make_qx_quants (kquants._signed_scale) with those weights; Q4_1 / Q5_1: make_qkx3_quants. The codes
  are the search's own (not coded again against the fp16 scale), as ggml stores them.
- Q2_K: each sub-block of 16 by make_qkx3_quants (squared errors; sigma2 1/256 of the sum of squares), then the 16
  scales and the 16 mins by make_qp_quants in 4 bits. Q3_K: each sub-block by make_qx_quants with those weights, the
  16 scales by make_qx_quants weighted by their sub-blocks' summed weights.
- Q8_0, F16, BF16: the importance is not used (as in llama.cpp).

As in kquants.py every sum runs in the C loop's order and every operation rounds to float32, so that the bytes are
`llama-quantize --imatrix`'s (tests/quant/test_imatrix.py keeps blocks it wrote).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.quant import iquants, native
from llmkit.quant.kquants import (
    CHUNK,
    EPS,
    QK_K,
    _f32,
    _fp16,
    _halves,
    _k4_codes,
    _nearest,
    _ordered_sum,
    _pack_q2_k,
    _pack_q3_k,
    _pack_q4_k,
    _pack_q5_k,
    _pack_scales_k4,
    _q6_k,
    _scale_and_min,
    _signed_scale,
)

# the types the importance shapes, and those that ignore it (as llama.cpp's do)
WEIGHTED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
UNWEIGHTED = ("Q8_0", "F16", "BF16")


def _sqrt(v: Tensor) -> Tensor:
    """sqrtf, correctly rounded (in float64, then float32: torch's float32 sqrt is sometimes an ulp off)."""
    return torch.sqrt(v.double()).float()


def _weights(x: Tensor, qw: Tensor, sigma2: Tensor) -> Tensor:
    """qw sqrt(sigma2 + x^2), each operation in float32 (sigma2 broadcast over x)."""
    return qw * _sqrt(sigma2 + x * x)


def _qp(x: Tensor, w: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """make_qp_quants over groups x (n, B) of non-negative values (sub-block scales or mins) weighted by w (n, B):
    -> scale (B,), codes (n, B) in 0..nmax with x ~ scale * code. From the largest value's grid and 8 grids around
    it (kept where the weighted squared error is smaller), then up to 5 passes that move one code at a time to what
    the least-squares fit of the others asks for, kept where the fit then explains more."""
    top = torch.clamp(x.amax(0), min=0.0)
    zero = top < EPS
    top = torch.where(zero, torch.ones_like(top), top)
    iscale = _f32(nmax) / top
    scale = _f32(1.0) / iscale
    first = _nearest(iscale * x)
    diff = x - scale * first
    best = _ordered_sum(w * diff * diff)
    for step in (*range(-4, 0), *range(1, 5)):
        trial_iscale = (_f32(0.1) * _f32(step) + _f32(nmax)) / top
        trial_scale = _f32(1.0) / trial_iscale
        diff = x - trial_scale * torch.clamp(_nearest(trial_iscale * x), max=nmax)
        error = _ordered_sum(w * diff * diff)
        better = error < best
        best = torch.where(better, error, best)
        iscale = torch.where(better, trial_iscale, iscale)
    codes = torch.clamp(_nearest(iscale * x), max=nmax)
    sum_lx, sum_l2 = _ordered_sum(w * x * codes), _ordered_sum(w * codes * codes)
    for _ in range(5):  # (C stops after a pass that changes nothing: the passes after it change nothing either)
        for i in range(x.shape[0]):
            wi, xi, li = w[i], x[i], codes[i]
            slx = sum_lx - wi * xi * li
            sl2 = sum_l2 - wi * li * li
            fits = (slx > 0) & (sl2 > 0)
            new = torch.clamp(_nearest(xi * sl2 / torch.where(fits, slx, 1.0)), max=nmax)
            slx, sl2 = slx + wi * xi * new, sl2 + wi * new * new
            take = fits & (new != li) & (slx * slx * sum_l2 > sum_lx * sum_lx * sl2)
            codes[i] = torch.where(take, new, li)
            sum_lx, sum_l2 = torch.where(take, slx, sum_lx), torch.where(take, sl2, sum_l2)
    scale = torch.where(sum_l2 > 0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1.0), 0.0)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0.0, codes)


def _k4(x: Tensor, qw: Tensor, nmax: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """quantize_row_q4_K_impl / _q5_K_impl's scales for super-blocks x, importance qw (B, 256): -> fp16 d, dmin
    (B,), the 12 scale bytes (B, 12), codes (B, 256)."""
    B = x.shape[0]
    sigma2 = _f32(2.0) * _ordered_sum(x.T.contiguous() * x.T.contiguous()) / _f32(QK_K)
    sub = x.reshape(B * 8, 32).T.contiguous()  # (32, B 8): a sub-block per column
    weights = _weights(sub, qw.reshape(B * 8, 32).T.contiguous(), sigma2.repeat_interleave(8))
    sums = _ordered_sum(weights).reshape(B, 8).T.contiguous()  # (8, B)
    scales, mins, codes = _scale_and_min(sub, weights, nmax, -0.9, 0.05, 36)
    d, ls = _qp(scales.reshape(B, 8).T.contiguous(), sums, 63)
    dmin, lm = _qp(mins.reshape(B, 8).T.contiguous(), sums, 63)
    ls, lm = ls.T.to(torch.int32), lm.T.to(torch.int32)
    d16, dmin16 = _fp16(d)[1], _fp16(dmin)[1]
    return d16, dmin16, _pack_scales_k4(ls, lm), _k4_codes(x, d16, dmin16, ls, lm, codes, nmax)


def _q4_k(x: Tensor, qw: Tensor) -> Tensor:
    return _pack_q4_k(*_k4(x, qw, 15))


def _q5_k(x: Tensor, qw: Tensor) -> Tensor:
    return _pack_q5_k(*_k4(x, qw, 31))


def _q2_k(x: Tensor, qw: Tensor) -> Tensor:
    """quantize_row_q2_K_impl: each sub-block of 16 by make_qkx3_quants (squared errors, where the plain rule
    weighs absolute ones by |x|), then the 16 scales and the 16 mins by make_qp_quants in 4 bits; sigma2 is 1/256
    of the super-block's sum of squares (not 2/256)."""
    B = x.shape[0]
    sigma2 = _ordered_sum(x.T.contiguous() * x.T.contiguous()) / _f32(QK_K)
    sub = x.reshape(B * 16, 16).T.contiguous()  # (16, B 16)
    weights = _weights(sub, qw.reshape(B * 16, 16).T.contiguous(), sigma2.repeat_interleave(16))
    sums = _ordered_sum(weights).reshape(B, 16).T.contiguous()  # (16, B)
    scales, mins, codes = _scale_and_min(sub, weights, 3, -0.9, 0.05, 36)
    d, ls = _qp(scales.reshape(B, 16).T.contiguous(), sums, 15)
    dmin, lm = _qp(mins.reshape(B, 16).T.contiguous(), sums, 15)
    packed = (ls.T.to(torch.int32) | (lm.T.to(torch.int32) << 4)) & 255
    return _pack_q2_k(x, packed, _fp16(d)[1], _fp16(dmin)[1], codes)


def _q3_k(x: Tensor, qw: Tensor) -> Tensor:
    """quantize_row_q3_K_impl: each sub-block of 16 by make_qx_quants (codes -4..3) with the weights, then the 16
    scales themselves by make_qx_quants (codes -32..31), weighted by their sub-blocks' summed weights."""
    B = x.shape[0]
    sigma2 = _f32(2.0) * _ordered_sum(x.T.contiguous() * x.T.contiguous()) / _f32(QK_K)
    sub = x.reshape(B * 16, 16).T.contiguous()  # (16, B 16)
    weights = _weights(sub, qw.reshape(B * 16, 16).T.contiguous(), sigma2.repeat_interleave(16))
    sums = _ordered_sum(weights).reshape(B, 16).T.contiguous()  # (16, B)
    scales, codes = _signed_scale(sub, 4, weights)
    d, ls = _signed_scale(scales.reshape(B, 16).T.contiguous(), 32, sums)
    return _pack_q3_k(x, ls.T.to(torch.int32), _fp16(d)[1], codes)


def _q6_k_weighted(x: Tensor, qw: Tensor) -> Tensor:
    return _q6_k(x, qw)


def _iq4_nl(x: Tensor, qw: Tensor) -> Tensor:
    """Blocks x (B, 32) -> (B, 18)."""
    sigma2 = _ordered_sum(x.T.contiguous() * x.T.contiguous()) * _f32(2.0 / 32)
    w = _weights(x, qw, sigma2[:, None])
    d = iquants._block_scales(x.t(), w.t())
    codes = iquants._nearest_level(iquants._inverse(d)[:, None] * x)
    return torch.cat((_halves(_fp16(d)[1]), iquants._pack(codes)), dim=1)


def _iq4_xs(x: Tensor, qw: Tensor) -> Tensor:
    """Super-blocks x (B, 256) -> (B, 136)."""
    B = x.shape[0]
    sigma2 = _ordered_sum(x.T.contiguous() * x.T.contiguous()) * _f32(2.0 / QK_K)
    w = _weights(x, qw, sigma2[:, None]).reshape(B * 8, 32)
    scales = iquants._block_scales(x.reshape(B * 8, 32).t(), w.t()).reshape(B, 8)
    return iquants._iq4_xs_pack(x, scales)


def _row_sigma2(x: Tensor, blocks_per_row: int) -> Tensor:
    """The 32-weight types' sigma2: each row's sum of squares over its width, one per block (N blocks_per_row,)."""
    rows = x.reshape(-1, blocks_per_row * 32)
    return (_ordered_sum(rows.T.contiguous() * rows.T.contiguous()) / _f32(rows.shape[1])).repeat_interleave(
        blocks_per_row
    )


def _symmetric(x: Tensor, qw: Tensor, sigma2: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """Q4_0 / Q5_0: blocks x (B, 32) -> fp16 d (B,), codes (B, 32) in 0..2 nmax - 1."""
    w = _weights(x, qw, sigma2[:, None])
    d, codes = _signed_scale(x.T.contiguous(), nmax, w.T.contiguous())
    return _fp16(d)[1], codes.T


def _asymmetric(x: Tensor, qw: Tensor, sigma2: Tensor, nmax: int) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_1 / Q5_1: blocks x (B, 32) -> fp16 d and m (B,), codes (B, 32) in 0..nmax (w = d q + m)."""
    w = _weights(x, qw, sigma2[:, None])
    d, minus, codes = _scale_and_min(x.T.contiguous(), w.T.contiguous(), nmax, -0.9, 0.05, 36)
    return _fp16(d)[1], _fp16(-minus)[1], codes.T


def _nibbles(codes: Tensor) -> Tensor:
    c = codes.to(torch.uint8)
    return (c[:, :16] & 15) | ((c[:, 16:] & 15) << 4)


def _fifth(codes: Tensor) -> Tensor:
    """(B, 32) codes -> (B, 4) bytes: bit j of the little-endian word is code j's bit 4."""
    bits = ((codes.to(torch.int64) >> 4) & 1).reshape(-1, 4, 8)
    return (bits << torch.arange(8)).sum(-1).to(torch.uint8)


def _q4_0(x: Tensor, qw: Tensor, sigma2: Tensor) -> Tensor:
    d, codes = _symmetric(x, qw, sigma2, 8)
    return torch.cat((_halves(d), _nibbles(codes)), dim=1)


def _q5_0(x: Tensor, qw: Tensor, sigma2: Tensor) -> Tensor:
    d, codes = _symmetric(x, qw, sigma2, 16)
    return torch.cat((_halves(d), _fifth(codes), _nibbles(codes)), dim=1)


def _q4_1(x: Tensor, qw: Tensor, sigma2: Tensor) -> Tensor:
    d, m, codes = _asymmetric(x, qw, sigma2, 15)
    return torch.cat((_halves(d), _halves(m), _nibbles(codes)), dim=1)


def _q5_1(x: Tensor, qw: Tensor, sigma2: Tensor) -> Tensor:
    d, m, codes = _asymmetric(x, qw, sigma2, 31)
    return torch.cat((_halves(d), _halves(m), _fifth(codes), _nibbles(codes)), dim=1)


SUPER = {  # units of 256 weights
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k_weighted, "IQ4_XS": _iq4_xs,
}  # fmt: skip
BLOCK = {"IQ4_NL": _iq4_nl}  # units of 32, no row-wide sigma2
ROW = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1}  # units of 32, sigma2 over the row


GGML = {  # ggml's type numbers, cpu_kquants.cpp's `kind`
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
    "IQ4_NL": 20, "IQ4_XS": 23,
}  # fmt: skip


@torch.no_grad()
def quantize_weighted(w: Tensor, name: str, importance: Tensor) -> Tensor:
    """Float rows w (N, K) and the importance of each of their K inputs -> (N, row bytes) uint8 blocks of type
    `name` (one of WEIGHTED), by llama.cpp's rules with an importance matrix: by cpu_kquants.cpp (the same bytes,
    tested equal) where llmkit's C++ extension runs, else here, rows a chunk at a time."""
    x = w.detach().float().cpu().contiguous()
    ext = native.module()
    if ext is not None:
        return ext.quantize_weighted(x, GGML[name], importance.detach().float().cpu().contiguous())
    return quantize_weighted_reference(x, name, importance)


@torch.no_grad()
def quantize_weighted_reference(x: Tensor, name: str, importance: Tensor) -> Tensor:
    """quantize_weighted in PyTorch (x (N, K) float32)."""
    N, K = x.shape
    qw = importance.detach().float().cpu().reshape(1, K)
    unit = QK_K if name in SUPER else 32
    rows = max(1, CHUNK * unit // K)
    out = []
    for r in range(0, N, rows):
        part = x[r : r + rows].contiguous()
        n = part.shape[0]
        units, weights = part.reshape(-1, unit), qw.expand(n, K).reshape(-1, unit)
        if name in SUPER:
            blocks = SUPER[name](units, weights)
        elif name in BLOCK:
            blocks = BLOCK[name](units, weights)
        else:
            blocks = ROW[name](units, weights, _row_sigma2(units, K // 32))
        out.append(blocks.reshape(n, -1))
    return torch.cat(out) if out else x.new_empty(0, 0).byte()
