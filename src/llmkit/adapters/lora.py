"""LoRA (Hu et al., 2021): fine-tune a frozen model through low-rank updates of chosen projections.

    y = W x (+ b)                        the pretrained projection, frozen (float, or int8/int4: QLoRA)
      + (alpha / r) · B A dropout(x)     A (r, in) random, B (out, r) zero: at the start the model is unchanged

Only A and B train: r · (in + out) numbers per projection instead of in · out, and the optimizer keeps state only
for them. The adapters are applied from outside the model: each target projection gets a `lora` submodule and a
forward hook that adds its output, so the model code knows nothing of them, the base weights keep their names
(`blocks.0.attn.wq.weight`), and the adapters' are `blocks.0.attn.wq.lora.A` and `.lora.B`. `merge_lora` folds
B A into W (W += alpha / r · B A) and removes the hooks: the merged model computes the same logits at full speed.

Targets are llmkit's projection names (wq, wk, wv, wo, w1, w2, w3; MLA's wq_a, wq_b, wkv_a, wkv_b, ...): every
nn.Linear (or quantized linear) of the model whose own name is in the list. Shapes: N tokens, I in, O out, r rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.errors import ConfigError

DEFAULT_TARGETS = ("wq", "wk", "wv", "wo")


class LoRA(nn.Module):
    """The low-rank update of one projection: x (..., I) -> (alpha / r) B A dropout(x) (..., O)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if r < 1:
            raise ConfigError(f"lora r={r} must be >= 1")
        self.r, self.alpha = r, float(alpha)
        self.scale = self.alpha / r
        self.A = nn.Parameter(torch.empty(r, in_features, device=device, dtype=dtype))  # (r, I)
        self.B = nn.Parameter(torch.zeros(out_features, r, device=device, dtype=dtype))  # (O, r)
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # as nn.Linear's own init (and PEFT's)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.linear(self.dropout(x).to(self.A.dtype), self.A)  # (..., r)
        return nn.functional.linear(h, self.B) * self.scale  # (..., O)

    def delta(self) -> Tensor:
        """The update of the weight, (alpha / r) B A: (O, I)."""
        return (self.B @ self.A) * self.scale

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha:g}, in={self.A.shape[1]}, out={self.B.shape[0]}"


def _add_update(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
    """The forward hook: the projection's output plus its adapter's."""
    lora: LoRA = module.lora  # type: ignore[assignment]
    return output + lora(args[0]).to(output.dtype)


def projections(model: nn.Module) -> dict[str, nn.Module]:
    """The model's projections an adapter can attach to, by qualified name: nn.Linear and quantized linear layers
    (an MoE's experts are stacked tensors, not layers, and take no adapter)."""
    from llmkit.quant.linear import QuantizedLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantizedLinear)) and n}


def target_names(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """The qualified names of the projections whose own name is in `targets`; an unknown target is an error that
    lists the names there are."""
    wanted = list(targets)
    found = {n: n.rsplit(".", 1)[-1] for n in projections(model)}
    available = sorted(set(found.values()))
    missing = [t for t in wanted if t not in available]
    if not wanted or missing:
        raise ConfigError(
            f"lora.targets: {', '.join(missing) or '(none)'} is not a projection of this model; its projections are "
            f"{', '.join(available)}"
        )
    return [n for n, leaf in found.items() if leaf in wanted]


def add_lora(
    model: nn.Module, r: int, alpha: float, dropout: float = 0.0, targets: Iterable[str] = DEFAULT_TARGETS
) -> list[str]:
    """Freeze every parameter of `model` and attach trainable adapters to the target projections (by their own
    names, e.g. wq); returns their qualified names."""
    names = target_names(model, targets)
    attach_lora(model, names, r, alpha, dropout)
    return names


def attach_lora(model: nn.Module, names: list[str], r: int, alpha: float, dropout: float = 0.0) -> None:
    """Freeze every parameter of `model` and attach a trainable adapter to each projection in `names` (qualified),
    on the projection's device and in its float dtype (a quantized one's compute dtype)."""
    if has_lora(model):
        raise ConfigError("the model already has LoRA adapters (merge them first, or add them once)")
    layers = projections(model)
    unknown = [n for n in names if n not in layers]
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a projection of this model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        layer: Any = layers[name]  # nn.Linear or a QuantizedLinear: in_features, out_features
        # a float layer's own dtype; a quantized one's compute dtype (its dtype probe follows the model's casts)
        like: Tensor = layer.weight if isinstance(layer, nn.Linear) else layer.dtype_probe
        dtype = like.dtype if like.dtype.is_floating_point else torch.float32
        layer.lora = LoRA(layer.in_features, layer.out_features, r, alpha, dropout, device=like.device, dtype=dtype)
        layer._lora_hook = layer.register_forward_hook(_add_update)


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRA) for m in model.modules())


def adapters(model: nn.Module) -> dict[str, LoRA]:
    """The adapters by the qualified name of the projection they belong to."""
    return {n.removesuffix(".lora"): m for n, m in model.named_modules() if isinstance(m, LoRA)}


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Only the adapters' tensors, under the model's own names (`blocks.0.attn.wq.lora.A`)."""
    return {f"{n}.lora.{k}": v.detach() for n, m in adapters(model).items() for k, v in (("A", m.A), ("B", m.B))}


def remove_lora(model: nn.Module) -> None:
    """Detach every adapter and its hook (without merging: the model is the base model again)."""
    layers: dict[str, Any] = dict(model.named_modules())
    for name in adapters(model):
        layer = layers[name]
        layer._lora_hook.remove()
        del layer._lora_hook
        del layer.lora


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its projection's weight (W += alpha / r · B A) and remove it; returns the merged names.
    Quantized projections cannot take a float update: merge into the float checkpoint they were quantized from."""
    layers = dict(model.named_modules())
    merged = []
    for name, lora in adapters(model).items():
        weight = layers[name].weight if isinstance(layers[name], nn.Linear) else None
        if not isinstance(weight, nn.Parameter):
            raise ConfigError(
                f"{name} holds quantized weights: an adapter cannot be folded into them; load the float checkpoint "
                "they were quantized from, attach the adapters there, and merge"
            )
        weight.add_(lora.delta().to(weight.dtype))
        merged.append(name)
    remove_lora(model)
    return merged


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
