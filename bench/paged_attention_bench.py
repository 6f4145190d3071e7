"""Decoding attention over a paged cache, three ways, at Llama-3.1-8B's attention shape (32 query heads, 8 kv heads,
head dim 128) in bf16, same keys, same rows, one run:

- llmkit's Triton kernel (llmkit.kernels.paged_attention), reading each row's blocks in place, at the engine's
  block size (16) and at 128;
- FlexAttention's paged form (torch.nn.attention.flex_attention, compiled, with a block mask mapped to physical
  pages by torch.nn.attention.experimental PagedAttention; its pages must be as long as the mask's blocks, 128): the
  attention call, and apart the block mask each step needs when the rows' lengths change;
- gather + SDPA: each row's blocks copied into a contiguous tensor, then scaled_dot_product_attention with a length
  mask (what llmkit's PyTorch runner does).

    python3 bench/paged_attention_bench.py [--batches 1,64] [--contexts 4096] [--json]
    python3 bench/paged_attention_bench.py --device cpu --batches 2 --contexts 256 --heads 4 --kv-heads 2 --dim 32

Each output is checked against llmkit's reference; times are medians of --iters calls after a warm-up, and the
bandwidth column is the keys and values the rows hold over that time.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def timed(fn: Callable[[], Any], iters: int, device: str) -> float:
    """Median seconds of fn() over `iters` calls after two warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def case(B: int, L: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from llmkit.kernels.paged_attention import PagedRows, chunks_for, paged_attention, paged_attention_reference

    dev, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    H, K, D = args.heads, args.kv_heads, args.dim
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths = [L - (7 * b) % 64 for b in range(B)]  # rows of nearly the context's length
    q = torch.randn(B, H, D, generator=gen).to(dev, dtype)
    scale = D**-0.5
    out: dict[str, Any] = {"batch": B, "context": L}
    kv_bytes = sum(lengths) * K * D * 2 * torch.empty((), dtype=dtype).element_size()

    # one pool of 128-slot pages, every row's pages shuffled through it; the same keys seen as 16-slot blocks
    pages = -(-L // 128)
    perm = torch.randperm(B * pages, generator=gen)
    k128 = torch.randn(K, B * pages, 128, D, generator=gen).to(dev, dtype)
    v128 = torch.randn(K, B * pages, 128, D, generator=gen).to(dev, dtype)
    table128 = perm.view(B, pages)
    reference = None
    for bs in (16, 128):
        per = 128 // bs
        k, v = k128.view(K, B * pages * per, bs, D), v128.view(K, B * pages * per, bs, D)
        table = (table128[:, :, None] * per + torch.arange(per)).reshape(B, pages * per)
        rows = PagedRows.of(table, [n - 1 for n in lengths], [1] * B, torch.device(dev))
        chunks = chunks_for(B, K, L)
        if reference is None:
            reference = paged_attention_reference(q, k, v, rows, scale).float()
        got = paged_attention(q, k, v, rows, scale, chunks=chunks)
        out[f"llmkit_bs{bs}_err"] = (got.float() - reference).abs().max().item()
        call = functools.partial(paged_attention, q, k, v, rows, scale, chunks=chunks)
        out[f"llmkit_bs{bs}_us"] = 1e6 * timed(call, args.iters, dev)
        out[f"llmkit_bs{bs}_gbs"] = kv_bytes / out[f"llmkit_bs{bs}_us"] / 1e3

    # FlexAttention's paged form: the cache as (1, K, pages x 128, D), a logical mask mapped to the pages
    paged = PagedAttention(B * pages, 128, B, device=dev)
    on = table128.to(dev)
    paged.page_table[:, :pages] = on
    paged.physical_to_logical[torch.arange(B, device=dev)[:, None], on] = torch.arange(pages, device=dev)
    paged.capacity[:] = pages * 128
    k_flat = k128.reshape(1, K, B * pages * 128, D)
    v_flat = v128.reshape(1, K, B * pages * 128, D)
    lens = torch.tensor(lengths, device=dev)

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lens[b]

    def mask() -> Any:
        logical = create_block_mask(visible, B, None, 1, pages * 128, device=dev, BLOCK_SIZE=(128, 128))
        return paged.convert_logical_block_mask(logical)

    block_mask = mask()
    flex = torch.compile(flex_attention, dynamic=False) if dev == "cuda" else flex_attention
    q4 = q[:, :, None]  # (B, H, 1, D)
    got = flex(q4, k_flat, v_flat, block_mask=block_mask, scale=scale, enable_gqa=True)[:, :, 0]
    out["flex_err"] = (got.float() - reference).abs().max().item()
    flex_call = lambda: flex(q4, k_flat, v_flat, block_mask=block_mask, scale=scale, enable_gqa=True)  # noqa: E731
    out["flex_us"] = 1e6 * timed(flex_call, args.iters, dev)
    out["flex_gbs"] = kv_bytes / out["flex_us"] / 1e3
    out["flex_mask_us"] = 1e6 * timed(mask, max(3, args.iters // 4), dev)

    # gather + SDPA with a length mask
    def gather() -> torch.Tensor:
        keys = k128.index_select(1, on.reshape(-1)).view(K, B, pages * 128, D).transpose(0, 1)
        values = v128.index_select(1, on.reshape(-1)).view(K, B, pages * 128, D).transpose(0, 1)
        allowed = torch.arange(pages * 128, device=dev)[None] < lens[:, None]  # (B, S)
        return F.scaled_dot_product_attention(
            q4, keys, values, attn_mask=allowed[:, None, None], scale=scale, enable_gqa=True
        )[:, :, 0]

    out["gather_err"] = (gather().float() - reference).abs().max().item()
    out["gather_us"] = 1e6 * timed(gather, args.iters, dev)
    out["gather_gbs"] = kv_bytes / out["gather_us"] / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(json.dumps({"card": card, "torch": torch.__version__}) if args.json else f"{card}, torch {torch.__version__}")
    for L in (int(x) for x in args.contexts.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            row = case(B, L, args)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
