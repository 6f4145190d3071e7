"""Absolute position encodings added to the token embeddings (RoPE, applied inside attention, is in rope.py).

Attention is permutation-invariant: without positions "dog bites man" and "man bites dog" give the same scores.
- Sinusoidal (Vaswani et al. 2017 §3.5): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same). No
  parameters; PE(pos + k) is a linear function of PE(pos), and it is defined for any position, including ones
  longer than seen in training.
- Learned (GPT-2): one trained vector per position up to a maximum length; nothing beyond it.

Both map positions (B | 1, T) int -> (B | 1, T, C) and are added to the (scaled) token embeddings.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit.config import Layout
from llmkit.errors import ConfigError
from llmkit.layers.tables import token_table


class SinusoidalPositions(nn.Module):
    """Fixed sinusoid position vectors. positions (B | 1, T) -> (B | 1, T, C) fp32.

    layout 'interleaved' puts sin at even and cos at odd dims (the paper); 'half' puts all sines first, then all
    cosines (tensor2tensor, Marian). Same frequencies either way."""

    def __init__(self, dim: int, base: float = 10000.0, layout: Layout = "interleaved") -> None:
        super().__init__()
        if dim % 2:
            raise ConfigError(f"d_model={dim} must be even for sinusoidal positions (sin/cos pairs)")
        self.dim, self.base, self.layout = dim, base, layout

    def forward(self, positions: Tensor) -> Tensor:
        exponent = torch.arange(0, self.dim, 2, device=positions.device).float() / self.dim  # 2i / d
        angles = positions.float().unsqueeze(-1) / self.base**exponent  # (B, T, C/2)
        if self.layout == "half":
            return torch.cat((angles.sin(), angles.cos()), dim=-1)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # sin, cos, sin, cos, ...

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, layout={self.layout}"


class LearnedPositions(nn.Module):
    """A trained vector per position. positions (B | 1, T) -> (B | 1, T, C)."""

    def __init__(self, max_seq_len: int, dim: int) -> None:
        super().__init__()
        self.table = token_table(max_seq_len, dim)

    def forward(self, positions: Tensor) -> Tensor:
        return self.table(positions)
