"""Position-wise feed-forward networks: the same small network applied to every token independently.

    MLP     FFN(x) = act(x W1 + b1) W2 + b2          the paper's ReLU MLP (hidden 4C); GPT-2 uses GELU
    SwiGLU  FFN(x) = (silu(x W1) * x W3) W2         a gated MLP (Shazeer 2020, LLaMA); GeGLU with act = gelu

Most of a large model's parameters, and much of what it "knows", sit in these layers. Every feed-forward variant
(these two and the mixture of experts in moe.py) has one signature, `forward(x, extras=None)`; a dense one has
nothing to report. Shapes: (..., C) -> (..., C), hidden width I.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.config import Activation, FFNKind
from llmkit.layers.extras import Extras

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


class MLP(nn.Module):
    """act(x W1 + b1) W2 + b2. (..., C) -> (..., C)."""

    def __init__(self, dim: int, hidden: int, activation: Activation = "relu", bias: bool = True) -> None:
        super().__init__()
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor, extras: Extras | None = None) -> Tensor:
        return self.w2(self.act(self.w1(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class SwiGLU(nn.Module):
    """(act(x W1) * x W3) W2 with act = silu (SwiGLU) or gelu (GeGLU). (..., C) -> (..., C)."""

    def __init__(self, dim: int, hidden: int, activation: Activation = "silu", bias: bool = False) -> None:
        super().__init__()
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.w1 = nn.Linear(dim, hidden, bias=bias)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=bias)  # up
        self.w2 = nn.Linear(hidden, dim, bias=bias)  # down

    def forward(self, x: Tensor, extras: Extras | None = None) -> Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


FFN: dict[str, type[MLP] | type[SwiGLU]] = {"mlp": MLP, "swiglu": SwiGLU}


def build_ffn(kind: FFNKind, dim: int, hidden: int, activation: Activation, bias: bool) -> nn.Module:
    """The dense feed-forward network named by `kind`."""
    return FFN[kind](dim, hidden, activation, bias)
