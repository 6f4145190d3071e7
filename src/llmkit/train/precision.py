"""How a training step's arithmetic is done, a strategy the loop is given: the autocast dtype of the forward (none in
fp32) and, in fp16, the gradient scaler that keeps small gradients from flushing to zero (CUDA only; bf16 has fp32's
range and needs none). The loop calls backward, unscale and step through it and never names a precision."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from llmkit.train.control import autocast
from llmkit.train.optim import Optimizer, parts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """`name`: fp32, bf16 or fp16 (resolved: control.resolve_precision turns "auto" into one of them)."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.device = name, device
        self.dtype = DTYPES[name]
        self.scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's context: autocast to the precision's dtype (nothing in fp32)."""
        return autocast(self.name, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: Optimizer) -> None:
        """The gradients at their true size, before they are clipped and checked."""
        if self.scaler is not None:
            for part in parts(optimizer):
                self.scaler.unscale_(part)

    def step(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            for part in parts(optimizer):  # (each skipped alike when a gradient is not finite)
                self.scaler.step(part)
            self.scaler.update()
        else:
            optimizer.step()
