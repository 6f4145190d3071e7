"""Phi-3 and Phi-4-mini (model_type phi3): the Llama block with q, k, v fused in one projection and gate and up in
another, which the key map splits by rows:

    model.layers.{i}.self_attn.qkv_proj     blocks.{i}.attn.{wq, wk, wv}     rows [H*D | K*D | K*D]
    model.layers.{i}.self_attn.o_proj       blocks.{i}.attn.wo
    model.layers.{i}.mlp.gate_up_proj       blocks.{i}.ffn.{w1, w3}          rows [I | I]
    model.layers.{i}.mlp.down_proj          blocks.{i}.ffn.w2
    (embedding, norms and head as in llmkit.interop.hf.decoder)

Partial rotary dimensions (Phi-4-mini rotates 3/4 of each head) and a sliding window over every layer are read;
the "longrope" scaling of the 128k-context releases is not supported (llmkit.interop.hf.rope says so).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar

from llmkit.config import ModelConfig
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_KEYS, DECODER_SHAPE, decoder_common_rules
from llmkit.interop.hf.fields import Derived, Entry, Field, fixed, optional_positive
from llmkit.interop.hf.rope import PARTIAL_ROTARY
from llmkit.interop.keymap import Rule, Split

FIELDS: tuple[Entry, ...] = (
    *DECODER_KEYS,
    Field("attention.n_kv_heads", "num_key_value_heads", int, None),
    Field("attention.head_dim", "head_dim", int, None),
    Field("attention.sliding_window", "sliding_window", optional_positive, None),
    Field("ffn.hidden_dim", "intermediate_size", int),
    activation_field("ffn.activation", "hidden_act", "phi3", "silu"),
    PARTIAL_ROTARY,
    Field("dropout", "resid_pdrop", float, 0.0),
    Derived("embd_pdrop", lambda cfg: cfg.dropout),  # llmkit has one dropout for the residual and the embedding
    *fixed(
        "Phi-3 is a decoder of pre-norm RMSNorm blocks with RoPE, grouped-query attention and SwiGLU feed-forwards, "
        "none with biases",
        {
            **DECODER_SHAPE,
            "norm.kind": "rmsnorm",
            "norm.unit_offset": False,
            "scale_embeddings": False,
            "ffn.kind": "swiglu",
            "ffn.bias": False,
            "moe": None,
            "attention.kind": "gqa",
            "attention.qkv_bias": False,
            "attention.out_bias": False,
            "attention.qk_norm": False,
            "position.layout": "half",
            "mtp_depth": 0,
        },
    ),
)


class Phi3Family(Family):
    name = "phi3"
    model_types: ClassVar[tuple[str, ...]] = ("phi3",)
    architectures: ClassVar[dict[str, str]] = {"phi3": "Phi3ForCausalLM"}
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        q, kv, hidden = cfg.attention.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden_dim
        a, o, m = "model.layers.{i}.self_attn.", "blocks.{i}.attn.", "model.layers.{i}.mlp."
        return [
            *decoder_common_rules(),
            Rule(
                (o + "wq.weight", o + "wk.weight", o + "wv.weight"),
                a + "qkv_proj.weight",
                Split((q, kv, kv), dim=0),
                where="layers",
            ),
            Rule(o + "wo.weight", a + "o_proj.weight", where="layers"),
            Rule(
                ("blocks.{i}.ffn.w1.weight", "blocks.{i}.ffn.w3.weight"),
                m + "gate_up_proj.weight",
                Split((hidden, hidden), dim=0),
                where="layers",
            ),
            Rule("blocks.{i}.ffn.w2.weight", m + "down_proj.weight", where="layers"),
        ]
