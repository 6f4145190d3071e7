"""Gemma (model_type gemma) and Gemma 2 (gemma2): the Llama layout with these changes, each a setting of llmkit's
config.

    embeddings times sqrt(hidden_size)               scale_embeddings
    RMSNorm gains stored as 1 + weight               norm.unit_offset (the weights load as they are, no +1 added)
    GeGLU feed-forward: gelu_tanh(x W1) * x W3       ffn.kind swiglu with ffn.activation gelu_tanh
and tied embeddings by default, and a head_dim of its own (256 in the released models). Gemma's first releases say
hidden_act "gelu" but mean the tanh approximation, and transformers computes the tanh form for it; so does llmkit.

Gemma 2 adds:
    a second norm on each sub-layer's output          norm.placement sandwich
    attention scores soft-capped at 50                attention.softcap (attn_logit_softcapping)
    final logits soft-capped at 30                    logit_softcap (final_logit_softcapping)
    q.k scaled by query_pre_attn_scalar^-0.5          attention.scale (None when the scalar is head_dim)
    local and global layers alternating               attention.sliding_window with full_every 2 (layer_types)
and its four norms per layer are named

    model.layers.{i}.input_layernorm                  blocks.{i}.attn_residual.norm
    model.layers.{i}.post_attention_layernorm         blocks.{i}.attn_residual.post_norm
    model.layers.{i}.pre_feedforward_layernorm        blocks.{i}.ffn_residual.norm
    model.layers.{i}.post_feedforward_layernorm       blocks.{i}.ffn_residual.post_norm

(in Gemma, as in Llama, post_attention_layernorm is the norm before the feed-forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.activations import activation_from_hf, activation_to_hf
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_SHAPE, SIZE_KEYS, attention_rules, decoder_common_rules, swiglu_rules
from llmkit.interop.hf.fields import Custom, Entry, Field, Fixed, HFConfig, Stated, fixed, require
from llmkit.interop.hf.rope import ROPE, rope_from_hf, rope_to_hf
from llmkit.interop.keymap import Rule


def _activation_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """Gemma reads hidden_activation, else hidden_act, and takes "gelu" for the tanh approximation (as transformers'
    GemmaConfig does); Gemma 2 reads hidden_activation as it is."""
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    try:
        act = "gelu_tanh" if name == "gelu" and hf.get("model_type") != "gemma2" else activation_from_hf(name)
    except ValueError as e:
        raise ConfigError(f"config.json hidden_activation={name!r} is not supported; {e}") from None
    return {"ffn.activation": act}


def _activation_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    name = activation_to_hf(cfg.ffn.activation, "gemma")
    return {"hidden_act": name, "hidden_activation": name}


_G1, _G2, _G3 = ("gemma",), ("gemma2",), ("gemma3_text",)


def _scale_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """attention.scale from query_pre_attn_scalar; None (head_dim^-0.5) when the scalar is the head width."""
    scalar, head_dim = hf.get("query_pre_attn_scalar", 256), hf.get("head_dim", 256)
    return {"attention.scale": None if scalar == head_dim else float(scalar) ** -0.5}


def _scale_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.attention.scale is None:
        return {"query_pre_attn_scalar": cfg.head_dim}
    scalar = cfg.attention.scale**-2.0
    return {"query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar}


def _windows_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """The window and which layers skip it, from sliding_window and layer_types (derived as transformers does when
    absent: layers 0, 2, 4, ... slide). llmkit holds "every n-th layer is global"; other patterns are refused."""
    window = hf.get("sliding_window")
    n = int(require(hf, "num_hidden_layers"))
    pattern = 2 if hf.get("model_type") == "gemma2" else int(hf.get("sliding_window_pattern") or 6)  # as transformers
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    sliding = [t == "sliding_attention" for t in types]
    if not window or not any(sliding):
        return {"attention.sliding_window": None, "attention.full_every": None}
    if all(sliding):
        return {"attention.sliding_window": int(window), "attention.full_every": None}
    full = [i for i, s in enumerate(sliding) if not s]
    every = full[0] + 1
    if any(((i + 1) % every == 0) == s for i, s in enumerate(sliding)):
        raise ConfigError(
            f"config.json layer_types puts full attention in layers {full}; llmkit supports it in every n-th layer"
        )
    return {"attention.sliding_window": int(window), "attention.full_every": every}


def _gemma3_rope_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """Gemma 3 keeps one RoPE per layer type: rope_parameters {"full_attention": ..., "sliding_attention": ...}
    (transformers 5), or rope_theta / rope_scaling for the global layers and rope_local_base_freq (4.x)."""
    params = dict(hf.get("rope_parameters") or {})
    full = dict(params.get("full_attention") or {}) if "full_attention" in params else params
    local = dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json scales the sliding layers' RoPE ({local['rope_type']!r}); llmkit does not")
    theta = full.get("rope_theta") or hf.get("rope_theta") or 1_000_000.0  # Gemma3TextConfig's defaults
    flat = {"rope_parameters": {**full, "rope_theta": theta}, "rope_scaling": hf.get("rope_scaling")}
    out = rope_from_hf({**flat, "max_position_embeddings": hf.get("max_position_embeddings") or 131_072})
    out["position.local_theta"] = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10_000.0)
    return out


def _gemma3_rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = rope_to_hf(cfg)
    local = cfg.position.local_theta or cfg.position.theta
    out["rope_parameters"] = {
        "full_attention": out["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
    return {**out, "rope_local_base_freq": local}


def _windows_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    a = cfg.attention
    types = ["full_attention" if a.window_of(i) is None else "sliding_attention" for i in range(cfg.n_layers)]
    return {"sliding_window": a.sliding_window, "layer_types": types}


FIELDS: tuple[Entry, ...] = (
    *SIZE_KEYS,
    Field("attention.n_kv_heads", "num_key_value_heads", int, None),
    Field("attention.head_dim", "head_dim", int, 256),  # GemmaConfig's default when config.json has none
    Field(("attention.qkv_bias", "attention.out_bias"), "attention_bias", bool, False),
    Field("ffn.hidden_dim", "intermediate_size", int),
    Field("norm.eps", "rms_norm_eps", float, 1e-6),
    Field("tie_embeddings", "tie_word_embeddings", bool, True),
    dataclasses.replace(ROPE, only=_G1 + _G2),
    Custom(_gemma3_rope_from_hf, _gemma3_rope_to_hf, only=_G3),
    Custom(_activation_from_hf, _activation_to_hf),
    Fixed("ffn.activation", "gelu_tanh", "transformers reads Gemma's 'gelu' as the tanh GELU", only=("gemma",)),
    *fixed(
        "Gemma is a decoder of RMSNorm blocks (gains stored as 1 + weight) with RoPE, scaled embeddings and gated "
        "GELU feed-forwards without biases, with no QK-norm",
        {
            **{k: v for k, v in DECODER_SHAPE.items() if k != "norm.placement"},
            "norm.kind": "rmsnorm",
            "norm.unit_offset": True,
            "scale_embeddings": True,
            "ffn.kind": "swiglu",
            "ffn.bias": False,
            "moe": None,
            "attention.kind": "gqa",
            "position.layout": "half",
            "position.rope_fraction": 1.0,
            "mtp_depth": 0,
        },
    ),
    *fixed(
        "Gemma and Gemma 2 have no QK-norm and one RoPE base (those are gemma3_text)",
        {"attention.qk_norm": False, "position.local_theta": None},
        only=_G1 + _G2,
    ),
    # gemma
    *fixed(
        "Gemma's blocks are pre-norm, with no sliding window, soft-capping or scale of their own (those are gemma2)",
        {
            "norm.placement": "pre",
            "attention.sliding_window": None,
            "attention.full_every": None,
            "attention.softcap": None,
            "attention.scale": None,
            "logit_softcap": None,
        },
        only=_G1,
    ),
    # gemma2 and gemma3_text
    Fixed("norm.placement", "sandwich", "Gemma 2 and 3 normalise each sub-layer's input and output", only=_G2 + _G3),
    Field("attention.softcap", "attn_logit_softcapping", float, None, only=_G2 + _G3),
    Field("logit_softcap", "final_logit_softcapping", float, None, only=_G2 + _G3),
    Custom(_scale_from_hf, _scale_to_hf, only=_G2 + _G3),
    Custom(_windows_from_hf, _windows_to_hf, only=_G2 + _G3),
    # gemma3_text
    Fixed("attention.qk_norm", True, "Gemma 3 normalises every query and key head", only=_G3),
    Stated("use_bidirectional_attention", False, "llmkit reads Gemma 3 as a causal decoder", only=_G3),
)


class GemmaFamily(Family):
    name = "gemma"
    model_types: ClassVar[tuple[str, ...]] = ("gemma", "gemma2", "gemma3_text")
    architectures: ClassVar[dict[str, str]] = {
        "gemma": "GemmaForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        mlp = swiglu_rules("model.layers.{i}.mlp.", "blocks.{i}.ffn.", "layers")
        rules = decoder_common_rules() + attention_rules() + mlp
        if cfg.norm.placement != "sandwich":
            return rules
        layer = "model.layers.{i}."
        norms = {  # Gemma 2: post_attention_layernorm is the attention's output norm
            "blocks.{i}.attn_residual.post_norm.weight": layer + "post_attention_layernorm.weight",
            "blocks.{i}.ffn_residual.norm.weight": layer + "pre_feedforward_layernorm.weight",
            "blocks.{i}.ffn_residual.post_norm.weight": layer + "post_feedforward_layernorm.weight",
        }
        rules = [r for r in rules if r.ours != "blocks.{i}.ffn_residual.norm.weight"]
        return rules + [Rule(ours, theirs, where="layers") for ours, theirs in norms.items()]
