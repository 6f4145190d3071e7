"""The AVX512-VNNI integer kernel (quant/cpu_vnni.cpp) against the arithmetic it implements, computed here in
float64 from the same integer codes, and against the AVX2 kernel. Runs where the CPU has AVX512-VNNI."""

from __future__ import annotations

import pytest
import torch

from llmkit.errors import InputError
from llmkit.quant import Int4Linear, Int8Linear, native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llmkit's CPU kernels")


def needs_vnni() -> None:
    if not native.module().cpu_has_avx512_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")


def exact(layer: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """x's rows rounded to int8 per block of 32 as the kernels round them (scale max|x| / 127, codes round(x * (1 /
    scale)) in fp32, half to even), each block's dot with the weight codes, scaled and summed in float64; int4 adds
    zero * sum(x) with x's float sums."""
    M, K = x.shape
    blocks = x.view(M, K // 32, 32)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = (blocks * inverse[..., None]).round()
    if isinstance(layer, Int4Linear):
        packed = layer.qweight.to(torch.int64)
        w = torch.stack([packed & 15, packed >> 4], -1).view(layer.qweight.shape[0], K)
    else:
        w = layer.qweight.to(torch.int64)
    N, G = layer.scales.shape
    per_block = lambda t: t.repeat_interleave(K // 32 // G, dim=1).double()  # noqa: E731  (N, groups) -> (N, blocks)
    dots = torch.einsum("mbk,nbk->mnb", codes.double(), w.view(N, K // 32, 32).double())
    y = (dots * per_block(layer.scales)[None] * scale.double()[:, None, :]).sum(-1)
    if isinstance(layer, Int4Linear):
        y += (per_block(layer.zeros)[None] * blocks.sum(-1).double()[:, None, :]).sum(-1)
    return y


def product(layer: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    ext = native.module()
    if isinstance(layer, Int4Linear):
        return ext.int4_linear(x.contiguous(), layer.qweight, layer.scales, layer.zeros)
    return ext.int8_linear(x.contiguous(), layer.qweight, layer.scales)


# (rows, inputs, outputs, group): one row (int4 takes 4 blocks at a time there, the rest one by one), a partial tile
# of 16 outputs, more rows than one pass over a tile takes (8), groups of several blocks
SHAPES = [
    (1, 32, 5, None),
    (1, 160, 37, None),
    (1, 576, 48, None),
    (3, 96, 16, None),
    (8, 256, 33, 64),
    (12, 576, 70, None),
    (20, 128, 17, 128),
    (9, 1024, 64, 32),
]


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize(("rows", "width", "outputs", "group"), SHAPES)
def test_vnni_products_equal_the_integer_arithmetic(cls, rows, width, outputs, group):
    needs_vnni()
    torch.manual_seed(rows + width)
    layer = cls.from_linear(torch.nn.Linear(width, outputs, bias=False), group_size=group, kernel="avx2")
    x = torch.randn(rows, width)
    x[0, :32] = 0.0  # a block of zeros (scale 0)
    reference = exact(layer, x)
    with native.integer_kernel_set("auto"):
        assert native.integer_kernel() == "avx512-vnni"
        out = product(layer, x)
    # fp32 sums of K / 32 terms against float64: a few units in the last place of the largest
    assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    with native.integer_kernel_set("avx2"):
        assert native.integer_kernel() == "avx2"
        avx2 = product(layer, x)
    assert (out - avx2).abs().max() <= 1e-5 * avx2.abs().max()


def test_vnni_products_are_wrong_when_the_codes_are():
    """The comparison above can fail: one weight code changed moves the result away from the reference."""
    needs_vnni()
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(64, 16, bias=False), kernel="avx2")
    x = torch.randn(2, 64)
    reference = exact(layer, x)
    layer.qweight[3, 17] = 100 - layer.qweight[3, 17].item()
    assert (product(layer, x).double() - reference).abs().max() > 1e-3 * reference.abs().max()


def test_the_integer_kernel_is_chosen_by_name():
    with pytest.raises(InputError, match="avx2"):
        native.set_integer_kernel("vnni")
    expected = "avx512-vnni" if native.module().cpu_has_avx512_vnni() else "avx2"
    with native.integer_kernel_set("auto"):
        assert native.integer_kernel() == expected
    with native.integer_kernel_set("avx2"):
        assert native.integer_kernel() == "avx2"


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
def test_the_decode_steps_tiled_scales_give_the_same_bits_and_follow_in_place_updates(cls):
    """The C++ decode step keeps each projection's scales transposed by tiles of 16 outputs for the VNNI kernel: its
    products equal the per-call ones bit for bit (70 outputs: a partial last tile), and an in-place change of the
    scales (or zeros) is seen at the next step, as the step's other weights are."""
    needs_vnni()
    torch.manual_seed(3)
    layer = cls.from_linear(torch.nn.Linear(576, 70, bias=False), kernel="avx2")
    ext = native.module()
    zeros = layer.zeros if cls is Int4Linear else None
    with native.integer_kernel_set("auto"):
        projection = ext.Projection(1 if cls is Int4Linear else 2, layer.qweight, layer.scales, zeros)
        assert projection.tiled()
        for rows in (1, 3, 12):
            x = torch.randn(rows, 576)
            assert torch.equal(projection.product(x), product(layer, x)), rows
        with torch.no_grad():
            layer.scales.mul_(2.0)
            if zeros is not None:
                zeros.add_(0.5)
        assert torch.equal(projection.product(x), product(layer, x))
    with native.integer_kernel_set("avx2"):
        assert torch.equal(projection.product(x), product(layer, x))
        assert not projection.tiled()
