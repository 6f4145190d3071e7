"""Weight formats: how a float matrix becomes int8, int4 or fp8 codes with scales, and back. Pure tensor functions.

int8, symmetric:   w[n, k] ~= q[n, k] * scale[n, g(k)]               q in [-127, 127]
int4, asymmetric:  w[n, k] ~= q[n, k] * scale[n, g(k)] + zero[n, g(k)]    q in [0, 15]
fp8, symmetric:    w[n, k] ~= f[n, k] * scale[n, g(k)]               f an fp8 E4M3 number, |f| <= 448

g(k) = k // group_size is the group of column k; group_size None means one group per output row (per-channel).
int4 codes are stored two to a byte, (N, K // 2) uint8: column 2j in the low nibble, 2j + 1 in the high one. fp8
codes are the bytes of torch.float8_e4m3fn numbers (OCP FP8's E4M3: 1 sign bit, 4 exponent bits of bias 7, 3
mantissa bits, no infinities; the format H100-class GPUs multiply), held as uint8 so that casting a model to bf16
leaves them alone.

llama.cpp's own block formats (a GGUF file's Q4_0 ... Q6_K) are held as stored instead: llmkit.quant.blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.errors import InputError

GGUF_BLOCK = 32


def groups_of(in_features: int, group_size: int | None) -> int:
    """How many scale groups a row of `in_features` has; a group size that does not divide it is an error."""
    if group_size is None:
        return 1
    if group_size < 1 or in_features % group_size:
        raise InputError(f"group_size={group_size} does not divide the input width {in_features}")
    return in_features // group_size


def _grouped(w: Tensor, group_size: int | None) -> Tensor:
    """(N, K) -> (N, G, K // G) float32."""
    N, K = w.shape
    return w.float().reshape(N, groups_of(K, group_size), -1)


def quantize_int8(w: Tensor, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """(N, K) float -> codes (N, K) int8 and scales (N, G) float32, symmetric, rounding to nearest."""
    g = _grouped(w, group_size)
    scale = g.abs().amax(-1) / 127  # (N, G)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale gives zeros
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes (N, K) int8, scales (N, G) -> (N, K) in `dtype`."""
    N, K = q.shape
    return (q.float().reshape(N, scale.shape[1], -1) * scale[..., None]).reshape(N, K).to(dtype)


FP8_MAX = 448.0  # the largest E4M3 number


def quantize_fp8(w: Tensor, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """(N, K) float -> codes (N, K) uint8 (the bytes of float8_e4m3fn numbers) and scales (N, G) float32: each
    group's largest magnitude mapped to 448, every weight rounded to the nearest E4M3 number (ties to even)."""
    g = _grouped(w, group_size)
    scale = g.abs().amax(-1) / FP8_MAX  # (N, G)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    f = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return f.view(torch.uint8).reshape(w.shape), scale


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes (N, K) uint8 (float8_e4m3fn bytes), scales (N, G) -> (N, K) in `dtype`."""
    N, K = q.shape
    f = q.contiguous().view(torch.float8_e4m3fn).float()
    return (f.reshape(N, scale.shape[1], -1) * scale[..., None]).reshape(N, K).to(dtype)


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float -> codes (N, K // 2) uint8 (packed), scales and zeros (N, G) float32: each group's range
    [min, max] split into 15 steps."""
    g = _grouped(w, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # (N, G)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.reshape(w.shape)), scale, lo


def dequantize_int4(packed: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes (N, K // 2) packed uint8, scales and zeros (N, G) -> (N, K) in `dtype`."""
    q = unpack_int4(packed)
    N, K = q.shape
    g = q.float().reshape(N, scale.shape[1], -1)
    return (g * scale[..., None] + zero[..., None]).reshape(N, K).to(dtype)


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) codes in [0, 15] -> (N, K // 2) uint8: even columns in the low nibble."""
    if q.shape[-1] % 2:
        raise InputError(f"int4 needs an even input width, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """(N, K // 2) uint8 -> (N, K) uint8 codes in [0, 15]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


# ---- GGUF's float tensor types (llmkit.quant.blocks holds the quantized ones as stored)

GGUF_FLOAT = {"F32", "F16", "BF16", "F64"}  # unquantized: kept in the model's dtype
