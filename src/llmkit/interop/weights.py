"""Building a model straight from another format's tensors: checked first, read lazily, no second copy.

The model is built on the meta device (no memory), every name and shape the key map implies is checked against the
source's header, and then each rule's tensors are read, transformed, cast and assigned in turn. Memory holds the
model being filled plus one rule's inputs.

A tensor-parallel rank loads its part only (`split`): the model is cut on the meta device first, each cut tensor
remembers which part of which whole tensor it is (llmkit.parts), and only those parts are read: slices of the file
where the format and the rule allow (safetensors with pread, GGUF from its memory map; identity, transposed,
stacked-expert, RoPE-permuted and fused tensors such as GPT-2's c_attn or Phi-3's qkv_proj), else the rule's tensors
whole, cut at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError
from llmkit.interop.keymap import IDENTITY, Concrete, check_against
from llmkit.interop.safetensors_io import CheckpointError
from llmkit.layers.precision import fp32_state
from llmkit.models import DecoderLM, EncoderDecoder, build_model
from llmkit.parts import SOURCE, Index, mark_sources, narrowed, own, parts_of

if TYPE_CHECKING:
    from llmkit.quant import QuantSpec

# a model -> the importance of each input of its layers, by layer name (ImportanceMatrix.for_model)
LayerImportance = Callable[[torch.nn.Module], Mapping[str, Tensor]]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """llmkit's state-dict names and shapes for `cfg` (from a meta-device model: no memory)."""
    return {n: tuple(t.shape) for n, t in build_model(cfg, device="meta").state_dict().items()}


Split = Callable[[torch.nn.Module], object]  # cuts a model built on the meta device down to one rank's part
PartReader = Callable[[str, Index], Tensor]  # (a tensor's name in the source, a part of it) -> that part only


def _checkpoint_dtype(
    concrete: list[Concrete],
    get: Callable[[str], Tensor],
    part: PartReader | None,
    shapes: Mapping[str, tuple[int, ...]],
) -> torch.dtype:
    """The floating dtype of the first weight the map reads (embeddings come first): the model's default dtype.
    With a part reader, one element of it is read."""
    for c in concrete:
        name = c.theirs[0]
        t = part(name, tuple((0, min(1, n)) for n in shapes[name])) if part is not None else get(name)
        if t.is_floating_point():
            return t.dtype
    return torch.float32


class RuleReader:
    """llmkit's tensors read from another format through its rules, whole or in part: a part is read alone where
    the rule's transform says how (Transform.part), else its rule's inputs are read whole, transformed and cut (one
    rule's at a time: the last one is kept for the rule's other outputs)."""

    def __init__(self, concrete: list[Concrete], get: Callable[[str], Tensor], part: PartReader | None) -> None:
        self.rule = {n: (c, k) for c in concrete for k, n in enumerate(c.ours)}
        self.get, self.part = get, part
        self.last: tuple[Concrete | None, list[Tensor]] = (None, [])

    def __call__(self, name: str, index: Index | None, shape: tuple[int, ...]) -> Tensor:
        c, k = self.rule[name]
        if index is not None and self.part is not None:
            how = c.transform.part(c.theirs, index, shape, k)
            if how is not None:
                pieces, transform = how
                return transform.to_ours([self.part(n, i) for n, i in pieces])[0]
        if self.last[0] is not c:
            self.last = (None, [])  # the previous rule's tensors go before this one's are read
            self.last = (c, c.transform.to_ours([self.get(n) for n in c.theirs]))
        whole = self.last[1][k]
        return whole if index is None else own(narrowed(whole, index))


def _fill(
    model: torch.nn.Module, read: Callable[[str, Index | None], Tensor], device: torch.device, where: str
) -> None:
    """Assign every state-dict entry of `model` (on the meta device, maybe cut: parts.parts_of) what `read(source
    name, part)` gives, each part read once (a tied weight is one tensor), checked against the expected shape."""
    state: dict[str, Tensor] = {}
    done: dict[tuple[str, Index | None], Tensor] = {}
    meta, parts = model.state_dict(keep_vars=True), parts_of(model)
    for name, key in parts.items():
        if key not in done:
            done[key] = read(*key)
        t = state[name] = done[key]
        if tuple(t.shape) != tuple(meta[name].shape):
            raise CheckpointError(f"{where}: {key[0]} has shape {tuple(t.shape)}, expected {tuple(meta[name].shape)}")
        if key[1] is not None:  # (a buffer is assigned as it is)
            setattr(t, SOURCE, key)
    model.load_state_dict(state, strict=True, assign=True)
    materialize_buffers(model, device)
    # a part keeps saying which part it is (the assigned parameters are new objects)
    held = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for name, key in parts.items():
        if key[1] is not None and name in held:
            setattr(held[name], SOURCE, key)


def build_with_weights(
    cfg: ModelConfig,
    concrete: list[Concrete],
    get: Callable[[str], Tensor],
    source_shapes: Mapping[str, tuple[int, ...]],
    ignored: Callable[[str], bool],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    where: str,
    *,
    split: Split | None = None,
    part: PartReader | None = None,
    quantize: str | None = None,
    own_width: bool = False,
    view: Callable[[str], Tensor] | None = None,
    importance: LayerImportance | None = None,
) -> DecoderLM | EncoderDecoder:
    """A model for `cfg` holding the source's weights. Raises MappingError naming missing, unexpected or misshapen
    source tensors before anything is read. `split` cuts the model (on the meta device) first, and then only the
    parts it keeps are read: through `part` where the source reads slices, else whole one rule at a time.
    `quantize` (a GGUF block type or one of llama.cpp's mixtures: "Q4_K_M", "Q8_0", ...) quantizes each layer's
    weight as it is read (`_quantizing`), so memory never holds the float model, each weighted by `importance`
    where given. `own_width`: a bf16 or fp16
    source loaded on the CPU without a dtype keeps its weights at that width where llmkit's kernels multiply them
    (`held_width`): where the source gives `view`s of its tensors (a memory map), those are the layers' blocks."""
    model = build_model(cfg, device="meta")
    ours = model.state_dict()
    produced = [n for c in concrete for n in c.ours]
    unmapped = sorted(set(ours) - set(produced))
    if unmapped:  # a key map that forgets a parameter is a bug in llmkit, not in the checkpoint
        raise LLMKitError(f"the key map does not produce {unmapped[:8]}; please report this")
    check_against(concrete, {n: tuple(t.shape) for n, t in ours.items()}, source_shapes, ignored, where)
    keep, shapes = fp32_state(model), {n: tuple(t.shape) for n, t in ours.items()}
    if split is not None:
        mark_sources(model)
        split(model)
    target = dtype or _checkpoint_dtype(concrete, get, part, source_shapes)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if own_width and quantize is None and split is None and dtype is None and dev.type == "cpu":
        width = held_width(model, target)
        if width is not None:
            quantize, target = width, torch.float32
    reader = RuleReader(concrete, get, part)

    def read(name: str, index: Index | None) -> Tensor:
        t = reader(name, index, shapes[name])
        if t.is_floating_point():
            t = t.to(torch.float32 if name in keep else target)
        return t.to(dev)

    fill: Callable[[str, Index | None], Tensor] = read
    if quantize is not None:
        if split is not None:
            raise LLMKitError("quantizing while loading reads whole layers: it does not take a tensor-parallel split")

        from llmkit.quant.blocks import FLOAT_TYPES

        def source(name: str, kind: str) -> Tensor:  # a weight to quantize to `kind`, as the source stores it
            c, _ = reader.rule[name]
            if view is not None and kind in FLOAT_TYPES and c.transform is IDENTITY and dev.type == "cpu":
                stored = view(c.theirs[0])
                if stored.dtype == FLOAT_TYPES[kind]:  # the block type's own width: held as mapped
                    return stored
            return reader(name, None, shapes[name]).to(dev)

        fill = _quantizing(model, quantize, read, source, importance)
    _fill(model, fill, dev, where)
    if quantize is not None:
        model.to(target)  # the dtype the quantized layers compute in (blocks keep theirs)
    return model


def held_width(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """The block type ("BF16", "F16") that holds the weights of `model`, whose checkpoint stores them in `dtype`, at
    their own width, with activations in fp32: every linear layer, the head and the embedding table as the file's
    bytes, multiplied by llmkit's C++ kernels (a decoding step reads 2 bytes a weight, not an fp32 copy's 4, and
    not through PyTorch's bf16 path, which decodes at half the memory's rate). None where that does not apply: an
    fp32 source, no C++ kernels on this machine, a mixture of experts (its stacks are not block layers), or a layer
    whose inputs are not whole blocks of 32."""
    from llmkit.layers.moe import GroupedExperts
    from llmkit.quant import native
    from llmkit.quant.blocks import FLOAT_TYPES

    name = next((n for n, t in FLOAT_TYPES.items() if t == dtype), None)
    if name is None or native.module() is None or not isinstance(model, DecoderLM):
        return None
    for module in model.modules():
        if isinstance(module, GroupedExperts) or (isinstance(module, torch.nn.Linear) and module.in_features % 32):
            return None
    return name


def _quantizing(
    model: torch.nn.Module,
    method: str,
    read: Callable[[str, Index | None], Tensor],
    source: Callable[[str, str], Tensor],
    importance: LayerImportance | None = None,
) -> Callable[[str, Index | None], Tensor]:
    """Give the meta-device `model` the quantized structure of `method` (a GGUF block type for every linear layer
    and the head, or a mixture's types: llmkit.quant.mixtures), and return a reader that fills each layer's blocks
    by reading its float weight as the source stores it (`source(name, block type)`: not cast first) and
    quantizing it at once (a tied head's blocks from the embedding table); everything else comes from `read`. A
    weight stored in the block type's own width (a bf16 tensor held as BF16) is not copied. `importance` weighs
    each layer it has a row for (llmkit.quant.weighted)."""
    from llmkit.quant import apply_spec
    from llmkit.quant.apply import spec_for
    from llmkit.quant.blocks import TYPES, quantize_blocks
    from llmkit.quant.mixtures import MIXTURES

    name = method.upper()
    if name not in TYPES and name not in MIXTURES:
        raise LLMKitError(f"quantizing while loading takes a GGUF block type or a mixture, not {method!r}")
    spec = spec_for(model, name, include_head=True, importance=importance is not None)
    tied = getattr(model, "head", "absent") is None
    rows = importance(model) if importance is not None else {}
    apply_spec(model, spec)

    def read_quantized(key: str, index: Index | None) -> Tensor:
        layer, _, field = key.rpartition(".")
        if field != "blocks":
            return read(key, index)
        weight = "embed.weight" if layer == "head" and tied else f"{layer}.weight"
        kind = spec.embedding if layer == "embed" and spec.embedding else spec.for_layer(layer)[0]
        return quantize_blocks(source(weight, kind), kind, rows.get(layer) if layer != "embed" else None)

    return read_quantized


def build_quantized(
    cfg: ModelConfig,
    spec: QuantSpec,
    read: Callable[[dict[str, tuple[int, ...]]], dict[str, Tensor]],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    where: str,
    *,
    split: Split | None = None,
    part: Callable[[str, Index | None], Tensor] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> DecoderLM | EncoderDecoder:
    """A model for `cfg` with the quantized structure of `spec`, holding the tensors `read(expected names and
    shapes)` returns (codes, scales, and the float weights left unquantized). Floats are cast to `dtype` (default:
    the first float weight's), scales stay fp32. With `split` (which cuts the model on the meta device first) and
    `part(our name, part or None)`, only this rank's parts are read (`shapes`: the source's, checked first)."""
    from llmkit.quant import apply_spec

    model = build_model(cfg, device="meta")
    apply_spec(model, spec)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    keep = fp32_state(model)
    if shapes is not None:
        check_state(expected, shapes, where)
    if split is not None:
        mark_sources(model)
        split(model)
    if split is None or part is None:  # read whole (and cut when split)
        whole = read(expected)
        check_state(expected, {n: tuple(t.shape) for n, t in whole.items()}, where)

        def part(name: str, index: Index | None) -> Tensor:
            return whole[name] if index is None else own(narrowed(whole[name], index))

    parts = {key: part(*key) for key in dict.fromkeys(parts_of(model).values())}
    whole = {}
    floats = [t.dtype for (n, _), t in parts.items() if t.is_floating_point() and n not in keep]
    target = dtype or (floats[0] if floats else torch.float32)
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def cast(name: str, index: Index | None) -> Tensor:
        t = parts.pop((name, index))
        if t.is_floating_point():
            t = t.to(torch.float32 if name in keep else target)
        return t.to(dev)

    _fill(model, cast, dev, where)
    model.to(target)  # the dtype the quantized layers compute in (codes and scales keep theirs)
    return model


def check_state(expected: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """A CheckpointError naming the quantized weights missing, unexpected or misshapen."""
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: quantized weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [n for n in expected if tuple(shapes[n]) != expected[n]]
    if bad:
        raise CheckpointError(f"{where}: {bad[0]} has shape {tuple(shapes[bad[0]])}, expected {expected[bad[0]]}")


@torch.no_grad()
def materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Put the buffers that are not in a checkpoint on `device`: ones still on the meta device get their initial
    value, zeros (in fp32 where declared so); computed ones (rotary frequencies, built on the CPU) are moved."""
    keep = fp32_state(model)
    for prefix, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is None or buf.device == device:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if buf.is_meta:
                dtype = torch.float32 if full in keep else buf.dtype
                module._buffers[name] = torch.zeros(buf.shape, dtype=dtype, device=device)
            else:
                module._buffers[name] = buf.to(device)
