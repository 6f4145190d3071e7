"""The lightning indexer's scores over a paged pool (llmkit.kernels.index_scores): the Triton kernel (interpreted
without a GPU) against the reference, and the reference against the indexer's own formula."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llmkit.kernels import triton_usable
from llmkit.kernels.index_scores import index_scores, index_scores_reference
from llmkit.kernels.paged_rows import PagedRows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton is not installed")


def _case(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedRows]:
    keys = torch.randn(40, 4, 16, device=DEVICE, dtype=dtype)
    table = torch.randperm(40)[:30].view(3, 10)  # scattered blocks
    rows = PagedRows.of(table, [5, 0, 20], [1, 13, 4], DEVICE)  # a decoding row, a prompt chunk, a later chunk
    q = torch.randn(18, 4, 16, device=DEVICE, dtype=dtype)
    w = torch.randn(18, 4, device=DEVICE)
    return q, w, keys, rows


@pytest.mark.parametrize("first_key", [0, 1])  # 1: an MTP module's pool, whose position j is in slot j + 1
@pytest.mark.parametrize("programs", [1, 100])  # every key tile in one program, or dealt out among several
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_equals_the_reference(programs, dtype, first_key):
    q, w, keys, rows = _case(dtype)
    rows = dataclasses.replace(rows, first_key=first_key)
    got = index_scores(q, w, keys, rows, 0.25, programs=programs)
    want = index_scores_reference(q, w, keys, rows, 0.25)
    assert got.shape == (18, 24) and torch.equal(got.isinf(), want.isinf())  # -inf exactly where unseen
    seen = want.isfinite()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got[seen], want[seen], **tol)


def test_the_reference_is_the_indexers_formula():
    """I(t, s) = sum_j w(t, j) ReLU(q(t, j) . k(s)) * scale for the prompt chunk's queries, over its own keys."""
    q, w, keys, rows = _case()
    got = index_scores_reference(q, w, keys, rows, 0.25)[1:14, :13]  # the second row: 13 queries from position 0
    k = keys[rows.table[1, torch.arange(13) // 4].long(), torch.arange(13) % 4]  # (13, Di)
    want = torch.einsum("tjs,tj->ts", F.relu(torch.einsum("tjd,sd->tjs", q[1:14], k)) * 0.25, w[1:14])
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    torch.testing.assert_close(got[causal], want[causal])
    assert got[~causal].eq(float("-inf")).all()
