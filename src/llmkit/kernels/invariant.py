"""Batch-invariant products and row reductions for the GPU: a row's result has the same bits whatever the other rows
of the call, so that a request's answer does not depend on what else the server is running.

Why torch's own kernels are not: cuBLAS picks its kernel, its tiles and whether to split the sum over K by the
shape of the whole product, and a reduction kernel splits a row over more threads when there are few rows. The sum
for one output is then taken in another order, and floating-point addition is not associative (He et al. 2025,
"Defeating nondeterminism in LLM inference", Thinking Machines). Nothing is random: the same batch gives the same
bits; another batch gives other bits.

The fix is to make the order depend on nothing but the row: here every product runs one Triton kernel with one tile
shape whatever M is (so one compiled program, whose per-output order over K is fixed: BLOCK_K at a time, in order,
never split), and every last-dim reduction runs one program per row, over the row BLOCK at a time. What it costs
(decoding at small batches reads the weights with fewer programs than cuBLAS would use; no split-K) is measured in
bench/gpu_bench.py.

They are applied from outside the model, as compilation is: `BatchInvariant(device_type)` is a dispatch mode
(torch.utils._python_dispatch) under which the aten products (mm, addmm, bmm; linear, matmul and einsum reach them
decomposed) and last-dim means, sums and layer norms on that device go to these kernels. Ops whose order llmkit
cannot fix this way (torch's attention kernels, scatter-adds, the quantized products, grouped products) raise
instead of quietly giving load-dependent answers. vLLM's batch-invariant mode takes the same approach (aten
overrides with Triton kernels, attention without key splits).

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors, which is how the tests check them. Shapes: M rows,
K inputs, N outputs, C the reduced (last) dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmkit.errors import InputError

# one tile shape for every product: the order of a row's sums is then the same whatever the batch
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
ROW_BLOCK = 1024  # elements of a row summed per step of a reduction


@triton.jit(do_not_specialize=["M"])
def _product_tile(
    a_ptr, b_ptr, c_ptr, M, N, K,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """C[batch] tile (BLOCK_M, BLOCK_N) = A[batch] (M, K) @ B[batch] (K, N), K walked BLOCK_K at a time in order."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a_at = a_ptr + batch * s_ab + rm[:, None] * s_am + rk[None, :] * s_ak
    b_at = b_ptr + batch * s_bb + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_at, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
        b = tl.load(b_at, mask=(k0 + rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_at += BLOCK_K * s_ak
        b_at += BLOCK_K * s_bk
    c_at = c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c_at, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _row_sum(x_ptr, out_ptr, C, s_x, divisor, BLOCK: tl.constexpr):
    """out[row] = sum of x[row, :C] / divisor, in fp32: BLOCK lanes each summing their columns in order, then the
    lanes summed."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        acc += tl.load(x_ptr + row * s_x + c0 + c, mask=c0 + c < C, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, (tl.sum(acc, axis=0) / divisor).to(out_ptr.dtype.element_ty))


@triton.jit
def _layer_norm_row(
    x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, C, s_x, s_o, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row of LayerNorm (Ba et al. 2016): (x - mean) / sqrt(var + eps) * w + b, the variance taken about the
    mean in a second pass."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        acc += tl.load(x_ptr + row * s_x + c0 + c, mask=c0 + c < C, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / C
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        x = tl.load(x_ptr + row * s_x + c0 + c, mask=c0 + c < C, other=0.0).to(tl.float32)
        d = tl.where(c0 + c < C, x - mean, 0.0)
        acc += d * d
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / C + eps)
    for c0 in range(0, C, BLOCK):
        inside = c0 + c < C
        y = (tl.load(x_ptr + row * s_x + c0 + c, mask=inside, other=0.0).to(tl.float32) - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + c0 + c, mask=inside, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + c0 + c, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_o + c0 + c, y.to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """a (Z, M, K) @ b (Z, K, N) -> (Z, M, N) in a's dtype, every row of every batch in the same order."""
    Z, M, K = a.shape
    N = b.shape[2]
    if b.shape[:2] != (Z, K) or a.dtype != b.dtype:
        raise InputError(f"cannot multiply {tuple(a.shape)} {a.dtype} by {tuple(b.shape)} {b.dtype}")
    c = torch.empty(Z, M, N, device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), Z)
    _product_tile[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # tf32 is for fp32 inputs only: exact fp32 here
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return c


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) @ b (K, N) -> (M, N); b may be a transposed view (a weight's W^T), read in place."""
    return bmm(a[None], b[None])[0]


def row_sum(x: Tensor, mean: bool = False) -> Tensor:
    """The sum (or mean) of x (..., C) over its last dim -> (...), in x's dtype, accumulated in fp32."""
    C = x.shape[-1]
    flat = x.reshape(-1, C) if x.stride(-1) == 1 else x.contiguous().view(-1, C)  # (M, C)
    out = torch.empty(flat.shape[0], device=x.device, dtype=x.dtype)
    if flat.shape[0]:
        _row_sum[(flat.shape[0],)](flat, out, C, flat.stride(0), float(C) if mean else 1.0, BLOCK=ROW_BLOCK)
    return out.view(x.shape[:-1])


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dim of x (..., C) -> (out (..., C), mean (..., 1), rstd (..., 1)), as
    aten.native_layer_norm returns them (mean and rstd in fp32)."""
    C = x.shape[-1]
    flat = x.reshape(-1, C) if x.stride(-1) == 1 else x.contiguous().view(-1, C)  # (M, C)
    out = torch.empty_like(flat)
    stats = torch.empty(2, flat.shape[0], device=x.device, dtype=torch.float32)
    if flat.shape[0]:
        _layer_norm_row[(flat.shape[0],)](
            flat, weight if weight is not None else flat, bias if bias is not None else flat, out, stats[0], stats[1],
            C, flat.stride(0), out.stride(0), eps,
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=ROW_BLOCK,
        )  # fmt: skip
    shape = (*x.shape[:-1], 1)
    return out.view(x.shape), stats[0].view(shape), stats[1].view(shape)


aten = torch.ops.aten


def _addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta: float = 1, alpha: float = 1) -> Tensor:
    out = mm(a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta)


def _reduce_last(mean: bool) -> Callable[..., Tensor | None]:
    """aten.sum.dim_IntList / aten.mean.dim over the last dim only (None: leave it to torch)."""

    def reduce(
        x: Tensor, dim: list[int] | None, keepdim: bool = False, *, dtype: torch.dtype | None = None
    ) -> Tensor | None:
        if not dim or len(dim) != 1 or dim[0] % x.dim() != x.dim() - 1 or not x.is_floating_point():
            return None
        out = row_sum(x if dtype is None else x.to(dtype), mean)
        return out[..., None] if keepdim else out

    return reduce


def _native_layer_norm(
    x: Tensor, shape: list[int], weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor] | None:
    return layer_norm(x, weight, bias, eps) if len(shape) == 1 else None


# the kernels above, by the aten op they stand in for (a handler returning None leaves the call to torch)
HANDLED: dict[Any, Callable[..., Any]] = {
    aten.mm.default: mm,
    aten.bmm.default: bmm,
    aten.addmm.default: _addmm,
    aten.sum.dim_IntList: _reduce_last(mean=False),
    aten.mean.dim: _reduce_last(mean=True),
    aten.native_layer_norm.default: _native_layer_norm,
}
# composite ops run as their parts, so that the products inside them come here
DECOMPOSED = {aten.linear.default, aten.matmul.default, aten.einsum.default, aten.layer_norm.default}
# ops whose order depends on the batch and that llmkit has no invariant kernel for
REFUSED = {
    aten.baddbmm.default, aten.addbmm.default, aten.mv.default, aten.addmv.default, aten.dot.default,
    aten.index_add_.default, aten.index_add.default, aten.scatter_add_.default, aten.scatter_add.default,
    aten._grouped_mm.default, aten._weight_int8pack_mm.default, aten._weight_int4pack_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._flash_attention_forward.default,
    aten._efficient_attention_forward.default,
}  # fmt: skip


class BatchInvariant(TorchDispatchMode):
    """While active (`with BatchInvariant("cuda"):`), products and last-dim reductions on `device_type` tensors run
    the kernels above: every row's bits independent of the rows beside it. Ops on other devices pass through."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next((a for a in tree_leaves(args) if isinstance(a, Tensor)), None)  # (einsum's come in a list)
        if first is None or first.device.type != self.device_type:
            return func(*args, **kwargs)
        if func in DECOMPOSED:
            with self:  # the parts come back through this mode
                return func.decompose(*args, **kwargs)
        if func in REFUSED:
            raise InputError(f"{func} has no batch-invariant kernel: the batch-invariant mode does not take it")
        handler = HANDLED.get(func)
        if handler is not None and (out := handler(*args, **kwargs)) is not None:
            return out
        return func(*args, **kwargs)
