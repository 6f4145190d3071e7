"""Gemma (model_type gemma): the Llama layout with three changes, each a setting of llmkit's config.

    embeddings times sqrt(hidden_size)               scale_embeddings
    RMSNorm gains stored as 1 + weight               norm.unit_offset (the weights load as they are, no +1 added)
    GeGLU feed-forward: gelu_tanh(x W1) * x W3       ffn.kind swiglu with ffn.activation gelu_tanh
and tied embeddings by default, and a head_dim of its own (256 in the released models). The tensor names are Llama's
(llmkit.interop.hf.decoder). Gemma's first releases say hidden_act "gelu" but mean the tanh approximation, and
transformers computes the tanh form for it; llmkit does the same.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.activations import activation_from_hf, activation_to_hf
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_SHAPE, attention_rules, decoder_common_rules, swiglu_rules
from llmkit.interop.hf.fields import Custom, Entry, Field, HFConfig, fixed
from llmkit.interop.hf.rope import ROPE
from llmkit.interop.keymap import Rule


def _activation_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    try:
        act = "gelu_tanh" if name == "gelu" else activation_from_hf(name)
    except ValueError as e:
        raise ConfigError(f"config.json hidden_act={name!r} is not supported; {e}") from None
    return {"ffn.activation": act}


def _activation_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.ffn.activation == "gelu":
        raise ConfigError(
            "ffn.activation='gelu' cannot be written as model_type 'gemma': transformers reads Gemma's 'gelu' as the "
            "tanh approximation (use gelu_tanh)"
        )
    return {"hidden_act": activation_to_hf(cfg.ffn.activation, "gemma")}


FIELDS: tuple[Entry, ...] = (
    Field("vocab_size", "vocab_size", int),
    Field("d_model", "hidden_size", int),
    Field("n_layers", "num_hidden_layers", int),
    Field("attention.n_heads", "num_attention_heads", int),
    Field("attention.n_kv_heads", "num_key_value_heads", int, None),
    Field("attention.head_dim", "head_dim", int, 256),  # GemmaConfig's default when config.json has none
    Field("attention.dropout", "attention_dropout", float, 0.0),
    Field(("attention.qkv_bias", "attention.out_bias"), "attention_bias", bool, False),
    Field("ffn.hidden_dim", "intermediate_size", int),
    Field("norm.eps", "rms_norm_eps", float, 1e-6),
    Field("tie_embeddings", "tie_word_embeddings", bool, True),
    ROPE,
    Custom(_activation_from_hf, _activation_to_hf),
    *fixed(
        "Gemma is a decoder of pre-norm RMSNorm blocks (gains stored as 1 + weight) with RoPE, scaled embeddings and "
        "gated GELU feed-forwards without biases, with neither a sliding window nor QK-norm",
        {
            **DECODER_SHAPE,
            "norm.kind": "rmsnorm",
            "norm.unit_offset": True,
            "scale_embeddings": True,
            "ffn.kind": "swiglu",
            "ffn.bias": False,
            "moe": None,
            "attention.kind": "gqa",
            "attention.sliding_window": None,
            "attention.qk_norm": False,
            "position.layout": "half",
            "position.rope_fraction": 1.0,
            "mtp_depth": 0,
        },
    ),
)


class GemmaFamily(Family):
    name = "gemma"
    model_types: ClassVar[tuple[str, ...]] = ("gemma",)
    architectures: ClassVar[dict[str, str]] = {"gemma": "GemmaForCausalLM"}
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        return (
            decoder_common_rules()
            + attention_rules()
            + swiglu_rules("model.layers.{i}.mlp.", "blocks.{i}.ffn.", "layers")
        )
