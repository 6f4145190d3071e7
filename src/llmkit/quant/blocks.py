"""llama.cpp's block formats (GGUF's quantized tensor types), held by llmkit as the file stores them.

A row of K weights is K / n blocks of n weights (32, or 256 for the K-quants' super-blocks), each a fixed number of
bytes: a (N, K) matrix is (N, K / n * bytes) uint8, byte for byte the file's tensor. This module says what each
type's bytes mean, with the dequantization written out in PyTorch (the reference, and the path on devices without
llmkit's kernels); `cpu_blocks.cpp` multiplies the same bytes on the CPU. Layouts are ggml's (ggml-common.h), the
formulas those of its reference dequantization (ggml-quants.c), per weight in a block:

    Q8_0   fp16 d, 32 int8 q                           w = d q
    Q4_0   fp16 d, 16 bytes of nibbles                 w = d (q - 8)
    Q4_1   fp16 d, fp16 m, 16 bytes                    w = d q + m
    Q5_0   fp16 d, 32 high bits, 16 bytes              w = d (q - 16)      q = nibble | high bit << 4
    Q5_1   fp16 d, fp16 m, 32 high bits, 16 bytes      w = d q + m
    IQ4_NL fp16 d, 16 bytes                            w = d T[q]          T: 16 non-uniform levels (KVALUES)
  super-blocks of 256 (sub-blocks of 16 or 32 with their own scales):
    Q2_K   16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit q, fp16 d, fp16 dmin
                                                       w = d sc_s q - dmin m_s          (sub-blocks of 16)
    Q3_K   32 bytes of high bits, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, fp16 d
                                                       w = d (sc_s - 32) (q - 4 (1 - h))  (sub-blocks of 16)
    Q4_K   fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
                                                       w = d sc_s q - dmin m_s          (sub-blocks of 32)
    Q5_K   as Q4_K, and 32 bytes of fifth bits        w = d sc_s q - dmin m_s          (sub-blocks of 32)
    Q6_K   128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
                                                       w = d sc_s (q - 32)              (sub-blocks of 16)
    IQ4_XS fp16 d, 16 + 2 bits of 6-bit scales, 128 bytes   w = d (ls_s - 32) T[q]    (sub-blocks of 32)
  unquantized, rows in "blocks" of 32 (no head):
    F16    32 IEEE half floats
    BF16   32 bfloat16s (an fp32's top 16 bits)

Every quantized type reads as w = A_s c + B_s over sub-blocks s of 16 weights, with small integer codes c (signed: the
offset folded in; unsigned where a min is subtracted): the form the C++ kernels compute in (`cpu_blocks.cpp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.quant import iquants, kquants, native, weighted

QK_K = kquants.QK_K
# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h kvalues_iq4nl): a non-uniform grid fitted to weights' distribution
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: its name, ggml's number for it (the C++ kernels take it too), weights and bytes per
    block."""

    name: str
    ggml: int
    weights: int
    bytes: int

    @property
    def bits(self) -> float:
        return 8 * self.bytes / self.weights

    def row_bytes(self, k: int) -> int:
        """Bytes of a row of k weights; k must be a whole number of blocks."""
        if k % self.weights:
            raise InputError(f"{self.name} stores rows in blocks of {self.weights} weights; {k} is not a multiple")
        return k // self.weights * self.bytes


TYPES = {
    t.name: t
    for t in (
        BlockType("Q4_0", 2, 32, 18),
        BlockType("Q4_1", 3, 32, 20),
        BlockType("Q5_0", 6, 32, 22),
        BlockType("Q5_1", 7, 32, 24),
        BlockType("Q8_0", 8, 32, 34),
        BlockType("Q2_K", 10, QK_K, 84),
        BlockType("Q3_K", 11, QK_K, 110),
        BlockType("Q4_K", 12, QK_K, 144),
        BlockType("Q5_K", 13, QK_K, 176),
        BlockType("Q6_K", 14, QK_K, 210),
        BlockType("IQ4_NL", 20, 32, 18),
        BlockType("IQ4_XS", 23, QK_K, 136),
        BlockType("F16", 1, 32, 64),
        BlockType("BF16", 30, 32, 64),
    )
}
# Half-width floats, which GGUF files and Hugging Face checkpoints store unquantized: held at their own width and
# multiplied as stored as the block types are (rows sized in "blocks" of 32 weights without a head).
FLOAT_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


def block_type(name: str) -> BlockType:
    """The BlockType called `name` (case-insensitive: "q4_k" or "Q4_K"); an InputError lists the known ones."""
    t = TYPES.get(name.upper())
    if t is None:
        raise InputError(f"unknown block type {name!r}; llmkit holds {', '.join(TYPES)}")
    return t


# ---- reading fields out of blocks (..., bytes) uint8


def _f16(b: Tensor, at: int) -> Tensor:
    """The fp16 field at byte `at` of every block -> (..., 1) float32."""
    lo, hi = b[..., at].to(torch.int32), b[..., at + 1].to(torch.int32)
    return (lo | (hi << 8)).to(torch.int16).view(torch.float16).float()[..., None]


def _nibbles(b: Tensor) -> Tensor:
    """(..., n) bytes -> (..., 2n): the low nibbles, then the high ones."""
    return torch.cat((b & 15, b >> 4), dim=-1)


def _bits(b: Tensor, n: int) -> Tensor:
    """(..., n / 8) bytes -> (..., n) bits, bit j of the little-endian word first."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b[..., None] >> shifts) & 1).reshape(*b.shape[:-1], n)


def _scale_min_k4(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's and Q5_K's 12 bytes (..., 12) -> 8 six-bit scales and 8 six-bit mins (..., 8) each. Bytes 0-3 hold
    scales 0-3 in their low six bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low four bits of scales 4-7 (low
    nibble) and mins 4-7 (high nibble), whose top two bits are the top bits of bytes 0-3 and 4-7."""
    s = s.to(torch.int32)
    lo_s, lo_m, rest = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo_s & 63, (rest & 15) | ((lo_s >> 6) << 4)), dim=-1)
    mins = torch.cat((lo_m & 63, (rest >> 4) | ((lo_m >> 6) << 4)), dim=-1)
    return sc.float(), mins.float()


def _per(values: Tensor, n: int) -> Tensor:
    """(..., S) per-sub-block values -> (..., S * n): each repeated over its sub-block's n weights."""
    return values.repeat_interleave(n, dim=-1)


# ---- one function per type: blocks (..., bytes) -> weights (..., weights per block) float32


def _q8_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * b[..., 2:].view(torch.int8).float()


def _q4_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 2:]).float() - 8)


def _q4_1(b: Tensor) -> Tensor:
    return _f16(b, 0) * _nibbles(b[..., 4:]).float() + _f16(b, 2)


def _q5(b: Tensor, high_at: int) -> Tensor:
    """Q5_0's and Q5_1's 5-bit codes: nibbles, and bit j of the 32-bit word at `high_at` as code j's fifth bit."""
    return (_nibbles(b[..., high_at + 4 :]) | (_bits(b[..., high_at : high_at + 4], 32) << 4)).float()


def _q5_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * (_q5(b, 2) - 16)


def _q5_1(b: Tensor) -> Tensor:
    return _f16(b, 0) * _q5(b, 4) + _f16(b, 2)


def _iq4_nl(b: Tensor) -> Tensor:
    table = torch.tensor(KVALUES, dtype=torch.float32, device=b.device)
    return _f16(b, 0) * table[_nibbles(b[..., 2:]).long()]


def _q2_k(b: Tensor) -> Tensor:
    # 2-bit codes: 128 weights per 32 bytes of q, weight 32 j + l of each half at bits 2 j of byte l
    sc, q, d, dmin = b[..., :16], b[..., 16:80], _f16(b, 80), _f16(b, 82)
    halves = q.reshape(*q.shape[:-1], 2, 1, 32)  # (..., half, 1, byte)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8)[:, None]  # (j, 1)
    codes = ((halves >> shifts) & 3).reshape(*q.shape[:-1], QK_K).float()  # (..., 256) in weight order
    return _per(d * (sc & 15).float(), 16) * codes - _per(dmin * (sc >> 4).float(), 16)


def _q3_k(b: Tensor) -> Tensor:
    hmask, q, d = b[..., :32], b[..., 32:96], _f16(b, 108)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8)[:, None]
    low = ((q.reshape(*q.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*q.shape[:-1], QK_K)
    # the high bit of weight 32 u + l (u = 4 half + j) is bit u of hmask[l]; a clear bit subtracts 4
    high = _bits(hmask, QK_K).reshape(*hmask.shape[:-1], 32, 8).transpose(-1, -2).reshape(*hmask.shape[:-1], QK_K)
    codes = low.float() - 4 * (1 - high.float())
    return _per(d * (_q3_scales(b[..., 96:108]) - 32), 16) * codes


def _q3_scales(s: Tensor) -> Tensor:
    """Q3_K's 12 bytes -> 16 six-bit scales: the low nibbles of bytes 0-7 are scales 0-7, their high nibbles scales
    8-15; bytes 8-11 hold the top two bits, scale i's at bits 2 (i // 4) of byte 8 + i % 4."""
    s = s.to(torch.int32)
    low = torch.cat((s[..., :8] & 15, s[..., :8] >> 4), dim=-1)  # (..., 16)
    top = s[..., 8:12]  # (..., 4)
    i = torch.arange(16, device=s.device)
    high = (top[..., i % 4] >> (2 * (i // 4))) & 3
    return (low | (high << 4)).float()


def _q4_k(b: Tensor) -> Tensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _scale_min_k4(b[..., 4:16])
    q = b[..., 16:].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
    codes = torch.stack((q & 15, q >> 4), dim=-2).reshape(*b.shape[:-1], QK_K).float()
    return _per(d * sc, 32) * codes - _per(dmin * m, 32)


def _q5_k(b: Tensor) -> Tensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _scale_min_k4(b[..., 4:16])
    qh, q = b[..., 16:48], b[..., 48:].reshape(*b.shape[:-1], 4, 32)
    low = torch.stack((q & 15, q >> 4), dim=-2).reshape(*b.shape[:-1], QK_K)
    # the fifth bit of weight 32 u + l is bit u of qh[l]
    high = _bits(qh, QK_K).reshape(*qh.shape[:-1], 32, 8).transpose(-1, -2).reshape(*qh.shape[:-1], QK_K)
    return _per(d * sc, 32) * (low | (high << 4)).float() - _per(dmin * m, 32)


def _q6_k(b: Tensor) -> Tensor:
    ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208].view(torch.int8), _f16(b, 208)
    ql = ql.reshape(*b.shape[:-1], 2, 2, 32)  # (..., half, 32-byte run, l)
    qh = qh.reshape(*b.shape[:-1], 2, 1, 32)  # (..., half, 1, l)
    # weight 128 h + 32 p + l: nibble p // 2 of ql[h][p % 2][l], bits 2 p of qh[h][l] on top
    low = torch.stack((ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4), dim=-2)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8)[:, None]
    high = (qh >> shifts) & 3  # (..., half, 4, 32)
    codes = (low | (high << 4)).reshape(*b.shape[:-1], QK_K).float() - 32
    return _per(d * sc.float(), 16) * codes


def _iq4_xs(b: Tensor) -> Tensor:
    d = _f16(b, 0)
    high = (b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8))[..., None]  # (..., 1)
    u = torch.arange(8, device=b.device)
    low = (b[..., 4:8].to(torch.int32)[..., u // 2] >> (4 * (u % 2))) & 15
    ls = (low | (((high >> (2 * u)) & 3) << 4)).float()  # (..., 8) six-bit scales
    table = torch.tensor(KVALUES, dtype=torch.float32, device=b.device)
    q = b[..., 8:].reshape(*b.shape[:-1], 8, 16)
    codes = table[_nibbles(q).long()].reshape(*b.shape[:-1], QK_K)
    return _per(d * (ls - 32), 32) * codes


_DEQUANTIZE = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "IQ4_NL": _iq4_nl,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_XS": _iq4_xs,
    "F16": lambda b: b.view(torch.float16).float(),
    "BF16": lambda b: b.view(torch.bfloat16).float(),
}


def dequantize(blocks: Tensor, kind: BlockType | str, k: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Rows of blocks (..., row_bytes) uint8 of `kind` holding k weights each -> (..., k) in `dtype`."""
    t = kind if isinstance(kind, BlockType) else block_type(kind)
    row = t.row_bytes(k)
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != row:
        raise InputError(f"{t.name} rows of {k} weights are {row} bytes of uint8, got {tuple(blocks.shape)}")
    b = blocks.reshape(*blocks.shape[:-1], k // t.weights, t.bytes)
    return _DEQUANTIZE[t.name](b).reshape(*blocks.shape[:-1], k).to(dtype)


# ---- quantizing float rows into blocks (llama.cpp's reference rules, ggml-quants.c's quantize_row_*_ref)


def _round_away(v: Tensor) -> Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _half_bytes(v: Tensor) -> Tensor:
    """(..., 1) float32 -> (..., 2) uint8: the fp16 value's little-endian bytes."""
    h = v.to(torch.float16).view(torch.int16).to(torch.int32)
    return torch.cat((h & 255, (h >> 8) & 255), dim=-1).to(torch.uint8)


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d != 0, 1 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def _pack_nibbles(q: Tensor) -> Tensor:
    """(..., 32) codes in [0, 15] -> (..., 16) bytes: q[j] low, q[j + 16] high."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _signed_max(x: Tensor) -> Tensor:
    """The value of largest magnitude in each block (its sign kept), (..., 1)."""
    return torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))


def _fifth_bits(q: Tensor) -> Tensor:
    """(..., 32) codes -> (..., 4) bytes: bit j of the little-endian word is code j's bit 4."""
    bits = ((q.to(torch.int64) >> 4) & 1).reshape(*q.shape[:-1], 4, 8)
    return (bits << torch.arange(8, device=q.device)).sum(-1).to(torch.uint8)


def _quant_q8_0(x: Tensor) -> Tensor:
    d = x.abs().amax(-1, keepdim=True) / 127
    q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat((_half_bytes(d), q), dim=-1)


def _quant_q4_0(x: Tensor) -> Tensor:
    d = _signed_max(x) / -8
    q = torch.clamp((x * _inverse(d) + 8.5).to(torch.int8), max=15)  # (int8) truncates toward zero
    return torch.cat((_half_bytes(d), _pack_nibbles(q)), dim=-1)


def _quant_q4_1(x: Tensor) -> Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.clamp(((x - lo) * _inverse(d) + 0.5).to(torch.int8), max=15)
    return torch.cat((_half_bytes(d), _half_bytes(lo), _pack_nibbles(q)), dim=-1)


def _quant_q5_0(x: Tensor) -> Tensor:
    d = _signed_max(x) / -16
    q = torch.clamp((x * _inverse(d) + 16.5).to(torch.int8), max=31)
    return torch.cat((_half_bytes(d), _fifth_bits(q), _pack_nibbles(q & 15)), dim=-1)


def _quant_q5_1(x: Tensor) -> Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 31
    q = torch.clamp(((x - lo) * _inverse(d) + 0.5).to(torch.int8), max=31)
    return torch.cat((_half_bytes(d), _half_bytes(lo), _fifth_bits(q), _pack_nibbles(q & 15)), dim=-1)


_QUANTIZE = {"Q8_0": _quant_q8_0, "Q4_0": _quant_q4_0, "Q4_1": _quant_q4_1, "Q5_0": _quant_q5_0, "Q5_1": _quant_q5_1}


def quantize_blocks(w: Tensor, kind: BlockType | str, importance: Tensor | None = None) -> Tensor:
    """Float rows (N, K) -> (N, row_bytes) uint8 blocks of `kind` in the GGUF file's layout, by llama.cpp's
    reference rules: for the 32-weight types the bytes the `gguf` package's quantize gives, for the K-quants
    (kquants.py) those of ggml's quantize_row_*_ref, for IQ4_NL and IQ4_XS (iquants.py) those `llama-quantize`
    writes without an importance matrix; F16 and BF16 round to the nearest (half to even). With `importance` (K,):
    each input's mean square activation (llmkit.interop.imatrix), by llama.cpp's rules with an importance matrix
    (weighted.py; Q8_0, F16 and BF16 do not use it)."""
    t = kind if isinstance(kind, BlockType) else block_type(kind)
    N, K = w.shape
    t.row_bytes(K)
    if importance is not None and t.name not in weighted.UNWEIGHTED:
        if t.name not in weighted.WEIGHTED:
            raise InputError(
                f"{t.name} is not quantized with an importance matrix in llmkit (it is for "
                f"{', '.join(weighted.WEIGHTED)}): quantize without --imatrix, or to another type"
            )
        if importance.numel() != K:
            raise InputError(f"an importance row of {importance.numel()} inputs for a matrix of {K}")
        return weighted.quantize_weighted(w, t.name, importance).to(w.device)
    if t.name in FLOAT_TYPES:  # rounded to the nearest half-width float
        return w.detach().to(FLOAT_TYPES[t.name]).contiguous().view(torch.uint8)
    x = w.detach().float().cpu()
    if t.name in iquants.QUANTIZE:  # llmkit's C++ (the same bytes) where it runs
        ext = native.module()
        units = x.reshape(-1, t.weights).contiguous()
        out = ext.quantize_iq4(units, t.ggml) if ext is not None else iquants.quantize_iq4(units, t.name)
        return out.reshape(N, -1).to(w.device)
    if t.name in kquants.QUANTIZE:  # llmkit's C++ (the same bytes, ~10x faster) where it runs
        ext = native.module()
        supers = x.reshape(-1, QK_K).contiguous()
        out = ext.quantize_k(supers, t.ggml) if ext is not None else kquants.quantize_k(supers, t.name)
        return out.reshape(N, -1).to(w.device)
    blocks = _QUANTIZE[t.name](x.reshape(N, K // t.weights, t.weights))
    return blocks.reshape(N, -1).contiguous().to(w.device)
