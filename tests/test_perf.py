"""The machine measurements that MFU and bandwidth fractions are reported against."""

from __future__ import annotations

import time

import torch

from llmkit.perf import matmul_flops, memory_bandwidth


def test_measurements_are_positive_and_bounded_in_time_whatever_the_dtype():
    # bf16 on a CPU without bf16 instructions runs at ~1 GFLOP/s: a 2048^3 product would take seconds, and a bf16
    # training run spent 6 minutes measuring its peak before the product's size was fitted to the time asked for
    for dtype in (torch.float32, torch.bfloat16):
        start = time.perf_counter()
        assert matmul_flops(dtype, seconds=0.1) > 0
        assert time.perf_counter() - start < 3.0
    assert memory_bandwidth(mib=64, seconds=0.05) > 0
