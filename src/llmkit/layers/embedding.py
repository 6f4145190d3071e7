"""Token embeddings and the positions that go with them: the additive ones (sinusoidal, learned) added here, and the
RoPE tables that attention applies to queries and keys."""

from __future__ import annotations

import math

from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.layers.position import LearnedPositions, SinusoidalPositions
from llmkit.layers.rope import RotaryEmbedding


class InputEmbedding(nn.Module):
    """tokens (B, T), positions (B | 1, T) -> (B, T, C): table lookup (times sqrt(C) when scaled, as in the paper,
    so that embeddings and sinusoids have comparable size), plus additive positions, then dropout."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        p = cfg.position
        self.positions: nn.Module | None
        if p.kind == "sinusoidal":
            self.positions = SinusoidalPositions(cfg.d_model, p.theta, p.layout)
        elif p.kind == "learned":
            self.positions = LearnedPositions(max_seq_len, cfg.d_model)
        else:
            self.positions = None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, table: nn.Embedding, tokens: Tensor, positions: Tensor) -> Tensor:
        x = table(tokens)
        if self.scale != 1.0:
            x = x * self.scale
        if self.positions is not None:
            x = x + self.positions(positions).to(x.dtype)
        return self.dropout(x)


def build_rope(cfg: ModelConfig, local: bool = False) -> RotaryEmbedding | None:
    """The model's RoPE tables, or with `local` those of its sliding-window layers when position.local_theta gives
    them a base of their own (None otherwise)."""
    p = cfg.position
    if local:
        return None if p.local_theta is None else RotaryEmbedding(cfg.rope_dim, p.local_theta, p.max_seq_len, None)
    return RotaryEmbedding(cfg.rope_dim, p.theta, p.max_seq_len, p.scaling) if p.kind == "rope" else None
