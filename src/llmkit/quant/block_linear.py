"""A linear layer holding its weights in one of llama.cpp's block formats (blocks.py), multiplied as stored.

    BlockLinear(in, out, bias, "Q4_K")     blocks (out, in / 256 * 144) uint8

`blocks` is the GGUF tensor's bytes, so a layer loaded from a file holds exactly the file's bytes (a K-quant's can be
a view of the mapped file). Where llmkit's CPU kernels run, a 32-weight type's blocks are moved within each row into
groups of 8 (blocks.group_blocks: 8 scales, then 8 blocks of codes; same bytes), and moved back when the state dict
is read, so the state dict, checkpoints and tensor-parallel cuts always see the file's layout (HeldBlocks).

The product: llmkit's CPU kernels on the blocks where they run (cpu_blocks.cpp: x rounded to int8, integer dot
products for decoding rows; from integer_rows() + 1 rows on, panels dequantized to bf16 or fp32 and multiplied by
torch), else the blocks dequantized by PyTorch (blocks.dequantize) and F.linear.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.errors import InputError
from llmkit.parts import SOURCE
from llmkit.quant import native
from llmkit.quant.blocks import BlockType, block_type, dequantize, group_blocks, quantize_blocks, ungroup_blocks
from llmkit.quant.kernels import Kernel
from llmkit.quant.linear import QuantizedLinear, _avx2_rows, _rows_apply


class HeldBlocks(torch.nn.Module):
    """A module whose `blocks` buffer holds rows of GGUF blocks of type `block`: in the file's layout, or grouped for
    llmkit's CPU kernels (`grouped`; 32-weight types only). Its state dict always holds the file's layout."""

    block: BlockType
    blocks: Tensor
    grouped: bool = False

    def set_grouped(self, grouped: bool) -> None:
        """Move the blocks into (or out of) llmkit's grouped layout; K-quants have only one."""
        grouped = grouped and self.block.head > 0
        if grouped != self.grouped and not self.blocks.is_meta:
            ext = native.module() if self.blocks.device.type == "cpu" else None
            if ext is not None and self.blocks.is_contiguous() and self.blocks.untyped_storage().nbytes() > 0:
                ext.regroup(self.blocks, self.block.ggml, self.k, grouped)  # in place: no second copy
            else:
                move = group_blocks if grouped else ungroup_blocks
                moved = move(self.blocks, self.block)
                if (source := getattr(self.blocks, SOURCE, None)) is not None:  # which part of a whole tensor it is
                    setattr(moved, SOURCE, source)
                self._buffers["blocks"] = moved
        self.grouped = grouped and not self.blocks.is_meta

    def rows(self, index: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `index` of the matrix, dequantized: llmkit's C++ dequantization on the CPU where it runs."""
        picked = self.blocks[index]
        ext = native.module() if picked.device.type == "cpu" else None
        if ext is not None and (self.grouped or not self.block.head):
            return ext.block_dequantize(picked.contiguous(), self.block.ggml, self.k).to(dtype)
        return dequantize(picked, self.block, self.k, dtype, grouped=self.grouped)

    @property
    def k(self) -> int:
        """Weights a row (from the blocks' shape: whole blocks of `block`)."""
        return self.blocks.shape[-1] // self.block.bytes * self.block.weights

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.grouped:  # the file's layout (a copy that says which part it is, as the buffer does)
            flat = ungroup_blocks(self.blocks, self.block)
            if (source := getattr(self.blocks, SOURCE, None)) is not None:
                setattr(flat, SOURCE, source)
            destination[prefix + "blocks"] = flat

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
        self.grouped = False  # what is loaded is the file's layout; prepare() (a post hook) groups it again
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


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
        out.grouped = False  # the file's layout, as _encode writes it; prepare() groups it
        out.blocks.copy_(quantize_blocks(w, out.block, importance))
        if linear.bias is not None and out.bias is not None:
            out.bias.data.copy_(linear.bias.detach())
        out.prepare()
        return out

    def _encode(self, w: Tensor) -> dict[str, Tensor]:
        self.grouped = False  # load_weight writes the file's layout; prepare() groups it
        return {"blocks": quantize_blocks(w, self.block)}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(self.blocks, self.block, self.in_features, dtype, grouped=self.grouped)

    def _dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> Tensor:
        return dequantize(self.blocks[start:end], self.block, self.in_features, dtype, grouped=self.grouped)

    def _native_rows(self, x: Tensor, start: int, end: int) -> Tensor:
        if self.block.head and not self.grouped:
            raise RuntimeError("the C++ kernels read grouped blocks")  # rows_product dequantizes instead
        return native.block_linear(x, self.blocks[start:end], self.block.ggml)

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
        self.set_grouped(self.resolved == "avx2")

    def _forward(self, x: Tensor) -> Tensor:
        if self.resolved == "avx2" and _avx2_rows(x):
            return _rows_apply(x, lambda x2: native.block_linear(x2, self.blocks, self.block.ggml), self.bias)
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{self.block.name} ({self.block.bits:.4g} bits a weight), kernel={self.kernel}"
        )
