"""The matrix products of quantized weights, and which one runs where.

Each kernel computes y = x @ W^T for codes and scales in the formats of formats.py. Which kernels are fast depends on
the machine (measured on an AVX2-only AMD EPYC, 2 cores): there PyTorch's int8 and int4 weight-only kernels run at
2-45 GFLOP/s, slower than fp32 itself, so `choose` falls back to dequantizing; FBGEMM's dynamically quantized int8
product runs at 2-8x fp32's speed but rounds activations to 7 bits per tensor, which took SmolLM2-135M's
perplexity on Shakespeare from 43.0 to 101 (weight-only int8: 43.2), so it is never chosen by itself. `choose`
picks by device, dtype and CPU capability; a layer's `kernel` can force one (tests run every kernel against the
dequantized reference):

    "dequant"     dequantize W to x's dtype, then F.linear: exact in x's dtype, every device; no speed-up
    "avx2"        llmkit's own kernels (native.py, cpu_kernel.cpp), x86 CPUs with AVX2, fp32: x rounded to int8 per
                  block of 32 (llama.cpp's method), integer dot products. At every row count they were as fast as
                  dequantizing and one fp32 matmul or faster (bench/quant_kernel_bench.py), so they take all rows
    "int8-dyn"    CPU, fp32, int8 per-channel: FBGEMM, activations quantized to 7 bits per call (opt-in: inexact)
    "int8-wo"     torch's weight-only int8 kernel (_weight_int8pack_mm): CUDA, and CPUs with AVX-512
    "int4-wo"     torch's weight-only int4 kernels (_weight_int4pack_mm[_for_cpu]): CUDA bf16, CPUs with AVX-512
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Kernel = Literal["auto", "dequant", "avx2", "int8-dyn", "int8-wo", "int4-wo"]
KERNELS: tuple[Kernel, ...] = ("auto", "dequant", "avx2", "int8-dyn", "int8-wo", "int4-wo")

INT4_TILES = 8  # inner k tiles of the CUDA int4 layout: K must be a multiple of 16 * INT4_TILES = 128


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 kernels take


def choose(
    bits: int, device: torch.device, dtype: torch.dtype, per_channel: bool, in_features: int, group_size: int = 32
) -> Kernel:
    """The fastest exact-enough kernel for a layer on `device` computing in `dtype` (see the module docstring)."""
    if device.type == "cpu" and dtype == torch.float32 and avx2_applies(per_channel, in_features, group_size):
        return "avx2"
    if bits == 8:
        if per_channel and (device.type == "cuda" or _avx512()) and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            return "int8-wo"
        return "dequant"
    if group_size not in INT4_GROUPS:
        return "dequant"
    if device.type == "cuda" and dtype == torch.bfloat16 and in_features % (16 * INT4_TILES) == 0:
        return "int4-wo"
    if device.type == "cpu" and _avx512() and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "int4-wo"
    return "dequant"


def avx2_applies(per_channel: bool, in_features: int, group_size: int) -> bool:
    """Whether llmkit's AVX2 kernels take this layer: input width a multiple of 32, groups of 32 x 2^k, and the
    kernels built on this machine (compiled on the first call)."""
    if in_features % 32 or (not per_channel and group_size not in INT4_GROUPS):
        return False
    from llmkit.quant import native

    return native.available()


# ---- preparing a layer's weights for a kernel (once, outside forward)


def prepack_int8_dynamic(q: Tensor, scale: Tensor, bias: Tensor | None) -> Any:
    """FBGEMM's packed form of int8 per-channel codes (N, K) with scales (N, 1)."""
    with warnings.catch_warnings():  # quantized tensors are how FBGEMM takes its input; the warning is about them
        warnings.simplefilter("ignore")
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        w = torch._make_per_channel_quantized_tensor(q.cpu(), scale[:, 0].double().cpu(), zeros, 0)
        return torch.ops.quantized.linear_prepack(w, None if bias is None else bias.detach().float().cpu())


def prepack_int4(packed: Tensor, scale: Tensor, zero: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """torch's int4 layout of codes (N, K // 2) and scales/zeros (N, G) -> (weight, scales_and_zeros (G, N, 2)).
    torch's kernels dequantize as (q - 8) * scale + zero', so zero' = zero + 8 * scale."""
    from llmkit.quant.formats import unpack_int4

    sz = torch.stack((scale, zero + 8 * scale), dim=-1).transpose(0, 1).contiguous()  # (G, N, 2)
    if device.type == "cuda":
        # the CUDA layout takes the codes packed two per byte with the even column in the high nibble
        q = unpack_int4(packed)
        hi_first = (q[:, 0::2] << 4) | q[:, 1::2]
        return torch.ops.aten._convert_weight_to_int4pack(hi_first.to(device), INT4_TILES), sz.to(device)
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed).to(torch.int32), 1)
    return w, sz


# ---- the products


def int8_dynamic(x: Tensor, packed: Any) -> Tensor:
    """x (..., K) fp32 on the CPU @ FBGEMM-packed int8 W^T (+ bias) -> (..., N) fp32."""
    return torch.ops.quantized.linear_dynamic(x, packed, True)  # reduce_range: 7-bit activations, no overflow on AVX2


def int8_weight_only(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., K) @ (q * scale)^T with torch's weight-only int8 kernel."""
    shape = x.shape
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), q, scale[:, 0].to(x.dtype))
    y = y.reshape(*shape[:-1], -1)
    return y + bias if bias is not None else y


def int4_weight_only(x: Tensor, w: Tensor, sz: Tensor, group_size: int, bias: Tensor | None) -> Tensor:
    """x (..., K) @ W^T with torch's int4 kernels (w and sz from prepack_int4)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.device.type == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(x2, w, group_size, sz.to(x.dtype))
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, group_size, sz.to(x.dtype))
    y = y.reshape(*shape[:-1], -1)
    return y + bias if bias is not None else y


def dequantized(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """The reference: F.linear with the dequantized weight (already in x's dtype)."""
    return F.linear(x, w, bias)
