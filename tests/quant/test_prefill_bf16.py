"""Many-row quantized products on the CPU's bf16 units (llmkit.quant.native.set_prefill_dtype)."""

from __future__ import annotations

import pytest
import torch

from llmkit.errors import InputError
from llmkit.quant import Int4Linear, Int8Linear, native

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
    with native.prefill_dtype("bf16"):
        out, few_bf16 = layer(x), layer(few)
    with native.prefill_dtype("fp32"):
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
    with native.prefill_dtype("bf16"):
        out = layer(torch.eye(96))  # row k: column k of W
    assert torch.equal(out.t(), layer.dequantize().bfloat16().float())


def test_the_prefill_dtype_setting(monkeypatch):
    with pytest.raises(InputError, match="not one of auto, int8, bf16, fp32"):
        native.set_prefill_dtype("fp16")
    with native.prefill_dtype("auto"):
        assert native.prefill_bf16() == native.cpu_bf16_native()
    with native.prefill_dtype("fp32"):
        assert native.integer_rows() == native.INTEGER_ROWS and not native.prefill_bf16()
    with native.prefill_dtype("bf16"):
        assert native.integer_rows() == native.BF16_ROWS - 1 and native.prefill_bf16()
    monkeypatch.setattr(native, "_prefill", "half")  # as LLMKIT_PREFILL_DTYPE=half sets it
    native.prefill_bf16.cache_clear()
    with pytest.raises(InputError, match="LLMKIT_PREFILL_DTYPE='half'"):
        native.prefill_bf16()
    with pytest.raises(InputError, match="LLMKIT_PREFILL_DTYPE='half'"):
        native.prefill_integer()
    native.prefill_bf16.cache_clear()
