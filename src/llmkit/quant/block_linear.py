"""A linear layer holding its weights in one of llama.cpp's block formats (blocks.py), multiplied as stored.

    BlockLinear(in, out, bias, "Q4_K")     blocks (out, in / 256 * 144) uint8

`blocks` is the GGUF tensor's bytes, so a layer loaded from a file holds exactly the file's bytes, often as a view of
the mapped file: every kernel reads the blocks as the file stores them.

The product: llmkit's CPU kernels on the blocks where they run (cpu_blocks.cpp: x rounded to int8, integer dot
products for decoding rows; from the layer's KernelChoice.integer_rows + 1 rows on, panels in integers, or
dequantized to bf16 or fp32 and multiplied by torch), else the blocks dequantized by PyTorch (blocks.dequantize) and
F.linear.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.errors import InputError
from llmkit.quant import native
from llmkit.quant.blocks import BlockType, block_type, dequantize, quantize_blocks
from llmkit.quant.kernels import Kernel
from llmkit.quant.linear import QuantizedLinear, _avx2_rows, _rows_apply


class HeldBlocks(torch.nn.Module):
    """A module whose `blocks` buffer holds rows of GGUF blocks of type `block`, as the file stores them."""

    block: BlockType
    blocks: Tensor

    def rows(self, index: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `index` of the matrix, dequantized: llmkit's C++ dequantization on the CPU where it runs."""
        picked = self.blocks[index]
        ext = native.module() if picked.device.type == "cpu" else None
        if ext is not None:
            return ext.block_dequantize(picked.contiguous(), self.block.ggml, self.k).to(dtype)
        return dequantize(picked, self.block, self.k, dtype)

    @property
    def k(self) -> int:
        """Weights a row (from the blocks' shape: whole blocks of `block`)."""
        return self.blocks.shape[-1] // self.block.bytes * self.block.weights


class BlockLinear(HeldBlocks, QuantizedLinear):
    """nn.Linear's interface over rows of GGUF blocks of one type (`block`, a BlockType)."""

    bits: ClassVar[int] = 0  # varies by type: block.bits
    default_group_size = None
    fp32_buffers = ()
    blocks: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        block: BlockType | str = "Q8_0",
        kernel: Kernel = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.block = block if isinstance(block, BlockType) else block_type(block)
        if kernel not in ("auto", "dequant", "avx2"):
            raise InputError(f"a {self.block.name} layer runs kernel 'auto', 'dequant' or 'avx2', not {kernel!r}")
        row = self.block.row_bytes(in_features)  # checks the width is whole blocks
        super().__init__(in_features, out_features, bias, None, kernel, device, dtype)
        self.group_size = self.block.weights
        self.register_buffer("blocks", torch.zeros(out_features, row, dtype=torch.uint8, device=device))
        if self.blocks.device.type != "meta":
            self.prepare()

    @property
    def method(self) -> str:
        """The QuantSpec method that rebuilds this layer: the block type's name."""
        return self.block.name

    @classmethod
    def from_float(
        cls, linear: torch.nn.Linear, block: BlockType | str, kernel: Kernel = "auto", importance: Tensor | None = None
    ) -> BlockLinear:
        """A copy of `linear` with its weights quantized to `block` (llama.cpp's rules: blocks.quantize_blocks,
        weighted by the importance of each input where given)."""
        w = linear.weight.detach()
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, block, kernel, w.device, w.dtype)
        if importance is None:
            out.load_weight(w, linear.bias)
            return out
        out.blocks.copy_(quantize_blocks(w, out.block, importance))
        if linear.bias is not None and out.bias is not None:
            out.bias.data.copy_(linear.bias.detach())
        out.prepare()
        return out

    def _encode(self, w: Tensor) -> dict[str, Tensor]:
        return {"blocks": quantize_blocks(w, self.block)}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(self.blocks, self.block, self.in_features, dtype)

    def _dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        return dequantize(self.blocks[start:end], self.block, self.in_features, dtype)

    def _native_rows(self, x: Tensor, start: int, end: int) -> Tensor:
        return native.block_linear(x, self.blocks[start:end], self.block.ggml, self.kernel_choice)

    def _resolve(self) -> Kernel:
        if self.kernel == "avx2" and not native.available():
            raise InputError("kernel='avx2' needs an x86 CPU with AVX2 and a C++ compiler (see llmkit.quant.native)")
        if self.kernel != "auto":
            return self.kernel
        on_cpu = self.blocks.device.type == "cpu" and self.compute_dtype == torch.float32
        return "avx2" if on_cpu and native.available() else "dequant"

    def prepare(self) -> None:
        self._prepared = None
        self.resolved = self._resolve()

    def _forward(self, x: Tensor) -> Tensor:
        if self.resolved == "avx2" and _avx2_rows(x):
            choice = self.kernel_choice
            return _rows_apply(x, lambda x2: native.block_linear(x2, self.blocks, self.block.ggml, choice), self.bias)
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{self.block.name} ({self.block.bits:.4g} bits a weight), kernel={self.kernel}"
        )
