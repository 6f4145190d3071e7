"""What the decoder-only families after Llama (Llama, Mistral, Qwen2, Mixtral, DeepSeek-V3) share: the config.json
keys every one of their configs has, and the key-map rules for the parts they name alike.

    model.embed_tokens.weight                       embed.weight
    model.layers.{i}.input_layernorm                blocks.{i}.attn_residual.norm
    model.layers.{i}.post_attention_layernorm       blocks.{i}.ffn_residual.norm
    model.norm.weight / lm_head.weight              norm.weight / head.weight (absent when tied)
    model.layers.{i}.self_attn.{q,k,v,o}_proj       blocks.{i}.attn.{wq,wk,wv,wo}          (GQA)
    ....{gate,up,down}_proj                         ....{w1,w3,w2}                         (SwiGLU)
    ....experts.{e}.{w1,w3,w2} or fused             blocks.{i}.ffn.experts.{w1,w3,w2}      (stacked over e)
"""

from __future__ import annotations

from collections.abc import Collection

from llmkit.config import ModelConfig
from llmkit.interop.hf.fields import Entry, Field, fixed
from llmkit.interop.hf.rope import ROPE
from llmkit.interop.keymap import Rule, Split, Stack

DECODER_FIELDS: tuple[Entry, ...] = (
    Field("vocab_size", "vocab_size", int),
    Field("d_model", "hidden_size", int),
    Field("n_layers", "num_hidden_layers", int),
    Field("attention.n_heads", "num_attention_heads", int),
    Field("attention.dropout", "attention_dropout", float, 0.0),
    Field("norm.eps", "rms_norm_eps", float, 1e-6),
    Field("tie_embeddings", "tie_word_embeddings", bool, False),
    ROPE,
    *fixed(
        "its checkpoints are decoders of pre-norm RMSNorm blocks with RoPE and SwiGLU feed-forwards",
        {
            "norm.kind": "rmsnorm",
            "norm.placement": "pre",
            "position.kind": "rope",
            "ffn.kind": "swiglu",
            "encoder": None,
            "head_bias": False,
            "scale_embeddings": False,
        },
    ),
)
"""config.json keys every Llama-style decoder has."""


def decoder_common_rules() -> list[Rule]:
    """Embedding, per-layer norms, final norm and head."""
    return [
        Rule("embed.weight", "model.embed_tokens.weight"),
        Rule("blocks.{i}.attn_residual.norm.weight", "model.layers.{i}.input_layernorm.weight", where="layers"),
        Rule("blocks.{i}.ffn_residual.norm.weight", "model.layers.{i}.post_attention_layernorm.weight", where="layers"),
        Rule("norm.weight", "model.norm.weight"),
        Rule("head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings),
    ]


_QKVO = [("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")]


def attention_rules(prefix: str = "model.layers.{i}.self_attn.", ours: str = "blocks.{i}.attn.") -> list[Rule]:
    """q/k/v/o projections with optional biases (Qwen2: q/k/v only; Llama attention_bias: all four)."""
    rules = [Rule(f"{ours}{a}.weight", f"{prefix}{b}_proj.weight", where="layers") for a, b in _QKVO]
    rules += [
        Rule(f"{ours}{a}.bias", f"{prefix}{b}_proj.bias", where="layers", when=lambda c: c.attention.qkv_bias)
        for a, b in _QKVO[:3]
    ]
    rules.append(Rule(f"{ours}wo.bias", f"{prefix}o_proj.bias", where="layers", when=lambda c: c.attention.out_bias))
    return rules


def swiglu_rules(prefix: str, ours: str, where: str, bias: bool = False) -> list[Rule]:
    """gate/up/down projections <-> w1/w3/w2, with biases when the config has them (Llama's mlp_bias)."""
    names = [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]
    rules = [Rule(f"{ours}{a}.weight", f"{prefix}{b}.weight", where=where) for a, b in names]
    if bias:
        rules += [
            Rule(f"{ours}{a}.bias", f"{prefix}{b}.bias", where=where, when=lambda c: c.ffn.bias) for a, b in names
        ]
    return rules


def fused_layout(names: Collection[str]) -> bool:
    """Whether a state dict keeps experts fused (transformers 5.x in memory) rather than one tensor per expert."""
    return any(n.endswith("experts.gate_up_proj") for n in names)


def expert_rules(
    cfg: ModelConfig,
    names: Collection[str],
    split: str,
    split_names: tuple[str, str, str],
    fused: str,
    where: str = "moe",
    ours: str = "blocks.{i}.ffn.experts.",
) -> list[Rule]:
    """Routed experts, from one tensor per expert (`split` + "{e}." + name, as saved on disk) or the fused in-memory
    layout: gate_up_proj (E, 2I, C) = [w1; w3] and down_proj (E, C, I)."""
    assert cfg.moe is not None
    if fused_layout(names):
        hidden = cfg.moe.expert_hidden_dim
        return [
            Rule((ours + "w1", ours + "w3"), fused + "gate_up_proj", Split((hidden, hidden), dim=1), where=where),
            Rule(ours + "w2", fused + "down_proj", where=where),
        ]
    return [
        Rule(ours + a, split + "{e}." + b + ".weight", Stack(), where=where)
        for a, b in zip(("w1", "w3", "w2"), split_names, strict=True)
    ]
