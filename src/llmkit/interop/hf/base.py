"""What every Hugging Face family provides, and the config helpers they share.

A family turns a checkpoint's `config.json` into a ModelConfig and back, and gives the declarative key map
(`rules`) between llmkit's parameter names and the checkpoint's. Everything about Hugging Face names lives under
`llmkit.interop.hf`; the models never see them.
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import Activation, ModelConfig, RopeScaling
from llmkit.errors import ConfigError
from llmkit.interop.keymap import Rule

_ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
_ACTIVATION_NAMES: dict[str, str] = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def activation_from_hf(name: str, field: str = "hidden_act") -> Activation:
    if name not in _ACTIVATIONS:
        raise ConfigError(f"config.json {field}={name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def activation_to_hf(act: Activation) -> str:
    return _ACTIVATION_NAMES[act]


def require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise ConfigError(f"config.json has no {key!r}, which a {hf.get('model_type')} checkpoint needs")
    return hf[key]


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, int]:
    """(theta, scaling, max_seq_len) from either config style: `rope_theta` + `rope_scaling` (transformers 4.x and
    most checkpoints) or `rope_parameters` (transformers 5.x). max_seq_len covers the scaled context."""
    params = dict(hf.get("rope_parameters") or {})
    old = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    spec = old or params
    kind = spec.get("rope_type", spec.get("type", "default"))
    max_len = int(hf.get("max_position_embeddings") or 2048)
    if kind in (None, "default"):
        return theta, None, max_len
    factor = float(spec.get("factor", 1.0))
    original = spec.get("original_max_position_embeddings")
    if kind == "linear":
        scaling = RopeScaling(kind="linear", factor=factor)
    elif kind == "dynamic":  # transformers grows from max_position_embeddings
        scaling = RopeScaling(kind="dynamic", factor=factor, original_max_seq_len=max_len)
    elif kind == "yarn":
        scaling = RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_seq_len=int(original or max_len),
            beta_fast=float(spec.get("beta_fast") or 32.0),
            beta_slow=float(spec.get("beta_slow") or 1.0),
            # absent: llmkit's default 1.0; null: 0 (falsy), which is how transformers treats it
            mscale=float(spec.get("mscale") or 0.0) if "mscale" in spec else 1.0,
            mscale_all_dim=float(spec.get("mscale_all_dim") or 0.0),
            attention_factor=None if spec.get("attention_factor") is None else float(spec["attention_factor"]),
            truncate=bool(spec.get("truncate", True)),
        )
    elif kind == "llama3":
        scaling = RopeScaling(
            kind="llama3",
            factor=factor,
            original_max_seq_len=int(require(spec, "original_max_position_embeddings")),
            low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
            high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        )
    else:
        raise ConfigError(
            f"config.json rope type {kind!r} is not supported; supported: default, linear, dynamic, yarn, llama3"
        )
    extended = int((scaling.original_max_seq_len or max_len) * factor)
    return theta, scaling, max(max_len, extended)


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Both config styles, so that transformers 4.x and 5.x read the same RoPE."""
    p = cfg.position
    s = p.scaling
    out: dict[str, Any] = {"rope_theta": p.theta}
    if s is None:
        out["rope_scaling"] = None
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": p.theta}
        return out
    spec: dict[str, Any] = {"rope_type": s.kind, "factor": s.factor}
    if s.kind == "ntk":
        raise ConfigError("static NTK RoPE scaling has no Hugging Face equivalent (use 'dynamic')")
    if s.kind == "yarn":
        spec.update(
            original_max_position_embeddings=s.original_max_seq_len,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
            mscale=s.mscale,
            mscale_all_dim=s.mscale_all_dim,
            truncate=s.truncate,
        )
        if s.attention_factor is not None:
            spec["attention_factor"] = s.attention_factor
    if s.kind == "llama3":
        spec.update(
            original_max_position_embeddings=s.original_max_seq_len,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
        )
    out["rope_scaling"] = dict(spec)
    out["rope_parameters"] = {**spec, "rope_theta": p.theta}
    return out


def hf_max_positions(cfg: ModelConfig) -> int:
    """max_position_embeddings to write: the unscaled length for dynamic scaling (transformers grows from it)."""
    s = cfg.position.scaling
    if s is not None and s.kind == "dynamic" and s.original_max_seq_len is not None:
        return s.original_max_seq_len
    return cfg.position.max_seq_len


class Family(abc.ABC):
    """One Hugging Face model family (possibly several model_types sharing a layout)."""

    name: str = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[dict[str, str]] = {}  # model_type -> class name written to config.json

    @abc.abstractmethod
    def config_from_hf(self, hf: dict[str, Any], names: Collection[str]) -> ModelConfig:
        """ModelConfig from config.json (and the checkpoint's tensor names, where they decide a detail)."""

    @abc.abstractmethod
    def config_to_hf(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        """config.json fields for `cfg`."""

    @abc.abstractmethod
    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        """The key map for `cfg`; `names` (the checkpoint's tensor names, or empty when writing) picks a layout where
        a family has more than one (fused or split experts, prefixed or bare GPT-2 names)."""

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        """Tensors a checkpoint may hold that llmkit recomputes or ties (buffers, rotary tables, tied copies)."""
        return name.endswith("rotary_emb.inv_freq")

    def model_type_for(self, cfg: ModelConfig) -> str | None:
        """The first of this family's model_types whose config.json describes the same architecture as `cfg`."""
        for model_type in self.model_types:
            try:
                back = self.config_from_hf(self.config_to_hf(cfg, model_type), ())
            except ConfigError:
                continue
            if back.architecture() == cfg.architecture():
                return model_type
        return None
