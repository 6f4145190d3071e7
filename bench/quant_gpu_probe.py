"""Decoding speed of quantized weights on a GPU (no llama.cpp or GGUF file there): SmolLM2-135M's shape with random
weights, bf16 against int8 and int4 (torch's CUDA weight-only kernels), eager `generate`, greedy, batch 1 and 8.

    python bench/quant_gpu_probe.py [--new 128] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from engine_bench import smollm2_random

from llmkit.generate import generate
from llmkit.quant import describe, quantize, weight_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    base = smollm2_random().to(args.device, torch.bfloat16).eval()
    models = {"bf16": base}
    for method in ("int8", "int4"):
        models[method] = quantize(copy.deepcopy(base), method, include_head=True).to(torch.bfloat16)
    print(f"{'weights':<6} {'batch':>5} {'tok/s':>8}  weight bytes")
    for name, model in models.items():
        for batch in (1, 8):
            prompt = torch.randint(0, 49152, (batch, 32), device=args.device)
            generate(model, prompt, max_new_tokens=8)
            torch.cuda.synchronize()
            start = time.perf_counter()
            generate(model, prompt, max_new_tokens=args.new)
            torch.cuda.synchronize()
            rate = batch * args.new / (time.perf_counter() - start)
            print(f"{name:<6} {batch:>5} {rate:>8.1f}  {weight_bytes(model) / 1e6:.0f} MB: {describe(model)}")


if __name__ == "__main__":
    main()
