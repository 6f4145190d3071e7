"""StarCoder2 (model_type starcoder2): pre-norm LayerNorm blocks (with biases) around grouped-query attention with
RoPE and a plain GELU MLP, every projection with a bias (use_bias), a sliding window over every layer, tied
embeddings by default.

    model.layers.{i}.input_layernorm / post_attention_layernorm   blocks.{i}.attn_residual.norm / ffn_residual.norm
    model.norm                                                    norm                       (weights and biases)
    model.layers.{i}.self_attn.{q,k,v,o}_proj                     blocks.{i}.attn.{wq,wk,wv,wo}
    model.layers.{i}.mlp.c_fc / c_proj                            blocks.{i}.ffn.w1 / w2
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar

from llmkit.config import ModelConfig
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_SHAPE, SIZE_KEYS, attention_rules, decoder_common_rules
from llmkit.interop.hf.fields import Derived, Entry, Field, fixed, optional_positive
from llmkit.interop.hf.rope import ROPE
from llmkit.interop.keymap import Rule

FIELDS: tuple[Entry, ...] = (
    *SIZE_KEYS,
    Field("attention.n_kv_heads", "num_key_value_heads", int, None),
    Field("attention.sliding_window", "sliding_window", optional_positive, None),
    Field(("attention.qkv_bias", "attention.out_bias", "ffn.bias"), "use_bias", bool, True),
    Field("ffn.hidden_dim", "intermediate_size", int),
    activation_field("ffn.activation", "hidden_act", "starcoder2", "gelu_tanh"),
    Field("norm.eps", "norm_epsilon", float, 1e-5),
    Field("tie_embeddings", "tie_word_embeddings", bool, True),
    Field("dropout", "residual_dropout", float, 0.0),
    Derived("embedding_dropout", lambda cfg: cfg.dropout),  # llmkit has one dropout for the residual and embedding
    ROPE,
    *fixed(
        "StarCoder2 is a decoder of pre-norm LayerNorm blocks with RoPE, grouped-query attention and a GELU MLP",
        {
            **DECODER_SHAPE,
            "norm.kind": "layernorm",
            "norm.bias": True,
            "scale_embeddings": False,
            "ffn.kind": "mlp",
            "moe": None,
            "attention.kind": "gqa",
            "attention.qk_norm": False,
            "position.layout": "half",
            "position.rope_fraction": 1.0,
            "mtp_depth": 0,
        },
    ),
)


class StarCoder2Family(Family):
    name = "starcoder2"
    model_types: ClassVar[tuple[str, ...]] = ("starcoder2",)
    architectures: ClassVar[dict[str, str]] = {"starcoder2": "Starcoder2ForCausalLM"}
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        m, f = "model.layers.{i}.mlp.", "blocks.{i}.ffn."
        rules = decoder_common_rules(norm_bias=True) + attention_rules()
        for ours, theirs in (("w1", "c_fc"), ("w2", "c_proj")):
            rules.append(Rule(f"{f}{ours}.weight", f"{m}{theirs}.weight", where="layers"))
            rules.append(Rule(f"{f}{ours}.bias", f"{m}{theirs}.bias", where="layers", when=lambda c: c.ffn.bias))
        return rules
