"""State that stays in fp32 whatever dtype the model is cast to, declared in one place.

Some buffers hold values that bf16 cannot keep: DeepSeek-V3's router score-correction bias moves in steps of 1e-3
(bf16 has 8 bits of mantissa, so a step would round away), and RoPE's inverse frequencies are compared bit for bit
with the references. A module lists such buffers in `fp32_buffers`; `model.to(torch.bfloat16)` then casts
everything else, and checkpoint writers and loaders ask `fp32_state(model)` which names to leave alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FP32Buffers(nn.Module):
    """Keeps the buffers named in `fp32_buffers` in fp32 when the module is cast (model.to(torch.bfloat16))."""

    fp32_buffers: tuple[str, ...] = ()

    def _apply(self, fn: Any, recurse: bool = True) -> FP32Buffers:
        kept = {n: b for n in self.fp32_buffers if (b := self._buffers.get(n)) is not None}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = new.float() if old.is_meta else old.to(new.device, torch.float32)
        return self


def fp32_state(model: nn.Module) -> set[str]:
    """State-dict names of the buffers that stay fp32 in `model` (router biases, rotary frequencies)."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, FP32Buffers):
            for name in module.fp32_buffers:
                if module._buffers.get(name) is not None:
                    names.add(f"{prefix}.{name}" if prefix else name)
    return names


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None, keep: set[str]) -> dict[str, torch.Tensor]:
    """A state dict with its floating-point tensors cast to `dtype`, except the names in `keep`."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() and k not in keep else v for k, v in state.items()}
