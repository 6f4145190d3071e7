"""What a forward pass reports besides its output, when the caller asks for it.

Training needs more than the logits: the load-balancing and z losses of every MoE router, how many tokens each
expert received (for DeepSeek-V3's bias update), and the sparse-attention indexer's loss. Inspection wants the
attention weights. None of that is kept on the modules: the caller passes an `Extras` into the forward call, each
layer appends what it was asked for, in the order the layers run, and the caller reads it afterwards.

    extras = Extras(attention_weights=True)
    logits = model(tokens, extras=extras)
    extras.self_attention[-1]           # (B, H, T, S): the last self-attention layer's weights

A call without an Extras computes nothing beyond its output (no router statistics while decoding, for instance), and
the same model can serve several callers at once. Under activation checkpointing the recomputation in the backward
pass appends a second copy of each record to an Extras the caller has already read; it is not read again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

IndexerMode = Literal["off", "dense", "sparse"]


@dataclass(frozen=True)
class MoEStats:
    """What one MoE layer measured in one call. `layer` is the index the layer was built with (blocks first, then
    the multi-token-prediction modules), so records can be matched to routers whatever the call order."""

    layer: int
    aux_loss: Tensor  # scalar, load-balancing loss (Switch or sequence-wise, per aux_loss_kind)
    z_loss: Tensor  # scalar, router z-loss mean(logsumexp(logits)^2)
    counts: Tensor  # (E,) float, assignments per expert chosen by the router (before capacity dropping)
    dropped: Tensor  # scalar, fraction of assignments dropped by the capacity limit


class Extras:
    """A request for side outputs, and the place layers put them.

    attention_weights: keep every attention layer's weights (B, H, T, S) in `self_attention` / `cross_attention`.
    indexer: how DeepSeek sparse attention trains its lightning indexer in this call (DeepSeek-V3.2 §2.1): "off"
        (inference, or a model without one), "dense" (the warm-up: attention stays dense and the indexer learns to
        match it) or "sparse" (attention uses the indexer's selection). Ignored outside training mode.

    A plain class, not a dataclass, on purpose: FSDP2 rebuilds the dataclasses among a wrapped module's arguments
    that hold tensors needing gradients (to hook them for its backward), so the layers of every FSDP-wrapped block
    after the first MoE layer appended their records to a copy the caller never saw (their balance losses and expert
    loads were lost in training). FSDP passes other objects through as they are.
    """

    def __init__(self, attention_weights: bool = False, indexer: IndexerMode = "off") -> None:
        self.attention_weights = attention_weights
        self.indexer: IndexerMode = indexer
        self.moe: list[MoEStats] = []
        self.indexer_losses: list[Tensor] = []
        self.self_attention: list[Tensor] = []
        self.cross_attention: list[Tensor] = []

    def __repr__(self) -> str:
        return (
            f"Extras(attention_weights={self.attention_weights}, indexer={self.indexer!r}, {len(self.moe)} MoE "
            f"records, {len(self.indexer_losses)} indexer losses, {len(self.self_attention)} + "
            f"{len(self.cross_attention)} attention maps)"
        )

    def moe_loss(self, aux_coef: float, z_coef: float, like: Tensor) -> Tensor:
        """The MoE layers' balance and z losses, weighted by their coefficients, summed over layers (fp32)."""
        total = like.new_zeros((), dtype=torch.float32)
        for s in self.moe:
            total = total + aux_coef * s.aux_loss + z_coef * s.z_loss
        return total

    def indexer_loss(self, like: Tensor) -> Tensor:
        """The mean of the sparse-attention layers' indexer losses (0 without any)."""
        return torch.stack(self.indexer_losses).mean() if self.indexer_losses else like.new_zeros(())

    def expert_load(self) -> dict[int, Tensor]:
        """Assignments per expert, summed over the calls of each MoE layer: layer index -> (E,)."""
        load: dict[int, Tensor] = {}
        for s in self.moe:
            load[s.layer] = load[s.layer] + s.counts if s.layer in load else s.counts
        return load
