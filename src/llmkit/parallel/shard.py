"""Cutting one layer down to one rank's part, in place: the rows (outputs) or columns (inputs) of a linear layer,
float or quantized, and the rows (vocabulary) of an embedding table. What each part is for is tensor.py's business.

    rows [a, b)      y[..., a:b] = x W[a:b]^T + bias[a:b]       a column-parallel layer: its own outputs
    columns [a, b)   part of y  = x[..., a:b] W[:, a:b]^T        a row-parallel layer: one term of a sum over ranks

Every cut tensor is copied (`contiguous().clone()`), so that the full matrix is freed once the caller drops it: a
rank then holds its part only, which the tests measure.

Cutting a model built on the meta device costs nothing, and each cut remembers which part of which whole tensor it
is (llmkit.parts), which is how a loader reads from a checkpoint only the slices this rank keeps.
"""

from __future__ import annotations

import torch
from torch import nn

from llmkit.errors import InputError
from llmkit.parts import cut, cut_parameter
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.embedding import BlockEmbedding
from llmkit.quant.linear import Fp8Linear, Int4Linear, Int8Linear, QuantizedLinear

Linear = nn.Linear | QuantizedLinear


def span(size: int, rank: int, world: int) -> tuple[int, int]:
    """The part [a, b) of range(size) that `rank` of `world` holds: equal parts (size divides), else the first
    ranks one more each."""
    base, extra = divmod(size, world)
    a = rank * base + min(rank, extra)
    return a, a + base + (rank < extra)


@torch.no_grad()
def take_rows(layer: Linear, a: int, b: int) -> None:
    """Keep output rows [a, b) of `layer` (and of its bias)."""
    if isinstance(layer, nn.Linear):
        layer.weight = cut_parameter(layer.weight, 0, a, b)
    elif isinstance(layer, QuantizedLinear):
        for name in ("qweight", "scales", "zeros", "blocks"):
            t = layer._buffers.get(name)
            if t is not None:
                layer._buffers[name] = cut(t, 0, a, b)
    else:
        raise InputError(f"tensor parallelism cannot split a {type(layer).__name__} by rows")
    if layer.bias is not None:
        layer.bias = cut_parameter(layer.bias, 0, a, b)
    layer.out_features = b - a
    _prepared(layer)


@torch.no_grad()
def take_columns(layer: Linear, a: int, b: int, keep_bias: bool) -> None:
    """Keep input columns [a, b) of `layer`; its bias only where `keep_bias` (the ranks' parts are summed, and the
    bias must be added once)."""
    if isinstance(layer, nn.Linear):
        layer.weight = cut_parameter(layer.weight, 1, a, b)
    elif isinstance(layer, (Int8Linear, Int4Linear, Fp8Linear)):
        g = layer.group_size
        if g is not None and (a % g or b % g):
            raise InputError(f"inputs [{a}, {b}) of an {layer.method} layer cut its groups of {g}")
        if isinstance(layer, Int4Linear):
            layer._buffers["qweight"] = cut(layer.qweight, 1, a // 2, b // 2)  # two codes a byte, in input order
        else:
            layer._buffers["qweight"] = cut(layer.qweight, 1, a, b)
        if g is not None:  # per-group scales follow their inputs; one scale per row (int8's default) stays
            for name in ("scales", "zeros"):
                t = layer._buffers.get(name)
                if t is not None:
                    layer._buffers[name] = cut(t, 1, a // g, b // g)
            layer.n_groups = (b - a) // g
    elif isinstance(layer, BlockLinear):  # whole blocks, in the file's layout
        w = layer.block.weights
        if a % w or b % w:
            raise InputError(f"inputs [{a}, {b}) of a {layer.block.name} layer cut its blocks of {w} inputs")
        layer._buffers["blocks"] = cut(layer.blocks, 1, a // w * layer.block.bytes, b // w * layer.block.bytes)
    else:
        raise InputError(f"tensor parallelism cannot split a {type(layer).__name__} by columns")
    if not keep_bias:
        layer.bias = None
    layer.in_features = b - a
    _prepared(layer)


def _prepared(layer: Linear) -> None:
    if isinstance(layer, QuantizedLinear) and not layer.dtype_probe.is_meta:
        layer.prepare()  # the kernel's own form of the weights, remade from the cut codes


@torch.no_grad()
def take_embedding_rows(table: nn.Embedding | BlockEmbedding, a: int, b: int) -> None:
    """Keep rows [a, b) of an embedding table (the tokens a..b-1), float or held as GGUF blocks."""
    if isinstance(table, BlockEmbedding):
        table._buffers["blocks"] = cut(table.blocks, 0, a, b)
    else:
        table.weight = cut_parameter(table.weight, 0, a, b)
    table.num_embeddings = b - a


def resident_bytes(module: nn.Module) -> int:
    """The bytes of the distinct storages behind `module`'s parameters and buffers: what this process holds of
    it, views of one storage counted once."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
