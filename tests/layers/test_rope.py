import math

import pytest
import torch

from llmkit import RopeScaling
from llmkit.layers.rope import (
    RopeTables,
    RotaryEmbedding,
    apply_rope,
    interleaved_to_half,
    rope_frequencies,
    yarn_mscale,
)

D = 16


def tables(positions, dim=D, theta=10000.0, scaling=None):
    return RotaryEmbedding(dim, theta, 512, scaling)(torch.as_tensor(positions))


def rotation_matrix(m: int, dim: int, layout: str) -> torch.Tensor:
    """The block-diagonal R_m of the RoPE paper, as a dense matrix (the reference the element-wise path avoids)."""
    inv = rope_frequencies(dim, 10000.0)[0].double()
    R = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):
        a, b = (i, i + dim // 2) if layout == "half" else (2 * i, 2 * i + 1)
        c, s = math.cos(m * inv[i]), math.sin(m * inv[i])
        R[a, a], R[a, b], R[b, a], R[b, b] = c, -s, s, c
    return R


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_elementwise_rope_equals_the_rotation_matrix(layout):
    x = torch.randn(1, 5, 2, D)  # (B, T, H, D)
    out = apply_rope(x, tables(torch.arange(5)), layout)
    for m in range(5):
        ref = x[0, m].double() @ rotation_matrix(m, D, layout).T
        torch.testing.assert_close(out[0, m].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_score_depends_only_on_the_offset(layout):
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def score(m, n):
        qm = apply_rope(q, tables([m]), layout)
        kn = apply_rope(k, tables([n]), layout)
        return (qm * kn).sum()

    ref = score(3, 1)
    for shift in (0, 7, 40, 300):
        torch.testing.assert_close(score(3 + shift, 1 + shift), ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_half_and_interleaved_layouts_agree_after_permutation():
    x = torch.randn(2, 6, 3, D)
    rope = tables(torch.arange(6))
    interleaved = apply_rope(x, rope, "interleaved")
    half = apply_rope(interleaved_to_half(x), rope, "half")
    torch.testing.assert_close(interleaved_to_half(interleaved), half)


def test_tables_match_direct_computation_and_stay_fp32_in_a_bf16_model():
    rope = RotaryEmbedding(D, 10000.0, 64)
    positions = torch.tensor([[0, 5, 63]])
    t = rope(positions)
    angles = positions.float().unsqueeze(-1) * rope.inv_freq
    torch.testing.assert_close(t.cos, angles.cos())
    cast = RotaryEmbedding(D, 10000.0, 64).to(torch.bfloat16)
    assert cast.inv_freq.dtype == torch.float32 and torch.equal(cast(positions).cos, t.cos)
    assert "inv_freq" not in rope.state_dict()  # recomputed, never stored


def base(dim=D, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, dim, 2).double() / dim)


def test_linear_scaling_divides_every_frequency():
    inv, att = rope_frequencies(D, 10000.0, RopeScaling(kind="linear", factor=4.0))
    torch.testing.assert_close(inv.double(), base() / 4, rtol=1e-6, atol=0)
    assert att == 1.0


def test_ntk_scaling_stretches_the_base():
    inv, _ = rope_frequencies(D, 10000.0, RopeScaling(kind="ntk", factor=4.0))
    torch.testing.assert_close(inv.double(), base(theta=10000.0 * 4.0 ** (D / (D - 2))), rtol=1e-6, atol=0)
    assert inv[0] == 1.0  # the highest frequency is kept: extrapolated, not interpolated


def test_dynamic_scaling_grows_with_the_length_beyond_the_original():
    s = RopeScaling(kind="dynamic", factor=2.0, original_max_seq_len=100)
    short, _ = rope_frequencies(D, 10000.0, s, seq_len=80)
    torch.testing.assert_close(short.double(), base(), rtol=1e-6, atol=0)
    long, _ = rope_frequencies(D, 10000.0, s, seq_len=300)
    grown = 10000.0 * (2.0 * 300 / 100 - 1) ** (D / (D - 2))
    torch.testing.assert_close(long.double(), base(theta=grown), rtol=1e-6, atol=0)
    rope = RotaryEmbedding(D, 10000.0, 512, s)  # the module picks the length from the positions
    torch.testing.assert_close(rope(torch.arange(300)).cos[0, 7], torch.cos(7 * long))


def test_yarn_keeps_high_frequencies_interpolates_low_ones_and_scales_attention():
    s = RopeScaling(kind="yarn", factor=8.0, original_max_seq_len=256, beta_fast=32.0, beta_slow=1.0)
    dim = 64
    inv, att = rope_frequencies(dim, 10000.0, s)
    b = base(dim)
    wavelength = 2 * math.pi / b
    rotations = 256 / wavelength  # how often each pair rotates over the original context
    fast, slow = rotations > 32 + 1e-9, rotations < 1 - 1e-9
    assert fast.any() and slow.any()
    # truncation moves the ramp's ends to whole dims; dims clearly on either side are pure extrapolation/interpolation
    torch.testing.assert_close(inv.double()[fast][:-1], b[fast][:-1], rtol=1e-6, atol=0)
    torch.testing.assert_close(inv.double()[slow][1:], b[slow][1:] / 8, rtol=1e-6, atol=0)
    assert ((inv.double() <= b * (1 + 1e-6)) & (inv.double() >= b / 8 * (1 - 1e-6))).all()
    assert att == pytest.approx(0.1 * math.log(8.0) + 1.0)
    assert yarn_mscale(1.0) == 1.0
    # the attention factor multiplies cos and sin, i.e. scales q.k by its square
    cos = RotaryEmbedding(dim, 10000.0, 16, s)(torch.arange(1)).cos
    torch.testing.assert_close(cos[0, 0], torch.full((dim // 2,), att))


def test_llama3_scaling_by_wavelength():
    s = RopeScaling(kind="llama3", factor=8.0, original_max_seq_len=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    dim = 128
    inv = rope_frequencies(dim, 500000.0, s)[0].double()
    b = base(dim, 500000.0)
    wavelength = 2 * math.pi / b
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    torch.testing.assert_close(inv[high], b[high], rtol=1e-6, atol=0)
    torch.testing.assert_close(inv[low], b[low] / 8, rtol=1e-6, atol=0)
    mid = ~high & ~low
    smooth = (8192 / wavelength[mid] - 1) / (4 - 1)
    torch.testing.assert_close(inv[mid], (1 - smooth) * b[mid] / 8 + smooth * b[mid], rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("scaling", "hf"),
    [
        (RopeScaling(kind="linear", factor=4.0), {"rope_type": "linear", "factor": 4.0}),
        (
            RopeScaling(kind="dynamic", factor=2.0, original_max_seq_len=64),
            {"rope_type": "dynamic", "factor": 2.0},
        ),
        (
            RopeScaling(kind="yarn", factor=40.0, original_max_seq_len=64, mscale=1.0, mscale_all_dim=1.0),
            {
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        (
            RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=64),
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        ),
        (
            RopeScaling(kind="llama3", factor=8.0, original_max_seq_len=64, low_freq_factor=1.0, high_freq_factor=4.0),
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
        ),
    ],
)
def test_scalings_match_transformers(scaling, hf):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=64,
        rope_parameters={"rope_theta": 10000.0, **hf},
    )
    ref_inv, ref_att = ROPE_INIT_FUNCTIONS[hf["rope_type"]](config, None, seq_len=200)
    inv, att = rope_frequencies(64, 10000.0, scaling, seq_len=200)
    torch.testing.assert_close(inv, ref_inv, rtol=0, atol=0)
    assert att == pytest.approx(ref_att)


def test_tables_broadcast_over_batch_positions():
    rope = RotaryEmbedding(D, 10000.0, 32)
    t = rope(torch.tensor([[0, 1, 2], [5, 6, 7]]))
    assert isinstance(t, RopeTables) and t.cos.shape == (2, 3, D // 2)
    torch.testing.assert_close(t.cos[1, 0], rope(torch.tensor([5])).cos[0, 0])
