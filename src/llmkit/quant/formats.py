"""Weight formats: how a float matrix becomes int8 or int4 codes with scales, and back. Pure tensor functions.

int8, symmetric:   w[n, k] ~= q[n, k] * scale[n, g(k)]               q in [-127, 127]
int4, asymmetric:  w[n, k] ~= q[n, k] * scale[n, g(k)] + zero[n, g(k)]    q in [0, 15]

g(k) = k // group_size is the group of column k; group_size None means one group per output row (per-channel).
int4 codes are stored two to a byte, (N, K // 2) uint8: column 2j in the low nibble, 2j + 1 in the high one.

llama.cpp's blocks of 32 weights are exactly these formats with group_size 32 (`from_gguf_blocks`):
    Q8_0  (fp16 d, 32 x int8 q):              w = d * q
    Q5_0  (fp16 d, 32 high bits, 16 bytes):   w = d * (q - 16)        -> int8 code q - 16, scale d
    Q4_0  (fp16 d, 16 bytes of nibbles):      w = d * (q - 8)         -> scale d, zero -8 d
    Q4_1  (fp16 d, fp16 m, 16 bytes):         w = d * q + m           -> scale d, zero m
with a block's 32 codes stored as 16 bytes holding q[j] in the low and q[j + 16] in the high nibble of byte j; and
so is the K-quant most files use for most tensors (Q4_K_M, Q4_K_S):
    Q4_K  (super-blocks of 256: fp16 d, fp16 dmin, 8 six-bit scales sc and mins m, 128 bytes of nibbles):
          w = d sc_i * q - dmin m_i in sub-block i of 32     -> scale d sc_i, zero -dmin m_i
whose bytes hold sub-blocks 2c and 2c + 1 as the low and high nibbles of the same 32 bytes. Other block types
(Q6_K, Q5_K, Q5_1, Q3_K, Q2_K, the IQ types) have no exact llmkit format: `requantized_int8` rounds their
dequantized weights to int8 in groups of 32, an error of at most 1/254 of the group's largest weight (Q6_K, the
finest of them, has steps of 1/32 of its 16-weight sub-block's largest).
"""

from __future__ import annotations

import numpy as np
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


# ---- llama.cpp's blocks

GGUF_KINDS = {"Q8_0": "int8", "Q5_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}
GGUF_FLOAT = {"F32", "F16", "BF16", "F64"}  # unquantized: kept in the model's dtype
QK_K = 256  # weights per K-quant super-block


def from_gguf_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> dict[str, Tensor]:
    """The raw bytes of a GGUF tensor of a type in GGUF_KINDS with logical shape (N, K) -> our tensors, exactly:
    {"qweight", "scales"} for int8, {"qweight", "scales", "zeros"} for int4, group size 32."""
    if kind not in GGUF_KINDS:
        raise InputError(f"GGUF type {kind} has no exact llmkit format")
    N, K = shape
    per = QK_K if kind.endswith("_K") else GGUF_BLOCK
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(N, K // per, -1)  # (N, blocks a row, bytes a block)

    def f16(start: int) -> Tensor:  # a half-precision field of every block -> (N, blocks a row) float32
        return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32))

    def nibbles(b: np.ndarray) -> Tensor:  # (..., 16 j) bytes -> (..., 32) codes: q[j] low, q[j + 16] high nibble
        t = torch.from_numpy(b.copy())
        return torch.cat((t & 15, t >> 4), dim=-1)

    d = f16(0)
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(N, K)
        return {"qweight": q, "scales": d}
    if kind == "Q5_0":  # the fifth bit of q[j] is bit j of a little-endian 32-bit word
        high = torch.from_numpy(blocks[..., 2:6].copy().view("<u4").astype(np.int64))  # (N, G, 1)
        bits = (high >> torch.arange(32)) & 1  # (N, G, 32)
        q = nibbles(blocks[..., 6:]).to(torch.int64) | (bits << 4)
        return {"qweight": (q - 16).to(torch.int8).reshape(N, K), "scales": d}
    if kind == "Q4_K":
        sc, mins = _k_scales(blocks[..., 4:16])  # (N, S, 8) each
        scales = (d[..., None] * sc).reshape(N, K // GGUF_BLOCK)
        zeros = -(f16(2)[..., None] * mins).reshape(N, K // GGUF_BLOCK)
        q = torch.from_numpy(blocks[..., 16:].copy()).reshape(N, K // QK_K, 4, 1, 32)  # 4 chunks of 32 bytes
        codes = torch.cat((q & 15, q >> 4), dim=3)  # (N, S, 4, 2, 32): sub-blocks 2c (low), 2c + 1 (high)
        return {"qweight": pack_int4(codes.reshape(N, K)), "scales": scales, "zeros": zeros}
    codes = nibbles(blocks[..., -16:])  # (N, G, 32)
    zero = -8 * d if kind == "Q4_0" else f16(2)
    return {"qweight": pack_int4(codes.reshape(N, K)), "scales": d, "zeros": zero}


def _k_scales(packed: np.ndarray) -> tuple[Tensor, Tensor]:
    """A K-quant super-block's 12 bytes -> its 8 six-bit scales and 8 six-bit mins, float32 (..., 8) each. Bytes
    0-3 hold scales 0-3 in their low six bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low four bits of scales 4-7
    (low nibble) and mins 4-7 (high nibble), whose top two bits are the top bits of bytes 0-3 and 4-7."""
    b = torch.from_numpy(packed.copy()).to(torch.int32)
    lo_s, lo_m, rest = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat((lo_s & 63, (rest & 15) | ((lo_s >> 6) << 4)), dim=-1)
    mins = torch.cat((lo_m & 63, (rest >> 4) | ((lo_m >> 6) << 4)), dim=-1)
    return sc.float(), mins.float()


def requantized_int8(weight: Tensor) -> dict[str, Tensor]:
    """A GGUF tensor of a block type without an exact llmkit format, dequantized to weight (N, K) -> int8 in
    groups of 32: {"qweight", "scales"} (see the module docstring for the error)."""
    q, scales = quantize_int8(weight, GGUF_BLOCK)
    return {"qweight": q, "scales": scales}
