"""LoRA adapters in PEFT's files, so that Hugging Face's `peft` loads llmkit's adapters and llmkit loads PEFT's.

    DIR/adapter_config.json          {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
                                      "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": ..., ...}
    DIR/adapter_model.safetensors    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   (r, in)
                                     base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   (out, r)

The names are transformers' module names: llmkit's projection `blocks.0.attn.wq` is `model.layers.0.self_attn.q_proj`
by the model family's weight map (llmkit.interop.hf), which must map that projection's weight one-to-one (so
GPT-2's fused c_attn takes no adapter here). PEFT's scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.adapters.lora import adapters, attach_lora
from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.safetensors_io import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def is_peft_adapter(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and (p / ADAPTER_WEIGHTS).is_file()


def hf_module_names(cfg: ModelConfig) -> dict[str, str]:
    """llmkit projection name -> transformers' module name, for every projection whose weight maps one-to-one."""
    from llmkit.interop.hf import family_for, infer_model_type
    from llmkit.interop.keymap import Identity, expand

    family = family_for(infer_model_type(cfg))
    names = {}
    for c in expand(family.rules(cfg, ()), cfg):
        one = len(c.ours) == 1 and len(c.theirs) == 1 and isinstance(c.transform, Identity)
        if one and c.ours[0].endswith(".weight") and c.theirs[0].endswith(".weight"):
            names[c.ours[0].removesuffix(".weight")] = c.theirs[0].removesuffix(".weight")
    return names


def adapter_tensors(
    model: nn.Module, cfg: ModelConfig, state: dict[str, Tensor] | None = None
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The model's adapters as PEFT's tensors, and the adapter_config.json entries that describe them. `state`: the
    adapters' tensors under llmkit's names (`NAME.lora.A`), when they come from elsewhere (gathered from shards)."""
    found = adapters(model)
    if not found:
        raise ConfigError("the model has no LoRA adapters to save")
    names = hf_module_names(cfg)
    unmapped = [n for n in found if n not in names]
    if unmapped:
        raise ConfigError(
            f"{unmapped[0]} has no one-to-one counterpart in transformers' {cfg_family(cfg)} layout, so PEFT could "
            "not load its adapter: choose other lora.targets"
        )
    shapes = {(m.r, m.alpha, m.dropout.p if isinstance(m.dropout, nn.Dropout) else 0.0) for m in found.values()}
    if len(shapes) != 1:
        raise ConfigError("PEFT's adapter_config.json has one r, alpha and dropout: the adapters differ")
    ((r, alpha, dropout),) = shapes
    tensors = {}
    for name, m in found.items():
        hf = PREFIX + names[name]
        a, b = (m.A, m.B) if state is None else (state[name + ".lora.A"], state[name + ".lora.B"])
        tensors[hf + ".lora_A.weight"] = a.detach().contiguous()
        tensors[hf + ".lora_B.weight"] = b.detach().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({names[n].rsplit(".", 1)[-1] for n in found}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    return tensors, config


def cfg_family(cfg: ModelConfig) -> str:
    from llmkit.interop.hf import infer_model_type

    return infer_model_type(cfg)


def save_peft(
    model: nn.Module,
    cfg: ModelConfig,
    directory: str | os.PathLike[str],
    *,
    base: str | None = None,
    state: dict[str, Tensor] | None = None,
) -> Path:
    """Write the model's adapters in PEFT's layout; `base` is recorded as base_model_name_or_path."""
    from safetensors.torch import save_file

    tensors, config = adapter_tensors(model, cfg, state)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config["base_model_name_or_path"] = base
    (d / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return d


UNSUPPORTED: dict[str, tuple[Any, Any]] = {  # key: (the default, another allowed value)
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
}


def read_adapter_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A PEFT adapter_config.json, checked to describe plain LoRA (what llmkit's adapters are)."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{Path(directory)} has no {ADAPTER_CONFIG}: not a PEFT adapter") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config.get('peft_type')!r}; llmkit reads LORA adapters")
    for key, allowed in UNSUPPORTED.items():
        if config.get(key, allowed[0]) not in allowed:
            raise CheckpointError(f"{path}: {key}={config[key]!r} is not supported (llmkit's adapters are plain LoRA)")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise CheckpointError(f"{path}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def read_peft(directory: str | os.PathLike[str], cfg: ModelConfig) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(adapter_config.json, the adapters' tensors under llmkit's names `NAME.lora.A` / `NAME.lora.B`) of a PEFT
    adapter folder, for a model whose config is `cfg`."""
    from safetensors import safe_open

    d = Path(directory)
    config = read_adapter_config(d)
    if not (d / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"{d} has no {ADAPTER_WEIGHTS} (llmkit reads adapters saved as safetensors)")
    ours = {hf: name for name, hf in hf_module_names(cfg).items()}
    state: dict[str, Tensor] = {}
    with safe_open(str(d / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            module, _, part = key.removeprefix(PREFIX).rpartition(".lora_")
            kind, _, rest = part.partition(".")
            if kind not in ("A", "B") or not rest.endswith("weight"):
                raise CheckpointError(f"{d / ADAPTER_WEIGHTS}: unexpected tensor {key}")
            if module not in ours:
                raise CheckpointError(f"{d / ADAPTER_WEIGHTS}: {key} adapts {module}, which this model does not have")
            state[f"{ours[module]}.lora.{kind}"] = f.get_tensor(key)
    modules = {k.rsplit(".lora.", 1)[0] for k in state}
    incomplete = sorted(n for n in modules if f"{n}.lora.A" not in state or f"{n}.lora.B" not in state)
    if not state or incomplete:
        raise CheckpointError(
            f"{d / ADAPTER_WEIGHTS}: no complete lora_A / lora_B pair for {incomplete or 'any module'}"
        )
    return config, state


def load_peft(model: nn.Module, cfg: ModelConfig, directory: str | os.PathLike[str]) -> list[str]:
    """Attach the adapters PEFT (or llmkit) saved in `directory` to `model`, frozen base and all; returns the
    qualified names of the projections that got one."""
    config, state = read_peft(directory, cfg)
    r = int(config["r"])
    alpha = float(config["lora_alpha"]) * (math.sqrt(r) if config.get("use_rslora") else 1.0)  # scale alpha / sqrt(r)
    names = sorted({k.rsplit(".lora.", 1)[0] for k in state})
    attach_lora(model, names, r, alpha, float(config.get("lora_dropout") or 0.0))
    found = adapters(model)
    with torch.no_grad():
        for name in names:
            m, a, b = found[name], state[name + ".lora.A"], state[name + ".lora.B"]
            if a.shape != m.A.shape or b.shape != m.B.shape:
                raise CheckpointError(
                    f"{Path(directory) / ADAPTER_WEIGHTS}: {name}'s adapter has shapes {tuple(a.shape)}, "
                    f"{tuple(b.shape)}; r={r} on this model needs {tuple(m.A.shape)}, {tuple(m.B.shape)}"
                )
            m.A.copy_(a)
            m.B.copy_(b)
    return names
