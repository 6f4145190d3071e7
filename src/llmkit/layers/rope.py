"""Rotary position embedding (RoPE, Su et al. 2021) and its context-extension scalings.

RoPE rotates each pair of dimensions (x_a, x_b) of a query or key at position m by the angle m * theta_i:

    [x_a']   [cos m.theta_i  -sin m.theta_i] [x_a]          theta_i = base ** (-2i / d),  i = 0 .. d/2 - 1
    [x_b'] = [sin m.theta_i   cos m.theta_i] [x_b]

so that <R_m q, R_n k> = <q, R_(n-m) k>: the score depends only on the offset n - m (relative position from absolute
rotations). R_m is block-diagonal and sparse, so it is applied element-wise with cached cos/sin tables, never as a
matmul with the rotation matrix:

    x' = x * cos + rotate(x) * sin

Two pair layouts exist and give identical scores once the dimensions are permuted to match:
  half        pairs (i, i + d/2)  — GPT-NeoX, Hugging Face Llama checkpoints
  interleaved pairs (2i, 2i + 1)  — the RoPE paper, Meta's original LLaMA code, DeepSeek

Shapes: B batch, T positions, H heads, D rotated dims (even), F = D / 2 frequencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.config import Layout, RopeScaling
from llmkit.errors import ConfigError
from llmkit.layers.precision import FP32Buffers


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term sqrt(1/t) = 0.1 * mscale * ln(factor) + 1 (Peng et al. 2023, eq. 22)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_CPU = torch.device("cpu")  # explicit, so that building a model on the meta device still gives real frequencies


def _base_inv_freq(dim: int, theta: float) -> Tensor:
    # computed in fp32, as the reference implementations do, so that tables match them bit for bit
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=_CPU).float() / dim
    return 1.0 / (theta**exponent)


def rope_frequencies(
    dim: int, theta: float, scaling: RopeScaling | None = None, seq_len: int | None = None
) -> tuple[Tensor, float]:
    """Inverse frequencies theta_i (F,) fp32 for `dim` rotated dims, and the factor that multiplies cos and sin.

    `seq_len` is the current length, used only by dynamic NTK scaling.
    """
    if dim < 2 or dim % 2:
        raise ConfigError(f"rotary dim={dim} must be even and >= 2")
    if scaling is not None and scaling.kind in ("ntk", "dynamic") and dim < 4:
        raise ConfigError(f"{scaling.kind} RoPE scaling needs at least 4 rotary dims, got {dim}")
    if scaling is None:
        return _base_inv_freq(dim, theta), 1.0
    s = scaling
    if s.kind == "linear":  # position interpolation: positions / factor == frequencies / factor
        return _base_inv_freq(dim, theta) / s.factor, 1.0
    if s.kind == "ntk":  # NTK-aware: stretch the base so low frequencies interpolate, high ones extrapolate
        return _base_inv_freq(dim, theta * s.factor ** (dim / (dim - 2))), 1.0
    if s.kind == "dynamic":  # NTK with the factor grown to the current length, only past the trained length
        assert s.original_max_seq_len is not None
        length = max(seq_len or 0, s.original_max_seq_len)
        grown = (s.factor * length / s.original_max_seq_len) - (s.factor - 1)
        return _base_inv_freq(dim, theta * grown ** (dim / (dim - 2))), 1.0
    if s.kind == "yarn":
        return _yarn_frequencies(dim, theta, s)
    return _llama3_frequencies(dim, theta, s), 1.0


def _yarn_frequencies(dim: int, theta: float, s: RopeScaling) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies that rotate fewer than `beta_slow` times over the original context are
    interpolated (/ factor), those rotating more than `beta_fast` times are kept, with a linear ramp between."""
    assert s.original_max_seq_len is not None
    original = s.original_max_seq_len

    def dim_for_rotations(rotations: float) -> float:
        # the dimension index whose wavelength fits `rotations` times into the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for_rotations(s.beta_fast), dim_for_rotations(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=_CPU) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    base = theta ** (torch.arange(0, dim, 2, device=_CPU).float() / dim)
    inv_freq = (1.0 / (s.factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = yarn_mscale(s.factor)
    return inv_freq, attention


def _llama3_frequencies(dim: int, theta: float, s: RopeScaling) -> Tensor:
    """LLaMA-3.1: wavelengths longer than original/low_freq_factor are divided by factor, shorter than
    original/high_freq_factor are kept, and a smooth interpolation joins them."""
    assert s.original_max_seq_len is not None
    inv_freq = _base_inv_freq(dim, theta)
    original = s.original_max_seq_len
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class RopeTables:
    """cos and sin for the positions of one forward call, each (B | 1, T, F), fp32."""

    cos: Tensor
    sin: Tensor


class RotaryEmbedding(FP32Buffers):
    """Builds cos/sin tables for positions. positions (T,) or (B, T) int -> RopeTables (B | 1, T, F).

    The inverse frequencies are a non-persistent fp32 buffer (not part of checkpoints, and kept in fp32 when the
    model is cast to bf16), computed on the CPU so that they match the reference implementations bit for bit.
    The angles of each call's positions are computed on the fly: a handful of elementwise operations per call,
    with no table to fill in during the forward pass.
    """

    fp32_buffers = ("inv_freq",)

    def __init__(self, dim: int, theta: float, max_seq_len: int, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.dim, self.theta, self.max_seq_len, self.scaling = dim, theta, max_seq_len, scaling
        inv_freq, self.attention_factor = rope_frequencies(dim, theta, scaling, seq_len=max_seq_len)
        default = torch.empty(0).device  # the device models are being built on (a `with torch.device(...)`)
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", inv_freq if default.type == "meta" else inv_freq.to(default), False)
        self.dynamic = scaling is not None and scaling.kind == "dynamic"

    def forward(self, positions: Tensor) -> RopeTables:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)  # (1, T)
        inv_freq = self.inv_freq
        if self.dynamic:  # the frequencies depend on the current length (read from the positions)
            inv_freq, _ = rope_frequencies(self.dim, self.theta, self.scaling, int(positions.max()) + 1)
        angles = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)  # (B | 1, T, F)
        return RopeTables(angles.cos() * self.attention_factor, angles.sin() * self.attention_factor)

    def extra_repr(self) -> str:
        kind = self.scaling.kind if self.scaling else "none"
        return f"dim={self.dim}, theta={self.theta}, max_seq_len={self.max_seq_len}, scaling={kind}"


def apply_rope(x: Tensor, rope: RopeTables, layout: Layout) -> Tensor:
    """Rotate x (B, T, H, D) by its positions' angles; rope tables (B | 1, T, D/2). Returns x's shape and dtype."""
    cos = rope.cos.unsqueeze(2).to(x.dtype)  # (B, T, 1, F)
    sin = rope.sin.unsqueeze(2).to(x.dtype)
    if layout == "half":
        x1, x2 = x.chunk(2, dim=-1)  # pairs (i, i + F)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # pairs (2i, 2i + 1)
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def interleaved_to_half(x: Tensor) -> Tensor:
    """Permute the last dim from the interleaved to the half pair layout: [a0 b0 a1 b1 ..] -> [a0 a1 .. b0 b1 ..].

    apply_rope(x, layout='interleaved') permuted this way equals apply_rope(permuted x, layout='half')."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
