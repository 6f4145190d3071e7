"""How token positions enter a model: `PositionConfig` and its RoPE context extension `RopeScaling`, sub-configs of
`llmkit.config.ModelConfig` (which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from llmkit.config.base import ConfigBase

MAX_CONTEXT = 1 << 27  # a longer context is a typo or a damaged file (10M-token contexts are the longest published)

PositionKind = Literal["sinusoidal", "learned", "rope", "none"]
Layout = Literal["half", "interleaved"]
RopeScalingKind = Literal["linear", "ntk", "dynamic", "yarn", "llama3"]


@dataclass(frozen=True)
class RopeScaling(ConfigBase):
    """Context extension for RoPE. Each kind rescales the rotary frequencies:

    - linear (position interpolation, Chen et al. 2023): every frequency / factor.
    - ntk (NTK-aware, bloc97 2023): base theta * factor ** (d / (d - 2)).
    - dynamic (dynamic NTK): ntk with the factor grown from the current length, only past the original length.
    - yarn (Peng et al. 2023): per-frequency blend of interpolation and extrapolation, plus an attention scale
      0.1 * ln(factor) + 1 applied to q and k.
    - llama3 (Meta 2024): low frequencies / factor, high frequencies kept, a smooth ramp in between.
    """

    path: ClassVar[str] = "position.scaling"
    kind: RopeScalingKind
    factor: float
    original_max_seq_len: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def validate(self) -> None:
        self.require(self.factor > 0, "factor", "must be > 0 (1.0 means no scaling)")
        if self.kind in ("dynamic", "yarn", "llama3"):
            self.require(
                self.original_max_seq_len is not None,
                "original_max_seq_len",
                f"is required for kind={self.kind!r} (the context length the model was trained with)",
            )
        if self.original_max_seq_len is not None:
            self.at_least(1, "original_max_seq_len")
        if self.kind == "yarn":
            self.require(self.beta_fast > self.beta_slow, "beta_fast", f"must be > beta_slow={self.beta_slow}")
        if self.kind == "llama3":
            self.require(
                self.high_freq_factor > self.low_freq_factor,
                "high_freq_factor",
                f"must be > low_freq_factor={self.low_freq_factor}",
            )


@dataclass(frozen=True)
class PositionConfig(ConfigBase):
    """How token positions enter the model.

    kind: sinusoidal (fixed, added to embeddings, Vaswani et al. 2017), learned (added), rope (rotary, applied to q
    and k), none. layout: for rope, which dimensions form a rotated pair ("half": i and i + d/2 as in HF Llama;
    "interleaved": 2i and 2i+1 as in the RoPE paper and DeepSeek); for sinusoidal, where sin and cos go
    ("interleaved": sin at 2i, cos at 2i+1 as in the paper; "half": sin then cos, as tensor2tensor and Marian).
    local_theta: the RoPE base of the sliding-window layers when it differs from the others' (Gemma 3: 10,000
    locally, 1,000,000 with scaling globally); never scaled.
    """

    path: ClassVar[str] = "position"
    kind: PositionKind = "rope"
    max_seq_len: int = 2048
    theta: float = 10000.0
    layout: Layout = "half"
    rope_fraction: float = 1.0
    scaling: RopeScaling | None = None
    local_theta: float | None = None

    def validate(self) -> None:
        self.within(1, MAX_CONTEXT, "max_seq_len")
        self.require(self.theta > 1.0, "theta", "must be > 1 (the RoPE / sinusoid base, usually 10000)")
        self.require(0.0 < self.rope_fraction <= 1.0, "rope_fraction", "must be in (0, 1]")
        if self.scaling is not None:
            self.require(self.kind == "rope", "kind", "does not use position.scaling; scaling needs kind='rope'")
        if self.local_theta is not None:
            self.require(self.local_theta > 1.0, "local_theta", "must be > 1, or None for one RoPE base")
            self.require(self.kind == "rope", "local_theta", "needs kind='rope'")
