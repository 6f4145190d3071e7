"""A product with llmkit's int4 weights for the GPU, at any input width: y = x W^T with W decoded tile by tile from
its codes, never whole.

llmkit's int4 layout (llmkit.quant.formats): codes (N, K / 2) uint8, two per byte (even columns in the low nibble),
and per group of `group` inputs a scale and a zero (N, K / group) in fp32: w = code * scale + zero. torch's
weight-only int4 kernel needs its own packing, bf16 inputs and K a multiple of 128 (SmolLM2-135M's 576-wide
layers are not), so llmkit.quant.linear.Int4Linear takes this kernel where torch's does not apply.

One program computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps: it loads the x tile, the bytes that
hold the tile's codes (each byte twice, once for its low nibble's column and once for its high one's: they come
from the cache the second time), the scales and zeros of their groups, decodes the weights in x's dtype and
multiplies. A weight is read once per BLOCK_M rows of x, so a decoding step (M <= 16) reads the codes once.

It must equal x times the dequantized weight (llmkit.quant.formats.dequantize_int4), which the tests check. Shapes:
M rows of x, K inputs, N outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _int4_tile(
    x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group, s_xm, s_qn, s_sn, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        inside = (rn[:, None] < N) & (rk[None, :] < K)  # (N, K) of the tile
        byte = tl.load(q_ptr + rn[:, None] * s_qn + rk[None, :] // 2, mask=inside, other=0)
        code = (byte >> ((rk[None, :] % 2) * 4).to(tl.uint8)) & 15  # even columns low, odd columns high
        g = rn[:, None] * s_sn + rk[None, :] // group  # each weight's group
        scale = tl.load(s_ptr + g, mask=inside, other=0.0)
        zero = tl.load(z_ptr + g, mask=inside, other=0.0)
        w = (code.to(tl.float32) * scale + zero).to(x.dtype)  # (BLOCK_N, BLOCK_K)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def int4_matmul(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """x (M, K) in fp32, fp16 or bf16, codes (N, K / 2) uint8, scales and zeros (N, K / group) fp32 -> (M, N) in
    x's dtype: x times the dequantized weight, decoded a tile at a time."""
    M, K = x.shape
    N = codes.shape[0]
    assert codes.shape[1] * 2 == K and K % scales.shape[1] == 0, "codes, scales and x disagree on the input width"
    x = x.contiguous()
    codes, scales, zeros = codes.contiguous(), scales.contiguous(), zeros.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    BLOCK_M = 16 if M <= 16 else 64
    BLOCK_N, BLOCK_K = 64, 64
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _int4_tile[grid](
        x, codes, scales, zeros, y, M, N, K, K // scales.shape[1],
        x.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return y
