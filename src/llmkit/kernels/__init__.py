"""llmkit's GPU kernels, in Triton, each beside the PyTorch computation it must equal: paged_attention (attention
that reads a paged KV cache in place, over every key or each query's selected ones), index_scores (sparse
attention's indexer scores over a paged pool), weight_matmul (products with int4 and int8 weights at any width) and
invariant (products and norms whose rows' bits do not depend on the batch). Triton is imported only where a kernel
runs; its interpreter runs the same kernels on CPU tensors (TRITON_INTERPRET=1), which is how CI checks them."""

from __future__ import annotations

import os

import torch


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernel can run on `device`: a CUDA device with Triton installed, or CPU tensors under
    Triton's interpreter (TRITON_INTERPRET=1, which the tests use)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
