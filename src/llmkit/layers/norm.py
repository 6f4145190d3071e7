"""Normalisation layers: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta     normalises each token over its features
RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * w                         no centring, no bias: cheaper, as good
               x / sqrt(mean(x^2) + eps) * (1 + w)                   Gemma's form: w stored as the gain minus 1

Both normalise one token's feature vector (the last dimension), unlike BatchNorm, which normalises one feature across
the batch. Shapes: (..., C) -> (..., C).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit.config import NormConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm. (..., C) -> (..., C). Computed in fp32 whatever the input dtype (as LLaMA does),
    because the mean of squares loses precision in bf16."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose gain is 1 + weight (Gemma): the weight starts at 0, and weight decay pulls the gain towards 1
    rather than 0. The product is taken in fp32 before casting back, as Gemma's reference does. (..., C) -> (..., C)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with an optional bias. (..., C) -> (..., C). torch's fused kernel."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(dim, eps=eps, bias=bias)


def build_norm(cfg: NormConfig, dim: int) -> nn.Module:
    """The norm named by `cfg.kind` over `dim` features."""
    if cfg.kind == "rmsnorm":
        return OffsetRMSNorm(dim, eps=cfg.eps) if cfg.unit_offset else RMSNorm(dim, eps=cfg.eps)
    return LayerNorm(dim, eps=cfg.eps, bias=cfg.bias)
