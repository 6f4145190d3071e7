"""The paged-attention kernel compiles for an H100 (sm_90) on every push, without a GPU (tests/kernel_tests/
sm90_compile.py: Triton's compiler and its wheel's ptxas): the quantized pools' variants (--kv-dtype fp8 and int8)
as decoding steps and prompt chunks launch them, each within an H100's 227 KiB of shared memory per program, fp8
codes widened by the hardware's e4m3 conversions. The interpreter checks what the kernel computes; this checks that
the GPU's compiler takes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")
SCRIPT = Path(__file__).with_name("sm90_compile.py")
H100_SHARED = 227 * 1024


@pytest.mark.slow
def test_quantized_pools_compile_for_sm90() -> None:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton wheel brings no ptxas")
    pairs = ["bf16:fp8e4nv", "fp16:fp8e4nv", "bf16:i8", "fp32:i8"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), *pairs], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2 * len(pairs)
    for row in rows:
        assert 0 < row["shared"] <= H100_SHARED, row
        assert (row["fp8_cvt"] > 0) == (row["pool"] == "fp8e4nv"), row
