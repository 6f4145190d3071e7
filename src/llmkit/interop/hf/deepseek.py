"""DeepSeek-V3 (model_type deepseek_v3) and DeepSeek-V3.2 (deepseek_v32, adds the sparse-attention indexer).

    model.layers.{i}.self_attn.q_a_proj / q_a_layernorm / q_b_proj     blocks.{i}.attn.wq_a / q_norm / wq_b
      (or self_attn.q_proj when q_lora_rank is null)                   blocks.{i}.attn.wq
    model.layers.{i}.self_attn.kv_a_proj_with_mqa / kv_a_layernorm     blocks.{i}.attn.wkv_a / kv_norm
    model.layers.{i}.self_attn.kv_b_proj / o_proj                      blocks.{i}.attn.wkv_b / wo
    model.layers.{i}.self_attn.indexer.wq_b / wk / k_norm / weights_proj   blocks.{i}.attn.indexer.wq / wk / k_norm /
                                                                           w_heads                       (V3.2)
    layers < first_k_dense_replace: mlp.{gate,up,down}_proj            blocks.{i}.ffn.{w1,w3,w2}
    other layers: mlp.gate.weight / mlp.gate.e_score_correction_bias   blocks.{i}.ffn.router.weight / score_bias
                  mlp.experts.{e}.{gate,up,down}_proj (stacked)        blocks.{i}.ffn.experts.{w1,w3,w2}
                  mlp.shared_experts.{gate,up,down}_proj               blocks.{i}.ffn.shared.{w1,w3,w2}
    model.layers.{n + m}: enorm / hnorm / eh_proj / shared_head.norm   mtp.{m}.emb_norm / h_norm / proj / norm
                          and a full block                              mtp.{m}.block   (when the checkpoint has it)

The main attention's RoPE rotates adjacent pairs (rope_interleave, the default), which llmkit's interleaved layout
does natively, so no rows are permuted; the V3.2 indexer rotates in the half layout, as llmkit's indexer does.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar

from llmkit.config import (
    AttentionConfig,
    FFNConfig,
    IndexerConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    PositionConfig,
)
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
from llmkit.interop.hf.llama import swiglu_rules
from llmkit.interop.hf.mixtral import expert_rules
from llmkit.interop.keymap import Rule


def _mtp_present(hf: dict[str, Any], names: Collection[str]) -> int:
    """MTP depth whose weights the checkpoint holds (transformers drops them when it saves); with no tensor names to
    look at, the depth config.json states."""
    n, depth = int(hf.get("num_hidden_layers", 0)), int(hf.get("num_nextn_predict_layers") or 0)
    if not names:
        return depth
    return sum(1 for m in range(depth) if f"model.layers.{n + m}.eh_proj.weight" in names)


class DeepSeekFamily(Family):
    name = "deepseek"
    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3", "deepseek_v32")
    architectures: ClassVar[dict[str, str]] = {
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "deepseek_v32": "DeepseekV32ForCausalLM",
    }

    def config_from_hf(self, hf: dict[str, Any], names: Collection[str]) -> ModelConfig:
        mt = hf.get("model_type", "deepseek_v3")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError("DeepSeek-V3 checkpoints route with sigmoid scores and topk_method 'noaux_tc'")
        if int(hf.get("moe_layer_freq", 1)) != 1:
            raise ConfigError(f"config.json moe_layer_freq={hf['moe_layer_freq']} is not supported (only 1)")
        theta, scaling, max_len = rope_from_hf(hf)
        q_lora = hf.get("q_lora_rank")
        mla = MLAConfig(
            kv_lora_rank=int(require(hf, "kv_lora_rank")),
            q_lora_rank=int(q_lora) if q_lora else None,
            qk_nope_head_dim=int(require(hf, "qk_nope_head_dim")),
            qk_rope_head_dim=int(require(hf, "qk_rope_head_dim")),
            v_head_dim=int(require(hf, "v_head_dim")),
        )
        indexer = None
        if mt == "deepseek_v32":
            indexer = IndexerConfig(
                n_heads=int(require(hf, "index_n_heads")),
                head_dim=int(require(hf, "index_head_dim")),
                topk=int(require(hf, "index_topk")),
            )
        bias = bool(hf.get("attention_bias", False))
        activation = activation_from_hf(hf.get("hidden_act", "silu"))
        return ModelConfig(
            vocab_size=int(require(hf, "vocab_size")),
            d_model=int(require(hf, "hidden_size")),
            n_layers=int(require(hf, "num_hidden_layers")),
            attention=AttentionConfig(
                kind="dsa" if indexer else "mla",
                n_heads=int(require(hf, "num_attention_heads")),
                qkv_bias=bias,
                out_bias=bias,
                dropout=float(hf.get("attention_dropout", 0.0)),
                mla=mla,
                indexer=indexer,
            ),
            ffn=FFNConfig(kind="swiglu", hidden_dim=int(require(hf, "intermediate_size")), activation=activation),
            moe=MoEConfig(
                n_experts=int(require(hf, "n_routed_experts")),
                top_k=int(require(hf, "num_experts_per_tok")),
                expert_hidden_dim=int(require(hf, "moe_intermediate_size")),
                activation=activation,
                n_shared_experts=int(hf.get("n_shared_experts") or 0),
                score_func="sigmoid",
                n_groups=int(hf.get("n_group") or 1),
                topk_groups=int(hf.get("topk_group") or 1),
                norm_topk=bool(hf.get("norm_topk_prob", True)),
                routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
                score_bias=True,
                first_dense_layers=int(hf.get("first_k_dense_replace", 0)),
                aux_loss_kind="sequence",
                aux_loss_coef=float(hf.get("aux_loss_alpha", 0.0)),
            ),
            position=PositionConfig(
                kind="rope",
                max_seq_len=max_len,
                theta=theta,
                layout="interleaved" if hf.get("rope_interleave", True) else "half",
                scaling=scaling,
            ),
            norm=NormConfig(kind="rmsnorm", eps=float(hf.get("rms_norm_eps", 1e-6))),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mtp_depth=_mtp_present(hf, names),
        )

    def config_to_hf(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        a, m = cfg.attention, cfg.moe
        if a.kind == "gqa" or m is None or a.mla is None:
            raise ConfigError("only an MLA + MoE decoder maps to DeepSeek-V3")
        if (a.kind == "dsa") != (model_type == "deepseek_v32"):
            raise ConfigError("DeepSeek sparse attention maps to deepseek_v32, dense MLA to deepseek_v3")
        if m.score_func != "sigmoid" or not m.score_bias or m.capacity_factor is not None or m.expert_kind != "swiglu":
            raise ConfigError("DeepSeek-V3 routes with sigmoid scores and a score-correction bias, no capacity limit")
        if cfg.norm.kind != "rmsnorm" or cfg.norm.placement != "pre" or cfg.ffn.kind != "swiglu" or cfg.ffn.bias:
            raise ConfigError("DeepSeek-V3 uses pre-norm RMSNorm blocks and SwiGLU feed-forward")
        if cfg.encoder is not None or cfg.head_bias or cfg.scale_embeddings or a.qkv_bias != a.out_bias:
            raise ConfigError("this model has parts a DeepSeek-V3 checkpoint cannot hold")
        mla = a.mla
        out: dict[str, Any] = {
            "model_type": model_type,
            "architectures": [self.architectures[model_type]],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads,
            "attention_bias": a.qkv_bias,
            "attention_dropout": a.dropout,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "qk_head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            "head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "intermediate_size": cfg.ffn.hidden_dim,
            "moe_intermediate_size": m.expert_hidden_dim,
            "hidden_act": activation_to_hf(cfg.ffn.activation),
            "n_routed_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "n_shared_experts": m.n_shared_experts,
            "n_group": m.n_groups,
            "topk_group": m.topk_groups,
            "norm_topk_prob": m.norm_topk,
            "routed_scaling_factor": m.routed_scale,
            "first_k_dense_replace": m.first_dense_layers,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "aux_loss_alpha": m.aux_loss_coef,
            "num_nextn_predict_layers": cfg.mtp_depth,
            "max_position_embeddings": hf_max_positions(cfg),
            "rms_norm_eps": cfg.norm.eps,
            "rope_interleave": cfg.position.layout == "interleaved",
            "tie_word_embeddings": cfg.tie_embeddings,
            **rope_to_hf(cfg),
        }
        if m.activation != cfg.ffn.activation:
            raise ConfigError("DeepSeek-V3 uses one activation (hidden_act) for dense and expert feed-forwards")
        if a.indexer is not None:
            out.update(index_n_heads=a.indexer.n_heads, index_head_dim=a.indexer.head_dim, index_topk=a.indexer.topk)
        return out

    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        layer = self._layer_rules(cfg, names)
        mtp = [self._as_mtp(r) for r in layer if r.where in ("layers", "moe")]
        return [
            Rule("embed.weight", "model.embed_tokens.weight"),
            Rule("norm.weight", "model.norm.weight"),
            Rule("head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings),
            *layer,
            *mtp,
            Rule("mtp.{i}.emb_norm.weight", "model.layers.{i}.enorm.weight", where="mtp", offset=_n_layers),
            Rule("mtp.{i}.h_norm.weight", "model.layers.{i}.hnorm.weight", where="mtp", offset=_n_layers),
            Rule("mtp.{i}.proj.weight", "model.layers.{i}.eh_proj.weight", where="mtp", offset=_n_layers),
            Rule("mtp.{i}.norm.weight", "model.layers.{i}.shared_head.norm.weight", where="mtp", offset=_n_layers),
        ]

    @staticmethod
    def _as_mtp(rule: Rule) -> Rule:
        """A main-block rule re-targeted at the MTP module's block (DeepSeek stores MTP layer m as layer n + m)."""
        ours = tuple(o.replace("blocks.{i}.", "mtp.{i}.block.") for o in _names(rule.ours))
        return Rule(ours if len(ours) > 1 else ours[0], rule.theirs, rule.transform, "mtp", rule.when, _n_layers)

    def _layer_rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        a = "model.layers.{i}.self_attn."
        o = "blocks.{i}.attn."
        has_q_lora = lambda c: c.attention.mla is not None and c.attention.mla.q_lora_rank is not None  # noqa: E731
        bias = lambda c: c.attention.qkv_bias  # noqa: E731
        rules = [
            Rule(o + "wq_a.weight", a + "q_a_proj.weight", where="layers", when=has_q_lora),
            Rule(o + "wq_a.bias", a + "q_a_proj.bias", where="layers", when=lambda c: has_q_lora(c) and bias(c)),
            Rule(o + "q_norm.weight", a + "q_a_layernorm.weight", where="layers", when=has_q_lora),
            Rule(o + "wq_b.weight", a + "q_b_proj.weight", where="layers", when=has_q_lora),
            Rule(o + "wq.weight", a + "q_proj.weight", where="layers", when=lambda c: not has_q_lora(c)),
            Rule(o + "wkv_a.weight", a + "kv_a_proj_with_mqa.weight", where="layers"),
            Rule(o + "wkv_a.bias", a + "kv_a_proj_with_mqa.bias", where="layers", when=bias),
            Rule(o + "kv_norm.weight", a + "kv_a_layernorm.weight", where="layers"),
            Rule(o + "wkv_b.weight", a + "kv_b_proj.weight", where="layers"),
            Rule(o + "wo.weight", a + "o_proj.weight", where="layers"),
            Rule(o + "wo.bias", a + "o_proj.bias", where="layers", when=lambda c: c.attention.out_bias),
            Rule("blocks.{i}.attn_residual.norm.weight", "model.layers.{i}.input_layernorm.weight", where="layers"),
            Rule(
                "blocks.{i}.ffn_residual.norm.weight",
                "model.layers.{i}.post_attention_layernorm.weight",
                where="layers",
            ),
        ]
        is_dsa = lambda c: c.attention.kind == "dsa"  # noqa: E731
        for ours, theirs in (("wq", "wq_b"), ("wk", "wk"), ("w_heads", "weights_proj")):
            rules.append(Rule(f"{o}indexer.{ours}.weight", f"{a}indexer.{theirs}.weight", where="layers", when=is_dsa))
        for p in ("weight", "bias"):
            rules.append(Rule(f"{o}indexer.k_norm.{p}", f"{a}indexer.k_norm.{p}", where="layers", when=is_dsa))
        rules += swiglu_rules("model.layers.{i}.mlp.", "blocks.{i}.ffn.", "dense")
        gate = "model.layers.{i}.mlp.gate."
        rules += [
            Rule("blocks.{i}.ffn.router.weight", gate + "weight", where="moe"),
            Rule("blocks.{i}.ffn.router.score_bias", gate + "e_score_correction_bias", where="moe"),
            *expert_rules(
                cfg,
                names,
                "model.layers.{i}.mlp.experts.",
                ("gate_proj", "up_proj", "down_proj"),
                "model.layers.{i}.mlp.experts.",
            ),
            *swiglu_rules("model.layers.{i}.mlp.shared_experts.", "blocks.{i}.ffn.shared.", "moe"),
        ]
        if cfg.moe is not None and not cfg.moe.n_shared_experts:
            rules = [r for r in rules if "shared_experts" not in str(r.theirs)]
        return rules

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        if super().ignored(name, cfg) or (cfg.tie_embeddings and name == "lm_head.weight"):
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


def _n_layers(cfg: ModelConfig) -> int:
    return cfg.n_layers


def _names(t: str | tuple[str, ...]) -> tuple[str, ...]:
    return (t,) if isinstance(t, str) else t
