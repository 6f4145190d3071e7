"""Fine-tuning strategies: what trains, what a checkpoint holds, and how one is read back. The loop takes one.

    Full        every weight trains; a checkpoint holds them all
    Partial     only the parameters under some names train (train.trainable, e.g. [mtp]: a grafted drafter); a
                checkpoint holds every weight, so that it loads as a model of its own
    LoRA        the model is frozen and low-rank adapters on chosen projections train (llmkit.adapters); a checkpoint
                holds the adapters only, in PEFT's layout, pointing at the base checkpoint; resuming reads them back
                over the base as built
    QLoRA       LoRA on a quantized base (a GGUF file's quantized layers), recorded as such in the checkpoint

`backward_factor` is what the loop needs for MFU: the FLOPs of a training step over the forward's, 3 when every
weight gets a gradient (forward, and the backward's two matrix products), 2 when only the activations do (adapters),
and unknown for a partial model (how far the backward pass reaches depends on where the trained part sits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.adapters import add_lora, lora_state_dict, trainable_count
from llmkit.train.config import TrainConfig
from llmkit.train.source import TrainingError


class FineTuning:
    """What trains (`prepare`), what is saved (`saved`, `adapter`) and how a checkpoint is read back (`restore`)."""

    backward_factor: float | None = 3.0

    def prepare(self, model: nn.Module) -> str | None:
        """Set what trains on the built model, before the optimizer sees it; returns a line for the log, if any."""
        return None

    def saved(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The part of the model's full state dict a checkpoint holds."""
        return state

    @property
    def adapter(self) -> dict[str, Any] | None:
        """For a checkpoint of adapters only: {"base": the base checkpoint, "quantized": bool}; None otherwise."""
        return None

    def restore(self, model: nn.Module, saved: dict[str, Tensor]) -> dict[str, Tensor]:
        """The full state dict to resume from, given what a checkpoint of this strategy holds."""
        return saved


@dataclass
class Full(FineTuning):
    """Every weight trains."""


@dataclass
class Partial(FineTuning):
    """Only the parameters named `prefixes` or under them (e.g. "mtp", "blocks.11") train; the rest are frozen."""

    prefixes: list[str]
    backward_factor: float | None = None

    def prepare(self, model: nn.Module) -> str | None:
        names = [n for n, _ in model.named_parameters()]
        for prefix in self.prefixes:
            if not any(_under(n, prefix) for n in names):
                tops = sorted({n.split(".")[0] for n in names})
                raise TrainingError(
                    f"train.trainable: no parameter is named {prefix} or under it; the model has {tops}"
                )
        for name, p in model.named_parameters():
            p.requires_grad_(any(_under(name, q) for q in self.prefixes))
        return None


@dataclass
class LoRA(FineTuning):
    """Adapters of rank r, scale alpha / r, on the `targets` projections of a frozen base read from `base`."""

    r: int
    alpha: float
    base: str
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    seed: int = 0  # the adapters' own initialisation, the same in every process
    backward_factor: float | None = 2.0
    quantized = False
    _names: set[str] = field(default_factory=set, init=False, repr=False)

    def prepare(self, model: nn.Module) -> str | None:
        torch.manual_seed(self.seed)
        projections = add_lora(model, self.r, self.alpha, self.dropout, self.targets)
        self._names = set(lora_state_dict(model))
        trainable, total = trainable_count(model)
        return (
            f"LoRA r={self.r} alpha={self.alpha:g} on {len(projections)} projections ({', '.join(self.targets)}): "
            f"{trainable:,} trainable of {total:,} parameters"
        )

    def saved(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: v for k, v in state.items() if k in self._names}

    @property
    def adapter(self) -> dict[str, Any] | None:
        return {"base": self.base, "quantized": self.quantized}

    def restore(self, model: nn.Module, saved: dict[str, Tensor]) -> dict[str, Tensor]:
        return {**model.state_dict(), **saved}  # the base as built, the adapters as saved


@dataclass
class QLoRA(LoRA):
    """LoRA on a base whose layers stay quantized."""

    quantized = True


def from_config(cfg: TrainConfig, base: str | None) -> FineTuning:
    """The strategy a config asks for: lora.r > 0 (lora.quantized: QLoRA) on the checkpoint `base`, train.trainable,
    or every weight."""
    lo = cfg.lora
    if lo.r:
        assert base is not None  # TrainConfig.validate: adapters need model.checkpoint
        kind = QLoRA if lo.quantized else LoRA
        return kind(lo.r, lo.alpha, base, lo.dropout, list(lo.targets), seed=cfg.train.seed + 1)
    if cfg.train.trainable is not None:
        return Partial(list(cfg.train.trainable))
    return Full()


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")
