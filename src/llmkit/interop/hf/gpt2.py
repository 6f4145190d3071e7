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
from typing import Any, ClassVar

from llmkit.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.base import Family, activation_from_hf, require
from llmkit.interop.keymap import Rule, Split, Transpose

_ACT_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


class GPT2Family(Family):
    name = "gpt2"
    model_types: ClassVar[tuple[str, ...]] = ("gpt2",)
    architectures: ClassVar[dict[str, str]] = {"gpt2": "GPT2LMHeadModel"}

    def config_from_hf(self, hf: dict[str, Any], names: Collection[str]) -> ModelConfig:
        for flag, bad in (
            ("scale_attn_by_inverse_layer_idx", True),
            ("add_cross_attention", True),
            ("scale_attn_weights", False),
        ):
            if hf.get(flag, not bad) == bad:
                raise ConfigError(
                    f"config.json {flag}={bad} changes GPT-2's attention in a way llmkit does not support"
                )
        d = int(require(hf, "n_embd"))
        return ModelConfig(
            vocab_size=int(require(hf, "vocab_size")),
            d_model=d,
            n_layers=int(require(hf, "n_layer")),
            attention=AttentionConfig(
                n_heads=int(require(hf, "n_head")),
                qkv_bias=True,
                out_bias=True,
                dropout=float(hf.get("attn_pdrop", 0.0)),
            ),
            ffn=FFNConfig(
                kind="mlp",
                hidden_dim=int(hf.get("n_inner") or 4 * d),
                activation=activation_from_hf(hf.get("activation_function", "gelu_new"), "activation_function"),
                bias=True,
            ),
            position=PositionConfig(kind="learned", max_seq_len=int(require(hf, "n_positions"))),
            norm=NormConfig(kind="layernorm", placement="pre", eps=float(hf.get("layer_norm_epsilon", 1e-5))),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            dropout=float(hf.get("resid_pdrop", 0.0)),
        )

    def config_to_hf(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        a, f = cfg.attention, cfg.ffn
        ok = (
            a.kind == "gqa"
            and a.n_kv_heads == a.n_heads
            and cfg.head_dim * a.n_heads == cfg.d_model
            and a.qkv_bias
            and a.out_bias
            and a.sliding_window is None
            and f.kind == "mlp"
            and f.bias
            and cfg.position.kind == "learned"
            and cfg.norm.kind == "layernorm"
            and cfg.norm.placement == "pre"
            and cfg.norm.bias
            and cfg.moe is None
            and cfg.encoder is None
            and not cfg.mtp_depth
            and not cfg.head_bias
            and not cfg.scale_embeddings
        )
        if not ok:
            raise ConfigError(
                "only a GPT-2-shaped model (MHA with biases, learned positions, LayerNorm, MLP) maps to gpt2"
            )
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": a.n_heads,
            "n_inner": f.hidden_dim,
            "n_positions": cfg.position.max_seq_len,
            "activation_function": _ACT_NAMES[f.activation],
            "layer_norm_epsilon": cfg.norm.eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attn_pdrop": a.dropout,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
        }

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
        return name.endswith((".attn.bias", ".attn.masked_bias")) or (cfg.tie_embeddings and name == "lm_head.weight")
