"""Quantizing float rows to llama.cpp's K-quants (Q2_K ... Q6_K), by its reference rules (ggml-quants.c's
quantize_row_q2_K_ref ... _q6_K_ref), which `llama-quantize` runs when it has no importance matrix.

A super-block of 256 weights is cut into sub-blocks (32 weights for Q4_K and Q5_K, 16 for Q2_K, Q3_K and Q6_K). Each
sub-block's scale (and min) is searched for first, in float32:

- Q4_K / Q5_K / Q2_K (`_scale_and_min`, make_qkx2_quants): codes 0..nmax with w = scale q - min. Start from the
  sub-block's range, then try 21 (Q4_K) or 16 (Q5_K, Q2_K) stretched grids; for each, the least-squares scale and
  min of those codes, weighted by av + |x| (av the sub-block's root mean square; Q2_K: |x|); keep the one of least
  weighted error (squared; Q2_K: absolute).
- Q6_K (`_signed_scale`, make_qx_quants): codes -32..31 with w = scale q. Start from the largest magnitude, try 18
  grids around it, keep the one whose least-squares fit (weights x^2) explains most.
- Q3_K (`_q3_search`, make_q3_quants): codes -4..3 from the largest magnitude's grid, then up to 5 passes that move
  one code at a time to the level its least-squares fit (weights x^2) asks for, where the fit then explains more.

Then the super-block's sub-block scales are themselves quantized (6 bits against an fp16 d, and 6-bit mins against
an fp16 dmin; 4-bit scales and mins for Q2_K; signed 6-bit scales for Q3_K; int8 against d for Q6_K), and every
weight is coded again against its sub-block's rounded scale.

Every sum runs in the order of the C loops (`_ordered_sum`), every product and quotient is one float32 operation,
and the square root is correctly rounded (torch's float32 sqrt is sometimes an ulp off: it is taken in float64),
because near ties between candidate scales make the chosen one depend on the last bit. The bytes are
`llama-quantize`'s: every block of every tensor of a Qwen2.5-1.5B-shaped file in Q4_K_M, Q5_K_M and Q2_K
(bench/quantize_bench.py; tests/quant/test_kquants.py keeps 32 blocks of each type).

This module is the reference, and the path where llmkit's C++ extension does not run: cpu_kquants.cpp computes the
same bytes (tested equal) several times faster (on 2 Zen 4 cores, 7.6 / 1.4 / 8.8 us a super-block of Q2_K / Q3_K /
Q4_K against 30 / 13 / 33 here), which blocks.quantize_blocks takes where it can.
"""

from __future__ import annotations

import torch
from torch import Tensor

QK_K = 256
EPS = 1e-15  # ggml's GROUP_MAX_EPS: a group whose largest magnitude is below it is all zeros
CHUNK = 1 << 16  # super-blocks quantized at a time (their float32 work arrays stay a few MB)


def _f32(v: float) -> Tensor:
    """A float32 scalar, so that arithmetic on it rounds as C's float does (a Python float is a double)."""
    return torch.tensor(v, dtype=torch.float32)


def _ordered_sum(t: Tensor) -> Tensor:
    """(n, B) -> (B,): t[0] + t[1] + ... + t[n-1] in that order, each addition rounded to float32 (C's `s += t[i]`;
    torch.sum adds in another order, which changes the last bits and, near ties, the scales chosen)."""
    s = t[0].clone()
    for i in range(1, t.shape[0]):
        s.add_(t[i])
    return s


def _nearest(v: Tensor) -> Tensor:
    """ggml's nearest_int: round half to even (it adds 1.5 * 2^23), as torch.round does."""
    return torch.round(v)


def _fp16(v: Tensor) -> tuple[Tensor, Tensor]:
    """v rounded to fp16 and back (the stored d), and the fp16 values."""
    h = v.to(torch.float16)
    return h.float(), h


def _error(w: Tensor, diff: Tensor, mad: bool) -> Tensor:
    """make_qkx2_quants' weighted error: sum w |diff| (use_mad, Q2_K's) or sum w diff^2, in the C loop's order."""
    return _ordered_sum(w * (diff.abs() if mad else diff * diff))


def _scale_and_min(
    x: Tensor, w: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, mad: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """make_qkx2_quants over sub-blocks x, w (n, B) (inputs first): -> scale (B,), min (B,) (positive: subtracted),
    codes (n, B) in 0..nmax. `mad`: the error weighs absolute differences, not squared ones."""
    lo = torch.clamp(x.amin(0), max=0.0)
    hi = x.amax(0)
    flat = hi == lo  # all weights equal (and not above zero): codes 0, the min their value
    first_min = lo
    width = torch.where(flat, torch.ones_like(hi), hi - lo)
    sum_w = _ordered_sum(w)
    sum_x = _ordered_sum(w * x)
    iscale = _f32(nmax) / width
    scale = _f32(1.0) / iscale
    codes = torch.clamp(_nearest(iscale * (x - lo)), 0, nmax)
    best = _error(w, scale * codes + lo - x, mad)
    for step in range(nstep + 1):  # each grid spans max - min for the best min so far (the C code reuses `min`)
        width = torch.where(flat, torch.ones_like(hi), hi - lo)
        iscale = ((_f32(rmin) + _f32(rdelta) * _f32(step)) + _f32(nmax)) / width
        trial = torch.clamp(_nearest(iscale * (x - lo)), 0, nmax)
        wl = w * trial
        sum_l, sum_l2, sum_xl = _ordered_sum(wl), _ordered_sum(wl * trial), _ordered_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clipped = this_min > 0
        this_scale = torch.where(clipped, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), this_scale)
        this_min = torch.where(clipped, torch.zeros_like(this_min), this_min)
        error = _error(w, this_scale * trial + this_min - x, mad)
        better = ok & (error < best) & ~flat
        codes = torch.where(better, trial, codes)
        best = torch.where(better, error, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    codes = torch.where(flat, torch.zeros_like(codes), codes)
    return scale, -torch.where(flat, first_min, lo), codes


def _signed_scale(x: Tensor, nmax: int, w: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """make_qx_quants with rmse_type 1 over sub-blocks x (n, B): -> scale (B,), codes (n, B) in 0..2 nmax - 1
    (w = scale (code - nmax)). The fits are weighted by `w` (n, B) where given (an importance matrix's), else x^2."""
    peak = torch.gather(x, 0, x.abs().argmax(0, keepdim=True))[0]  # the first of largest magnitude, its sign kept
    zero = peak.abs() < EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    w = x * x if w is None else w

    def fit(iscale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        levels = torch.clamp(_nearest(iscale * x), -nmax, nmax - 1)
        return levels, _ordered_sum(w * x * levels), _ordered_sum(w * levels * levels)

    levels, sum_lx, sum_l2 = fit(_f32(-nmax) / peak)
    scale = torch.where(sum_l2 != 0, sum_lx / torch.where(sum_l2 != 0, sum_l2, torch.ones_like(sum_l2)), 0.0)
    best = scale * sum_lx
    for step in (*range(-9, 0), *range(1, 10)):
        trial, sum_lx, sum_l2 = fit(-(_f32(nmax) + _f32(0.1) * _f32(step)) / peak)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        levels = torch.where(better, trial, levels)
        scale = torch.where(better, sum_lx / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), scale)
        best = torch.where(better, scale * sum_lx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    levels = torch.where(zero, torch.full_like(levels, -nmax), levels)
    return scale, levels + nmax


def _q3_search(x: Tensor) -> tuple[Tensor, Tensor]:
    """make_q3_quants(16, 4, ., rmse) over sub-blocks x (16, B): -> scale (B,), codes (16, B) in 0..7 (w = scale
    (code - 4); all 0 for an all-zero sub-block). From the largest magnitude's grid, up to 5 passes move one code at
    a time to the level its least-squares fit (weights x^2) asks for, kept where the fit then explains more."""
    nmax = 4
    peak = torch.gather(x, 0, x.abs().argmax(0, keepdim=True))[0]
    zero = peak.abs() < EPS
    iscale = _f32(-nmax) / torch.where(zero, 1.0, peak)
    levels = torch.clamp(_nearest(iscale * x), -nmax, nmax - 1)
    w = x * x
    sum_lx, sum_l2 = _ordered_sum(w * x * levels), _ordered_sum(w * levels * levels)
    for _ in range(5):  # (C stops after a pass that changes nothing: the passes after it change nothing either)
        for i in range(x.shape[0]):
            wi, xi, li = w[i], x[i], levels[i]
            slx = sum_lx - wi * xi * li
            sl2 = sum_l2 - wi * li * li
            fits = slx > 0
            new = torch.clamp(_nearest(xi * sl2 / torch.where(fits, slx, 1.0)), -nmax, nmax - 1)
            slx, sl2 = slx + wi * xi * new, sl2 + wi * new * new
            take = fits & (new != li) & (sl2 > 0) & (slx * slx * sum_l2 > sum_lx * sum_lx * sl2)
            levels[i] = torch.where(take, new, li)
            sum_lx, sum_l2 = torch.where(take, slx, sum_lx), torch.where(take, sl2, sum_l2)
    scale = torch.where(sum_l2 > 0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1.0), 0.0)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0.0, levels + nmax)


def _pack_2bit(q: Tensor) -> Tensor:
    """(B, 256) 2-bit codes -> (B, 64) bytes: per half of 128, byte l holds codes l, l + 32, l + 64, l + 96."""
    q = q.reshape(-1, 2, 4, 32).to(torch.int32)
    return (q << (2 * torch.arange(4, dtype=torch.int32))[:, None]).sum(2).reshape(-1, 64).to(torch.uint8)


def _q2_k(x: Tensor) -> Tensor:
    B = x.shape[0]
    sub = x.reshape(B * 16, 16).T.contiguous()  # (16, B 16)
    scales, mins, codes = _scale_and_min(sub, sub.abs(), 3, -0.5, 0.1, 15, mad=True)
    scales, mins = scales.reshape(B, 16), mins.reshape(B, 16)
    max_scale = torch.where(scales.amax(1) > 0, scales.amax(1), 0.0)
    max_min = torch.where(mins.amax(1) > 0, mins.amax(1), 0.0)
    inv_scale = torch.where(max_scale > 0, _f32(15.0) / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_min = torch.where(max_min > 0, _f32(15.0) / torch.where(max_min > 0, max_min, 1.0), 0.0)
    # a byte per sub-block: its 4-bit scale, the 4-bit min above it (C's int -> uint8 stores wrap)
    ls = _nearest(inv_scale[:, None] * scales).to(torch.int32)
    lm = _nearest(inv_min[:, None] * mins).to(torch.int32)
    packed = (ls | (lm << 4)) & 255
    return _pack_q2_k(x, packed, _fp16(max_scale / _f32(15.0))[1], _fp16(max_min / _f32(15.0))[1], codes)


def _pack_q2_k(x: Tensor, packed: Tensor, d16: Tensor, dmin16: Tensor, codes: Tensor) -> Tensor:
    """Q2_K's bytes for super-blocks x (B, 256) whose sub-blocks have the scale and min bytes `packed` (B, 16), every
    weight coded again against them (a sub-block whose scale is 0 keeps its searched codes (16, B 16))."""
    B = x.shape[0]
    d, dmin = d16.float(), dmin16.float()
    sub_d, sub_m = d[:, None] * (packed & 15).float(), dmin[:, None] * (packed >> 4).float()
    xs = x.reshape(B, 16, 16)
    again = torch.clamp(_nearest((xs + sub_m[..., None]) / torch.where(sub_d != 0, sub_d, 1.0)[..., None]), 0, 3)
    q = torch.where((sub_d != 0)[..., None], again, codes.T.reshape(B, 16, 16)).reshape(B, QK_K)
    return torch.cat((packed.to(torch.uint8), _pack_2bit(q), _halves(d16), _halves(dmin16)), dim=1)


def _q3_k(x: Tensor) -> Tensor:
    B = x.shape[0]
    sub = x.reshape(B * 16, 16).T.contiguous()  # (16, B 16)
    scales, codes = _q3_search(sub)
    scales = scales.reshape(B, 16)
    peak = torch.gather(scales, 1, scales.abs().argmax(1, keepdim=True))[:, 0]  # the first largest, sign kept
    some = peak != 0
    iscale = _f32(-32.0) / torch.where(some, peak, 1.0)
    l = torch.clamp(_nearest(iscale[:, None] * scales), -32, 31).to(torch.int32) + 32  # (B, 16) in 0..63
    l = torch.where(some[:, None], l, 0)
    return _pack_q3_k(x, l, _fp16(torch.where(some, _f32(1.0) / iscale, 0.0))[1], codes)


def _pack_q3_k(x: Tensor, l: Tensor, d16: Tensor, codes: Tensor) -> Tensor:
    """Q3_K's bytes for super-blocks x (B, 256) whose sub-blocks have the 6-bit scales `l` (B, 16, 0..63 for -32..31)
    against d16, every weight coded again against them (a sub-block whose scale is 0 keeps its searched codes)."""
    B = x.shape[0]
    packed = torch.zeros(B, 12, dtype=torch.int32)  # low nibbles of scales 0-7, then 8-15 above them; top 2 bits
    packed[:, :8] = (l[:, :8] & 15) | ((l[:, 8:] & 15) << 4)
    top = l >> 4
    packed[:, 8:] = top[:, 0:4] | (top[:, 4:8] << 2) | (top[:, 8:12] << 4) | (top[:, 12:16] << 6)
    sub_d = d16.float()[:, None] * (l - 32).float()  # (the stored scales: all 0 bytes read back as -32, times d = 0)
    xs = x.reshape(B, 16, 16)
    again = torch.clamp(_nearest(xs / torch.where(sub_d != 0, sub_d, 1.0)[..., None]), -4, 3) + 4
    q = torch.where((sub_d != 0)[..., None], again, codes.T.reshape(B, 16, 16)).reshape(B, QK_K).to(torch.int32)
    high = (q > 3).to(torch.int32)  # the high bit of weight j: bit j // 32 of hmask[j % 32]
    hmask = (high.reshape(B, 8, 32) << torch.arange(8, dtype=torch.int32)[:, None]).sum(1).to(torch.uint8)
    return torch.cat((hmask, _pack_2bit(q - 4 * high), packed.to(torch.uint8), _halves(d16)), dim=1)


def _halves(h: Tensor) -> Tensor:
    """(B,) float16 -> (B, 2) uint8, little-endian."""
    v = h.view(torch.int16).to(torch.int32)
    return torch.stack((v & 255, (v >> 8) & 255), dim=-1).to(torch.uint8)


def _pack_scales_k4(ls: Tensor, lm: Tensor) -> Tensor:
    """Q4_K's / Q5_K's 12 bytes from 8 six-bit scales and mins (B, 8): bytes 0-3 scales 0-3, bytes 4-7 mins 0-3 (their
    top 2 bits carry scales / mins 4-7's high bits), bytes 8-11 the low nibbles of scale and min 4-7."""
    out = torch.zeros(ls.shape[0], 12, dtype=torch.int32)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return out.to(torch.uint8)


def _k4(x: Tensor, nmax: int, rmin: float, nstep: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The part Q4_K and Q5_K share, for super-blocks x (B, 256): -> fp16 d and dmin (B,), 12 scale bytes (B, 12),
    codes (B, 256) in 0..nmax."""
    B = x.shape[0]
    sub = x.reshape(B * 8, 32).T.contiguous()  # (32, B 8): a sub-block per column
    # sqrtf is correctly rounded; torch's float32 sqrt is not always (an ulp off): in float64, then rounded
    av = torch.sqrt((_ordered_sum(sub * sub) / _f32(32.0)).double()).float()
    weights = av + sub.abs()
    scales, mins, codes = _scale_and_min(sub, weights, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(B, 8), mins.reshape(B, 8)
    # C's running maxima start at +0 and take only larger values: -0.0 (an all-zero sub-block's min) stays +0
    max_scale = torch.where(scales.amax(1) > 0, scales.amax(1), 0.0)
    max_min = torch.where(mins.amax(1) > 0, mins.amax(1), 0.0)
    inv_scale = torch.where(max_scale > 0, _f32(63.0) / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_min = torch.where(max_min > 0, _f32(63.0) / torch.where(max_min > 0, max_min, 1.0), 0.0)
    # C stores nearest_int's result in a uint8 before MIN(63, .): a negative one wraps
    ls = torch.clamp(_nearest(inv_scale[:, None] * scales).to(torch.int32) & 255, max=63)
    lm = torch.clamp(_nearest(inv_min[:, None] * mins).to(torch.int32) & 255, max=63)
    d16, dmin16 = _fp16(max_scale / _f32(63.0))[1], _fp16(max_min / _f32(63.0))[1]
    return d16, dmin16, _pack_scales_k4(ls, lm), _k4_codes(x, d16, dmin16, ls, lm, codes, nmax)


def _k4_codes(x: Tensor, d16: Tensor, dmin16: Tensor, ls: Tensor, lm: Tensor, codes: Tensor, nmax: int) -> Tensor:
    """Every weight of super-blocks x (B, 256) coded again against its sub-block's stored scale d ls and min dmin lm
    (B, 8); a sub-block whose scale is 0 keeps its searched codes (32, B 8). -> (B, 256) uint8."""
    B = x.shape[0]
    sub_d = d16.float()[:, None] * ls.float()  # (B, 8)
    sub_m = dmin16.float()[:, None] * lm.float()
    xs = x.reshape(B, 8, 32)
    safe = torch.where(sub_d != 0, sub_d, 1.0)[..., None]
    again = torch.clamp(_nearest((xs + sub_m[..., None]) / safe), 0, nmax)
    codes = torch.where((sub_d != 0)[..., None], again, codes.T.reshape(B, 8, 32))
    return codes.reshape(B, QK_K).to(torch.uint8)


def _pack_q4_k(d16: Tensor, dmin16: Tensor, scales: Tensor, q: Tensor) -> Tensor:
    q = q.reshape(-1, 4, 2, 32)  # 4 runs of 64 weights: the first 32 in the low nibbles, the next 32 in the high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat((_halves(d16), _halves(dmin16), scales, qs), dim=1)


def _pack_q5_k(d16: Tensor, dmin16: Tensor, scales: Tensor, q: Tensor) -> Tensor:
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    fifth = (q >> 4).reshape(-1, 8, 32).to(torch.int32)  # the fifth bit of weight 32 u + l is bit u of qh[l]
    qh = (fifth << torch.arange(8, dtype=torch.int32)[:, None]).sum(1).to(torch.uint8)
    return torch.cat((_halves(d16), _halves(dmin16), scales, qh, qs), dim=1)


def _q4_k(x: Tensor) -> Tensor:
    return _pack_q4_k(*_k4(x, 15, -1.0, 20))


def _q5_k(x: Tensor) -> Tensor:
    return _pack_q5_k(*_k4(x, 31, -0.5, 15))


def _q6_k(x: Tensor, w: Tensor | None = None) -> Tensor:
    """Super-blocks x (B, 256) -> (B, 210); `w` (B, 256): the fits' weights (an importance matrix's), else x^2."""
    B = x.shape[0]
    sub = x.reshape(B * 16, 16).T.contiguous()  # (16, B 16)
    scales, codes = _signed_scale(sub, 32, None if w is None else w.reshape(B * 16, 16).T.contiguous())
    scales = scales.reshape(B, 16)
    peak = torch.gather(scales, 1, scales.abs().argmax(1, keepdim=True))[:, 0]
    zero = peak.abs() < EPS
    iscale = _f32(-128.0) / torch.where(zero, 1.0, peak)
    d, d16 = _fp16(_f32(1.0) / iscale)
    ls = torch.clamp(_nearest(iscale[:, None] * scales), max=127)  # (B, 16), in -128..127
    sub_d = d[:, None] * ls
    xs = x.reshape(B, 16, 16)
    again = torch.clamp(_nearest(xs / torch.where(sub_d != 0, sub_d, 1.0)[..., None]), -32, 31) + 32
    q = torch.where((sub_d != 0)[..., None], again, codes.T.reshape(B, 16, 16)).reshape(B, 2, 4, 32).to(torch.int32)
    # weight 128 h + 32 p + l: low nibble in ql[h][p % 2][l] (p // 2 picks the nibble), 2 high bits at 2 p of qh[h][l]
    ql = torch.stack(((q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)), 2)
    qh = ((q >> 4) << (2 * torch.arange(4, dtype=torch.int32))[:, None]).sum(2)
    out = torch.cat(
        (
            ql.reshape(B, 128).to(torch.uint8),
            qh.reshape(B, 64).to(torch.uint8),
            ls.to(torch.int8).view(torch.uint8),
            _halves(d16),
        ),
        dim=1,
    )
    return torch.where(zero[:, None], torch.zeros_like(out), out)


QUANTIZE = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


@torch.no_grad()
def quantize_k(x: Tensor, name: str) -> Tensor:
    """Super-blocks x (B, 256) float32 -> (B, bytes) uint8 blocks of K-quant `name`, CHUNK super-blocks at a time."""
    fn = QUANTIZE[name]
    return torch.cat([fn(part.contiguous()) for part in x.split(CHUNK)]) if x.shape[0] else x.new_empty(0, 0).byte()
