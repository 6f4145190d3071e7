"""Soft-capping (Gemma 2): cap * tanh(x / cap), a smooth bound on attention scores and output logits.

Near 0 it is the identity (tanh(u) ~ u), so small values pass unchanged; large ones saturate at +-cap instead of
growing without limit, which keeps the softmax away from one-hot extremes during training. Gemma 2 caps attention
scores at 50 and the final logits at 30. Shapes: any -> the same.
"""

from __future__ import annotations

import torch
from torch import Tensor


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(x / cap); x unchanged when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap
