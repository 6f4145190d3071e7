"""Building a model straight from another format's tensors: checked first, read lazily, no second copy.

The model is built on the meta device (no memory), every name and shape the key map implies is checked against the
source's header, and then each rule's tensors are read, transformed, cast and assigned in turn. Memory holds the
model being filled plus one rule's inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError
from llmkit.interop.keymap import Concrete, check_against, convert_to_ours
from llmkit.interop.safetensors_io import CheckpointError
from llmkit.layers.precision import fp32_state
from llmkit.models import DecoderLM, EncoderDecoder, build_model

if TYPE_CHECKING:
    from llmkit.quant import QuantSpec


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """llmkit's state-dict names and shapes for `cfg` (from a meta-device model: no memory)."""
    return {n: tuple(t.shape) for n, t in build_model(cfg, device="meta").state_dict().items()}


def _checkpoint_dtype(concrete: list[Concrete], get: Callable[[str], Tensor]) -> torch.dtype:
    """The floating dtype of the first weight the map reads (embeddings come first): the model's default dtype."""
    for c in concrete:
        t = get(c.theirs[0])
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def build_with_weights(
    cfg: ModelConfig,
    concrete: list[Concrete],
    get: Callable[[str], Tensor],
    source_shapes: Mapping[str, tuple[int, ...]],
    ignored: Callable[[str], bool],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    where: str,
) -> DecoderLM | EncoderDecoder:
    """A model for `cfg` holding the source's weights. Raises MappingError naming missing, unexpected or misshapen
    source tensors before anything is read."""
    model = build_model(cfg, device="meta")
    ours = model.state_dict()
    produced = [n for c in concrete for n in c.ours]
    unmapped = sorted(set(ours) - set(produced))
    if unmapped:  # a key map that forgets a parameter is a bug in llmkit, not in the checkpoint
        raise LLMKitError(f"the key map does not produce {unmapped[:8]}; please report this")
    check_against(concrete, {n: tuple(t.shape) for n, t in ours.items()}, source_shapes, ignored, where)
    keep = fp32_state(model)
    target = dtype or _checkpoint_dtype(concrete, get)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, Tensor] = {}
    for name, t in convert_to_ours(concrete, get):
        if t.is_floating_point():
            t = t.to(torch.float32 if name in keep else target)
        state[name] = t.to(dev)
    model.load_state_dict(state, strict=True, assign=True)
    materialize_buffers(model, dev)
    return model


def build_quantized(
    cfg: ModelConfig,
    spec: QuantSpec,
    read: Callable[[dict[str, tuple[int, ...]]], dict[str, Tensor]],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    where: str,
) -> DecoderLM | EncoderDecoder:
    """A model for `cfg` with the quantized structure of `spec`, holding the tensors `read(expected names and
    shapes)` returns (codes, scales, and the float weights left unquantized). Floats are cast to `dtype` (default:
    the first float weight's), scales stay fp32."""
    from llmkit.quant import apply_spec

    model = build_model(cfg, device="meta")
    apply_spec(model, spec)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    state = read(expected)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: quantized weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [n for n in expected if tuple(state[n].shape) != expected[n]]
    if bad:
        raise CheckpointError(f"{where}: {bad[0]} has shape {tuple(state[bad[0]].shape)}, expected {expected[bad[0]]}")
    keep = fp32_state(model)
    floats = [t.dtype for n, t in state.items() if t.is_floating_point() and n not in keep]
    target = dtype or (floats[0] if floats else torch.float32)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    for name, t in state.items():
        if t.is_floating_point():
            t = t.to(torch.float32 if name in keep else target)
        state[name] = t.to(dev)
    model.load_state_dict(state, strict=True, assign=True)
    materialize_buffers(model, dev)
    model.to(target)  # the dtype the quantized layers compute in (codes and scales keep theirs)
    return model


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
