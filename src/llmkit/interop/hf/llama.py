"""Llama (Llama-2, Llama-3 with its rope scaling), Mistral (sliding window) and Qwen2 (q/k/v biases): one layout.

model.embed_tokens.weight                       embed.weight
model.layers.{i}.self_attn.{q,k,v,o}_proj       blocks.{i}.attn.{wq,wk,wv,wo}
model.layers.{i}.mlp.{gate,up,down}_proj        blocks.{i}.ffn.{w1,w3,w2}
model.layers.{i}.input_layernorm                blocks.{i}.attn_residual.norm
model.layers.{i}.post_attention_layernorm       blocks.{i}.ffn_residual.norm
model.norm.weight / lm_head.weight              norm.weight / head.weight (absent when tied)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.base import (
    Family,
    activation_from_hf,
    activation_to_hf,
    hf_max_positions,
    require,
    rope_from_hf,
    rope_to_hf,
)
from llmkit.interop.keymap import Rule


def attention_rules(prefix: str = "model.layers.{i}.self_attn.", ours: str = "blocks.{i}.attn.") -> list[Rule]:
    """q/k/v/o projections with optional biases (Qwen2: q/k/v only; Llama attention_bias: all four)."""
    rules = [Rule(f"{ours}{a}.weight", f"{prefix}{b}_proj.weight", where="layers") for a, b in _QKVO]
    rules += [
        Rule(f"{ours}{a}.bias", f"{prefix}{b}_proj.bias", where="layers", when=lambda c: c.attention.qkv_bias)
        for a, b in _QKVO[:3]
    ]
    rules.append(Rule(f"{ours}wo.bias", f"{prefix}o_proj.bias", where="layers", when=lambda c: c.attention.out_bias))
    return rules


_QKVO = [("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")]


def swiglu_rules(prefix: str, ours: str, where: str, bias: bool = False) -> list[Rule]:
    names = [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]
    rules = [Rule(f"{ours}{a}.weight", f"{prefix}{b}.weight", where=where) for a, b in names]
    if bias:
        rules += [
            Rule(f"{ours}{a}.bias", f"{prefix}{b}.bias", where=where, when=lambda c: c.ffn.bias) for a, b in names
        ]
    return rules


def decoder_common_rules() -> list[Rule]:
    """Embedding, per-layer norms, final norm and head, shared by the Llama-like families."""
    return [
        Rule("embed.weight", "model.embed_tokens.weight"),
        Rule("blocks.{i}.attn_residual.norm.weight", "model.layers.{i}.input_layernorm.weight", where="layers"),
        Rule("blocks.{i}.ffn_residual.norm.weight", "model.layers.{i}.post_attention_layernorm.weight", where="layers"),
        Rule("norm.weight", "model.norm.weight"),
        Rule("head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings),
    ]


class LlamaFamily(Family):
    name = "llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2")
    architectures: ClassVar[dict[str, str]] = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }

    def config_from_hf(self, hf: dict[str, Any], names: Collection[str]) -> ModelConfig:
        mt = hf.get("model_type", "llama")
        d, heads = int(require(hf, "hidden_size")), int(require(hf, "num_attention_heads"))
        theta, scaling, max_len = rope_from_hf(hf)
        if mt == "qwen2":
            qkv_bias, out_bias = True, False
        else:
            qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        return ModelConfig(
            vocab_size=int(require(hf, "vocab_size")),
            d_model=d,
            n_layers=int(require(hf, "num_hidden_layers")),
            attention=AttentionConfig(
                n_heads=heads,
                n_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or d // heads),
                qkv_bias=qkv_bias,
                out_bias=out_bias,
                dropout=float(hf.get("attention_dropout", 0.0)),
                sliding_window=self._window(hf),
            ),
            ffn=FFNConfig(
                kind="swiglu",
                hidden_dim=int(require(hf, "intermediate_size")),
                activation=activation_from_hf(hf.get("hidden_act", "silu")),
                bias=bool(hf.get("mlp_bias", False)),
            ),
            position=PositionConfig(
                kind="rope",
                max_seq_len=max_len,
                theta=theta,
                layout="half",
                rope_fraction=float((hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)),
                scaling=scaling,
            ),
            norm=NormConfig(kind="rmsnorm", eps=float(hf.get("rms_norm_eps", 1e-6))),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    @staticmethod
    def _window(hf: dict[str, Any]) -> int | None:
        mt = hf.get("model_type")
        window = hf.get("sliding_window")
        if mt == "mistral":
            return int(window) if window else None
        if mt == "qwen2" and hf.get("use_sliding_window"):
            types = hf.get("layer_types") or []
            if window and types and all(t == "sliding_attention" for t in types):
                return int(window)
            if window:
                raise ConfigError(
                    "config.json use_sliding_window=true with full-attention layers (max_window_layers) mixes "
                    "window sizes across layers, which llmkit does not support"
                )
        return None

    def config_to_hf(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        a, f = cfg.attention, cfg.ffn
        if a.kind != "gqa" or cfg.moe is not None or f.kind != "swiglu" or cfg.norm.kind != "rmsnorm":
            raise ConfigError("only a GQA + SwiGLU + RMSNorm decoder maps to Llama, Mistral or Qwen2")
        if cfg.position.kind != "rope" or cfg.position.layout != "half" or cfg.norm.placement != "pre":
            raise ConfigError("Llama-family checkpoints use pre-norm and half-layout RoPE")
        if cfg.encoder is not None or cfg.mtp_depth or cfg.head_bias or cfg.scale_embeddings:
            raise ConfigError("this model has parts a Llama-family checkpoint cannot hold")
        if model_type == "qwen2" and (not a.qkv_bias or a.out_bias):
            raise ConfigError("Qwen2 has biases on q, k, v and not on o")
        if model_type != "qwen2" and a.qkv_bias != a.out_bias:
            raise ConfigError(f"{model_type} has one attention_bias flag for q, k, v and o")
        if model_type == "llama" and a.sliding_window is not None:
            raise ConfigError("Llama has no sliding window; use mistral")
        out: dict[str, Any] = {
            "model_type": model_type,
            "architectures": [LlamaFamily.architectures[model_type]],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": f.hidden_dim,
            "hidden_act": activation_to_hf(f.activation),
            "max_position_embeddings": hf_max_positions(cfg),
            "rms_norm_eps": cfg.norm.eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_dropout": a.dropout,
            **rope_to_hf(cfg),
        }
        if cfg.position.rope_fraction != 1.0:
            out["rope_parameters"]["partial_rotary_factor"] = cfg.position.rope_fraction
        if model_type == "llama":
            out.update(attention_bias=a.qkv_bias, mlp_bias=f.bias)
        elif f.bias:
            raise ConfigError(f"{model_type} has no feed-forward biases")
        if model_type == "mistral":
            out["sliding_window"] = a.sliding_window
        if model_type == "qwen2":
            out.update(
                use_sliding_window=a.sliding_window is not None,
                sliding_window=a.sliding_window,
                max_window_layers=0 if a.sliding_window else cfg.n_layers,
            )
        return out

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        return (
            decoder_common_rules()
            + attention_rules()
            + swiglu_rules("model.layers.{i}.mlp.", "blocks.{i}.ffn.", "layers", bias=True)
        )

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        return super().ignored(name, cfg) or (cfg.tie_embeddings and name == "lm_head.weight")
