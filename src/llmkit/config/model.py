"""Model configuration: one `ModelConfig` dataclass composed of small, validated sub-configs.

    ModelConfig
    ├── attention: AttentionConfig      kind gqa | mla | dsa
    │   ├── mla: MLAConfig              (DeepSeek-V2/V3 latent attention)
    │   └── indexer: IndexerConfig      (DeepSeek-V3.2 lightning indexer, kind dsa)
    ├── ffn: FFNConfig                  dense feed-forward: mlp | swiglu
    ├── moe: MoEConfig | None           mixture of experts (replaces ffn after `first_dense_layers`)
    ├── position: PositionConfig        sinusoidal | learned | rope | none      (position.py)
    │   └── scaling: RopeScaling        linear | ntk | dynamic | yarn | llama3
    ├── norm: NormConfig                layernorm | rmsnorm, pre | post
    └── encoder: EncoderConfig | None   set for an encoder-decoder model

Every config is frozen and validated on construction (the machinery is in base.py). An invalid value raises
`ConfigError` naming the field, the value and what would be valid, e.g. ``attention.n_heads=12 is not divisible by
attention.n_kv_heads=5 (valid n_kv_heads: 1, 2, 3, 4, 6, 12)``. Configs round-trip through JSON with `to_json` /
`from_json`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from llmkit.config.base import ConfigBase, divisors
from llmkit.config.position import MAX_CONTEXT as MAX_CONTEXT
from llmkit.config.position import Layout as Layout
from llmkit.config.position import PositionConfig as PositionConfig
from llmkit.config.position import PositionKind as PositionKind
from llmkit.config.position import RopeScaling as RopeScaling
from llmkit.config.position import RopeScalingKind as RopeScalingKind
from llmkit.errors import ConfigError

# Upper bounds of a model's sizes, far above any published model's (DeepSeek-V3: 61 layers, 7168 wide, 256 experts,
# 129k vocabulary; Gemma: 256k vocabulary; 10M-token contexts): a size beyond them is a typo or a damaged file, and
# refusing it before anything is built keeps a bad value from becoming an allocation of terabytes.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 17
MAX_HEADS = 4096
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24

AttentionKind = Literal["gqa", "mla", "dsa"]
NormKind = Literal["layernorm", "rmsnorm"]
NormPlacement = Literal["pre", "post", "sandwich"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
FFNKind = Literal["mlp", "swiglu"]
ScoreFunc = Literal["softmax", "sigmoid"]
GroupScore = Literal["top2_sum", "max"]
BalanceLoss = Literal["switch", "sequence"]
InitKind = Literal["normal", "xavier"]

# ----------------------------------------------------------------------------------------------------------------
# attention


@dataclass(frozen=True)
class MLAConfig(ConfigBase):
    """Multi-head latent attention (DeepSeek-V2 §2.1): keys and values are rebuilt from a shared latent of
    `kv_lora_rank` dims; a decoupled `qk_rope_head_dim` part carries RoPE with one key shared by all heads."""

    path: ClassVar[str] = "attention.mla"
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            self.require(getattr(self, name) >= 1, name, "must be >= 1")
        self.require(
            self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
            "qk_rope_head_dim",
            "must be even and >= 2 (RoPE rotates pairs of dimensions)",
        )
        if self.q_lora_rank is not None:
            self.require(self.q_lora_rank >= 1, "q_lora_rank", "must be >= 1, or None for a direct projection")


@dataclass(frozen=True)
class IndexerConfig(ConfigBase):
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): `n_heads` small heads score every key; each
    query attends only to its `topk` best keys."""

    path: ClassVar[str] = "attention.indexer"
    n_heads: int = 64
    head_dim: int = 128
    topk: int = 2048

    def validate(self) -> None:
        self.at_least(1, "n_heads")
        self.at_least(2, "head_dim")
        self.at_least(1, "topk")


@dataclass(frozen=True)
class AttentionConfig(ConfigBase):
    """Self-attention. kind gqa covers MHA (n_kv_heads == n_heads) and MQA (n_kv_heads == 1); mla needs `mla`;
    dsa (MLA + lightning indexer + top-k sparse attention) needs `mla` and `indexer`. sliding_window (gqa): each
    query sees only the `sliding_window` most recent tokens (Mistral-7B-v0.1). qk_norm (gqa): each query and key
    head is normalised (the model's norm kind, over head_dim, before RoPE) as in Qwen3 and Gemma 3, which keeps
    attention logits from growing without bound (Dehghani et al. 2023). full_every (with sliding_window): every
    n-th layer (layer i with (i + 1) % n == 0) attends to everything, the others through the window (Gemma 2:
    2, local and global layers alternating). softcap (gqa): scores become softcap * tanh(scores / softcap) before
    the softmax (Gemma 2's attention logit soft-capping). scale (gqa): the factor on q.k, head_dim^-0.5 when None
    (Gemma 2 uses query_pre_attn_scalar^-0.5)."""

    path: ClassVar[str] = "attention"
    kind: AttentionKind = "gqa"
    n_heads: int = 8
    n_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    dropout: float = 0.0
    sliding_window: int | None = None
    full_every: int | None = None
    qk_norm: bool = False
    softcap: float | None = None
    scale: float | None = None
    mla: MLAConfig | None = None
    indexer: IndexerConfig | None = None

    def validate(self) -> None:
        self.within(1, MAX_HEADS, "n_heads")
        self.require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        if self.sliding_window is not None:
            self.require(self.sliding_window >= 1, "sliding_window", "must be >= 1, or None for full attention")
            self.require(self.kind == "gqa", "sliding_window", "is only supported with attention.kind='gqa'")
        if self.qk_norm:
            self.require(self.kind == "gqa", "qk_norm", "is only supported with attention.kind='gqa'")
        if self.full_every is not None:
            self.require(self.full_every >= 1, "full_every", "must be >= 1, or None for a window in every layer")
            self.require(self.sliding_window is not None, "full_every", "needs a sliding_window")
        if self.softcap is not None:
            self.require(self.softcap > 0, "softcap", "must be > 0, or None for no soft-capping")
            self.require(self.kind == "gqa", "softcap", "is only supported with attention.kind='gqa'")
        if self.scale is not None:
            self.require(self.scale > 0, "scale", "must be > 0, or None for head_dim ** -0.5")
            self.require(self.kind == "gqa", "scale", "is only supported with attention.kind='gqa'")
        if self.kind == "gqa":
            self.require(self.mla is None, "mla", "is only used with attention.kind='mla' or 'dsa'")
            self.require(self.indexer is None, "indexer", "is only used with attention.kind='dsa'")
            if self.n_kv_heads is not None:
                self.at_least(1, "n_kv_heads")
                if self.n_heads % self.n_kv_heads != 0:
                    raise ConfigError(
                        f"attention.n_heads={self.n_heads} is not divisible by attention.n_kv_heads="
                        f"{self.n_kv_heads} (valid n_kv_heads: {divisors(self.n_heads)})"
                    )
            if self.head_dim is not None:
                self.at_least(1, "head_dim")
        else:
            self.require(self.mla is not None, "mla", f"is required for attention.kind={self.kind!r}")
            self.require(
                self.n_kv_heads is None,
                "n_kv_heads",
                "is not used by latent attention (every head reads the shared latent); leave it None",
            )
            self.require(
                self.head_dim is None,
                "head_dim",
                "is not used by latent attention (set mla.qk_nope_head_dim / qk_rope_head_dim / v_head_dim)",
            )
            if self.kind == "dsa":
                self.require(self.indexer is not None, "indexer", "is required for attention.kind='dsa'")
                assert self.mla is not None and self.indexer is not None
                if self.indexer.head_dim < self.mla.qk_rope_head_dim:
                    raise ConfigError(
                        f"attention.indexer.head_dim={self.indexer.head_dim} must be >= "
                        f"attention.mla.qk_rope_head_dim={self.mla.qk_rope_head_dim} (the indexer rotates its "
                        "first qk_rope_head_dim dimensions)"
                    )
            else:
                self.require(self.indexer is None, "indexer", "is only used with attention.kind='dsa'")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to every earlier token)."""
        if self.full_every is not None and (layer + 1) % self.full_every == 0:
            return None
        return self.sliding_window


# ----------------------------------------------------------------------------------------------------------------
# feed-forward and mixture of experts


@dataclass(frozen=True)
class FFNConfig(ConfigBase):
    """Dense position-wise feed-forward: mlp = act(x W1) W2 (paper: ReLU); swiglu = (silu(x W1) * x W3) W2."""

    path: ClassVar[str] = "ffn"
    kind: FFNKind = "swiglu"
    hidden_dim: int | None = None
    activation: Activation = "silu"
    bias: bool = False

    def validate(self) -> None:
        if self.hidden_dim is not None:
            self.within(1, MAX_WIDTH * 16, "hidden_dim")


@dataclass(frozen=True)
class MoEConfig(ConfigBase):
    """Mixture of experts. Switch: top_k=1, softmax, norm_topk=False. GShard / Mixtral: top_k=2, softmax,
    norm_topk=True. DeepSeek-V3: sigmoid scores, n_groups / topk_groups, score_bias (aux-loss-free balancing),
    routed_scale, shared experts. DeepSeek-V2: softmax scores, groups ranked by their best score (group_score "max",
    where V3 sums each group's two best: "top2_sum"), gates not renormalised. Qwen2-MoE: a shared expert whose output
    is scaled per token by sigmoid(x . w_gate) (shared_gate). Layers before `first_dense_layers` keep the dense `ffn`.

    aux_loss_kind: "switch" (Switch / GShard / Mixtral: E * sum_i f_i P_i over the whole batch) or "sequence"
    (DeepSeek-V2/V3: the same per sequence with f_i normalised by k, averaged over sequences)."""

    path: ClassVar[str] = "moe"
    n_experts: int = 8
    top_k: int = 2
    expert_hidden_dim: int = 1024
    expert_kind: FFNKind = "swiglu"
    activation: Activation = "silu"
    n_shared_experts: int = 0
    shared_gate: bool = False
    score_func: ScoreFunc = "softmax"
    n_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = "top2_sum"
    norm_topk: bool = True
    routed_scale: float = 1.0
    score_bias: bool = False
    capacity_factor: float | None = None
    aux_loss_kind: BalanceLoss = "switch"
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    first_dense_layers: int = 0

    def validate(self) -> None:
        self.within(1, MAX_EXPERTS, "n_experts")
        self.require(1 <= self.top_k <= self.n_experts, "top_k", f"must be between 1 and n_experts={self.n_experts}")
        self.at_least(1, "expert_hidden_dim")
        self.at_least(0, "n_shared_experts")
        if self.shared_gate:
            self.require(self.n_shared_experts >= 1, "shared_gate", "needs n_shared_experts >= 1 (it gates them)")
        if self.n_groups < 1 or self.n_experts % self.n_groups != 0:
            raise ConfigError(
                f"moe.n_groups={self.n_groups} must divide moe.n_experts={self.n_experts} "
                f"(valid n_groups: {divisors(self.n_experts)})"
            )
        self.require(
            1 <= self.topk_groups <= self.n_groups,
            "topk_groups",
            f"must be between 1 and n_groups={self.n_groups}",
        )
        reachable = self.topk_groups * (self.n_experts // self.n_groups)
        self.require(
            self.top_k <= reachable,
            "top_k",
            f"exceeds the {reachable} experts in the topk_groups={self.topk_groups} selected groups",
        )
        self.require(self.routed_scale > 0, "routed_scale", "must be > 0")
        if self.capacity_factor is not None:
            self.require(self.capacity_factor > 0, "capacity_factor", "must be > 0, or None for no capacity limit")
        self.at_least(0, "aux_loss_coef", "z_loss_coef", "first_dense_layers")


# ----------------------------------------------------------------------------------------------------------------
# norms, encoder, model


@dataclass(frozen=True)
class NormConfig(ConfigBase):
    """kind: layernorm | rmsnorm. placement: pre (x + f(norm(x)), GPT-2/LLaMA), post (norm(x + f(x)), the
    original Transformer) or sandwich (x + norm'(f(norm(x))), Gemma 2: a second norm on each sub-layer's output).
    bias: LayerNorm's additive bias. unit_offset (rmsnorm): the gain is 1 + weight, with the weight stored as its
    offset from 1 and initialised to 0 (Gemma)."""

    path: ClassVar[str] = "norm"
    kind: NormKind = "rmsnorm"
    placement: NormPlacement = "pre"
    eps: float = 1e-5
    bias: bool = True
    unit_offset: bool = False

    def validate(self) -> None:
        self.require(self.eps > 0, "eps", "must be > 0")
        if self.unit_offset:
            self.require(self.kind == "rmsnorm", "unit_offset", "is only supported with norm.kind='rmsnorm'")


@dataclass(frozen=True)
class EncoderConfig(ConfigBase):
    """The encoder of an encoder-decoder model. vocab_size None: source and target share one vocabulary and one
    embedding matrix (the paper's shared BPE vocabulary)."""

    path: ClassVar[str] = "encoder"
    n_layers: int = 6
    vocab_size: int | None = None

    def validate(self) -> None:
        self.at_least(1, "n_layers")
        if self.vocab_size is not None:
            self.at_least(1, "vocab_size")


@dataclass(frozen=True)
class ModelConfig(ConfigBase):
    """A whole model. Decoder-only when `encoder` is None, encoder-decoder otherwise (`n_layers` is then the
    number of decoder layers). The config holds what was given: `attention.head_dim`, `attention.n_kv_heads` and
    `ffn.hidden_dim` left as None are derived on demand (the `head_dim`, `n_kv_heads` and `ffn_hidden_dim`
    properties, or `resolved()`), so a config changed with `dataclasses.replace` stays consistent."""

    vocab_size: int
    d_model: int
    n_layers: int
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    position: PositionConfig = field(default_factory=PositionConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    moe: MoEConfig | None = None
    encoder: EncoderConfig | None = None
    tie_embeddings: bool = False
    scale_embeddings: bool = False
    head_bias: bool = False
    logit_softcap: float | None = None
    dropout: float = 0.0
    mtp_depth: int = 0
    init: InitKind = "normal"
    init_std: float = 0.02

    def validate(self) -> None:
        self.within(1, MAX_VOCAB, "vocab_size")
        self.within(1, MAX_WIDTH, "d_model")
        self.within(1, MAX_LAYERS, "n_layers")
        self.require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        self.within(0, MAX_LAYERS, "mtp_depth")
        self.require(self.init_std > 0, "init_std", "must be > 0")
        if self.logit_softcap is not None:
            self.require(self.logit_softcap > 0, "logit_softcap", "must be > 0, or None for no soft-capping")
        a = self.attention
        if a.kind == "gqa" and a.head_dim is None and self.d_model % a.n_heads != 0:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by attention.n_heads={a.n_heads}; set "
                f"attention.head_dim explicitly or choose n_heads among {divisors(self.d_model)}"
            )
        if self.moe is not None and self.moe.first_dense_layers > self.n_layers:
            raise ConfigError(f"moe.first_dense_layers={self.moe.first_dense_layers} exceeds n_layers={self.n_layers}")
        if self.encoder is not None:
            if self.attention.kind != "gqa":
                raise ConfigError(
                    f"attention.kind={self.attention.kind!r} is not supported in an encoder-decoder model "
                    "(cross-attention is defined for kind='gqa')"
                )
            self.require(self.mtp_depth == 0, "mtp_depth", "is only supported for decoder-only models")
            if self.attention.qk_norm:
                raise ConfigError("attention.qk_norm is only supported in decoder-only models")
        if self.attention.kind != "gqa" and self.position.kind != "rope":
            raise ConfigError(
                f"position.kind={self.position.kind!r} cannot be used with attention.kind="
                f"{self.attention.kind!r}: latent attention carries positions in its decoupled RoPE dims, "
                "so position.kind must be 'rope'"
            )
        if self.position.kind == "rope":
            rope = self.rope_dim
            if rope < 2 or rope % 2 != 0:
                raise ConfigError(
                    f"position.rope_fraction={self.position.rope_fraction} of head_dim={self.head_dim} gives "
                    f"{rope} rotary dims; RoPE needs an even number >= 2"
                )
            s = self.position.scaling
            if s is not None and s.kind in ("ntk", "dynamic") and rope < 4:
                raise ConfigError(
                    f"position.scaling.kind={s.kind!r} needs at least 4 rotary dims (it stretches the base by "
                    f"factor ** (d / (d - 2))), the model has {rope}"
                )

    # ---- derived quantities used by the layers (one place, so no layer re-derives them differently)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder is not None

    @property
    def head_dim(self) -> int:
        """Query/key head dimension: attention.head_dim, or d_model / n_heads when unset (for MLA: nope + rope
        dims)."""
        a = self.attention
        if a.kind == "gqa":
            return a.head_dim if a.head_dim is not None else self.d_model // a.n_heads
        assert a.mla is not None
        return a.mla.qk_nope_head_dim + a.mla.qk_rope_head_dim

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: attention.n_kv_heads, or n_heads (multi-head attention) when unset."""
        a = self.attention
        return a.n_kv_heads if a.n_kv_heads is not None else a.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense feed-forward width: ffn.hidden_dim, or when unset 4 * d_model for an MLP and LLaMA's rule for
        SwiGLU (2/3 of 4 * d_model, which keeps an MLP's parameter count with three matrices, rounded up to 256)."""
        f = self.ffn
        if f.hidden_dim is not None:
            return f.hidden_dim
        return 4 * self.d_model if f.kind == "mlp" else 256 * math.ceil(int(8 * self.d_model / 3) / 256)

    @property
    def rope_dim(self) -> int:
        """Number of rotated dimensions per head (0 without RoPE)."""
        if self.position.kind != "rope":
            return 0
        a = self.attention
        if a.kind != "gqa":
            assert a.mla is not None
            return a.mla.qk_rope_head_dim
        return int(self.head_dim * self.position.rope_fraction)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_dense_layers

    def resolved(self) -> ModelConfig:
        """This config with the derived sizes written out (attention.head_dim and n_kv_heads for GQA, ffn.hidden_dim).
        The config itself keeps what was given, so `dataclasses.replace(cfg, d_model=...)` derives them again."""
        a = self.attention
        if a.kind == "gqa":
            a = dataclasses.replace(a, head_dim=self.head_dim, n_kv_heads=self.n_kv_heads)
        return dataclasses.replace(self, attention=a, ffn=dataclasses.replace(self.ffn, hidden_dim=self.ffn_hidden_dim))

    def architecture(self) -> ModelConfig:
        """This config resolved, with the training-only settings (dropout, initialisation, loss coefficients) reset,
        so that two configs compare equal exactly when they compute the same function from the same weights."""
        resolved = self.resolved()
        moe, ffn = resolved.moe, resolved.ffn
        if moe is not None:
            moe = dataclasses.replace(moe, aux_loss_coef=0.0, z_loss_coef=0.0, aux_loss_kind="switch")
            if moe.n_groups == 1:  # one group: how groups would be ranked changes nothing
                moe = dataclasses.replace(moe, topk_groups=1, group_score="top2_sum")
            if moe.first_dense_layers == 0:  # every layer is MoE: the dense ffn settings are unused
                ffn = FFNConfig(moe.expert_kind, moe.expert_hidden_dim, moe.activation, False)
        position, attention = resolved.position, dataclasses.replace(resolved.attention, dropout=0.0)
        if attention.full_every is not None and attention.full_every > self.n_layers:  # no layer is a global one
            attention = dataclasses.replace(attention, full_every=None)
        if attention.sliding_window is None:  # no sliding-window layer uses a local RoPE base
            position = dataclasses.replace(position, local_theta=None)
        return dataclasses.replace(
            resolved,
            position=position,
            dropout=0.0,
            attention=attention,
            ffn=ffn,
            moe=moe,
            init="normal",
            init_std=0.02,
        )
