"""The quantized matrix products alone: llmkit's int4 and int8 kernels (AVX2, or AVX512-VNNI where the CPU has it; the
process's default KernelChoice for many rows) against fp32 `F.linear`, on SmolLM2's layer shapes, 1 to 64 rows of x,
with the error against the exact product on the same quantized weights.

    .venv/bin/python bench/quant_kernel_bench.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from llmkit.quant import native
from llmkit.quant.formats import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8


def seconds(fn: Callable[[], object], n: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    if not native.available():
        raise SystemExit("llmkit's C++ kernels are not available on this machine")
    choice = native.default_choice()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {choice.cpu.describe()}; times per call")
    print("error: max |y - exact| / max |exact|")
    print(
        f"{'N x K':<12} {'rows':>4} {'fp32 us':>8} {'int4 us':>8} {'x fp32':>7} {'int8 us':>8} {'x fp32':>7} "
        f"{'int4 Gw/s':>9} {'int4 err':>9} {'int8 err':>9}"
    )
    for N, K in [(1536, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(N, K) / K**0.5
        p4, s4, z4 = quantize_int4(w, 32)
        q8, s8 = quantize_int8(w)
        exact4, exact8 = dequantize_int4(p4, s4, z4), dequantize_int8(q8, s8)
        for M in (1, 4, 16, 64):
            x = torch.randn(M, K)
            y4, y8 = native.int4_linear(x, p4, s4, z4, choice), native.int8_linear(x, q8, s8, choice)
            r4, r8 = x @ exact4.T, x @ exact8.T
            e4 = float((y4 - r4).abs().max() / r4.abs().max())
            e8 = float((y8 - r8).abs().max() / r8.abs().max())
            t32 = seconds(partial(F.linear, x, w))
            t4 = seconds(partial(native.int4_linear, x, p4, s4, z4, choice))
            t8 = seconds(partial(native.int8_linear, x, q8, s8, choice))
            print(
                f"{f'{N}x{K}':<12} {M:>4} {t32 * 1e6:>8.0f} {t4 * 1e6:>8.0f} {t32 / t4:>6.2f}x {t8 * 1e6:>8.0f} "
                f"{t32 / t8:>6.2f}x {N * K / t4 / 1e9:>9.1f} {e4:>9.1e} {e8:>9.1e}"
            )


if __name__ == "__main__":
    main()
