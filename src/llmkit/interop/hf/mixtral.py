"""Mixtral: the Llama layout with a sparse MoE feed-forward in every layer (Mistral's sliding window included).

On disk (what save_pretrained writes, and the released checkpoints):
    model.layers.{i}.block_sparse_moe.gate.weight            blocks.{i}.ffn.router.weight
    model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2   blocks.{i}.ffn.experts.w1/w3/w2   (stacked over e)
In memory (transformers 5.x state_dict), also accepted:
    model.layers.{i}.mlp.gate.weight, mlp.experts.gate_up_proj (E, 2I, C) = [w1; w3], mlp.experts.down_proj (E, C, I)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import ModelConfig
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import attention_rules, decoder_common_rules, expert_rules, fused_layout
from llmkit.interop.hf.fields import Custom, Entry, Field, HFConfig, fixed, optional_positive, require
from llmkit.interop.hf.llama import GQA_FIELDS
from llmkit.interop.keymap import Rule


def _expert_width_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """Mixtral's intermediate_size is each expert's width. Every layer is MoE, so llmkit's dense ffn is unused; it
    gets the same width (what `ModelConfig.architecture()` assumes for an all-MoE model)."""
    width = int(require(hf, "intermediate_size"))
    return {"moe.expert_hidden_dim": width, "ffn.hidden_dim": width}


def _expert_width_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    assert cfg.moe is not None  # checked by the Fixed moe rows
    return {"intermediate_size": cfg.moe.expert_hidden_dim}


FIELDS: tuple[Entry, ...] = (
    *GQA_FIELDS,
    Field("attention.sliding_window", "sliding_window", optional_positive, None),
    activation_field(("moe.activation", "ffn.activation"), "hidden_act", "mixtral", "silu"),
    Custom(_expert_width_from_hf, _expert_width_to_hf),
    Field("moe.n_experts", "num_local_experts", int),
    Field("moe.top_k", "num_experts_per_tok", int),
    Field("moe.aux_loss_coef", "router_aux_loss_coef", float, 0.0),
    *fixed(
        "Mixtral has no attention or feed-forward biases",
        {"attention.qkv_bias": False, "attention.out_bias": False, "ffn.bias": False},
    ),
    *fixed(
        "Mixtral routes every layer to SwiGLU experts by softmax top-k, renormalised over the chosen experts, with "
        "no shared experts, expert groups, score bias, scale or capacity limit",
        {
            "moe.expert_kind": "swiglu",
            "moe.score_func": "softmax",
            "moe.norm_topk": True,
            "moe.n_groups": 1,
            "moe.n_shared_experts": 0,
            "moe.score_bias": False,
            "moe.routed_scale": 1.0,
            "moe.first_dense_layers": 0,
            "moe.capacity_factor": None,
        },
    ),
)


class MixtralFamily(Family):
    name = "mixtral"
    model_types: ClassVar[tuple[str, ...]] = ("mixtral",)
    architectures: ClassVar[dict[str, str]] = {"mixtral": "MixtralForCausalLM"}
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        layer = "model.layers.{i}."
        router = layer + ("mlp.gate.weight" if fused_layout(names) else "block_sparse_moe.gate.weight")
        return [
            *decoder_common_rules(),
            *attention_rules(),
            Rule("blocks.{i}.ffn.router.weight", router, where="moe"),
            *expert_rules(cfg, names, layer + "block_sparse_moe.experts.", ("w1", "w3", "w2"), layer + "mlp.experts."),
        ]
