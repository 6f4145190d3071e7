"""The optimizer: AdamW with weight decay on matrices only, or Muon for the hidden matrices with AdamW for the rest.

Decay pulls weights towards zero, which regularises the matrices of linear layers and embeddings; it would only
distort the scale-like parameters (norm gains, biases), so those get none. A training strategy can set parameters
apart in a group of their own (e.g. the sparse-attention indexer, whose learning rate its warm-up keeps apart);
such groups train without weight decay.

Muon (Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks"; torch.optim.Muon) takes a
hidden matrix's momentum, nudges it to the nearest orthogonal matrix with a few Newton-Schulz iterations (U V^T of
its SVD, approximately: the singular values land near 1 instead of exactly on it), and steps along that: every
direction of the update moves by about the same amount, where Adam's follow the gradient's largest ones. It is for
the matrices inside the blocks only; the embedding, the output head, the routers and every vector (gains, biases)
train with AdamW, as modded-nanogpt and nanochat train them. Its step is scaled as Moonshot's "Muon is Scalable for
LLM Training" (Liu et al., 2025) scales it, 0.2 sqrt(max(out, in)), so that an update has AdamW's typical size and
the same `optim.lr` and weight decay serve both. A routed expert's matrices (one tensor for all experts) stay with
AdamW: torch's Muon takes 2-D parameters only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from llmkit.errors import InputError
from llmkit.train.config import OptimConfig

# parameters that are not hidden matrices whatever their shape (a name part): token and position embeddings, the
# output head, a mixture's router (its scores feed a softmax or a sigmoid, not a residual stream)
NOT_HIDDEN = frozenset({"embed", "head", "pos_embed", "router", "lm_head"})


def param_groups(
    named: Iterable[tuple[str, nn.Parameter]], weight_decay: float, group_of: Callable[[str], str | None]
) -> list[dict[str, object]]:
    """AdamW's groups of the trainable parameters among `named`: matrices with decay, the rest without, and the
    groups a training strategy sets apart."""
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": []}
    for name, p in named:
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


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """Whether Muon trains `p`: a 2-D weight inside the blocks (not an embedding, head or router, nor LoRA's)."""
    parts = set(name.split("."))
    return p.dim() == 2 and not parts & NOT_HIDDEN and not any(part.startswith("lora") for part in parts)


class MuonWithAdamW:
    """torch.optim.Muon over the hidden matrices and torch.optim.AdamW over the rest, stepped together: what the
    loop needs of an optimizer (its groups, a step, zero_grad, the state to checkpoint). `parts` are the two
    optimizers, for what takes a list of them (torch.distributed.checkpoint, a gradient scaler)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.parts = (muon, adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.parts[0].state_dict(), "adamw": self.parts[1].state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parts[0].load_state_dict(state["muon"])
        self.parts[1].load_state_dict(state["adamw"])


Optimizer = torch.optim.Optimizer | MuonWithAdamW


def parts(optimizer: Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer` (one, or Muon's two)."""
    return list(optimizer.parts) if isinstance(optimizer, MuonWithAdamW) else [optimizer]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, group_of: Callable[[str], str | None] = lambda name: None
) -> Optimizer:
    """AdamW (the fused kernel, one pass over all parameters, where this torch supports it on the device); with
    `cfg.name == "muon"`, Muon for the hidden matrices and AdamW for the rest."""
    params = list(model.parameters())
    device = params[0].device.type if params else "cpu"
    sharded = any(type(p.data).__name__ == "DTensor" for p in params)  # FSDP: the foreach implementation
    fused = device in ("cpu", "cuda") and not sharded
    if cfg.name == "adamw":
        groups = param_groups(model.named_parameters(), cfg.weight_decay, group_of)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
    if not hasattr(torch.optim, "Muon"):
        raise InputError(f"optim.name=muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    hidden = [p for name, p in named if group_of(name) is None and is_hidden_matrix(name, p)]
    if not hidden:
        raise InputError("optim.name=muon found no hidden matrices to train: use optim.name=adamw")
    chosen = {id(p) for p in hidden}
    muon = torch.optim.Muon(
        [{"params": hidden, "name": "muon"}],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        adjust_lr_fn="match_rms_adamw",
    )
    adam_groups = param_groups([(n, p) for n, p in named if id(p) not in chosen], cfg.weight_decay, group_of)
    adamw = torch.optim.AdamW(adam_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
    return MuonWithAdamW(muon, adamw)
