"""Residual wiring around a sub-layer: pre-norm, post-norm and sandwich-norm.

    post-norm (Vaswani et al. 2017, "Add & Norm")        pre-norm (GPT-2, LLaMA)

        x ──┬──► sublayer ──► dropout ──►(+)──► norm ──►      x ──┬──► norm ──► sublayer ──► dropout ──►(+)──►
            └───────────────────────────────┘                     └──────────────────────────────────────┘

Post-norm is the paper's LayerNorm(x + Sublayer(x)); the residual path passes through every norm, which makes deep
stacks hard to train without warm-up. Pre-norm leaves an identity path from input to output (the gradient always has
a "1" to flow through) and needs one final norm after the last block.

Sandwich-norm (Gemma 2) is pre-norm with a second norm on the sub-layer's output before it joins the residual:
x + norm'(sublayer(norm(x))), which bounds what each sub-layer adds.

All three have one signature, `forward(x, sublayer)`, so a block never branches on which one it holds.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from torch import Tensor, nn

from llmkit.config import NormConfig
from llmkit.layers.norm import build_norm


class Residual(nn.Module, abc.ABC):
    """Base class: a norm, a dropout, and how they wrap a sub-layer. (B, T, C) -> (B, T, C)."""

    def __init__(self, norm_cfg: NormConfig, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm = build_norm(norm_cfg, dim)
        self.dropout = nn.Dropout(dropout)

    @abc.abstractmethod
    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """Apply `sublayer` to x with this wiring."""


class PreNorm(Residual):
    """x + dropout(sublayer(norm(x)))."""

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


class PostNorm(Residual):
    """norm(x + dropout(sublayer(x))) — the paper's Add & Norm."""

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return self.norm(x + self.dropout(sublayer(x)))


class SandwichNorm(Residual):
    """x + dropout(post_norm(sublayer(norm(x))))."""

    def __init__(self, norm_cfg: NormConfig, dim: int, dropout: float) -> None:
        super().__init__(norm_cfg, dim, dropout)
        self.post_norm = build_norm(norm_cfg, dim)

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return x + self.dropout(self.post_norm(sublayer(self.norm(x))))


RESIDUALS: dict[str, type[Residual]] = {"pre": PreNorm, "post": PostNorm, "sandwich": SandwichNorm}


def build_residual(norm_cfg: NormConfig, dim: int, dropout: float) -> Residual:
    return RESIDUALS[norm_cfg.placement](norm_cfg, dim, dropout)
