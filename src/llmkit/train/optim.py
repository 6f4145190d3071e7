"""The optimizer: AdamW with weight decay on matrices only.

Decay pulls weights towards zero, which regularises the matrices of linear layers and embeddings; it would only
distort the scale-like parameters (norm gains, biases), so those get none. A training strategy can set parameters
apart in a group of their own (e.g. the sparse-attention indexer, whose learning rate its warm-up keeps apart);
such groups train without weight decay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmkit.train.config import OptimConfig


def param_groups(
    model: nn.Module, weight_decay: float, group_of: Callable[[str], str | None] = lambda name: None
) -> list[dict[str, object]]:
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        special = group_of(name)
        key = special if special is not None else "decay" if p.dim() >= 2 else "no_decay"
        groups.setdefault(key, []).append(p)
    return [
        {"params": params, "weight_decay": weight_decay if key == "decay" else 0.0, "name": key}
        for key, params in groups.items()
        if params
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, group_of: Callable[[str], str | None] = lambda name: None
) -> torch.optim.AdamW:
    """AdamW; the fused kernel (one pass over all parameters) where this torch supports it on the device."""
    params = list(model.parameters())
    device = params[0].device.type if params else "cpu"
    sharded = any(type(p.data).__name__ == "DTensor" for p in params)  # FSDP: the foreach implementation
    fused = device in ("cpu", "cuda") and not sharded
    groups = param_groups(model, cfg.weight_decay, group_of)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
