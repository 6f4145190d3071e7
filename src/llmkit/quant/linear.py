"""Linear layers with quantized weights: nn.Linear's interface (in_features, out_features, bias, forward(x), and a
`weight` that reads back the dequantized matrix), weights held as int8, int4 or fp8 codes with fp32 scales.

    Int8Linear(in, out, bias, group_size=None)   qweight (N, K) int8, scales (N, G)
    Int4Linear(in, out, bias, group_size=32)     qweight (N, K // 2) uint8, scales and zeros (N, G)
    Fp8Linear(in, out, bias, group_size=None)    qweight (N, K) uint8 (fp8 E4M3 bytes), scales (N, G)

The state dict holds exactly those tensors (and bias), so a quantized model saves and loads like any other. The
forms a kernel wants (FBGEMM's packed int8, torch's int4 tile layout) are derived, never saved: they are rebuilt
whenever the layer is loaded or moved, never inside forward.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.kernels import triton_usable
from llmkit.layers.precision import FP32Buffers
from llmkit.quant import kernels, native
from llmkit.quant.formats import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    groups_of,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from llmkit.quant.kernels import Kernel


def _avx2_rows(x: Tensor) -> bool:
    """llmkit's AVX2 kernels take fp32 on the CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32


def _rows_apply(x: Tensor, fn: Any, bias: Tensor | None) -> Tensor:
    """fn over x as a contiguous (M, K) matrix, reshaped back, plus the bias."""
    y = fn(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*x.shape[:-1], -1)
    return y + bias if bias is not None else y


class QuantizedLinear(FP32Buffers, abc.ABC):
    """What Int8Linear and Int4Linear share: shapes, bias, the compute dtype, the kernel choice, quantizing a float
    layer. A subclass says how codes are made (`_encode`) and read back (`dequantize`), and which kernels it runs."""

    bits: ClassVar[int]
    default_group_size: ClassVar[int | None]
    fp32_buffers: tuple[str, ...] = ("scales", "zeros")
    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    dtype_probe: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group_size: int | None,
        kernel: Kernel = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if kernel not in kernels.KERNELS:
            raise InputError(f"kernel={kernel!r} is not one of {', '.join(kernels.KERNELS)}")
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        self.n_groups = groups_of(in_features, group_size)
        self.kernel: Kernel = kernel
        dtype = dtype or torch.get_default_dtype()
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        # follows the model's casts (model.to(torch.bfloat16)): the dtype `weight` dequantizes to
        self.register_buffer("dtype_probe", torch.empty(0, device=device, dtype=dtype), persistent=False)
        self._prepared: Any = None
        self.resolved: Kernel = "dequant"  # set by prepare()
        # how llmkit's C++ kernels multiply many rows (a prompt) on this machine: a value from outside
        # (llmkit.quant.apply.set_kernel_choice), the process's default until then
        self.kernel_choice: native.KernelChoice = native.default_choice()
        self.register_load_state_dict_post_hook(lambda module, _: module.prepare())

    @property
    @abc.abstractmethod
    def method(self) -> str:
        """The QuantSpec method that rebuilds this layer: int8, int4, fp8 (a block type's name for BlockLinear)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype_probe.dtype

    @property
    def weight(self) -> Tensor:
        """The dequantized (N, K) matrix in the compute dtype (for code that reads a linear layer's weight)."""
        return self.dequantize(self.compute_dtype)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out). The weights are frozen; when x needs a gradient (QLoRA: adapters before this
        layer train), the backward pass multiplies by the dequantized weights."""
        if torch.is_grad_enabled() and x.requires_grad:
            return _FrozenQuantized.apply(x, self)
        return self._forward(x)

    @abc.abstractmethod
    def _forward(self, x: Tensor) -> Tensor:
        """The kernel's product, without autograd."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None, kernel: Kernel = "auto") -> QuantizedLinear:
        """A quantized copy of `linear` (group_size None: the class's default)."""
        w = linear.weight.detach()
        group = group_size if group_size is not None else cls.default_group_size
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, group, kernel, w.device, w.dtype)
        out.load_weight(w, linear.bias)
        return out

    @torch.no_grad()
    def load_weight(self, w: Tensor, bias: Tensor | None = None) -> None:
        """Quantize the float matrix `w` (N, K) into this layer (and copy the bias)."""
        for name, t in self._encode(w).items():
            self._buffers[name].copy_(t)  # type: ignore[union-attr]
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)
        self.prepare()

    @abc.abstractmethod
    def _encode(self, w: Tensor) -> dict[str, Tensor]:
        """The codes and scales of `w` (N, K), by buffer name."""

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) matrix the codes stand for."""

    @abc.abstractmethod
    def prepare(self) -> None:
        """Build the kernel's form of the weights for the current device (after loading or moving)."""

    def rows_product(self, x: Tensor, start: int, end: int, allow_native: bool = True) -> Tensor:
        """x (n, in) @ rows [start, end) of W^T -> (n, end - start), without the bias: one expert's product when the
        layer holds a stack of experts (llmkit.quant.experts). Only those rows are read: llmkit's AVX2 kernel on
        their codes where it runs and `allow_native` (fp32 on an AVX2 CPU, no gradient asked for x), else those
        rows dequantized."""
        if (
            allow_native
            and native.available()
            and _avx2_rows(x)
            and not x.requires_grad
            and not torch.compiler.is_compiling()
        ):
            try:
                return self._native_rows(x.contiguous(), start, end)
            except RuntimeError:  # a group size the kernel does not take
                pass
        return F.linear(x, self._dequantize_rows(start, end, x.dtype))

    @abc.abstractmethod
    def _native_rows(self, x: Tensor, start: int, end: int) -> Tensor:
        """llmkit's AVX2 product of x (n, in) with rows [start, end) of the codes."""

    @abc.abstractmethod
    def _dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        """Rows [start, end) of the matrix the codes stand for."""

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedLinear:
        super()._apply(fn, recurse)
        if not self.dtype_probe.is_meta:
            self.prepare()
        return self

    def _resolve(self) -> Kernel:
        """The kernel for the current device and compute dtype (decided when the layer is prepared, not per call,
        so that forward stays cheap and traceable)."""
        if self.kernel == "avx2" and not native.available():
            raise InputError("kernel='avx2' needs an x86 CPU with AVX2 and a C++ compiler (see llmkit.quant.native)")
        if self.kernel != "auto":
            return self.kernel
        return kernels.choose(
            self.bits,
            self.qweight.device,
            self.compute_dtype,
            self.group_size is None,
            self.in_features,
            self.group_size or 32,
        )

    def extra_repr(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int{self.bits}, {g}, kernel={self.kernel}"
        )


class _ByteCodes(QuantizedLinear):
    """The layout int8 and fp8 share: a byte a weight, qweight (N, K) of `code_dtype`, and scales (N, G): one per
    output row (group_size None) or per group of inputs. `takes`: the kernel choices the format takes."""

    bits = 8
    default_group_size = None  # one scale per output row
    code_dtype: ClassVar[torch.dtype]
    takes: ClassVar[tuple[Kernel, ...]] = kernels.KERNELS

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        group_size: int | None = None,
        kernel: Kernel = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, group_size, kernel, device, dtype)
        if kernel not in self.takes:
            raise InputError(f"{self.method} layers run kernel {' or '.join(map(repr, self.takes))}, not {kernel!r}")
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=self.code_dtype, device=device))
        self.register_buffer("scales", torch.ones(out_features, self.n_groups, device=device))
        self.zeros: Tensor | None = None
        if self.qweight.device.type != "meta":
            self.prepare()


class Int8Linear(_ByteCodes):
    """int8 codes, symmetric, one scale per output row (group_size None) or per group of inputs."""

    method = "int8"
    code_dtype = torch.int8

    def _encode(self, w: Tensor) -> dict[str, Tensor]:
        q, s = quantize_int8(w, self.group_size)
        return {"qweight": q, "scales": s}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int8(self.qweight, self.scales, dtype)

    def _native_rows(self, x: Tensor, start: int, end: int) -> Tensor:
        return native.int8_linear(x, self.qweight[start:end], self.scales[start:end], self.kernel_choice)

    def _dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        return dequantize_int8(self.qweight[start:end], self.scales[start:end], dtype)

    def prepare(self) -> None:
        self._prepared = None
        self.resolved = self._resolve()
        fbgemm = self.qweight.device.type == "cpu" and self.group_size is None and kernels.fbgemm_available()
        if fbgemm and self.resolved == "int8-dyn":
            self._prepared = kernels.prepack_int8_dynamic(self.qweight, self.scales, self.bias)

    def _forward(self, x: Tensor) -> Tensor:
        kernel = self.resolved
        if kernel == "avx2" and _avx2_rows(x):
            return _rows_apply(
                x, lambda x2: native.int8_linear(x2, self.qweight, self.scales, self.kernel_choice), self.bias
            )
        if kernel == "int8-dyn" and self._prepared is not None and x.dtype == torch.float32:
            return kernels.int8_dynamic(x, self._prepared)
        if kernel == "int8-wo" and self.group_size is None:
            return kernels.int8_weight_only(x, self.qweight, self.scales, self.bias)
        if x.device.type == "cuda" and self.kernel != "dequant" and triton_usable(x.device):
            # grouped scales (torch's int8 kernel takes one scale a row): llmkit's Triton kernel
            from llmkit.kernels.weight_matmul import int8_matmul

            y = int8_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
            return y + self.bias.to(y.dtype) if self.bias is not None else y
        return kernels.dequantized(x, self.dequantize(x.dtype), self.bias)


class _FrozenQuantized(torch.autograd.Function):
    """A quantized layer inside a trained model: the kernel forward, and dL/dx = dL/dy W (W dequantized) backward.
    Nothing of the layer itself gets a gradient (its codes cannot take one; its bias is frozen with it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: QuantizedLinear) -> Tensor:
        ctx.layer = layer
        with torch.no_grad():
            return layer._forward(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        w = ctx.layer.dequantize(grad.dtype)  # (out, in)
        return grad @ w, None


class Int4Linear(QuantizedLinear):
    """int4 codes, asymmetric, a scale and a zero per group of `group_size` inputs."""

    bits = 4
    method = "int4"
    default_group_size = 32

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        group_size: int = 32,
        kernel: Kernel = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if group_size is None:
            raise InputError("int4 needs a group size (32, 64 or 128)")
        super().__init__(in_features, out_features, bias, group_size, kernel, device, dtype)
        if in_features % 2:
            raise InputError(f"int4 needs an even input width, got {in_features}")
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, self.n_groups, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, self.n_groups, device=device))
        self.zeros: Tensor
        if self.qweight.device.type != "meta":
            self.prepare()

    def _encode(self, w: Tensor) -> dict[str, Tensor]:
        q, s, z = quantize_int4(w, self.group_size or 32)
        return {"qweight": q, "scales": s, "zeros": z}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int4(self.qweight, self.scales, self.zeros, dtype)

    def _native_rows(self, x: Tensor, start: int, end: int) -> Tensor:
        return native.int4_linear(
            x, self.qweight[start:end], self.scales[start:end], self.zeros[start:end], self.kernel_choice
        )

    def _dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        return dequantize_int4(self.qweight[start:end], self.scales[start:end], self.zeros[start:end], dtype)

    def prepare(self) -> None:
        self._prepared = None
        self.resolved = self._resolve()
        dev = self.qweight.device
        if (
            self.resolved == "int4-wo"
            and self.group_size in kernels.INT4_GROUPS
            and (dev.type == "cpu" or self.in_features % 128 == 0)
        ):
            self._prepared = kernels.prepack_int4(self.qweight, self.scales, self.zeros, dev)

    def _forward(self, x: Tensor) -> Tensor:
        kernel = self.resolved
        if kernel == "avx2" and _avx2_rows(x):
            return _rows_apply(
                x,
                lambda x2: native.int4_linear(x2, self.qweight, self.scales, self.zeros, self.kernel_choice),
                self.bias,
            )
        ok_dtype = x.dtype == torch.bfloat16 if x.device.type == "cuda" else True
        if kernel == "int4-wo" and self._prepared is not None and ok_dtype:
            w, sz = self._prepared
            return kernels.int4_weight_only(x, w, sz, self.group_size or 32, self.bias)
        if x.device.type == "cuda" and self.kernel != "dequant" and triton_usable(x.device):
            # any width, any float dtype (torch's kernel wants bf16 and widths of 128s): llmkit's Triton kernel
            from llmkit.kernels.weight_matmul import int4_matmul

            y = int4_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales, self.zeros)
            y = y.view(*x.shape[:-1], self.out_features)
            return y + self.bias.to(y.dtype) if self.bias is not None else y
        return kernels.dequantized(x, self.dequantize(x.dtype), self.bias)


class Fp8Linear(_ByteCodes):
    """fp8 codes (E4M3, the format H100-class GPUs compute in), symmetric, one scale per output row (group_size
    None) or per group of inputs: half the bytes of bf16, read by llmkit's Triton kernel on a GPU (which decodes the
    bytes itself, so any card takes them, kernel 'auto'); elsewhere dequantized. The codes are uint8 bytes, so that a
    cast of the model (to bf16) leaves them alone."""

    method = "fp8"
    code_dtype = torch.uint8
    takes = ("auto", "dequant")

    def _encode(self, w: Tensor) -> dict[str, Tensor]:
        q, s = quantize_fp8(w, self.group_size)
        return {"qweight": q, "scales": s}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_fp8(self.qweight, self.scales, dtype)

    def _native_rows(self, x: Tensor, start: int, end: int) -> Tensor:
        raise RuntimeError("llmkit's C++ kernels do not read fp8 codes")  # (rows_product then dequantizes)

    def _dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8(self.qweight[start:end], self.scales[start:end], dtype)

    def prepare(self) -> None:
        self._prepared = None
        self.resolved = "dequant"

    def _forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cuda" and self.kernel != "dequant" and triton_usable(x.device):
            from llmkit.kernels.weight_matmul import fp8_matmul

            y = fp8_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
            return y + self.bias.to(y.dtype) if self.bias is not None else y
        return kernels.dequantized(x, self.dequantize(x.dtype), self.bias)


# the layer class of each of llmkit's own methods (QuantSpec.method)
LAYERS: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}
