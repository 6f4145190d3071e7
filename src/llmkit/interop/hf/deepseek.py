"""DeepSeek-V2 (model_type deepseek_v2), DeepSeek-V3 (deepseek_v3) and DeepSeek-V3.2 (deepseek_v32, adds the
sparse-attention indexer): one layout.

    model.layers.{i}.self_attn.q_a_proj / q_a_layernorm / q_b_proj     blocks.{i}.attn.wq_a / q_norm / wq_b
      (or self_attn.q_proj when q_lora_rank is null)                   blocks.{i}.attn.wq
    model.layers.{i}.self_attn.kv_a_proj_with_mqa / kv_a_layernorm     blocks.{i}.attn.wkv_a / kv_norm
    model.layers.{i}.self_attn.kv_b_proj / o_proj                      blocks.{i}.attn.wkv_b / wo
    model.layers.{i}.self_attn.indexer.wq_b / wk / k_norm / weights_proj   blocks.{i}.attn.indexer.wq / wk / k_norm /
                                                                           w_heads                       (V3.2)
    layers < first_k_dense_replace: mlp.{gate,up,down}_proj            blocks.{i}.ffn.{w1,w3,w2}
    other layers: mlp.gate.weight / mlp.gate.e_score_correction_bias   blocks.{i}.ffn.router.weight / score_bias (V3)
                  mlp.experts.{e}.{gate,up,down}_proj (stacked)        blocks.{i}.ffn.experts.{w1,w3,w2}
                  mlp.shared_experts.{gate,up,down}_proj               blocks.{i}.ffn.shared.{w1,w3,w2}
    model.layers.{n + m}: enorm / hnorm / eh_proj / shared_head.norm   mtp.{m}.emb_norm / h_norm / proj / norm
                          and a full block                              mtp.{m}.block   (when the checkpoint has it)
    (embedding, norms and head as in llmkit.interop.hf.decoder)

The main attention's RoPE rotates adjacent pairs (V2 always; V3's rope_interleave, the default), which llmkit's
interleaved layout does natively, so no rows are permuted; the V3.2 indexer rotates in the half layout, as llmkit's
indexer does.

The versions differ in routing. V2: softmax scores; topk_method "greedy" (plain top-k) or "group_limited_greedy"
(only the topk_group groups with the best single score are eligible); gates not renormalised, times
routed_scaling_factor. V3: sigmoid scores plus a score-correction bias for choosing, groups ranked by the sum of
their two best scores ("noaux_tc"), gates renormalised (norm_topk_prob) and scaled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import Layout, ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.activations import activation_field
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.decoder import DECODER_FIELDS, decoder_common_rules, expert_rules, swiglu_rules
from llmkit.interop.hf.fields import (
    Assumed,
    Custom,
    Derived,
    Entry,
    Field,
    Fixed,
    HFConfig,
    Stated,
    fixed,
    optional_positive,
    require,
)
from llmkit.interop.keymap import Rule, as_tuple

_V2, _V3, _V32 = ("deepseek_v2",), ("deepseek_v3",), ("deepseek_v32",)
_V3S = _V3 + _V32
_ROUTING = "DeepSeek-V3 routes with sigmoid scores and topk_method 'noaux_tc'"


def _v2_groups_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """V2's topk_method: "greedy" ignores the groups; "group_limited_greedy" keeps topk_group of n_group."""
    method = hf.get("topk_method") or "greedy"
    if method == "greedy":
        return {"moe.n_groups": 1, "moe.topk_groups": 1}
    if method == "group_limited_greedy":
        return {
            "moe.n_groups": int(require(hf, "n_group")),
            "moe.topk_groups": int(require(hf, "topk_group")),
            "moe.group_score": "max",
        }
    raise ConfigError(
        f"config.json topk_method={method!r} is not supported for deepseek_v2; supported: greedy, group_limited_greedy"
    )


def _v2_groups_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    assert cfg.moe is not None
    grouped = cfg.moe.n_groups > 1
    if grouped and cfg.moe.group_score != "max":
        raise ConfigError(
            f"moe.group_score={cfg.moe.group_score!r} cannot be written as model_type 'deepseek_v2': its expert groups "
            "rank by their best score ('max')"
        )
    return {
        "topk_method": "group_limited_greedy" if grouped else "greedy",
        "n_group": cfg.moe.n_groups,
        "topk_group": cfg.moe.topk_groups,
    }


def _mtp_depth_from_hf(hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
    """The MTP depth whose weights the checkpoint holds (transformers drops them when it saves); with no tensor names
    to look at, the depth config.json states."""
    n, depth = int(hf.get("num_hidden_layers") or 0), int(hf.get("num_nextn_predict_layers") or 0)
    if names:
        depth = sum(1 for m in range(depth) if f"model.layers.{n + m}.eh_proj.weight" in names)
    return {"mtp_depth": depth}


def _mtp_depth_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {"num_nextn_predict_layers": cfg.mtp_depth}


def _layout(rope_interleave: Any) -> Layout:
    return "interleaved" if rope_interleave else "half"


def _rope_interleave(layout: Layout) -> bool:
    return layout == "interleaved"


FIELDS: tuple[Entry, ...] = (
    *DECODER_FIELDS,
    Field(("attention.qkv_bias", "attention.out_bias"), "attention_bias", bool, False),
    Field("attention.mla.kv_lora_rank", "kv_lora_rank", int),
    Field("attention.mla.q_lora_rank", "q_lora_rank", optional_positive, None),
    Field("attention.mla.qk_nope_head_dim", "qk_nope_head_dim", int),
    Field("attention.mla.qk_rope_head_dim", "qk_rope_head_dim", int),
    Field("attention.mla.v_head_dim", "v_head_dim", int),
    Field("ffn.hidden_dim", "intermediate_size", int),
    activation_field(("ffn.activation", "moe.activation"), "hidden_act", "deepseek", "silu"),
    Field("moe.n_experts", "n_routed_experts", int),
    Field("moe.top_k", "num_experts_per_tok", int),
    Field("moe.expert_hidden_dim", "moe_intermediate_size", int),
    Field("moe.n_shared_experts", "n_shared_experts", int, 0),
    Field("moe.routed_scale", "routed_scaling_factor", float, 1.0),
    Field("moe.first_dense_layers", "first_k_dense_replace", int, 0),
    Field("moe.aux_loss_coef", "aux_loss_alpha", float, 0.0),
    Assumed("moe.aux_loss_kind", "sequence"),  # DeepSeek-V2 §2.2.3, V3 §2.1.2: the sequence-wise balance loss
    *fixed(
        "DeepSeek routes to SwiGLU experts with no capacity limit, and its feed-forwards have no biases",
        {"moe.expert_kind": "swiglu", "moe.capacity_factor": None, "ffn.bias": False, "attention.qk_norm": False},
    ),
    # V3 and V3.2
    Field("position.layout", "rope_interleave", _layout, "interleaved", _rope_interleave, only=_V3S),
    Field("moe.n_groups", "n_group", int, 1, only=_V3S),
    Field("moe.topk_groups", "topk_group", int, 1, only=_V3S),
    Field("moe.norm_topk", "norm_topk_prob", bool, True, only=_V3S),
    *fixed(
        "DeepSeek-V3 routes with sigmoid scores and a score-correction bias (auxiliary-loss-free balancing, "
        "DeepSeek-V3 §2.1.2), ranking expert groups by the sum of their two best scores",
        {"moe.score_func": "sigmoid", "moe.score_bias": True, "moe.group_score": "top2_sum"},
        only=_V3S,
    ),
    Stated("scoring_func", "sigmoid", _ROUTING, only=_V3S),
    Stated("topk_method", "noaux_tc", _ROUTING, only=_V3S),
    # V2
    Fixed("position.layout", "interleaved", "DeepSeek-V2 rotates adjacent pairs", only=_V2),
    Custom(_v2_groups_from_hf, _v2_groups_to_hf, only=_V2),
    *fixed(
        "DeepSeek-V2 routes with softmax scores, no score bias and gates that are not renormalised",
        {"moe.score_func": "softmax", "moe.score_bias": False, "moe.norm_topk": False},
        only=_V2,
    ),
    Stated("scoring_func", "softmax", "DeepSeek-V2 routes with softmax scores", only=_V2),
    Stated("mlp_bias", False, "llmkit reads DeepSeek-V2 feed-forwards without biases", only=_V2),
    Stated("moe_layer_freq", 1, "every layer after first_k_dense_replace is MoE in llmkit"),
    Custom(_mtp_depth_from_hf, _mtp_depth_to_hf, only=_V3S),
    Fixed("mtp_depth", 0, "DeepSeek-V2 has no multi-token prediction module (use deepseek_v3)", only=_V2),
    # keys transformers' DeepseekV3Config reads that follow from the MLA sizes
    Derived("num_key_value_heads", lambda cfg: cfg.attention.n_heads),
    Derived("qk_head_dim", lambda cfg: cfg.head_dim),
    Derived("head_dim", lambda cfg: cfg.rope_dim),
    # V3 has dense latent attention; V3.2 adds the lightning indexer that picks top-k keys per query
    Fixed("attention.kind", "mla", "it has latent attention (with sparse attention: deepseek_v32)", only=_V2 + _V3),
    Fixed("attention.kind", "dsa", "it has sparse attention (dense latent attention: deepseek_v3)", only=_V32),
    Field("attention.indexer.n_heads", "index_n_heads", int, only=_V32),
    Field("attention.indexer.head_dim", "index_head_dim", int, only=_V32),
    Field("attention.indexer.topk", "index_topk", int, only=_V32),
)


def _as_mtp(rule: Rule) -> Rule:
    """A main-block rule re-targeted at the MTP module's block (DeepSeek stores MTP layer m as layer n + m)."""
    ours = tuple(o.replace("blocks.{i}.", "mtp.{i}.block.") for o in as_tuple(rule.ours))
    return dataclasses.replace(rule, ours=ours, where="mtp", offset=_n_layers)


def _n_layers(cfg: ModelConfig) -> int:
    return cfg.n_layers


def _has_q_lora(cfg: ModelConfig) -> bool:
    return cfg.attention.mla is not None and cfg.attention.mla.q_lora_rank is not None


def _attention_rules() -> list[Rule]:
    """MLA's projections and norms, and V3.2's indexer."""
    a = "model.layers.{i}.self_attn."
    o = "blocks.{i}.attn."

    def bias(c: ModelConfig) -> bool:
        return c.attention.qkv_bias

    def is_dsa(c: ModelConfig) -> bool:
        return c.attention.kind == "dsa"

    rules = [
        Rule(o + "wq_a.weight", a + "q_a_proj.weight", where="layers", when=_has_q_lora),
        Rule(o + "wq_a.bias", a + "q_a_proj.bias", where="layers", when=lambda c: _has_q_lora(c) and bias(c)),
        Rule(o + "q_norm.weight", a + "q_a_layernorm.weight", where="layers", when=_has_q_lora),
        Rule(o + "wq_b.weight", a + "q_b_proj.weight", where="layers", when=_has_q_lora),
        Rule(o + "wq.weight", a + "q_proj.weight", where="layers", when=lambda c: not _has_q_lora(c)),
        Rule(o + "wkv_a.weight", a + "kv_a_proj_with_mqa.weight", where="layers"),
        Rule(o + "wkv_a.bias", a + "kv_a_proj_with_mqa.bias", where="layers", when=bias),
        Rule(o + "kv_norm.weight", a + "kv_a_layernorm.weight", where="layers"),
        Rule(o + "wkv_b.weight", a + "kv_b_proj.weight", where="layers"),
        Rule(o + "wo.weight", a + "o_proj.weight", where="layers"),
        Rule(o + "wo.bias", a + "o_proj.bias", where="layers", when=lambda c: c.attention.out_bias),
    ]
    for ours, theirs in (("wq", "wq_b"), ("wk", "wk"), ("w_heads", "weights_proj")):
        rules.append(Rule(f"{o}indexer.{ours}.weight", f"{a}indexer.{theirs}.weight", where="layers", when=is_dsa))
    for p in ("weight", "bias"):
        rules.append(Rule(f"{o}indexer.k_norm.{p}", f"{a}indexer.k_norm.{p}", where="layers", when=is_dsa))
    return rules


def deepseek_ffn_rules(cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
    """Dense SwiGLU in the first layers; router, routed experts and shared experts after."""
    mlp = "model.layers.{i}.mlp."
    rules = [
        *swiglu_rules(mlp, "blocks.{i}.ffn.", "dense"),
        Rule("blocks.{i}.ffn.router.weight", mlp + "gate.weight", where="moe"),
        Rule(
            "blocks.{i}.ffn.router.score_bias",
            mlp + "gate.e_score_correction_bias",
            where="moe",
            when=lambda c: c.moe is not None and c.moe.score_bias,
        ),
        *expert_rules(cfg, names, mlp + "experts.", ("gate_proj", "up_proj", "down_proj"), mlp + "experts."),
    ]
    if cfg.moe is not None and cfg.moe.n_shared_experts:
        rules += swiglu_rules(mlp + "shared_experts.", "blocks.{i}.ffn.shared.", "moe")
    return rules


class DeepSeekFamily(Family):
    name = "deepseek"
    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3", "deepseek_v32", "deepseek_v2")
    architectures: ClassVar[dict[str, str]] = {
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "deepseek_v32": "DeepseekV32ForCausalLM",
    }
    fields = FIELDS

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        main = decoder_common_rules() + _attention_rules() + deepseek_ffn_rules(cfg, names)
        mtp = [_as_mtp(r) for r in main if r.where in ("layers", "moe")]  # an MTP module's block is a MoE block
        layer = "model.layers.{i}."
        return [
            *main,
            *mtp,
            Rule("mtp.{i}.emb_norm.weight", layer + "enorm.weight", where="mtp", offset=_n_layers),
            Rule("mtp.{i}.h_norm.weight", layer + "hnorm.weight", where="mtp", offset=_n_layers),
            Rule("mtp.{i}.proj.weight", layer + "eh_proj.weight", where="mtp", offset=_n_layers),
            Rule("mtp.{i}.norm.weight", layer + "shared_head.norm.weight", where="mtp", offset=_n_layers),
        ]

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        if super().ignored(name, cfg):
            return True
        # an MTP layer stores its own copies of the embedding and the head; llmkit shares the main ones. MTP layers
        # of a checkpoint loaded without them (mtp_depth 0) are skipped, as transformers does.
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            layer = int(parts[2])
            if layer >= cfg.n_layers + cfg.mtp_depth:
                return True
            if layer >= cfg.n_layers and name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
                return True
        return False
