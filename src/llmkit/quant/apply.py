"""Quantizing a model from outside, like parallelism: `quantize(model, "int8")` swaps its linear layers (and MoE
experts) for quantized ones in place. The model's code does not change; a `QuantSpec` records what was done, so that
a checkpoint can rebuild the same structure before loading (`apply_spec`).

What is quantized: every nn.Linear inside the blocks (attention projections, MLA's down/up projections, whose
absorbed form reads the dequantized `weight`, the sparse indexer's, the MTP modules'), MoE experts' stacked weights,
and with include_head the output head (for a tied head, a quantized copy of the embedding; the embedding lookup
itself stays in float: it reads one row per token, unless the spec's embedding_from_head has it read its rows from
the head's codes, as a GGUF file's tied table loads). Routers and norms stay in float.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from llmkit.errors import InputError
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.layers.moe import GroupedExperts
from llmkit.quant import native
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.blocks import FLOAT_TYPES, TYPES
from llmkit.quant.embedding import BlockEmbedding, QuantizedEmbedding
from llmkit.quant.experts import QuantizedExperts
from llmkit.quant.kernels import Kernel
from llmkit.quant.linear import LAYERS, QuantizedLinear
from llmkit.quant.mixtures import MIXTURES, mixture_spec
from llmkit.quant.spec import Method, QuantSpec, embedding_table, quantized_spec, targets


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where `name` is, in the train / eval mode of the module it replaces (or of its parent, for a
    tied head that had no module)."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr, None)
    module.train(old.training if isinstance(old, nn.Module) else parent.training)
    setattr(parent, attr, module)


@torch.no_grad()
def quantize(
    model: nn.Module,
    method: Method,
    group_size: int | None = None,
    include_head: bool = False,
    kernel: Kernel = "auto",
    importance: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Replace `model`'s linear layers (and MoE experts; and the head with include_head) by quantized ones, in
    place; returns the model. int8 defaults to one scale per output row, int4 to groups of 32. `method` may also
    name one of llama.cpp's mixtures ("Q4_K_M", ...: llmkit.quant.mixtures), which sets each layer's block type,
    the head's and the embedding table's. `importance`: layer name -> the importance of each of its inputs
    (ImportanceMatrix.for_model, llmkit.interop.imatrix) weighs those block-type layers' quantization (weighted.py)."""
    if quantized_spec(model) is not None or any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise InputError("the model is already quantized (quantize a float model, or load the float checkpoint)")
    spec = spec_for(model, method, group_size, include_head, importance=importance is not None)
    rows = dict(importance or {})
    if rows and spec.method in LAYERS and not spec.layers:
        raise InputError(f"an importance matrix weighs llama.cpp's block types, not llmkit's {spec.method}")
    for name, module in targets(model, spec):
        _set(model, name, _quantized(module, spec, name, kernel, rows.get(name)))
    if spec.include_head and getattr(model, "head", "absent") is None:  # tied: a quantized copy of the embedding
        table = embedding_table(model)
        head = nn.Linear(table.shape[1], table.shape[0], bias=False, device=table.device)
        head.weight.data = table.detach()
        _set(model, "head", _quantized(head, spec, "head", kernel))
    if spec.embedding_from_head:  # the table is the head's codes (as a GGUF file holds a tied table)
        _set(model, "embed", QuantizedEmbedding(model.get_submodule("head")))  # type: ignore[arg-type]
    elif spec.embedding is not None:
        _set(model, "embed", BlockEmbedding.from_float(embedding_table(model), spec.embedding))
    set_kernel_choice(model, native.default_choice())
    model.quantization = spec  # type: ignore[assignment]  # a plain attribute: the record of what was done
    return model


def spec_for(
    model: nn.Module, method: str, group_size: int | None = None, include_head: bool = False, importance: bool = False
) -> QuantSpec:
    """The QuantSpec `quantize(model, method, ...)` applies: one of llama.cpp's mixtures ("Q4_K_M", ...: every
    layer, the head and the embedding table in their types; `importance`: the mixture as llama.cpp chooses it when
    given an importance matrix), or `method` for every linear layer (int4 in groups of 32 unless told)."""
    if method.upper() in MIXTURES:
        if group_size is not None:
            raise InputError(f"{method} gives each layer a block type of its own: no group size")
        return mixture_spec(model, method, importance)
    if method == "int4" and group_size is None:
        group_size = 32
    if method in FLOAT_TYPES and include_head:  # the embedding table at that width too (the head's, where tied)
        tied = getattr(model, "head", "absent") is None
        return QuantSpec(method, None, True, embedding_from_head=tied, embedding=None if tied else method)
    return QuantSpec(method, group_size, include_head)


def set_kernel_choice(model: nn.Module, choice: native.KernelChoice) -> None:
    """Give every quantized layer of `model` `choice` (how llmkit's C++ kernels multiply many rows on this machine:
    native.KernelChoice), and the attention layers with quantized projections a prompt kernel with it
    (GroupedQueryAttention.prefill_kernel: on the CPU's bf16 units where the many-row products multiply in bf16,
    whose precision the attention then shares)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.kernel_choice = choice
        if isinstance(module, GroupedQueryAttention) and isinstance(module.wq, QuantizedLinear):
            module.prefill_kernel = native.PrefillAttention(choice)


@contextlib.contextmanager
def kernel_choice_set(model: nn.Module, choice: native.KernelChoice) -> Iterator[None]:
    """set_kernel_choice(model, choice) inside the `with` block only: each layer has its own choice back after."""
    held: list[tuple[nn.Module, str, Any]]
    held = [(m, "kernel_choice", m.kernel_choice) for m in model.modules() if isinstance(m, QuantizedLinear)]
    held += [(m, "prefill_kernel", m.prefill_kernel) for m in model.modules() if isinstance(m, GroupedQueryAttention)]
    set_kernel_choice(model, choice)
    try:
        yield
    finally:
        for module, name, value in held:
            setattr(module, name, value)


def _quantized(
    module: nn.Module, spec: QuantSpec, name: str, kernel: Kernel, importance: torch.Tensor | None = None
) -> nn.Module:
    method, group = spec.for_layer(name)
    if isinstance(module, GroupedExperts):
        if method in TYPES:
            raise InputError(f"{name}: experts' stacks are quantized to int8 or int4, not {method}")
        return QuantizedExperts.from_experts(module, method, group, "dequant" if kernel == "dequant" else "auto")
    assert isinstance(module, nn.Linear)
    if method in TYPES:
        return BlockLinear.from_float(module, method, kernel, importance)
    return _layer_class(method).from_linear(module, group, kernel)


def _layer_class(method: str) -> type[QuantizedLinear]:
    return LAYERS[method]


def _shell(method: str, inputs: int, outputs: int, bias: bool, group: int | None, device: Any) -> QuantizedLinear:
    """An empty quantized layer of `method` (int8, int4, or a GGUF block type, whose blocks set their own groups)."""
    if method in TYPES:
        return BlockLinear(inputs, outputs, bias, method, device=device)
    return _layer_class(method)(inputs, outputs, bias, group, device=device)


def apply_spec(model: nn.Module, spec: QuantSpec, device: torch.device | str | None = "meta") -> nn.Module:
    """Give a freshly built (meta-device) model the quantized structure of `spec`, with empty weights, so that a
    quantized checkpoint's state dict loads into it."""
    for name, module in targets(model, spec):
        method, group = spec.for_layer(name)
        shell: nn.Module
        if isinstance(module, GroupedExperts):
            shell = QuantizedExperts.empty(module, method, group, device)
        else:
            assert isinstance(module, nn.Linear)
            bias = module.bias is not None
            shell = _shell(method, module.in_features, module.out_features, bias, group, device)
        _set(model, name, shell)
    if spec.include_head and getattr(model, "head", "absent") is None:
        vocab, dim = embedding_table(model).shape
        method, group = spec.for_layer("head")
        head = _shell(method, dim, vocab, False, group, device)
        model.head = head
        if spec.embedding_from_head:
            _set(model, "embed", QuantizedEmbedding(head))
    elif spec.embedding_from_head:
        raise InputError("embedding_from_head needs a tied model (one without a head of its own)")
    if spec.embedding is not None:
        vocab, dim = embedding_table(model).shape
        _set(model, "embed", BlockEmbedding(vocab, dim, spec.embedding, device=device))
    set_kernel_choice(model, native.default_choice())
    model.quantization = spec  # type: ignore[assignment]  # a plain attribute: the record of what was done
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer a forward pass reads as weights (codes and scales for quantized layers;
    non-persistent buffers such as rotary tables excluded)."""
    total = 0
    for module in model.modules():
        persistent = {n for n in module._buffers if n not in module._non_persistent_buffers_set}
        total += sum(p.numel() * p.element_size() for p in module._parameters.values() if p is not None)
        total += sum(
            b.numel() * b.element_size() for n, b in module._buffers.items() if b is not None and n in persistent
        )
    return total


def parameter_count(model: nn.Module) -> int:
    """The model's parameters counted as weights, quantized or not (a quantized (N, K) layer counts N * K)."""
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.in_features * module.out_features
    return total


def describe(model: nn.Module) -> str:
    """'225.0 MB of weights (int4 g32: 210 layers, int8 g32: 1 layer)', '895.1 MB of weights (Q4_K: 169 layers,
    Q6_K: 29 layers)', or '538.1 MB of weights (fp32)'."""
    kinds: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, BlockLinear):
            kinds[module.block.name] = kinds.get(module.block.name, 0) + 1
        elif isinstance(module, QuantizedLinear):
            g = "" if module.group_size is None else f" g{module.group_size}"
            key = f"{module.method}{g}"
            kinds[key] = kinds.get(key, 0) + 1
    floats = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    parts = [f"{k}: {n} layer{'s' if n > 1 else ''}" for k, n in kinds.items()] or sorted(floats)
    return f"{weight_bytes(model) / 1e6:.1f} MB of weights ({', '.join(parts)})"
