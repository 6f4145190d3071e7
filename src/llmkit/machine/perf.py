"""Measuring a machine's limits, so that throughput can be reported as a fraction of them (MFU, bandwidth), and the
allocator setting that training uses."""

from __future__ import annotations

import time

import torch


def matmul_flops(
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", n: int = 2048, seconds: float = 0.5
) -> float:
    """Sustained FLOP/s of an n x n matmul in `dtype` on `device` (2 n^3 FLOPs per product). Where the dtype is slow
    (bf16 on a CPU without bf16 instructions: a 2048^3 product can take 10 s), n shrinks so that one product takes
    at most a quarter of `seconds`, measured on a 256 x 256 one first."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)  # not the global RNG: measuring must not change a run
    if n > 256:
        probe = torch.randn(256, 256, device=dev, generator=g).to(dtype)
        probe @ probe  # warm up
        start = time.perf_counter()
        probe @ probe
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        n = fitted_size(2 * 256**3 / max(time.perf_counter() - start, 1e-9), seconds, n)
    a = torch.randn(n, n, device=dev, generator=g).to(dtype)
    b = torch.randn(n, n, device=dev, generator=g).to(dtype)
    a @ b  # warm up
    count, start = 0, time.perf_counter()
    while True:
        a @ b
        count += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * n**3 * count / elapsed


def fitted_size(rate: float, seconds: float, n: int) -> int:
    """The matrix size (a multiple of 64, from 256 to n) whose product, at `rate` FLOP/s, takes at most a quarter of
    `seconds`: 2 m^3 / rate <= seconds / 4."""
    fits = int((rate * seconds / 4 / 2) ** (1 / 3)) // 64 * 64
    return max(256, min(n, fits))


def memory_bandwidth(device: torch.device | str = "cpu", mib: int = 512, seconds: float = 0.5) -> float:
    """Sustained read bandwidth in bytes/s: summing a `mib` MiB fp32 tensor."""
    dev = torch.device(device)
    x = torch.ones(mib * 1024 * 1024 // 4, device=dev)
    x.sum()
    count, start = 0, time.perf_counter()
    while True:
        x.sum()
        count += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return x.numel() * 4 * count / elapsed


_TUNED = False


def tune_allocator() -> bool:
    """Keep freed memory in the process heap instead of returning it to the operating system (glibc only).

    A training step allocates and frees the same large buffers every time (logits, gradients, weight casts under
    autocast), and so does a serving step (activations, gathered keys). By default glibc serves large allocations
    (from 128 KiB, a threshold it raises up to 32 MiB as it sees them freed) with fresh mmap'd pages and unmaps them
    when freed, so every step pays page faults on all of them (BENCHMARKS.md shows what that costs a bf16 training
    step; llmkit.serve.server what it cost the server).
    Disabling mmap'd chunks and heap trimming lets the buffers be reused. The cost: the process does not give memory
    back before it exits. Returns whether the setting was applied."""
    global _TUNED
    if _TUNED:
        return True
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    # mallopt takes a C int: the largest trim threshold is 2**31 - 1 (1 << 40 once passed here became 0, which trimmed
    # the heap's top at every free and faulted it back in at the next allocation)
    _TUNED = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1)))
    return _TUNED
