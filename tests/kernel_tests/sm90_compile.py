"""Compile llmkit's paged-attention kernel for an H100 (sm_90) on a machine without a GPU: Triton's compiler and the
ptxas its wheel brings, no driver. Run as a script (Triton must not be in interpreter mode, which the test process
is); prints one JSON line per variant: its shared memory and how many fp8 conversions the PTX holds.

    python tests/kernel_tests/sm90_compile.py [bf16:fp8e4nv ...]     # QUERIES:POOL pairs; default: POOLS
"""

from __future__ import annotations

import inspect
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmkit.kernels import triton_paged

TARGET = GPUTarget("cuda", 90, 32)
# Llama-3.1-8B's attention: head dim 128, 4 query heads a kv head; (queries' dtype, the pool's) pairs as the engine
# launches them: a pool in the model's dtype, or one-byte codes with scales
POOLS = [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8e4nv"), ("fp16", "fp8e4nv"), ("bf16", "i8"), ("fp32", "i8")]


def compile_variant(q: str, pool: str, split: bool, block_m: int, group: int = 4, d: int = 128) -> dict[str, object]:
    """One specialisation of _attend_tile, its pointers typed as `launch` passes them, compiled for TARGET with the
    warps and stages `_options` gives it on an H100."""
    scaled = pool in ("fp8e4nv", "i8")
    consts = dict(D=d, DR=0, DV=d, BLOCK_D=d, BLOCK_DR=16, BLOCK_DV=d, BLOCK_M=block_m, BLOCK_G=group,
                  BLOCK_N=triton_paged.BLOCK_N, SOFTCAP=False, WINDOW=False, SPLIT=split, SELECT=False,
                  SCALED=scaled, PRECISION="ieee" if q == "fp32" else "tf32")  # fmt: skip
    out = "fp32" if split else q
    pointers = {"q_ptr": q, "k_ptr": pool, "r_ptr": pool, "v_ptr": pool, "ks_ptr": "fp32", "vs_ptr": "fp32",
                "out_ptr": out, "ml_ptr": out, "sel_ptr": "i32", "table_ptr": "i32", "q_start_ptr": "i32",
                "q_len_ptr": "i32", "start_ptr": "i32"}  # fmt: skip
    names = list(inspect.signature(triton_paged._attend_tile.fn).parameters)
    signature = {
        n: "constexpr" if n in consts else f"*{pointers[n]}" if n in pointers else "fp32" if n in ("scale", "softcap")
        else "i32"
        for n in names
    }  # fmt: skip
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    warps = 8 if block_m * group * d >= 32768 else 4
    kernel = triton.compile(
        ASTSource(fn=triton_paged._attend_tile, signature=signature, constexprs=constexprs),
        target=TARGET,
        options={"num_warps": warps, "num_stages": 3},
    )
    ptx = kernel.asm["ptx"]
    return {"q": q, "pool": pool, "split": split, "block_m": block_m, "shared": kernel.metadata.shared,
            "fp8_cvt": ptx.count("e4m3x2")}  # fmt: skip


def main(pairs: list[tuple[str, str]]) -> None:
    """Each (queries, pool) pair as a decoding step launches it (16-row tiles, keys in runs) and as a prompt chunk
    does (64-row tiles, one pass)."""
    for q, pool in pairs:
        for split, block_m in ((True, 4), (False, 16)):
            print(json.dumps(compile_variant(q, pool, split, block_m)), flush=True)


if __name__ == "__main__":
    # arguments: QUERIES:POOL pairs (default: every pair in POOLS)
    main([tuple(a.split(":")) for a in sys.argv[1:]] or POOLS)  # type: ignore[misc]
