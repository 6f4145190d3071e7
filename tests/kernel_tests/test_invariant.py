"""The batch-invariant kernels (llmkit.kernels.invariant): each equals torch's op, a row's bits do not depend on the
rows beside it, and the dispatch mode sends a model's products and norms to them. Without a GPU they run in
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit.errors import InputError
from llmkit.kernels import triton_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton is not installed")
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.mark.parametrize(("M", "K", "N"), [(1, 40, 24), (5, 130, 70), (70, 64, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_products_equal_torchs(M, K, N, dtype):
    from llmkit.kernels.invariant import bmm, mm

    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = torch.randn(N, K, device=DEVICE).to(dtype)
    got = mm(x, w.t())  # the weight read transposed, in place
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), **TOL[dtype])
    a, b = torch.randn(3, M, K, device=DEVICE).to(dtype), torch.randn(3, K, N, device=DEVICE).to(dtype)
    torch.testing.assert_close(bmm(a, b).float(), a.float() @ b.float(), **TOL[dtype])


def test_a_rows_product_has_the_same_bits_whatever_the_rows_beside_it():
    """Rows 0..m-1 of a product alone, among 70 rows, and among other values: the same bits (one tile shape, K in
    order). torch's own product need not give this."""
    from llmkit.kernels.invariant import mm

    x, w = torch.randn(70, 200, device=DEVICE), torch.randn(130, 200, device=DEVICE)
    full = mm(x, w.t())
    other = mm(torch.cat([x[:3], torch.randn(67, 200, device=DEVICE)]), w.t())
    for m in (1, 3, 65):
        assert torch.equal(mm(x[:m], w.t()), full[:m])
    assert torch.equal(other[:3], full[:3])


@pytest.mark.parametrize("C", [7, 64, 1500])  # below, at and past a reduction step's width (1024)
def test_row_reductions_equal_torchs(C):
    from llmkit.kernels.invariant import layer_norm, row_sum

    x = torch.randn(2, 5, C, device=DEVICE)
    torch.testing.assert_close(row_sum(x), x.sum(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(row_sum(x, mean=True), x.mean(-1), atol=1e-5, rtol=1e-5)
    w, b = torch.randn(C, device=DEVICE), torch.randn(C, device=DEVICE)
    for weight, bias in [(w, b), (w, None), (None, None)]:
        out, mean, rstd = layer_norm(x, weight, bias, 1e-5)
        torch.testing.assert_close(out, F.layer_norm(x, (C,), weight, bias, 1e-5), atol=1e-5, rtol=1e-5)
        assert mean.shape == rstd.shape == (2, 5, 1)
    assert torch.equal(row_sum(x[:1]), row_sum(x)[:1])


def test_the_mode_sends_a_models_products_and_norms_to_the_kernels():
    """Under BatchInvariant: linear (3-d, with a bias), einsum (its tensors come in a list), a last-dim mean and a
    LayerNorm give the kernels' bits; a mean over another dim, and tensors on another device, are torch's; an op
    without an invariant kernel is refused."""
    from llmkit.kernels import invariant

    x, w, b = torch.randn(2, 9, 48, device=DEVICE), torch.randn(40, 48, device=DEVICE), torch.randn(40, device=DEVICE)
    h = torch.randn(3, 9, 16, device=DEVICE)
    with torch.inference_mode(), invariant.BatchInvariant(DEVICE.type):
        linear = F.linear(x, w, b)
        einsum = torch.einsum("htd,hde->hte", h, h.transpose(1, 2))
        mean = x.pow(2).mean(-1, keepdim=True)
        across = x.mean(1)
        norm = F.layer_norm(x, (48,), w[0, :48].clone(), None)
    assert torch.equal(linear, invariant.mm(x.view(18, 48), w.t()).view(2, 9, 40) + b)
    assert torch.equal(einsum, invariant.bmm(h, h.transpose(1, 2)))
    assert torch.equal(mean, invariant.row_sum(x.pow(2), mean=True)[..., None])
    assert torch.equal(across, x.mean(1))
    assert torch.equal(norm, invariant.layer_norm(x, w[0, :48], None, 1e-5)[0])
    with invariant.BatchInvariant("meta"):  # nothing here is on that device
        assert torch.equal(F.linear(x, w), x @ w.t())
    with invariant.BatchInvariant(DEVICE.type), pytest.raises(InputError, match="no batch-invariant kernel"):
        torch.zeros(4, device=DEVICE).index_add_(0, torch.tensor([0, 1], device=DEVICE), torch.ones(2, device=DEVICE))
