"""Products with llmkit's int4 and int8 weights for the GPU, at any input width: y = x W^T with W decoded tile by
tile from its codes, never whole.

llmkit's layouts (llmkit.quant.formats):
- int4: codes (N, K / 2) uint8, two per byte (even columns in the low nibble), and per group of `group` inputs a
  scale and a zero (N, K / group) in fp32: w = code * scale + zero;
- int8: codes (N, K) int8 and per group (or per row: one group of K) a scale (N, K / group) fp32: w = code * scale.
torch's weight-only kernels need their own packing and cover only part of this (int4: bf16 inputs, K a multiple of
128, which SmolLM2-135M's 576-wide layers are not; int8: one scale per row), so llmkit.quant.linear takes this
kernel where torch's do not apply.

One program computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps: it loads the x tile, the codes of the
tile's weights (an int4 byte twice, once for its low nibble's column and once for its high one's: it comes from the
cache the second time), the scales (and zeros) of their groups, decodes the weights in x's dtype and multiplies. A
weight is read once per BLOCK_M rows of x, so a decoding step (M <= 16) reads the codes once.

It must equal x times the dequantized weight (dequantize_int4, dequantize_int8), which the tests check. Shapes: M
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
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        if BITS == 4:
            byte = tl.load(q_ptr + rn[:, None] * s_qn + rk[None, :] // 2, mask=inside, other=0)
            code = (byte >> ((rk[None, :] % 2) * 4).to(tl.uint8)) & 15  # even columns low, odd columns high
            w = code.to(tl.float32) * tl.load(s_ptr + g, mask=inside, other=0.0)
            w += tl.load(z_ptr + g, mask=inside, other=0.0)
        else:
            code = tl.load(q_ptr + rn[:, None] * s_qn + rk[None, :], mask=inside, other=0)
            w = code.to(tl.float32) * tl.load(s_ptr + g, mask=inside, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)  # (BLOCK_N, BLOCK_K) decoded
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor | None, bits: int) -> Tensor:
    M, K = x.shape
    N = codes.shape[0]
    assert codes.shape[1] * (8 // bits) == K and K % scales.shape[1] == 0, "codes, scales and x disagree on widths"
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
        BITS=bits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return y


def int4_matmul(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """x (M, K) in fp32, fp16 or bf16, codes (N, K / 2) uint8, scales and zeros (N, K / group) fp32 -> (M, N) in
    x's dtype: x times the dequantized weight, decoded a tile at a time."""
    return _launch(x, codes, scales, zeros, 4)


def int8_matmul(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """x (M, K) in fp32, fp16 or bf16, codes (N, K) int8, scales (N, K / group) fp32 (one column: a scale per row)
    -> (M, N) in x's dtype."""
    return _launch(x, codes, scales, None, 8)
