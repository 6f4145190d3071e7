"""Training strategies that some architectures need, given to the one training loop from outside.

A hook can put parameters into a named optimizer group, scale a group's learning rate at a step, pass options to the
training module's forward, and act after each optimizer step. The loop calls every hook at those points and never
asks which architecture it trains; a task (tasks.py) decides which hooks its model needs.

    RouterBiasUpdate   DeepSeek-V3's auxiliary-loss-free balancing: after each step, move every router's score
                       bias against its experts' load (§2.1.2)
    IndexerWarmUp      DeepSeek-V3.2's lightning indexer: for the first steps only the indexer trains, against
                       dense attention; then attention turns sparse and everything trains (§2.1)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from llmkit.layers.moe import MoE, update_router_bias
from llmkit.train.parallel import Runtime, all_reduce_sum


class Hook:
    """A training strategy; every method defaults to doing nothing."""

    def group(self, name: str) -> str | None:
        """The optimizer group for parameter `name`, or None for the default ones."""
        return None

    def lr_scale(self, step: int, group: str) -> float:
        """A factor on group `group`'s learning rate at `step`."""
        return 1.0

    def forward_options(self, step: int) -> dict[str, Any]:
        """Keyword arguments for the training module's forward at `step`."""
        return {}

    def after_step(self, stats: dict[str, Tensor], rt: Runtime) -> None:
        """Called after each optimizer step with the training module's statistics, summed over micro-steps."""


def router_bias_layers(model: nn.Module) -> list[int]:
    """Indices of the MoE layers whose routers keep a score-correction bias, in order."""
    return sorted(m.layer for m in model.modules() if isinstance(m, MoE) and m.router.score_bias is not None)


class RouterBiasUpdate(Hook):
    """b_i += rate * sign(mean load - load_i) for every biased router, from the load of the whole batch (all
    processes), so every process applies the same update. Reads the stat "expert_load" (L, E), rows in the order
    of `router_bias_layers`."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.model, self.rate = model, rate
        self.layers = router_bias_layers(model)

    def after_step(self, stats: dict[str, Tensor], rt: Runtime) -> None:
        load = all_reduce_sum(stats["expert_load"].clone(), rt)
        update_router_bias(self.model, dict(zip(self.layers, load.unbind(0), strict=True)), self.rate)


class IndexerWarmUp(Hook):
    """The sparse-attention indexer's warm-up: its parameters form the group "indexer"; for `steps` steps every
    other group has learning rate 0 and attention stays dense ("dense"), then attention uses the indexer's selection
    ("sparse")."""

    GROUP = "indexer"

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def group(self, name: str) -> str | None:
        return self.GROUP if ".indexer." in name else None

    def lr_scale(self, step: int, group: str) -> float:
        return 0.0 if step < self.steps and group != self.GROUP else 1.0

    def forward_options(self, step: int) -> dict[str, Any]:
        return {"indexer": "dense" if step < self.steps else "sparse"}
