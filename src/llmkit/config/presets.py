"""Named presets for real models, each citing its source, with the published parameter counts, and a `-tiny`
sibling of each (same mechanisms, a few layers, small widths) for tests and demos.

    >>> from llmkit import get_preset, build_model
    >>> cfg = get_preset("llama2-7b")
    >>> model = build_model(cfg, device="meta")       # 6.7B parameters, no memory

Parameter conventions (see `llmkit.analysis`): `params_total` counts the main model (DeepSeek's multi-token
prediction module, used only in training and speculative decoding, is reported apart as `params_mtp`, as DeepSeek
does); `params_active` is the total minus the routed experts a token does not use.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from llmkit.config import (
    AttentionConfig,
    EncoderConfig,
    FFNConfig,
    IndexerConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    PositionConfig,
    RopeScaling,
)
from llmkit.config.tiny import tiny_config
from llmkit.errors import ConfigError


@dataclass(frozen=True)
class Published:
    """A published parameter count. exact: the count of the released checkpoint (must match to the parameter);
    otherwise a rounded figure from a paper or announcement, matched within `rel_tol`. `convention` says what the
    source counted when it differs from llmkit's default."""

    value: float
    exact: bool = False
    rel_tol: float = 0.005
    convention: str = ""


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    source: str
    params_total: Published | None = None
    params_active: Published | None = None
    notes: str = ""


def _transformer(d: int, heads: int, ff: int, dropout: float) -> ModelConfig:
    # Vaswani et al. 2017 §3 and Table 3: N = 6 encoder and decoder layers, post-norm, ReLU FFN, sinusoidal
    # positions, embeddings * sqrt(d_model) shared by source, target and the pre-softmax projection (§3.4), and a
    # shared source-target BPE vocabulary of about 37000 tokens (§5.1, WMT 2014 EN-DE).
    return ModelConfig(
        vocab_size=37000,
        d_model=d,
        n_layers=6,
        encoder=EncoderConfig(n_layers=6),
        attention=AttentionConfig(n_heads=heads, qkv_bias=True, out_bias=True),
        ffn=FFNConfig(kind="mlp", hidden_dim=ff, activation="relu", bias=True),
        position=PositionConfig(kind="sinusoidal", max_seq_len=1024, layout="interleaved"),
        norm=NormConfig(kind="layernorm", placement="post", eps=1e-5),
        tie_embeddings=True,
        scale_embeddings=True,
        dropout=dropout,
        init="xavier",
    )


def _gpt(d: int, layers: int, heads: int, ctx: int) -> ModelConfig:
    # GPT-2 / GPT-3: pre-norm LayerNorm blocks, learned positions, GELU MLP of 4d, biases everywhere, tied head.
    return ModelConfig(
        vocab_size=50257,
        d_model=d,
        n_layers=layers,
        attention=AttentionConfig(n_heads=heads, qkv_bias=True, out_bias=True, dropout=0.1),
        ffn=FFNConfig(kind="mlp", hidden_dim=4 * d, activation="gelu_tanh", bias=True),
        position=PositionConfig(kind="learned", max_seq_len=ctx),
        norm=NormConfig(kind="layernorm", placement="pre", eps=1e-5),
        tie_embeddings=True,
        dropout=0.1,
    )


def _llama(d: int, layers: int, heads: int, kv_heads: int, ff: int, vocab: int = 32000) -> ModelConfig:
    # LLaMA-2: pre-norm RMSNorm, RoPE (HF checkpoints use the half layout), GQA, SwiGLU, untied head.
    return ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=layers,
        attention=AttentionConfig(n_heads=heads, n_kv_heads=None if kv_heads == heads else kv_heads),  # None: MHA
        ffn=FFNConfig(kind="swiglu", hidden_dim=ff),
        position=PositionConfig(kind="rope", max_seq_len=4096, theta=10000.0, layout="half"),
        norm=NormConfig(kind="rmsnorm", eps=1e-5),
    )


def _mixtral() -> ModelConfig:
    return dataclasses.replace(
        _llama(4096, 32, 32, 8, 14336),
        position=PositionConfig(kind="rope", max_seq_len=32768, theta=1e6, layout="half"),
        moe=MoEConfig(
            n_experts=8,
            top_k=2,
            expert_hidden_dim=14336,
            score_func="softmax",
            norm_topk=True,
            aux_loss_coef=0.02,
        ),
    )


def _mixtral_8x22b() -> ModelConfig:
    # the 8x7B block at larger widths: 56 layers of 6144, 48 query and 8 key/value heads, experts of 16384 hidden
    # units, a 32768-token vocabulary and a 64K context
    cfg = _mixtral()
    assert cfg.moe is not None
    return dataclasses.replace(
        _llama(6144, 56, 48, 8, 16384, vocab=32768),
        position=PositionConfig(kind="rope", max_seq_len=65536, theta=1e6, layout="half"),
        moe=dataclasses.replace(cfg.moe, expert_hidden_dim=16384),
    )


def _qwen3_06b() -> ModelConfig:
    # Qwen3: the Llama block with an RMSNorm on every query and key head (QK-norm), head_dim 128 of its own, no
    # biases, tied embeddings, theta 1e6
    return ModelConfig(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        attention=AttentionConfig(n_heads=16, n_kv_heads=8, head_dim=128, qk_norm=True),
        ffn=FFNConfig(kind="swiglu", hidden_dim=3072),
        position=PositionConfig(kind="rope", max_seq_len=40960, theta=1e6, layout="half"),
        norm=NormConfig(kind="rmsnorm", eps=1e-6),
        tie_embeddings=True,
    )


def _gemma_2b() -> ModelConfig:
    # Gemma: multi-query attention with head_dim 256, GeGLU (tanh GELU), RMSNorm gains stored as 1 + w, embeddings
    # times sqrt(d_model), tied head
    return ModelConfig(
        vocab_size=256000,
        d_model=2048,
        n_layers=18,
        attention=AttentionConfig(n_heads=8, n_kv_heads=1, head_dim=256),
        ffn=FFNConfig(kind="swiglu", hidden_dim=16384, activation="gelu_tanh"),
        position=PositionConfig(kind="rope", max_seq_len=8192, theta=10000.0, layout="half"),
        norm=NormConfig(kind="rmsnorm", eps=1e-6, unit_offset=True),
        tie_embeddings=True,
        scale_embeddings=True,
    )


def _gemma2_2b() -> ModelConfig:
    # Gemma 2: Gemma's block, sandwich norms, soft-capped scores (50) and logits (30), local (window 4096) and global
    # layers alternating
    g = _gemma_2b()
    return dataclasses.replace(
        g,
        d_model=2304,
        n_layers=26,
        attention=AttentionConfig(
            n_heads=8, n_kv_heads=4, head_dim=256, sliding_window=4096, full_every=2, softcap=50.0
        ),
        ffn=dataclasses.replace(g.ffn, hidden_dim=9216),
        norm=dataclasses.replace(g.norm, placement="sandwich"),
        logit_softcap=30.0,
    )


def _gemma3_1b() -> ModelConfig:
    # Gemma 3: Gemma 2's block with QK-norm, no soft-caps; 5 local layers (window 512, base 1e4) to each global (1e6)
    return ModelConfig(
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        attention=AttentionConfig(
            n_heads=4, n_kv_heads=1, head_dim=256, sliding_window=512, full_every=6, qk_norm=True
        ),
        ffn=FFNConfig(kind="swiglu", hidden_dim=6912, activation="gelu_tanh"),
        position=PositionConfig(kind="rope", max_seq_len=32768, theta=1e6, layout="half", local_theta=10000.0),
        norm=NormConfig(kind="rmsnorm", placement="sandwich", eps=1e-6, unit_offset=True),
        tie_embeddings=True,
        scale_embeddings=True,
    )


def _qwen15_moe() -> ModelConfig:
    # Qwen1.5-MoE-A2.7B (qwen2_moe): Qwen2 attention (q/k/v biases), 60 experts of 1408, top-4 with gates not
    # renormalised, and one shared expert of 4 x 1408 scaled per token by a sigmoid gate
    return ModelConfig(
        vocab_size=151936,
        d_model=2048,
        n_layers=24,
        attention=AttentionConfig(n_heads=16, qkv_bias=True),
        ffn=FFNConfig(kind="swiglu", hidden_dim=5632),
        position=PositionConfig(kind="rope", max_seq_len=8192, theta=1e6, layout="half"),
        norm=NormConfig(kind="rmsnorm", eps=1e-6),
        moe=MoEConfig(
            n_experts=60,
            top_k=4,
            expert_hidden_dim=1408,
            n_shared_experts=4,
            shared_gate=True,
            score_func="softmax",
            norm_topk=False,
            aux_loss_coef=0.001,
        ),
    )


def _deepseek(
    vocab: int, d: int, layers: int, heads: int, q_lora: int | None, ff: int, moe: MoEConfig, mscale: float
) -> ModelConfig:
    # DeepSeek-V2/V3: MLA (latent 512, 128 + 64 query/key dims per head, 128 value dims), fine-grained MoE after the
    # first dense layers, RMSNorm, interleaved RoPE with YaRN (factor 40 over a 4k original context)
    yarn = RopeScaling(
        kind="yarn",
        factor=40.0,
        original_max_seq_len=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )
    mla = MLAConfig(kv_lora_rank=512, q_lora_rank=q_lora, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=layers,
        attention=AttentionConfig(kind="mla", n_heads=heads, mla=mla),
        ffn=FFNConfig(kind="swiglu", hidden_dim=ff),
        moe=moe,
        position=PositionConfig(kind="rope", max_seq_len=163840, theta=10000.0, layout="interleaved", scaling=yarn),
        norm=NormConfig(kind="rmsnorm", eps=1e-6),
    )


def _deepseek_v2_lite() -> ModelConfig:
    moe = MoEConfig(
        n_experts=64,
        top_k=6,
        expert_hidden_dim=1408,
        n_shared_experts=2,
        score_func="softmax",
        norm_topk=False,
        first_dense_layers=1,
        aux_loss_kind="sequence",
        aux_loss_coef=0.001,
    )
    return _deepseek(102400, 2048, 27, 16, None, 10944, moe, mscale=0.707)


def _deepseek_v3() -> ModelConfig:
    moe = MoEConfig(
        n_experts=256,
        top_k=8,
        expert_hidden_dim=2048,
        n_shared_experts=1,
        score_func="sigmoid",
        n_groups=8,
        topk_groups=4,
        norm_topk=True,
        routed_scale=2.5,
        score_bias=True,
        first_dense_layers=3,
        aux_loss_kind="sequence",
        aux_loss_coef=0.0001,
    )
    return dataclasses.replace(_deepseek(129280, 7168, 61, 128, 1536, 18432, moe, mscale=1.0), mtp_depth=1)


def _deepseek_v32() -> ModelConfig:
    v3 = _deepseek_v3()
    attention = dataclasses.replace(
        v3.attention, kind="dsa", indexer=IndexerConfig(n_heads=64, head_dim=128, topk=2048)
    )
    return dataclasses.replace(v3, attention=attention)


_PAPER = "Vaswani et al. 2017, Attention Is All You Need, Table 3"
_TRANSFORMER_NOTE = (
    "Table 3's 65M (base) and 213M (big) cannot both follow from its own hyperparameters with one vocabulary: "
    "with the stated ~37000 shared tokens they give 63.1M and 214.2M (no vocabulary size gives both), so these "
    "figures are checked within 3.5% and 1%."
)

_BASE: list[Preset] = [
    Preset(
        "transformer-base",
        _transformer(512, 8, 2048, 0.1),
        _PAPER + " (base), §3.4, §5.1",
        Published(65e6, rel_tol=0.035),
        notes=_TRANSFORMER_NOTE,
    ),
    Preset(
        "transformer-big",
        _transformer(1024, 16, 4096, 0.3),
        _PAPER + " (big), §3.4, §5.1",
        Published(213e6, rel_tol=0.01),
        notes=_TRANSFORMER_NOTE,
    ),
    Preset(
        "gpt2",
        _gpt(768, 12, 12, 1024),
        "openai-community/gpt2 config.json (Radford et al. 2019)",
        Published(124_439_808, exact=True),
    ),
    Preset(
        "gpt2-medium",
        _gpt(1024, 24, 16, 1024),
        "openai-community/gpt2-medium config.json (Radford et al. 2019)",
        Published(354_823_168, exact=True),
        notes="The GPT-2 paper's table says 345M; the released checkpoint has 354,823,168 parameters.",
    ),
    Preset(
        "gpt3-175b",
        _gpt(12288, 96, 96, 2048),
        "Brown et al. 2020, Language Models are Few-Shot Learners, Table 2.1",
        Published(175.0e9),
        notes="GPT-3 alternates dense and locally banded sparse attention layers; that changes no parameter, and "
        "llmkit uses dense attention in every layer.",
    ),
    Preset(
        "llama2-7b",
        _llama(4096, 32, 32, 32, 11008),
        "meta-llama/Llama-2-7b-hf config.json (Touvron et al. 2023)",
        Published(6_738_415_616, exact=True),
    ),
    Preset(
        "llama2-70b",
        _llama(8192, 80, 64, 8, 28672),
        "meta-llama/Llama-2-70b-hf config.json (Touvron et al. 2023)",
        Published(68_976_648_192, exact=True),
    ),
    Preset(
        "qwen3-0.6b",
        _qwen3_06b(),
        "Qwen/Qwen3-0.6B config.json; 0.6B (0.44B without embeddings) from its model card (Qwen Team 2025)",
        Published(0.6e9, rel_tol=0.01),
        notes="The model card rounds 596M to 0.6B.",
    ),
    Preset(
        "gemma-2b",
        _gemma_2b(),
        "google/gemma-2b config.json (Gemma Team 2024); the paper's Table 2 gives 1,981,884,416 non-embedding "
        "parameters",
        Published(2_506_172_416, exact=True),
        notes="The paper's embedding count (524,550,144) is for a 256,128-token table; the released one has 256,000.",
    ),
    Preset(
        "gemma2-2b",
        _gemma2_2b(),
        "google/gemma-2-2b config.json (Gemma Team 2024); the paper's Table 1 gives 2,024,517,888 non-embedding "
        "parameters",
        Published(2_614_341_888, exact=True),
        notes="The paper's embedding count (590,118,912) is for a 256,128-token table; the released one has 256,000.",
    ),
    Preset(
        "gemma3-1b",
        _gemma3_1b(),
        "google/gemma-3-1b-pt config.json; 1B (302M embedding, 698M other) from the Gemma 3 report's Table 1",
        Published(1.0e9, rel_tol=0.01),
    ),
    Preset(
        "qwen1.5-moe-a2.7b",
        _qwen15_moe(),
        "Qwen/Qwen1.5-MoE-A2.7B config.json; 14.3B / 2.7B from its model card (Qwen Team 2024)",
        Published(14.3e9),
        Published(2.7e9, rel_tol=0.01),
    ),
    Preset(
        "mixtral-8x7b",
        _mixtral(),
        "mistralai/Mixtral-8x7B-v0.1 config.json; 46.7B / 12.9B from Mistral's "
        "announcement 'Mixtral of experts' (2023)",
        Published(46.7e9),
        Published(12.9e9),
    ),
    Preset(
        "mixtral-8x22b",
        _mixtral_8x22b(),
        "mistralai/Mixtral-8x22B-v0.1 config.json; 141B / 39B from Mistral's announcement 'Cheaper, Better, Faster, "
        "Stronger' (2024)",
        Published(141e9, rel_tol=0.01),
        Published(39e9, rel_tol=0.01),
    ),
    Preset(
        "deepseek-v2-lite",
        _deepseek_v2_lite(),
        "deepseek-ai/DeepSeek-V2-Lite config.json; 15.7B / 2.4B from the "
        "DeepSeek-V2 paper (DeepSeek-AI 2024), Appendix B",
        Published(15.7e9),
        Published(2.4e9, rel_tol=0.025, convention="activated parameters without the input embedding table"),
        notes="DeepSeek counts activated parameters without the input embedding (a lookup): 2.451B, which the "
        "paper states as 2.4B.",
    ),
    Preset(
        "deepseek-v3",
        _deepseek_v3(),
        "deepseek-ai/DeepSeek-V3 config.json; 671B / 37B from the DeepSeek-V3 Technical Report (DeepSeek-AI 2024)",
        Published(671e9),
        Published(37e9, rel_tol=0.015, convention="activated parameters without the input embedding table"),
        notes="Main model without the MTP module, as DeepSeek counts it; activated parameters without the input "
        "embedding give 36.6B, stated as 37B.",
    ),
    Preset(
        "deepseek-v3.2",
        _deepseek_v32(),
        "deepseek-ai/DeepSeek-V3.2-Exp config.json (index_n_heads 64, "
        "index_head_dim 128, index_topk 2048); 685B from its model card (main model, MTP module and the copy of "
        "the embedding and head the checkpoint stores for it)",
        Published(685e9, convention="checkpoint: main model + MTP module + the MTP copy of embedding and head"),
    ),
]

PRESETS: dict[str, Preset] = {}
for _p in _BASE:
    PRESETS[_p.name] = _p
    PRESETS[_p.name + "-tiny"] = Preset(
        _p.name + "-tiny", tiny_config(_p.config), f"toy-sized sibling of {_p.name}: same mechanisms, tiny widths"
    )


def list_presets() -> list[str]:
    return list(PRESETS)


def get_preset_info(name: str) -> Preset:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}{hint} Known presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset (see `list_presets()`)."""
    return get_preset_info(name).config
