"""Quantizing float rows to IQ4_NL and IQ4_XS, by llama.cpp's rules (ggml-quants.c's quantize_row_iq4_nl_impl, as
quantize_iq4_nl and quantize_iq4_xs call it from `llama-quantize` without an importance matrix: 7 tries).

Both types code each weight as one of 16 non-uniform levels T (blocks.KVALUES, -127 .. 113) times a scale per 32
weights. For each block of 32:

1. The weights' importance is x^2. The largest magnitude `max` (its sign kept) gives a first scale d = max / 127
   (so that max lands on the level -127, whose magnitude is the largest); every weight takes the level nearest
   x / d (`_nearest_level`, ggml's best_index_int8), and d becomes the least-squares fit of those levels,
   d = sum w q x / sum w q^2.
2. Fifteen more grids, 1 / d = (t - 127) / max for t = -7 .. 7: each one's least-squares d is kept if it explains
   more (sum w q x)^2 / sum w q^2 than the best so far.

IQ4_NL stores that d as fp16 and the levels against the float d. IQ4_XS stores, per 256 weights, one fp16 d =
-(the block scale of largest magnitude) / 32 and each block's scale as a 6-bit integer l in -32..31 (d l), then codes
the weights again against d l.

As in kquants.py, every sum runs in the order of the C loops, every product and quotient is one float32 operation
(C evaluates w*q*x as (w*q)*x), so that near ties pick what llama.cpp picks: the bytes are `llama-quantize`'s
(tests/quant/test_kquants.py keeps blocks of each type that it wrote).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.quant.kquants import CHUNK, EPS, QK_K, _f32, _fp16, _halves, _nearest, _ordered_sum

LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl
TRIES = 7


def _levels() -> Tensor:
    return torch.tensor(LEVELS, dtype=torch.float32)


def _nearest_level(v: Tensor) -> Tensor:
    """best_index_int8: the index of the level nearest v, the lower one on a tie (v - T[l] < T[l+1] - v, in float32)."""
    t = _levels()
    upper = torch.searchsorted(t, v.contiguous(), right=True).clamp(1, len(LEVELS) - 1)  # first level above v
    lower = upper - 1
    pick = torch.where(v - t[lower] < t[upper] - v, lower, upper)
    return torch.where(v <= t[0], 0, torch.where(v >= t[-1], len(LEVELS) - 1, pick))


def _fit(x: Tensor, w: Tensor, inverse: Tensor) -> tuple[Tensor, Tensor]:
    """sum w q x and sum w q^2 over a block (inputs first, (32, B)) for the levels nearest inverse * x."""
    q = _levels()[_nearest_level(inverse * x)]
    wq = w * q
    return _ordered_sum(wq * x), _ordered_sum(wq * q)


def _block_scales(x: Tensor, w: Tensor | None = None) -> Tensor:
    """x (32, B): each block's least-squares scale d (0 for a block below EPS), after the 15 tries; the fits
    weighted by `w` (32, B) where given (an importance matrix's), else by x^2."""
    x = x.contiguous()  # (each sum's terms are rows: contiguous)
    w = x * x if w is None else w.contiguous()
    arg = x.abs().argmax(0)  # (the first of equal magnitudes, as the C loop's strict >)
    top = x.gather(0, arg[None])[0]
    zero = top.abs() < EPS
    top = torch.where(zero, torch.ones_like(top), top)
    d = -top / _f32(LEVELS[0])
    sumqx, sumq2 = _fit(x, w, _f32(1.0) / d)
    d = torch.where(sumq2 > 0, sumqx / sumq2, torch.zeros_like(sumqx))
    best = d * sumqx
    for t in range(-TRIES, TRIES + 1):
        sumqx, sumq2 = _fit(x, w, _f32(t + LEVELS[0]) / top)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = torch.where(better, sumqx / sumq2, d)
        best = torch.where(better, d * sumqx, best)
    return torch.where(zero, torch.zeros_like(d), d)


def _inverse(v: Tensor) -> Tensor:
    """1 / v, and 0 where v is 0 (the C code's `v ? 1/v : 0`)."""
    return torch.where(v != 0, _f32(1.0) / torch.where(v != 0, v, torch.ones_like(v)), torch.zeros_like(v))


def _pack(codes: Tensor) -> Tensor:
    """(B, n) level indices -> (B, n / 2) bytes: per 32, code j in byte j's low nibble, code 16 + j in its high one."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _iq4_nl(x: Tensor) -> Tensor:
    """Blocks x (B, 32) -> (B, 18): fp16 d, 16 bytes of codes."""
    d = _block_scales(x.t())
    _, half = _fp16(d)
    codes = _nearest_level(_inverse(d)[:, None] * x)
    return torch.cat((_halves(half), _pack(codes)), dim=1)


def _iq4_xs(x: Tensor) -> Tensor:
    """Super-blocks x (B, 256) -> (B, 136): fp16 d, the 8 blocks' 6-bit scales (2 high bits each in a uint16, the
    low 4 in 4 bytes), 128 bytes of codes."""
    B = x.shape[0]
    return _iq4_xs_pack(x, _block_scales(x.reshape(B * 8, 32).t()).reshape(B, 8))


def _iq4_xs_pack(x: Tensor, scales: Tensor) -> Tensor:
    """IQ4_XS's bytes for super-blocks x (B, 256) whose 8 blocks have the least-squares scales `scales` (B, 8)."""
    B = x.shape[0]
    arg = scales.abs().argmax(1)  # the block scale of largest magnitude (0 if every scale is)
    top = scales.gather(1, arg[:, None])[:, 0]
    d = -top / _f32(32.0)
    _, half = _fp16(d)
    ls = torch.clamp(_nearest(_inverse(d)[:, None] * scales), -32, 31)
    dl = d[:, None] * ls
    codes = _nearest_level((_inverse(dl)[:, :, None] * x.reshape(B, 8, 32)).reshape(B * 8, 32)).reshape(B, 256)
    u = (ls + 32).to(torch.int64)
    high = ((u >> 4) << (2 * torch.arange(8))).sum(1)
    low = (u & 15).reshape(B, 4, 2)
    low_bytes = (low[:, :, 0] | (low[:, :, 1] << 4)).to(torch.uint8)
    high_bytes = torch.stack((high & 255, high >> 8), dim=1).to(torch.uint8)
    return torch.cat((_halves(half), high_bytes, low_bytes, _pack(codes)), dim=1)


QUANTIZE = {"IQ4_NL": (_iq4_nl, 32), "IQ4_XS": (_iq4_xs, QK_K)}


def quantize_iq4(x: Tensor, name: str) -> Tensor:
    """Blocks x (B, 32 for IQ4_NL or 256 for IQ4_XS) float32 -> (B, bytes) uint8 blocks of `name`."""
    fn, _ = QUANTIZE[name]
    if not x.shape[0]:
        return x.new_empty(0, 0).byte()
    return torch.cat([fn(part.contiguous()) for part in x.split(CHUNK)])
