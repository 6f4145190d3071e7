"""The machine measurements that MFU and bandwidth fractions are reported against."""

from __future__ import annotations

import torch

from llmkit.perf import fitted_size, matmul_flops, memory_bandwidth


def test_measurements_are_positive_whatever_the_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        assert matmul_flops(dtype, seconds=0.1) > 0
    assert memory_bandwidth(mib=64, seconds=0.05) > 0


def test_the_product_is_sized_to_the_time_asked_for():
    """bf16 on a CPU without bf16 instructions runs at ~1 GFLOP/s: a 2048^3 product would take 17 s, and a bf16
    training run spent 6 minutes measuring its peak before the product's size was fitted to the time asked for.
    Whatever the rate, one product of the fitted size takes at most a quarter of the time (down to the 256 floor)."""
    for rate in (1e9, 3.4e11, 2.2e12, 1e15):
        for seconds in (0.1, 0.5):
            m = fitted_size(rate, seconds, 2048)
            assert 256 <= m <= 2048 and m % 64 == 0
            assert 2 * m**3 / rate <= seconds / 4 or m == 256
            assert m == 2048 or 2 * (m + 64) ** 3 / rate > seconds / 4  # and it is the largest such size
    assert fitted_size(1e9, 0.1, 2048) == 256  # 1 GFLOP/s: the floor, 34 ms a product
