import math

import pytest
import torch

from llmkit import ConfigError
from llmkit.layers.position import SinusoidalPositions


def paper_pe(pos: int, i: int, d: int) -> float:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (Vaswani et al. §3.5)."""
    angle = pos / 10000 ** (2 * (i // 2) / d)
    return math.sin(angle) if i % 2 == 0 else math.cos(angle)


def test_sinusoidal_matches_the_paper_formula():
    d = 32
    pe = SinusoidalPositions(d)(torch.arange(50).unsqueeze(0))[0]
    ref = torch.tensor([[paper_pe(p, i, d) for i in range(d)] for p in range(50)])
    torch.testing.assert_close(pe, ref, rtol=1e-5, atol=1e-5)


def test_half_layout_puts_sines_first():
    d = 8
    inter = SinusoidalPositions(d, layout="interleaved")(torch.arange(10).unsqueeze(0))
    half = SinusoidalPositions(d, layout="half")(torch.arange(10).unsqueeze(0))
    torch.testing.assert_close(half[..., : d // 2], inter[..., 0::2])
    torch.testing.assert_close(half[..., d // 2 :], inter[..., 1::2])


def test_pe_at_pos_plus_k_is_a_linear_function_of_pe_at_pos():
    # sin(a + b) = sin a cos b + cos a sin b: a fixed rotation per frequency maps PE(pos) to PE(pos + k)
    d, k = 16, 5
    sp = SinusoidalPositions(d)
    pe = sp(torch.arange(40).unsqueeze(0))[0].double()
    X, Y = pe[:-k], pe[k:]
    M = torch.linalg.lstsq(X, Y).solution
    torch.testing.assert_close(X @ M, Y, rtol=1e-6, atol=1e-6)


def test_sinusoidal_extends_beyond_any_training_length():
    pe = SinusoidalPositions(16)(torch.tensor([[100_000]]))
    assert torch.isfinite(pe).all() and pe.abs().max() <= 1


def test_odd_width_is_rejected():
    with pytest.raises(ConfigError, match="d_model=7 must be even"):
        SinusoidalPositions(7)
