"""What the decoder-only families after Llama (Llama, Mistral, Qwen2, Mixtral, DeepSeek-V3) share: the config.json
keys every one of their configs has, and the key-map rules for the parts they name alike.

    model.embed_tokens.weight                       embed.weight
    model.layers.{i}.input_layernorm                blocks.{i}.attn_residual.norm
    model.layers.{i}.post_attention_layernorm       blocks.{i}.ffn_residual.norm
    model.norm.weight / lm_head.weight              norm.weight / head.weight (absent when tied)
    model.layers.{i}.self_attn.{q,k,v,o}_proj       blocks.{i}.attn.{wq,wk,wv,wo}          (GQA)
    model.layers.{i}.self_attn.{q,k}_norm           blocks.{i}.attn.{q,k}_norm             (QK-norm: Qwen3)
    ....{gate,up,down}_proj                         ....{w1,w3,w2}                         (SwiGLU)
    ....experts.{e}.{w1,w3,w2} or fused             blocks.{i}.ffn.experts.{w1,w3,w2}      (stacked over e)
"""

from __future__ import annotations

from collections.abc import Collection

from llmkit.config import ModelConfig
from llmkit.interop.hf.fields import Entry, Field, fixed
from llmkit.interop.hf.rope import ROPE
from llmkit.interop.keymap import Rule, Split, Stack

SIZE_KEYS: tuple[Entry, ...] = (
    Field("vocab_size", "vocab_size", int),
    Field("d_model", "hidden_size", int),
    Field("n_layers", "num_hidden_layers", int),
    Field("attention.n_heads", "num_attention_heads", int),
    Field("attention.dropout", "attention_dropout", float, 0.0),
)
"""The sizes every decoder family after GPT-2 names alike (their norm epsilon and tied-head default differ)."""

DECODER_KEYS: tuple[Entry, ...] = (
    *SIZE_KEYS,
    Field("norm.eps", "rms_norm_eps", float, 1e-6),
    Field("tie_embeddings", "tie_word_embeddings", bool, False),
    ROPE,
)
"""config.json keys every Llama-style decoder has."""

DECODER_SHAPE: dict[str, object] = {
    "norm.placement": "pre",
    "position.kind": "rope",
    "encoder": None,
    "head_bias": False,
}
"""What every Llama-style decoder is: pre-norm blocks, RoPE, no encoder, no head bias."""

DECODER_FIELDS: tuple[Entry, ...] = (
    *DECODER_KEYS,
    *fixed(
        "its checkpoints are decoders of pre-norm RMSNorm blocks with RoPE and SwiGLU feed-forwards",
        {
            **DECODER_SHAPE,
            "norm.kind": "rmsnorm",
            "norm.unit_offset": False,
            "ffn.kind": "swiglu",
            "scale_embeddings": False,
        },
    ),
)
"""The keys and the shape of Llama, Mistral, Qwen, Mixtral and DeepSeek."""


def decoder_common_rules(norm_bias: bool = False) -> list[Rule]:
    """Embedding, per-layer norms, final norm and head; `norm_bias`: LayerNorms with biases (StarCoder2, StableLM)."""
    params = ("weight", "bias") if norm_bias else ("weight",)
    rules = [Rule("embed.weight", "model.embed_tokens.weight")]
    for p in params:
        rules += [
            Rule(f"blocks.{{i}}.attn_residual.norm.{p}", f"model.layers.{{i}}.input_layernorm.{p}", where="layers"),
            Rule(
                f"blocks.{{i}}.ffn_residual.norm.{p}",
                f"model.layers.{{i}}.post_attention_layernorm.{p}",
                where="layers",
            ),
            Rule(f"norm.{p}", f"model.norm.{p}"),
        ]
    return [*rules, Rule("head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings)]


_QKVO = [("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")]


def attention_rules(prefix: str = "model.layers.{i}.self_attn.", ours: str = "blocks.{i}.attn.") -> list[Rule]:
    """q/k/v/o projections with optional biases (Qwen2: q/k/v only; Llama attention_bias: all four)."""
    rules = [Rule(f"{ours}{a}.weight", f"{prefix}{b}_proj.weight", where="layers") for a, b in _QKVO]
    rules += [
        Rule(f"{ours}{a}.bias", f"{prefix}{b}_proj.bias", where="layers", when=lambda c: c.attention.qkv_bias)
        for a, b in _QKVO[:3]
    ]
    rules.append(Rule(f"{ours}wo.bias", f"{prefix}o_proj.bias", where="layers", when=lambda c: c.attention.out_bias))
    return rules + qk_norm_rules(prefix, ours)


def qk_norm_rules(prefix: str = "model.layers.{i}.self_attn.", ours: str = "blocks.{i}.attn.") -> list[Rule]:
    """Per-head query and key norms (Qwen3's q_norm / k_norm, one gain of head_dim each), when the config has them."""
    return [
        Rule(f"{ours}{n}.weight", f"{prefix}{n}.weight", where="layers", when=lambda c: c.attention.qk_norm)
        for n in ("q_norm", "k_norm")
    ]


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
