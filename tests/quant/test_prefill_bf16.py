"""Many-row quantized products on the CPU's bf16 units (llmkit.quant.native.KernelChoice)."""

from __future__ import annotations

import pytest
import torch

from llmkit.errors import InputError
from llmkit.machine.cpu import CpuFeatures
from llmkit.quant import Int4Linear, Int8Linear, KernelChoice, kernel_choice_set, native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llmkit's AVX2 kernels")


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize(("rows", "width", "outputs"), [(32, 256, 96), (100, 64, (1 << 16) + 40)])
def test_many_rows_multiply_in_bf16_within_its_rounding(cls, rows, width, outputs):
    """From BF16_ROWS rows on (the second case: two panels of weights), x and W are rounded to bf16 and so is the
    result: each output is within 3 bf16 roundings of sum |x||w|; below it the integer products run, whatever the
    setting."""
    torch.manual_seed(0)
    layer = cls.from_linear(torch.nn.Linear(width, outputs, bias=False), kernel="avx2")
    x = torch.randn(rows, width)
    w = layer.dequantize()
    few = x[: native.BF16_ROWS - 1]
    with kernel_choice_set(layer, KernelChoice("bf16")):
        out, few_bf16 = layer(x), layer(few)
    with kernel_choice_set(layer, KernelChoice("fp32")):
        few_fp32 = layer(few)
    assert torch.equal(out, out.bfloat16().float())  # rounded to bf16: the bf16 product ran
    error = (out.double() - x.double() @ w.double().t()).abs()
    assert (error <= (x.abs() @ w.abs().t()).double() * 3 * 2**-9 + 1e-6).all()
    assert error.max() > 1e-3  # and it is not the fp32 product
    assert torch.equal(few_bf16, few_fp32)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_the_bf16_panels_are_the_weights_rounded_to_bf16(cls):
    """Multiplying the identity reads the dequantized panel back: the weights rounded to bf16, to nearest even."""
    torch.manual_seed(0)
    layer = cls.from_linear(torch.nn.Linear(96, 48, bias=False), kernel="avx2")
    with kernel_choice_set(layer, KernelChoice("bf16")):
        out = layer(torch.eye(96))  # row k: column k of W
    assert torch.equal(out.t(), layer.dequantize().bfloat16().float())


def test_the_kernel_choice(monkeypatch):
    """What each prefill dtype means on each of the machine kinds (CpuFeatures built, not read), and the process's
    default from LLMKIT_PREFILL_DTYPE, whose error names the variable."""
    with pytest.raises(InputError, match="not one of auto, int8, bf16, fp32"):
        KernelChoice("fp16")
    vnni = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})
    avx2, zen5, xeon = CpuFeatures(frozenset({"avx2"})), CpuFeatures(vnni, True), CpuFeatures(vnni | {"amx_bf16"}, True)
    assert not KernelChoice("auto", avx2).bf16_panels and KernelChoice("auto", avx2).integer_rows == native.INTEGER_ROWS
    assert KernelChoice("auto", zen5).integer_panels and KernelChoice("auto", zen5).bf16_panels
    assert not KernelChoice("auto", xeon).integer_panels and KernelChoice("auto", xeon).bf16_panels
    assert KernelChoice("int8", xeon).integer_panels
    fp32, bf16 = KernelChoice("fp32", zen5), KernelChoice("bf16", avx2)
    assert fp32.integer_rows == native.INTEGER_ROWS and not fp32.bf16_panels and not fp32.integer_panels
    assert bf16.integer_rows == native.BF16_ROWS - 1 and bf16.bf16_panels
    assert KernelChoice().cpu == native.default_choice().cpu
    monkeypatch.setenv("LLMKIT_PREFILL_DTYPE", "half")
    native.default_choice.cache_clear()
    try:
        with pytest.raises(InputError, match="LLMKIT_PREFILL_DTYPE='half'"):
            native.default_choice()
        monkeypatch.setenv("LLMKIT_PREFILL_DTYPE", "fp32")
        assert native.default_choice() == KernelChoice("fp32")
    finally:
        native.default_choice.cache_clear()


def test_a_kernel_choice_set_for_a_block_gives_each_layer_its_own_back():
    a = Int8Linear.from_linear(torch.nn.Linear(64, 32, bias=False))
    b = Int4Linear.from_linear(torch.nn.Linear(64, 32, bias=False))
    a.kernel_choice, b.kernel_choice = KernelChoice("fp32"), KernelChoice("bf16")
    model = torch.nn.Sequential(a, b)
    with kernel_choice_set(model, KernelChoice("int8")):
        assert a.kernel_choice == b.kernel_choice == KernelChoice("int8")
    assert (a.kernel_choice.prefill, b.kernel_choice.prefill) == ("fp32", "bf16")
