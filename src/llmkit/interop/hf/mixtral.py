"""Mixtral: the Llama layout with a sparse MoE feed-forward in every layer.

On disk (what save_pretrained writes, and the released checkpoints):
    model.layers.{i}.block_sparse_moe.gate.weight            blocks.{i}.ffn.router.weight
    model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2   blocks.{i}.ffn.experts.w1/w3/w2   (stacked over e)
In memory (transformers 5.x state_dict), also accepted:
    model.layers.{i}.mlp.gate.weight, mlp.experts.gate_up_proj (E, 2I, C) = [w1; w3], mlp.experts.down_proj (E, C, I)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import ModelConfig, MoEConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.base import require
from llmkit.interop.hf.llama import LlamaFamily, attention_rules, decoder_common_rules
from llmkit.interop.keymap import Rule, Split, Stack


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
    """Routed experts, from one tensor per expert (`split` + "{e}." + name) or the fused in-memory layout."""
    assert cfg.moe is not None
    if fused_layout(names):
        hidden = cfg.moe.expert_hidden_dim
        return [
            Rule((ours + "w1", ours + "w3"), fused + "gate_up_proj", Split((hidden, hidden), dim=1), where=where),
            Rule(ours + "w2", fused + "down_proj", where=where),
        ]
    w1, w3, w2 = split_names
    return [
        Rule(ours + "w1", split + "{e}." + w1 + ".weight", Stack(), where=where),
        Rule(ours + "w3", split + "{e}." + w3 + ".weight", Stack(), where=where),
        Rule(ours + "w2", split + "{e}." + w2 + ".weight", Stack(), where=where),
    ]


class MixtralFamily(LlamaFamily):
    name = "mixtral"
    model_types: ClassVar[tuple[str, ...]] = ("mixtral",)
    architectures: ClassVar[dict[str, str]] = {"mixtral": "MixtralForCausalLM"}

    def config_from_hf(self, hf: dict[str, Any], names: Collection[str]) -> ModelConfig:
        base = super().config_from_hf({**hf, "model_type": "mistral"}, names)
        moe = MoEConfig(
            n_experts=int(require(hf, "num_local_experts")),
            top_k=int(require(hf, "num_experts_per_tok")),
            expert_hidden_dim=int(require(hf, "intermediate_size")),
            activation=base.ffn.activation,
            score_func="softmax",
            norm_topk=True,
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        )
        return dataclasses.replace(base, moe=moe)

    def config_to_hf(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        m = cfg.moe
        if m is None or m.score_func != "softmax" or not m.norm_topk or m.n_groups != 1 or m.n_shared_experts:
            raise ConfigError("only a softmax top-k MoE with renormalised gates and no shared experts maps to Mixtral")
        if m.score_bias or m.routed_scale != 1.0 or m.first_dense_layers or m.expert_kind != "swiglu":
            raise ConfigError("Mixtral routes every layer with plain SwiGLU experts")
        if m.capacity_factor is not None or cfg.attention.qkv_bias or cfg.attention.out_bias:
            raise ConfigError("Mixtral has no capacity limit and no attention biases")
        dense = dataclasses.replace(cfg, moe=None, ffn=dataclasses.replace(cfg.ffn, hidden_dim=m.expert_hidden_dim))
        out = super().config_to_hf(dense, "mistral")
        out.update(
            model_type="mixtral",
            architectures=["MixtralForCausalLM"],
            num_local_experts=m.n_experts,
            num_experts_per_tok=m.top_k,
            router_aux_loss_coef=m.aux_loss_coef,
        )
        return out

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        fused = fused_layout(names)
        router = "model.layers.{i}.mlp.gate.weight" if fused else "model.layers.{i}.block_sparse_moe.gate.weight"
        return (
            decoder_common_rules()
            + attention_rules()
            + [Rule("blocks.{i}.ffn.router.weight", router, where="moe")]
            + expert_rules(
                cfg,
                names,
                "model.layers.{i}.block_sparse_moe.experts.",
                ("w1", "w3", "w2"),
                "model.layers.{i}.mlp.experts.",
            )
        )
