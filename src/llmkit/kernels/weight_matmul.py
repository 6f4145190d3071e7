"""Products with llmkit's int4, int8 and fp8 weights for the GPU, at any input width: y = x W^T with W decoded tile
by tile from its codes, never whole.

llmkit's layouts (llmkit.quant.formats):
- int4: codes (N, K / 2) uint8, two per byte (even columns in the low nibble), and per group of `group` inputs a
  scale and a zero (N, K / group) in fp32: w = code * scale + zero;
- int8: codes (N, K) int8 and per group (or per row: one group of K) a scale (N, K / group) fp32: w = code * scale;
- fp8: codes (N, K) uint8, each the byte of an E4M3 number (sign, 4 exponent bits of bias 7, 3 mantissa bits), and
  scales as int8's: w = fp8(code) * scale. The kernel decodes the byte with integer and exp2 arithmetic rather than
  a cast to Triton's fp8 type, which only cards of compute capability 8.9 and later take: any card (and Triton's
  CPU interpreter) runs it, and the decode costs a few operations per weight in a product bound by reading them.
torch's weight-only kernels need their own packing and cover only part of this (int4: bf16 inputs, K a multiple of
128, which SmolLM2-135M's 576-wide layers are not; int8: one scale per row), so llmkit.quant.linear takes this
kernel where torch's do not apply.

One program computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps: it loads the x tile, the codes of the
tile's weights (an int4 byte twice, once for its low nibble's column and once for its high one's: it comes from the
cache the second time), the scales (and zeros) of their groups, decodes the weights in x's dtype and multiplies. A
weight is read once per BLOCK_M rows of x, so a decoding step (M <= 16) reads the codes once.

It must equal x times the dequantized weight (dequantize_int4, dequantize_int8, dequantize_fp8), which the tests
check. Shapes: M
rows of x, K inputs, N outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _weight_tile(
    x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group, s_xm, s_qn, s_sn, s_ym,
    CODES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        inside = (rn[:, None] < N) & (rk[None, :] < K)  # (N, K) of the tile
        g = rn[:, None] * s_sn + rk[None, :] // group  # each weight's group
        if CODES == "int4":
            byte = tl.load(q_ptr + rn[:, None] * s_qn + rk[None, :] // 2, mask=inside, other=0)
            code = (byte >> ((rk[None, :] % 2) * 4).to(tl.uint8)) & 15  # even columns low, odd columns high
            w = code.to(tl.float32) * tl.load(s_ptr + g, mask=inside, other=0.0)
            w += tl.load(z_ptr + g, mask=inside, other=0.0)
        elif CODES == "int8":
            code = tl.load(q_ptr + rn[:, None] * s_qn + rk[None, :], mask=inside, other=0)
            w = code.to(tl.float32) * tl.load(s_ptr + g, mask=inside, other=0.0)
        else:  # fp8 E4M3: (-1)^s 2^(e - 7) (1 + m / 8), or 2^-6 m / 8 where e = 0
            byte = tl.load(q_ptr + rn[:, None] * s_qn + rk[None, :], mask=inside, other=0).to(tl.int32)
            e, m = (byte >> 3) & 15, (byte & 7).to(tl.float32)
            magnitude = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))  # 2^-9 m
            w = tl.where(byte >= 128, -magnitude, magnitude) * tl.load(s_ptr + g, mask=inside, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)  # (BLOCK_N, BLOCK_K) decoded
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor | None, kind: str) -> Tensor:
    M, K = x.shape
    N = codes.shape[0]
    per_byte = 2 if kind == "int4" else 1
    assert codes.shape[1] * per_byte == K and K % scales.shape[1] == 0, "codes, scales and x disagree on widths"
    x = x.contiguous()
    codes, scales = codes.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else scales  # (unread for int8)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    BLOCK_M = 16 if M <= 16 else 64
    BLOCK_N, BLOCK_K = 64, 64
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _weight_tile[grid](
        x, codes, scales, zeros, y, M, N, K, K // scales.shape[1],
        x.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
        CODES=kind, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return y


def int4_matmul(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """x (M, K) in fp32, fp16 or bf16, codes (N, K / 2) uint8, scales and zeros (N, K / group) fp32 -> (M, N) in
    x's dtype: x times the dequantized weight, decoded a tile at a time."""
    return _launch(x, codes, scales, zeros, "int4")


def int8_matmul(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """x (M, K) in fp32, fp16 or bf16, codes (N, K) int8, scales (N, K / group) fp32 (one column: a scale per row)
    -> (M, N) in x's dtype."""
    return _launch(x, codes, scales, None, "int8")


def fp8_matmul(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """x (M, K) in fp32, fp16 or bf16, codes (N, K) uint8 (float8_e4m3fn bytes), scales (N, K / group) fp32 -> (M, N)
    in x's dtype."""
    return _launch(x, codes, scales, None, "fp8")
