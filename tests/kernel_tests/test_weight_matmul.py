"""The int4, int8 and fp8 products for the GPU (llmkit.kernels.weight_matmul) against the dequantized weight, at widths
torch's int4 kernel refuses (not multiples of 128), with grouped int8 scales (which torch's int8 kernel refuses) and
at ragged row counts; in Triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from llmkit.kernels import triton_usable
from llmkit.quant.formats import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton is not installed")


@pytest.mark.parametrize(
    ("M", "K", "N", "group"), [(1, 96, 40, 32), (5, 160, 70, 32), (17, 192, 64, 64), (3, 224, 33, 32)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_product_equals_the_dequantized_weights(M, K, N, group, dtype):
    from llmkit.kernels.weight_matmul import int4_matmul

    codes, scales, zeros = quantize_int4(torch.randn(N, K), group)
    x = torch.randn(M, K).to(DEVICE, dtype)
    codes, scales, zeros = codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)
    got = int4_matmul(x, codes, scales, zeros)
    want = x.float() @ dequantize_int4(codes, scales, zeros).T
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.float(), want, **tol)


def test_fp8_codes_decode_to_their_e4m3_numbers_exactly():
    """Every byte but E4M3's two NaNs (0x7f, 0xff), decoded by the kernel's integer arithmetic: one-hot rows of x
    read the weights back exactly as float8_e4m3fn's own cast gives them (normal, subnormal, zero, -0)."""
    from llmkit.kernels.weight_matmul import fp8_matmul

    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes == 0x7F] = 0
    codes[codes == 0xFF] = 0
    codes = torch.stack([codes, codes.flip(0)]).to(DEVICE)  # (2, 256)
    scales = torch.tensor([[1.0], [0.5]], device=DEVICE)
    got = fp8_matmul(torch.eye(256, device=DEVICE), codes, scales)  # (256, 2): w^T
    assert torch.equal(got.T, dequantize_fp8(codes, scales))


@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.parametrize(("M", "K", "N", "group"), [(1, 96, 40, 32), (5, 160, 70, None), (17, 576, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_byte_code_products_equal_the_dequantized_weights(M, K, N, group, dtype, codes):
    """int8 and fp8: a byte a weight, a scale per row (group None) or per group."""
    from llmkit.kernels.weight_matmul import fp8_matmul, int8_matmul

    quantize, dequantize, product = {
        "int8": (quantize_int8, dequantize_int8, int8_matmul),
        "fp8": (quantize_fp8, dequantize_fp8, fp8_matmul),
    }[codes]
    q, scales = quantize(torch.randn(N, K), group)
    x = torch.randn(M, K).to(DEVICE, dtype)
    q, scales = q.to(DEVICE), scales.to(DEVICE)
    got = product(x, q, scales)
    want = x.float() @ dequantize(q, scales).T
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.float(), want, **tol)
