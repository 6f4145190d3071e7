"""RoPE in config.json, in both styles transformers has used, as two table entries (`ROPE`, `PARTIAL_ROTARY`).

transformers 4.x (and most published checkpoints) write `rope_theta` and a `rope_scaling` dict (`type` or
`rope_type`); transformers 5.x writes one `rope_parameters` dict holding `rope_theta` too. Both are read, and both
are written, so that either version loads an exported checkpoint with the same frequencies. The scaling kinds map
one to one onto `RopeScaling` (see llmkit.config), except static NTK, which transformers does not have.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from llmkit.config import ModelConfig, RopeScaling
from llmkit.errors import ConfigError
from llmkit.interop.hf.fields import Custom, HFConfig

_KINDS = "default, linear, dynamic, yarn, llama3"


def _scaling(kind: str, spec: HFConfig, max_len: int) -> RopeScaling:
    factor = float(spec.get("factor", 1.0))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "dynamic":  # transformers grows the context from max_position_embeddings
        return RopeScaling(kind="dynamic", factor=factor, original_max_seq_len=max_len)
    if kind == "yarn":
        return RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_seq_len=int(spec.get("original_max_position_embeddings") or max_len),
            beta_fast=float(spec.get("beta_fast") or 32.0),
            beta_slow=float(spec.get("beta_slow") or 1.0),
            # absent: llmkit's default 1.0; null: 0 (falsy), which is how transformers treats it
            mscale=float(spec.get("mscale") or 0.0) if "mscale" in spec else 1.0,
            mscale_all_dim=float(spec.get("mscale_all_dim") or 0.0),
            attention_factor=None if spec.get("attention_factor") is None else float(spec["attention_factor"]),
            truncate=bool(spec.get("truncate", True)),
        )
    if kind == "llama3":
        if spec.get("original_max_position_embeddings") is None:
            raise ConfigError("config.json rope type 'llama3' needs original_max_position_embeddings")
        return RopeScaling(
            kind="llama3",
            factor=factor,
            original_max_seq_len=int(spec["original_max_position_embeddings"]),
            low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
            high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        )
    raise ConfigError(f"config.json rope type {kind!r} is not supported; supported: {_KINDS}")


def rope_from_hf(hf: HFConfig, names: Collection[str] = ()) -> dict[str, Any]:
    """position.theta, .scaling and .max_seq_len (which covers the scaled context) from either config style."""
    params = dict(hf.get("rope_parameters") or {})
    spec = dict(hf.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    kind = spec.get("rope_type", spec.get("type", "default"))
    max_len = int(hf.get("max_position_embeddings") or 2048)
    scaling = None if kind in (None, "default") else _scaling(kind, spec, max_len)
    if scaling is not None:
        max_len = max(max_len, int((scaling.original_max_seq_len or max_len) * scaling.factor))
    return {"position.theta": theta, "position.scaling": scaling, "position.max_seq_len": max_len}


def _scaling_to_hf(s: RopeScaling) -> dict[str, Any]:
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
    return spec


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Both config styles, and max_position_embeddings: the unscaled length for dynamic scaling (transformers grows
    the context from it) and for linear scaling without an original length (reading multiplies it by the factor),
    the full one otherwise."""
    p = cfg.position
    s = p.scaling
    max_len = s.original_max_seq_len if s is not None and s.kind == "dynamic" and s.original_max_seq_len else None
    if s is not None and s.kind == "linear" and not s.original_max_seq_len:
        max_len = round(p.max_seq_len / s.factor)
    out: dict[str, Any] = {"rope_theta": p.theta, "max_position_embeddings": max_len or p.max_seq_len}
    spec = {"rope_type": "default"} if s is None else _scaling_to_hf(s)
    out["rope_scaling"] = None if s is None else dict(spec)
    out["rope_parameters"] = {**spec, "rope_theta": p.theta}
    return out


def partial_rotary(default: float = 1.0) -> Custom:
    """position.rope_fraction <-> rope_parameters.partial_rotary_factor (read also from the top level, where 4.x
    configs of StableLM and Phi keep it). `default`: what the family's config class assumes when the key is absent
    (GLM's 0.5), so the factor is always written."""

    def from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        return {"position.rope_fraction": default if factor is None else float(factor)}

    def to_hf(cfg: ModelConfig) -> dict[str, Any]:
        return {"rope_parameters": {"partial_rotary_factor": cfg.position.rope_fraction}}

    return Custom(from_hf, to_hf)


ROPE = Custom(rope_from_hf, rope_to_hf)
"""position.theta, .scaling and .max_seq_len <-> rope_theta, rope_scaling, rope_parameters, max_position_embeddings."""

PARTIAL_ROTARY = partial_rotary()
"""position.rope_fraction <-> rope_parameters.partial_rotary_factor (1.0 when absent)."""
