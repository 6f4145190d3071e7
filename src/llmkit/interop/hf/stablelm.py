"""StableLM (model_type stablelm: StableLM-2, StableLM-3B-4E1T, Zephyr): pre-norm LayerNorm blocks (with biases)
around grouped-query attention that rotates only a fraction of each head (partial_rotary_factor, 1/4 in the
releases) and SwiGLU feed-forwards. Tensor names are Llama's, plus the LayerNorm biases.

StableLM-2-12B's per-head LayerNorm on q and k (qk_layernorm) and its parallel residual (use_parallel_residual)
are refused by name: llmkit has neither.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar

from llmkit.config import ModelConfig
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_SHAPE, SIZE_KEYS, attention_rules, decoder_common_rules, swiglu_rules
from llmkit.interop.hf.fields import Entry, Field, Stated, fixed
from llmkit.interop.hf.rope import PARTIAL_ROTARY, ROPE
from llmkit.interop.keymap import Rule

_BLOCK = "llmkit's StableLM blocks are sequential, without per-head q/k LayerNorms"

FIELDS: tuple[Entry, ...] = (
    *SIZE_KEYS,
    Field("attention.n_kv_heads", "num_key_value_heads", int, None),
    Field("attention.qkv_bias", "use_qkv_bias", bool, False),
    Field("ffn.hidden_dim", "intermediate_size", int),
    activation_field("ffn.activation", "hidden_act", "stablelm", "silu"),
    Field("norm.eps", "layer_norm_eps", float, 1e-5),
    Field("tie_embeddings", "tie_word_embeddings", bool, False),
    Field("dropout", "hidden_dropout", float, 0.0),
    ROPE,
    PARTIAL_ROTARY,
    Stated("qk_layernorm", False, _BLOCK),
    Stated("use_parallel_residual", False, _BLOCK),
    *fixed(
        "StableLM is a decoder of pre-norm LayerNorm blocks with partial RoPE, grouped-query attention (q/k/v biases "
        "at most) and SwiGLU feed-forwards without biases",
        {
            **DECODER_SHAPE,
            "norm.kind": "layernorm",
            "norm.bias": True,
            "scale_embeddings": False,
            "ffn.kind": "swiglu",
            "ffn.bias": False,
            "moe": None,
            "attention.kind": "gqa",
            "attention.out_bias": False,
            "attention.sliding_window": None,
            "attention.qk_norm": False,
            "position.layout": "half",
            "mtp_depth": 0,
        },
    ),
)


class StableLMFamily(Family):
    name = "stablelm"
    model_types: ClassVar[tuple[str, ...]] = ("stablelm",)
    architectures: ClassVar[dict[str, str]] = {"stablelm": "StableLmForCausalLM"}
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        return (
            decoder_common_rules(norm_bias=True)
            + attention_rules()
            + swiglu_rules("model.layers.{i}.mlp.", "blocks.{i}.ffn.", "layers")
        )
