"""GPT-2: Conv1D weights stored (in, out) and q, k, v fused in one c_attn.

    [transformer.]wte / wpe                 embed / inputs.positions.table
    [transformer.]h.{i}.ln_1 / ln_2         blocks.{i}.attn_residual.norm / ffn_residual.norm
    [transformer.]h.{i}.attn.c_attn         blocks.{i}.attn.{wq,wk,wv}     transpose, split in three
    [transformer.]h.{i}.attn.c_proj         blocks.{i}.attn.wo             transpose
    [transformer.]h.{i}.mlp.c_fc / c_proj   blocks.{i}.ffn.w1 / w2         transpose
    [transformer.]ln_f                      norm

Checkpoints saved from GPT2LMHeadModel prefix names with "transformer."; the original OpenAI ones do not.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar

from llmkit.config import ModelConfig
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.fields import Derived, Entry, Field, Stated, fixed
from llmkit.interop.keymap import Rule, Split, Transpose

_ATTENTION_CHANGE = "it changes GPT-2's attention in a way llmkit does not support"

FIELDS: tuple[Entry, ...] = (
    Field("vocab_size", "vocab_size", int),
    Field("d_model", "n_embd", int),
    Field("n_layers", "n_layer", int),
    Field("attention.n_heads", "n_head", int),
    Field("attention.dropout", "attn_pdrop", float, 0.0),
    Field("ffn.hidden_dim", "n_inner", int, None),  # null: 4 * n_embd, also llmkit's default width for an MLP
    activation_field("ffn.activation", "activation_function", "gpt2", "gelu_tanh"),
    Field("position.max_seq_len", "n_positions", int),
    Field("norm.eps", "layer_norm_epsilon", float, 1e-5),
    Field("tie_embeddings", "tie_word_embeddings", bool, True),
    Field("dropout", "resid_pdrop", float, 0.0),
    Derived("embd_pdrop", lambda cfg: cfg.dropout),  # llmkit has one dropout for the residual and the embedding
    *fixed(
        "GPT-2 is a decoder of pre-norm LayerNorm blocks with learned positions, multi-head attention with biases "
        "and a GELU MLP with biases",
        {
            "attention.kind": "gqa",
            "attention.qkv_bias": True,
            "attention.out_bias": True,
            "attention.sliding_window": None,
            "ffn.kind": "mlp",
            "ffn.bias": True,
            "moe": None,
            "position.kind": "learned",
            "norm.kind": "layernorm",
            "norm.placement": "pre",
            "norm.bias": True,
            "encoder": None,
            "mtp_depth": 0,
            "head_bias": False,
            "scale_embeddings": False,
        },
    ),
    Stated("scale_attn_weights", True, _ATTENTION_CHANGE),
    Stated("scale_attn_by_inverse_layer_idx", False, _ATTENTION_CHANGE),
    Stated("add_cross_attention", False, _ATTENTION_CHANGE),
)


class GPT2Family(Family):
    name = "gpt2"
    model_types: ClassVar[tuple[str, ...]] = ("gpt2",)
    architectures: ClassVar[dict[str, str]] = {"gpt2": "GPT2LMHeadModel"}
    fields = FIELDS
    reference_stacks: ClassVar[tuple[str, ...]] = ("transformer.h",)

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        p = "" if ("wte.weight" in names and "transformer.wte.weight" not in names) else "transformer."
        C = cfg.d_model
        h = p + "h.{i}."
        qkv = Split((C, C, C), dim=0, then=Transpose())
        return [
            Rule("embed.weight", p + "wte.weight"),
            Rule("inputs.positions.table.weight", p + "wpe.weight"),
            Rule("blocks.{i}.attn_residual.norm.weight", h + "ln_1.weight", where="layers"),
            Rule("blocks.{i}.attn_residual.norm.bias", h + "ln_1.bias", where="layers"),
            Rule(
                ("blocks.{i}.attn.wq.weight", "blocks.{i}.attn.wk.weight", "blocks.{i}.attn.wv.weight"),
                h + "attn.c_attn.weight",
                qkv,
                where="layers",
            ),
            Rule(
                ("blocks.{i}.attn.wq.bias", "blocks.{i}.attn.wk.bias", "blocks.{i}.attn.wv.bias"),
                h + "attn.c_attn.bias",
                Split((C, C, C)),
                where="layers",
            ),
            Rule("blocks.{i}.attn.wo.weight", h + "attn.c_proj.weight", Transpose(), where="layers"),
            Rule("blocks.{i}.attn.wo.bias", h + "attn.c_proj.bias", where="layers"),
            Rule("blocks.{i}.ffn_residual.norm.weight", h + "ln_2.weight", where="layers"),
            Rule("blocks.{i}.ffn_residual.norm.bias", h + "ln_2.bias", where="layers"),
            Rule("blocks.{i}.ffn.w1.weight", h + "mlp.c_fc.weight", Transpose(), where="layers"),
            Rule("blocks.{i}.ffn.w1.bias", h + "mlp.c_fc.bias", where="layers"),
            Rule("blocks.{i}.ffn.w2.weight", h + "mlp.c_proj.weight", Transpose(), where="layers"),
            Rule("blocks.{i}.ffn.w2.bias", h + "mlp.c_proj.bias", where="layers"),
            Rule("norm.weight", p + "ln_f.weight"),
            Rule("norm.bias", p + "ln_f.bias"),
            Rule("head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings),
        ]

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        # the causal-mask buffers old checkpoints saved, and a tied head some of them store
        return name.endswith((".attn.bias", ".attn.masked_bias")) or super().ignored(name, cfg)
