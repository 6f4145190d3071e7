"""What this machine's CPU can do for llmkit's kernels, detected once per process into a value (`cpu_features()`)
that the kernel choices read (llmkit.quant.native.KernelChoice), instead of each asking /proc/cpuinfo on its own.

Tests and benchmarks build a CpuFeatures of their own (`CpuFeatures(frozenset({"avx2", ...}))`) to see what a
choice would be on another machine kind: the three this project runs on are an AVX2-only EPYC, a Zen 5 EPYC
(AVX-512 with VNNI and BF16) and a Xeon with AMX.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})  # the subsets llmkit's AVX-512 kernels use


@dataclass(frozen=True)
class CpuFeatures:
    """A CPU's instruction-set flags (as /proc/cpuinfo names them) and whether oneDNN multiplies bf16 on it."""

    flags: frozenset[str] = frozenset()
    bf16_native: bool = False  # oneDNN's bf16 matmuls run on AVX512-BF16 or AMX units, not emulated

    @functools.cached_property
    def avx2(self) -> bool:
        """AVX2 with FMA and F16C (every CPU with AVX2 has them): what llmkit's C++ kernels need at the least."""
        return {"avx2", "fma", "f16c"} <= self.flags

    @functools.cached_property
    def avx512_vnni(self) -> bool:
        """AVX-512 with VNNI's integer dot products (vpdpbusd): the wide integer kernels (cpu_vnni.cpp)."""
        return AVX512 | {"avx512_vnni"} <= self.flags

    @functools.cached_property
    def avx512_bf16(self) -> bool:
        """AVX-512 with the BF16 dot products (vdpbf16ps): the prompt attention kernel (cpu_attention.cpp)."""
        return AVX512 | {"avx512_bf16"} <= self.flags

    @functools.cached_property
    def amx(self) -> bool:
        """AMX's bf16 tiles (a Xeon's), on which oneDNN multiplies bf16 matrices."""
        return "amx_bf16" in self.flags

    @functools.cached_property
    def avx512(self) -> bool:
        """AVX-512 (F, BW, VL, DQ), which the AVX-512 kernels need beside the extension each names."""
        return self.flags >= AVX512

    def describe(self) -> str:
        """The features that choose kernels, for a log line: "AVX2, AVX512-VNNI, AVX512-BF16, AMX"."""
        named = [
            ("AVX2", self.avx2),
            ("AVX-512", self.avx512),
            ("AVX512-VNNI", self.avx512_vnni),
            ("AVX512-BF16", self.avx512_bf16),
            ("AMX", self.amx),
        ]
        return ", ".join(name for name, has in named if has) or "no vector extensions llmkit uses"


def read_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in a /proc/cpuinfo text (none where it has no flags line)."""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's CpuFeatures, read once (no flags where /proc/cpuinfo cannot be read: not Linux x86)."""
    try:
        flags = read_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    return CpuFeatures(flags, bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
