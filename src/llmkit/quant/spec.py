"""What a quantized model is quantized to: `QuantSpec` (the record a checkpoint keeps, which rebuilds the same
structure before loading), the methods it names, and which layers a spec covers (`targets`). apply.py swaps the
layers; mixtures.py writes llama.cpp's per-tensor choices as a spec."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from llmkit.errors import InputError
from llmkit.layers.moe import GroupedExperts
from llmkit.quant.blocks import TYPES
from llmkit.quant.experts import QuantizedExperts

Method = str  # "int8", "int4", "fp8", or a GGUF block type (llmkit.quant.blocks.TYPES: "Q4_K", "Q8_0", ...)
METHODS: tuple[str, ...] = ("int8", "int4", "fp8", *TYPES)
GROUP_SIZES = (32, 64, 128, 256)  # the ones torch's int4 kernels take; other sizes run dequantized


@dataclass(frozen=True)
class QuantSpec:
    """method: "int8", "int4", "fp8" or a GGUF block type ("Q4_K", ...: llmkit.quant.blocks); group_size: inputs
    per scale (None: one per output row, int8 and fp8; block types have their own); include_head: the output head too;
    layers: when given, exactly the layers quantized, each with its own [method, group size] (a GGUF file's: the
    tensors it stores quantized, each in its block type), overriding method and group_size; embedding_from_head: a
    tied model's embedding reads its rows from the quantized head's codes (QuantizedEmbedding) instead of keeping a
    float table (set where the codes are the table exactly: a GGUF file's tied embedding); embedding: an untied
    embedding table held in this block type (BlockEmbedding: rows dequantized when looked up)."""

    method: Method
    group_size: int | None = None
    include_head: bool = False
    layers: dict[str, list[Any]] | None = None
    embedding_from_head: bool = False
    embedding: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"quantization method {self.method!r} is not one of {', '.join(METHODS)}")
        for name, (method, _) in (self.layers or {}).items():
            if method not in METHODS:
                raise InputError(f"layer {name}: quantization method {method!r} is not one of {', '.join(METHODS)}")
        if self.embedding is not None and self.embedding not in TYPES:
            raise InputError(
                f"an embedding table is held in a GGUF block type ({', '.join(TYPES)}), not {self.embedding!r}"
            )
        if self.method == "int4" and self.group_size is None:
            raise InputError("int4 needs a group size: one of " + ", ".join(map(str, GROUP_SIZES)))
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise InputError(f"group_size={self.group_size} must be an even number of inputs (32, 64, 128 are usual)")
        if self.embedding_from_head and not self.include_head:
            raise InputError("embedding_from_head reads the quantized head's codes: it needs include_head")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        unknown = set(d) - {"method", "group_size", "include_head", "layers", "embedding_from_head", "embedding"}
        if unknown:
            raise InputError(f"unknown quantization fields {sorted(unknown)}")
        return cls(**d)

    def for_layer(self, name: str) -> tuple[Method, int | None]:
        if self.layers and name in self.layers:
            method, group = self.layers[name]
            return method, group
        return self.method, self.group_size


def quantized_spec(model: nn.Module) -> QuantSpec | None:
    """The spec a model was quantized with (None: not quantized)."""
    spec = getattr(model, "quantization", None)
    return spec if isinstance(spec, QuantSpec) else None


def targets(model: nn.Module, spec: QuantSpec) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every layer the spec quantizes, in the order of named_modules."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if (name == "head" and not spec.include_head) or (spec.layers is not None and name not in spec.layers):
            continue
        if isinstance(module, (nn.Linear, GroupedExperts)) and not isinstance(module, QuantizedExperts):
            out.append((name, module))
    return out


def embedding_table(model: nn.Module) -> torch.Tensor:
    """The embedding table's weight (float, before quantizing)."""
    weight = model.get_submodule("embed").weight
    assert isinstance(weight, torch.Tensor)
    return weight
