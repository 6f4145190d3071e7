"""GLM-4.5 (model_type glm4_moe) and dots.llm1 (dots1): grouped-query attention, as in Llama and Qwen3, in front of
DeepSeek-V3's mixture of experts. The key map is the two put together:

    model.layers.{i}.self_attn.{q,k,v,o}_proj (+ q_norm, k_norm)   blocks.{i}.attn.{wq,wk,wv,wo} (+ q_norm, k_norm)
    model.layers.{i}.mlp...                                         as DeepSeek-V3 (llmkit.interop.hf.deepseek):
        dense SwiGLU before first_k_dense_replace; then router weight and score-correction bias, routed experts
        stacked over e, shared experts

and the routing is V3's: sigmoid scores plus the correction bias for choosing, expert groups ranked by the sum of
their two best scores, gates renormalised (norm_topk_prob) and scaled.

    glm4_moe   q/k/v biases (attention_bias), QK-norm when use_qk_norm, RoPE on the first partial_rotary_factor of
               each head (1/2 in the releases)
    dots1      Qwen3's attention: QK-norm, attention_bias on all four projections; a window on the layers from
               max_window_layers on, of which llmkit reads one that every layer uses

GLM-4.5's multi-token-prediction layer (stored as layer num_hidden_layers, as DeepSeek does) is skipped, as
transformers skips it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_FIELDS, attention_rules, decoder_common_rules
from llmkit.interop.hf.deepseek import deepseek_ffn_rules
from llmkit.interop.hf.fields import Custom, Entry, Field, Fixed, HFConfig, fixed, require
from llmkit.interop.hf.rope import partial_rotary
from llmkit.interop.keymap import Rule

_GLM, _DOTS = ("glm4_moe",), ("dots1",)


def _dots_window_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """dots1 slides from layer max_window_layers on (its layer_types when given); llmkit has one window for all."""
    window, n = hf.get("sliding_window"), int(require(hf, "num_hidden_layers"))
    first = int(hf["max_window_layers"]) if hf.get("max_window_layers") is not None else 62  # Dots1Config's default
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)
    ]
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True, False}:
        raise ConfigError("config.json mixes sliding-window and full-attention layers, which llmkit does not support")
    return {"attention.sliding_window": int(window) if sliding == {True} and window else None}


def _dots_window_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    window = cfg.attention.sliding_window
    return {"sliding_window": window, "max_window_layers": 0 if window else cfg.n_layers}


FIELDS: tuple[Entry, ...] = (
    *DECODER_FIELDS,
    Field("attention.n_kv_heads", "num_key_value_heads", int, None),
    Field("attention.head_dim", "head_dim", int, None),
    partial_rotary(0.5),  # what Glm4MoeConfig assumes when absent (dots1 fixes 1.0 below)
    Field("ffn.hidden_dim", "intermediate_size", int),
    activation_field(("ffn.activation", "moe.activation"), "hidden_act", "glm4_moe", "silu"),
    Field("moe.n_experts", ("n_routed_experts", "num_local_experts"), int),
    Field("moe.top_k", "num_experts_per_tok", int),
    Field("moe.expert_hidden_dim", "moe_intermediate_size", int),
    Field("moe.n_shared_experts", "n_shared_experts", int, 0),
    Field("moe.n_groups", "n_group", int, 1),
    Field("moe.topk_groups", "topk_group", int, 1),
    Field("moe.norm_topk", "norm_topk_prob", bool, True),
    Field("moe.routed_scale", "routed_scaling_factor", float, 1.0),
    Field("moe.first_dense_layers", "first_k_dense_replace", int, 0),
    *fixed(
        "its experts are SwiGLU, chosen as DeepSeek-V3 chooses them (sigmoid scores, a score-correction bias, groups "
        "ranked by their two best scores), with no capacity limit; no biases in the feed-forwards, grouped-query "
        "attention with half-layout RoPE, no multi-token prediction module",
        {
            "moe.expert_kind": "swiglu",
            "moe.score_func": "sigmoid",
            "moe.score_bias": True,
            "moe.group_score": "top2_sum",
            "moe.capacity_factor": None,
            "moe.shared_gate": False,
            "ffn.bias": False,
            "attention.kind": "gqa",
            "position.layout": "half",
            "mtp_depth": 0,
        },
    ),
    # glm4_moe
    Field("attention.qkv_bias", "attention_bias", bool, False, only=_GLM),
    Field("attention.qk_norm", "use_qk_norm", bool, False, only=_GLM),
    *fixed("GLM-4.5 has no bias on o and no sliding window", {"attention.out_bias": False}, only=_GLM),
    Fixed("attention.sliding_window", None, "GLM-4.5 has no sliding window", only=_GLM),
    # dots1
    Field(("attention.qkv_bias", "attention.out_bias"), "attention_bias", bool, False, only=_DOTS),
    Fixed("attention.qk_norm", True, "dots.llm1 normalises every query and key head", only=_DOTS),
    Fixed("position.rope_fraction", 1.0, "dots.llm1 rotates every dimension of each head", only=_DOTS),
    Custom(_dots_window_from_hf, _dots_window_to_hf, only=_DOTS),
)


class GLM4MoEFamily(Family):
    name = "glm4_moe"
    model_types: ClassVar[tuple[str, ...]] = ("glm4_moe", "dots1")
    architectures: ClassVar[dict[str, str]] = {"glm4_moe": "Glm4MoeForCausalLM", "dots1": "Dots1ForCausalLM"}
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        return decoder_common_rules() + attention_rules() + deepseek_ffn_rules(cfg, names)

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        """GLM-4.5's MTP layer (model.layers.{num_hidden_layers}...) is skipped, as transformers skips it."""
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            return int(parts[2]) >= cfg.n_layers
        return super().ignored(name, cfg)
