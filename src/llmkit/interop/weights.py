"""Building a model straight from another format's tensors: checked first, read lazily, no second copy.

The model is built on the meta device (no memory), every name and shape the key map implies is checked against the
source's header, and then each rule's tensors are read, transformed, cast and assigned in turn. Memory holds the
model being filled plus one rule's inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError
from llmkit.interop.keymap import Concrete, check_against, convert_to_ours
from llmkit.layers.moe import FP32Buffers
from llmkit.models import DecoderLM, EncoderDecoder, build_model


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
    params = {n for n, _ in model.named_parameters()}
    target = dtype or _checkpoint_dtype(concrete, get)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, Tensor] = {}
    for name, t in convert_to_ours(concrete, get):
        if t.is_floating_point():
            t = t.to(target if name in params else torch.float32)  # buffers (router bias) stay fp32
        state[name] = t.to(dev)
    model.load_state_dict(state, strict=True, assign=True)
    materialize_buffers(model, dev)
    return model


@torch.no_grad()
def materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Give buffers that are not in a checkpoint (still on the meta device) their initial value: zeros."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                dtype = torch.float32 if isinstance(module, FP32Buffers) else buf.dtype
                module._buffers[name] = torch.zeros(buf.shape, dtype=dtype, device=device)
