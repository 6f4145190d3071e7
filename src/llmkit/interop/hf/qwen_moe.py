"""Qwen's mixtures of experts: Qwen2-MoE (qwen2_moe, Qwen1.5-MoE) and Qwen3-MoE (qwen3_moe).

Both are the Qwen attention (Qwen2's q/k/v biases; Qwen3's QK-norm) with a softmax top-k router:
    model.layers.{i}.mlp.gate.weight                        blocks.{i}.ffn.router.weight
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj    blocks.{i}.ffn.experts.{w1,w3,w2}   (stacked over e;
                                                            fused gate_up_proj / down_proj in memory, as Mixtral)
Qwen2-MoE adds one wide shared expert whose output each token scales by a sigmoid gate:
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj  blocks.{i}.ffn.shared.{w1,w3,w2}
    model.layers.{i}.mlp.shared_expert_gate.weight          blocks.{i}.ffn.shared_gate.weight
llmkit's shared experts are `n_shared_experts` copies of the routed width side by side, so Qwen2-MoE's
shared_expert_intermediate_size must be a multiple of moe_intermediate_size (it is 4x in Qwen1.5-MoE-A2.7B, 8x in
Qwen2-57B-A14B). Layers listed in mlp_only_layers (or skipped by decoder_sparse_step) keep a dense SwiGLU of
intermediate_size; llmkit supports them as the first layers of the stack (`moe.first_dense_layers`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import attention_rules, decoder_common_rules, expert_rules, swiglu_rules
from llmkit.interop.hf.fields import Custom, Entry, Field, Fixed, HFConfig, Stated, fixed, require
from llmkit.interop.hf.llama import GQA_FIELDS
from llmkit.interop.keymap import Rule

_Q2, _Q3 = ("qwen2_moe",), ("qwen3_moe",)


def _dense_layers_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """moe.first_dense_layers from mlp_only_layers and decoder_sparse_step, when the dense layers come first."""
    n = int(require(hf, "num_hidden_layers"))
    step = int(hf.get("decoder_sparse_step") or 1)
    only = {int(i) for i in hf.get("mlp_only_layers") or []}
    dense = [i for i in range(n) if i in only or (i + 1) % step != 0]
    if dense != list(range(len(dense))):
        raise ConfigError(
            f"config.json makes layers {dense} dense (mlp_only_layers={sorted(only)}, decoder_sparse_step={step}); "
            "llmkit supports dense layers only before the first mixture-of-experts layer"
        )
    if len(dense) == n:
        raise ConfigError("config.json makes every layer dense (mlp_only_layers / decoder_sparse_step): use qwen2")
    return {"moe.first_dense_layers": len(dense)}


def _dense_layers_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    assert cfg.moe is not None
    return {"decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.moe.first_dense_layers))}


def _shared_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """Qwen2-MoE's one shared expert of shared_expert_intermediate_size, as llmkit's n_shared_experts routed widths."""
    shared, routed = int(hf.get("shared_expert_intermediate_size") or 0), int(require(hf, "moe_intermediate_size"))
    if shared % routed:
        raise ConfigError(
            f"config.json shared_expert_intermediate_size={shared} is not a multiple of "
            f"moe_intermediate_size={routed}; llmkit's shared experts are whole multiples of the routed experts' width"
        )
    return {"moe.n_shared_experts": shared // routed, "moe.shared_gate": shared > 0}


def _shared_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    assert cfg.moe is not None
    if cfg.moe.n_shared_experts and not cfg.moe.shared_gate:
        raise ConfigError(
            "moe.n_shared_experts without moe.shared_gate cannot be written as qwen2_moe (its shared expert is gated)"
        )
    return {"shared_expert_intermediate_size": cfg.moe.expert_hidden_dim * cfg.moe.n_shared_experts}


FIELDS: tuple[Entry, ...] = (
    *GQA_FIELDS,
    Field("ffn.hidden_dim", "intermediate_size", int),
    activation_field(("ffn.activation", "moe.activation"), "hidden_act", "qwen", "silu"),
    Field("moe.n_experts", "num_experts", int, only=_Q2),
    Field("moe.n_experts", ("num_experts", "num_local_experts"), int, only=_Q3),  # transformers 5 saves the latter
    Field("moe.top_k", "num_experts_per_tok", int),
    Field("moe.expert_hidden_dim", "moe_intermediate_size", int),
    Field("moe.norm_topk", "norm_topk_prob", bool, False),
    Field("moe.aux_loss_coef", "router_aux_loss_coef", float, 0.0),
    Custom(_dense_layers_from_hf, _dense_layers_to_hf),
    Stated("use_sliding_window", False, "llmkit reads Qwen's mixtures of experts without a sliding window"),
    Fixed("attention.sliding_window", None, "Qwen's mixtures of experts are written without a sliding window"),
    *fixed(
        "Qwen's experts are SwiGLU, chosen by softmax top-k with no expert groups, score bias, scale or capacity "
        "limit, and the feed-forwards have no biases",
        {
            "moe.expert_kind": "swiglu",
            "moe.score_func": "softmax",
            "moe.n_groups": 1,
            "moe.score_bias": False,
            "moe.routed_scale": 1.0,
            "moe.capacity_factor": None,
            "ffn.bias": False,
        },
    ),
    # qwen2_moe: q/k/v biases, a gated shared expert
    Field("attention.qkv_bias", "qkv_bias", bool, True, only=_Q2),
    Fixed("attention.out_bias", False, "Qwen2-MoE has no bias on o", only=_Q2),
    Fixed("attention.qk_norm", False, "Qwen2-MoE has no QK-norm (use qwen3_moe)", only=_Q2),
    Custom(_shared_from_hf, _shared_to_hf, only=_Q2),
    # qwen3_moe: QK-norm, attention_bias on all four projections, no shared expert
    Field(("attention.qkv_bias", "attention.out_bias"), "attention_bias", bool, False, only=_Q3),
    Fixed("attention.qk_norm", True, "Qwen3-MoE normalises every query and key head (without: qwen2_moe)", only=_Q3),
    *fixed("Qwen3-MoE has no shared experts", {"moe.n_shared_experts": 0, "moe.shared_gate": False}, only=_Q3),
)


class QwenMoEFamily(Family):
    name = "qwen_moe"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_moe", "qwen3_moe")
    architectures: ClassVar[dict[str, str]] = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    fields = FIELDS

    def config_from_hf(self, hf: Any, names: Collection[str] = ()) -> ModelConfig:
        if not hf.get("num_experts") and not hf.get("num_local_experts"):
            raise ConfigError("config.json has num_experts=0 (a dense model): use qwen2 or qwen3")
        return super().config_from_hf(hf, names)

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        mlp = "model.layers.{i}.mlp."
        rules = [
            *decoder_common_rules(),
            *attention_rules(),
            *swiglu_rules(mlp, "blocks.{i}.ffn.", "dense"),
            Rule("blocks.{i}.ffn.router.weight", mlp + "gate.weight", where="moe"),
            *expert_rules(cfg, names, mlp + "experts.", ("gate_proj", "up_proj", "down_proj"), mlp + "experts."),
        ]
        if cfg.moe is not None and cfg.moe.n_shared_experts:
            rules += swiglu_rules(mlp + "shared_expert.", "blocks.{i}.ffn.shared.", "moe")
            rules.append(Rule("blocks.{i}.ffn.shared_gate.weight", mlp + "shared_expert_gate.weight", where="moe"))
        return rules
