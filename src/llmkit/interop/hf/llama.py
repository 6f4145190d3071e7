"""Llama (Llama-2, Llama-3 with its rope scaling), Mistral (sliding window), Qwen2 (q/k/v biases) and Qwen3
(QK-norm): one layout.

    model.layers.{i}.self_attn.{q,k,v,o}_proj       blocks.{i}.attn.{wq,wk,wv,wo}
    model.layers.{i}.mlp.{gate,up,down}_proj        blocks.{i}.ffn.{w1,w3,w2}
    model.layers.{i}.self_attn.{q,k}_norm           blocks.{i}.attn.{q,k}_norm       (qwen3)
    (embedding, norms and head as in llmkit.interop.hf.decoder)

The four model_types differ only in a few config.json keys, which are rows of one table:

    llama     attention_bias (q, k, v and o together), mlp_bias; no sliding window
    mistral   sliding_window; no biases
    qwen2     biases on q, k and v, never on o (Qwen2's modeling code); use_sliding_window, sliding_window and
              max_window_layers, of which llmkit reads a window that every layer uses
    qwen3     RMSNorm on every query and key head before RoPE; attention_bias (q, k, v and o); Qwen2's window keys
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_FIELDS, attention_rules, decoder_common_rules, swiglu_rules
from llmkit.interop.hf.fields import Custom, Entry, Field, Fixed, HFConfig, fixed, optional_positive, require
from llmkit.interop.keymap import Rule

GQA_FIELDS: tuple[Entry, ...] = (
    *DECODER_FIELDS,
    Field("attention.n_kv_heads", "num_key_value_heads", int, None),
    Field("attention.head_dim", "head_dim", int, None),
    *fixed(
        "its checkpoints use grouped-query attention with half-layout RoPE on every dimension of each head (its "
        "modeling code rotates them all, whatever partial_rotary_factor says) and no multi-token prediction",
        {"attention.kind": "gqa", "position.layout": "half", "position.rope_fraction": 1.0, "mtp_depth": 0},
    ),
)
"""The Llama layout's keys, shared with Mixtral."""


_QWEN = ("qwen2", "qwen3")


def _qwen2_window_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """A window when every layer slides. Qwen2 and Qwen3 slide only from layer max_window_layers on (transformers
    derives `layer_types` from it when the config has none); llmkit has one window for all layers."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if not window:
        return {"attention.sliding_window": None}
    types = hf.get("layer_types")
    if not types:  # as transformers derives them
        first = 28 if hf.get("max_window_layers") is None else int(hf["max_window_layers"])  # the configs' default
        n_layers = int(require(hf, "num_hidden_layers"))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True, False}:
        raise ConfigError(
            "config.json use_sliding_window=true with full-attention layers (max_window_layers) mixes window sizes "
            "across layers, which llmkit does not support"
        )
    return {"attention.sliding_window": int(window) if sliding == {True} else None}


def _qwen2_window_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    window = cfg.attention.sliding_window
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window else cfg.n_layers,
    }


FIELDS: tuple[Entry, ...] = (
    *GQA_FIELDS,
    Field("ffn.hidden_dim", "intermediate_size", int),
    activation_field("ffn.activation", "hidden_act", "llama", "silu"),
    Fixed("moe", None, "Llama, Mistral and Qwen2 have dense feed-forwards (a mixture of experts is mixtral)"),
    # llama
    Field(("attention.qkv_bias", "attention.out_bias"), "attention_bias", bool, False, only=("llama", "qwen3")),
    Field("ffn.bias", "mlp_bias", bool, False, only=("llama",)),
    Fixed("attention.sliding_window", None, "Llama has no sliding window; use mistral", only=("llama",)),
    # mistral
    Field("attention.sliding_window", "sliding_window", optional_positive, None, only=("mistral",)),
    *fixed(
        "Mistral has no biases",
        {"attention.qkv_bias": False, "attention.out_bias": False, "ffn.bias": False},
        only=("mistral",),
    ),
    # qwen2
    Custom(_qwen2_window_from_hf, _qwen2_window_to_hf, only=_QWEN),
    *fixed(
        "Qwen2 has biases on q, k and v, and none on o or in the feed-forward",
        {"attention.qkv_bias": True, "attention.out_bias": False, "ffn.bias": False},
        only=("qwen2",),
    ),
    # qwen3
    Fixed("ffn.bias", False, "Qwen3's feed-forwards have no biases", only=("qwen3",)),
    Fixed(
        "attention.qk_norm", True, "Qwen3 normalises every query and key head (without QK-norm: qwen2)", only=("qwen3",)
    ),
    Fixed("attention.qk_norm", False, "it has no QK-norm (use qwen3)", only=("llama", "mistral", "qwen2")),
)


class LlamaFamily(Family):
    name = "llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    architectures: ClassVar[dict[str, str]] = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        return (
            decoder_common_rules()
            + attention_rules()
            + swiglu_rules("model.layers.{i}.mlp.", "blocks.{i}.ffn.", "layers", bias=True)
        )
