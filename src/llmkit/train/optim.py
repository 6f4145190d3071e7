"""The optimizer: AdamW with weight decay on matrices only.

Decay pulls weights towards zero, which regularises the matrices of linear layers and embeddings; it would only
distort the scale-like parameters (norm gains, biases, the router's bias), so those get none. Optionally a separate
group for the sparse-attention indexer, whose learning rate the trainer can keep apart during its warm-up.
"""

from __future__ import annotations

import torch
from torch import nn

from llmkit.train.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    decay, no_decay, indexer = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".indexer." in name:
            indexer.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups: list[dict[str, object]] = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    if indexer:
        groups.append({"params": indexer, "weight_decay": 0.0, "name": "indexer"})
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; the fused kernel (one pass over all parameters) where this torch supports it on the device."""
    params = list(model.parameters())
    device = params[0].device.type if params else "cpu"
    sharded = any(type(p.data).__name__ == "DTensor" for p in params)  # FSDP: the foreach implementation
    fused = device in ("cpu", "cuda") and not sharded
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused
    )
