"""A token embedding that reads its rows from a quantized output head holding the same table (a tied model whose
file stores the table quantized, such as SmolLM2's Q8_0 GGUF): each token's row is dequantized from the head's codes
when it is looked up, so the model holds the table once, as codes, instead of also as a float copy (113 MB of
SmolLM2-135M's 225).

The head stays the model's own submodule (its codes are saved once, under "head."); this module only refers to it,
so it has no state of its own and follows the head's device and dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit.quant.block_linear import BlockLinear, HeldBlocks
from llmkit.quant.blocks import BlockType, block_type, quantize_blocks
from llmkit.quant.formats import dequantize_int4, dequantize_int8
from llmkit.quant.linear import Int4Linear, QuantizedLinear


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's interface (num_embeddings, embedding_dim, forward(ids), `weight` reading back the table) over
    the rows of a quantized head (vocab, dim)."""

    source: QuantizedLinear

    def __init__(self, head: QuantizedLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = None
        object.__setattr__(self, "source", head)  # a reference, not a submodule: the codes are saved as the head's

    @property
    def placement(self) -> Tensor:
        """An empty tensor on the device and in the dtype the rows come out in (the head's compute dtype)."""
        return self.source.dtype_probe

    @property
    def weight(self) -> Tensor:
        """The whole table, dequantized (for code that reads an embedding's weight; lookups read only their rows)."""
        return self.source.dequantize(self.source.compute_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        """ids (...) int -> rows (..., dim), dequantized from the head's codes."""
        head, flat = self.source, ids.reshape(-1)
        if isinstance(head, BlockLinear):
            rows = head.rows(flat, head.compute_dtype)
        elif isinstance(head, Int4Linear):
            rows = dequantize_int4(head.qweight[flat], head.scales[flat], head.zeros[flat], head.compute_dtype)
        else:
            rows = dequantize_int8(head.qweight[flat], head.scales[flat], head.compute_dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the quantized head"


class BlockEmbedding(HeldBlocks):
    """An embedding table (num_embeddings, embedding_dim) held as rows of GGUF blocks (`blocks`, uint8): each token's
    row is dequantized when it is looked up, so the table costs its file's bytes, not an fp32 copy (604 MB of
    Llama-3.2-3B's shape)."""

    blocks: Tensor
    dtype_probe: Tensor

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        block: BlockType | str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None
        self.block = block if isinstance(block, BlockType) else block_type(block)
        row = self.block.row_bytes(embedding_dim)
        self.register_buffer("blocks", torch.zeros(num_embeddings, row, dtype=torch.uint8, device=device))
        # follows the model's casts: the dtype rows come out in
        self.register_buffer("dtype_probe", torch.empty(0, device=device, dtype=dtype), persistent=False)

    @classmethod
    def from_float(cls, table: Tensor, block: BlockType | str) -> BlockEmbedding:
        """A float table (num_embeddings, embedding_dim) quantized to `block` (blocks.quantize_blocks)."""
        out = cls(table.shape[0], table.shape[1], block, device=table.device, dtype=table.dtype)
        out.blocks.copy_(quantize_blocks(table, out.block))
        return out

    @property
    def placement(self) -> Tensor:
        return self.dtype_probe

    @property
    def weight(self) -> Tensor:
        """The whole table, dequantized (for code that reads an embedding's weight)."""
        return self.rows(torch.arange(self.num_embeddings, device=self.blocks.device), self.dtype_probe.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        """ids (...) int -> rows (..., dim)."""
        return self.rows(ids.reshape(-1), self.dtype_probe.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.block.name} rows dequantized when looked up"
