"""Run by tests/parallel/test_sharded_loading.py under torchrun (gloo, 127.0.0.1): each checkpoint of argv[2:] loaded
whole, and loaded split across the processes reading only this rank's parts; the bytes each load reads from the
files are counted where they are read. Rank 0 writes the results (JSON) to argv[1]."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import gguf.quants
import torch
import torch.nn.functional as F
from on_ranks import run

import llmkit.interop.gguf
from llmkit.generate import generate
from llmkit.interop.load import load_model
from llmkit.interop.safetensors_io import LazyTensors
from llmkit.parallel import resident_bytes, split_loader

READ = [0]  # bytes handed out by the readers of safetensors and GGUF files


def counted(f: Callable[..., Any], size: Callable[[Any, tuple, dict], int]) -> Callable[..., Any]:
    def reading(*args: Any, **kwargs: Any) -> Any:
        out = f(*args, **kwargs)
        READ[0] += size(out, args, kwargs)
        return out

    return reading


LazyTensors.__getitem__ = counted(LazyTensors.__getitem__, lambda t, a, k: t.nbytes)  # type: ignore[method-assign]
LazyTensors.part = counted(LazyTensors.part, lambda t, a, k: t.nbytes)  # type: ignore[method-assign]
gguf.quants.dequantize = counted(gguf.quants.dequantize, lambda t, a, k: a[0].nbytes)
# blocks: read with pread (parts, llama's reordered q and k rows), or views of the memory map (read as they are used)
llmkit.interop.gguf.read_blocks = counted(llmkit.interop.gguf.read_blocks, lambda t, a, k: t.nbytes)
llmkit.interop.gguf.mapped = counted(llmkit.interop.gguf.mapped, lambda t, a, k: t.nbytes)


def load(path: str, split: bool) -> tuple[torch.nn.Module, int]:
    READ[0] = 0
    model = load_model(path, split=split_loader() if split else None).model.eval()
    return model, READ[0]


def case(path: str) -> dict:
    whole, whole_read = load(path, split=False)
    part, part_read = load(path, split=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, whole.cfg.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        ref, out = whole(tokens), part(tokens)
    prompts = [tokens[0, :7].tolist(), tokens[1].tolist()]
    greedy = generate(part, prompts, max_new_tokens=10).new_tokens
    return {
        **summed_gradients(whole, part, tokens),
        "path": path,
        "max_diff": (out - ref).abs().max().item(),
        "scale": ref.abs().max().item(),
        "greedy_equal": greedy == generate(whole, prompts, max_new_tokens=10).new_tokens,
        "bytes_fraction": resident_bytes(part) / resident_bytes(whole),
        "read_fraction": part_read / whole_read,
        "split": getattr(part, "tensor_parallel", None) is not None,
    }


def summed_gradients(whole: torch.nn.Module, part: torch.nn.Module, tokens: torch.Tensor) -> dict:
    """The gradients of the parameters the split model holds whole (norms), against the whole model's: the summing
    hooks must follow the parameters the loader assigned. Float models only."""
    if not any(p.is_floating_point() and p.requires_grad for p in part.parameters()) or any(
        not t.is_floating_point() for t in part.buffers() if t.dim() == 2
    ):
        return {"grad_diff": None}
    grads = []
    for model in (whole, part):
        logits = model(tokens)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    ref, got = grads
    shapes = {n: g.shape for n, g in ref.items()}
    diffs = [((g - ref[n]).abs().max() / ref[n].abs().max().clamp(min=1e-12)).item()
             for n, g in got.items() if n.endswith("norm.weight") and g.shape == shapes.get(n)]  # fmt: skip
    return {"grad_diff": max(diffs), "whole_grads": len(diffs)}


def main() -> None:
    run(lambda: [case(path) for path in sys.argv[2:]])


if __name__ == "__main__":
    main()
