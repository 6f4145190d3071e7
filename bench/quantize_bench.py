"""Quantizing a real-size checkpoint: `llmkit quantize --to q4_k_m` against llama.cpp's `llama-quantize`, same weights.

    bash bench/build_llama_server.sh       # once: llama.cpp's tools
    .venv/bin/python bench/quantize_bench.py [--shape qwen2.5-1.5b] [--mixture Q4_K_M] [--imatrix FILE]

The checkpoint is size_bench.py's random-weight one at a published shape (bf16 Hugging Face files); llama.cpp reads
it as its converter's bf16 GGUF file (made once, not timed). Each side runs in a child process, timed, with its
peak resident memory and its peak anonymous memory (RSS also counts the pages of the files a process maps, which the
page cache holds and can drop): llmkit from the Hugging Face directory to an llmkit checkpoint (each layer quantized
as it is read), llama-quantize from the bf16 GGUF file to a GGUF file. Then both results are loaded by llmkit and
compared tensor by tensor: the block type each tensor got (the mixture's rules), and the fraction of blocks that are
byte-equal (all of them, when llmkit computes what llama.cpp's reference code computes). With --imatrix FILE (an
importance matrix in llama.cpp's format: `llmkit imatrix` writes one) both sides quantize with it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import ROOT, report
from size_bench import LLAMA, OUT, SHAPES, THREADS, hf_checkpoint, llama_cpp_gguf


def _anonymous_kib(pid: int) -> int:
    """RssAnon of process `pid` (its own memory, not the pages of files it maps), in KiB; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:")), 0)


def timed_child(cmd: list[str]) -> tuple[float, float, float]:
    """Run `cmd`: its wall seconds, its peak RSS in GiB (os.wait4's usage of that one process: mapped file pages
    included), and its peak anonymous memory in GiB (sampled every 0.1 s from /proc)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    anonymous = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        anonymous = max(anonymous, _anonymous_kib(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return seconds, usage.ru_maxrss / 1024**2, anonymous / 1024**2


def blocks_of(path: Path) -> dict[str, tuple[str, Any]]:
    """Every block-held tensor of the model at `path`, loaded by llmkit: name -> (type, rows of blocks as stored)."""
    from llmkit.interop.load import load_model
    from llmkit.quant.block_linear import HeldBlocks

    model = load_model(path).model
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, HeldBlocks):
            out[name] = (module.block.name, module.state_dict()["blocks"])
    return out


def compare(ours: Path, theirs: Path) -> dict[str, Any]:
    a, b = blocks_of(ours), blocks_of(theirs)
    rows = []
    for name in sorted(set(a) | set(b), key=lambda n: (n.count("."), n)):
        kind_a, blocks_a = a.get(name, ("-", None))
        kind_b, blocks_b = b.get(name, ("-", None))
        equal = None
        if kind_a == kind_b and blocks_a is not None and blocks_b is not None:
            from llmkit.quant.blocks import TYPES

            size = TYPES[kind_a].bytes
            equal = float((blocks_a.view(-1, size) == blocks_b.view(-1, size)).all(1).float().mean())
        rows.append({"tensor": name, "llmkit": kind_a, "llama.cpp": kind_b, "equal_blocks": equal})
    return {"tensors": rows, "same_types": all(r["llmkit"] == r["llama.cpp"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--mixture", default="Q4_K_M")
    p.add_argument("--imatrix", default=None, metavar="FILE", help="an importance matrix both sides quantize with")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not (LLAMA / "build/bin/llama-quantize").is_file():
        sys.exit("llama.cpp's tools are not built: bash bench/build_llama_server.sh")
    hf = hf_checkpoint(args.shape)
    bf16 = llama_cpp_gguf(args.shape, "BF16")
    ours = OUT / args.shape / f"llmkit-{args.mixture.lower()}"
    theirs = OUT / args.shape / f"{args.shape}.{args.mixture}.bench.gguf"
    llmkit_cmd = [sys.executable, "-m", "llmkit", "quantize", str(hf), str(ours), "--to", args.mixture.lower(),
                  "--overwrite"]  # fmt: skip
    llama_cmd = [str(LLAMA / "build/bin/llama-quantize"), str(bf16), str(theirs), args.mixture, str(THREADS)]
    if args.imatrix:
        llmkit_cmd += ["--imatrix", str(Path(args.imatrix).resolve())]
        llama_cmd[1:1] = ["--imatrix", str(Path(args.imatrix).resolve())]
    # each side once (the machine must be quiet: on 2 cores another process halves either figure)
    llama_s, llama_rss, llama_anon = timed_child(llama_cmd)
    llmkit_s, llmkit_rss, llmkit_anon = timed_child(llmkit_cmd)
    result = {
        "shape": args.shape,
        "mixture": args.mixture,
        "imatrix": args.imatrix,
        "threads": THREADS,
        "llmkit_seconds": llmkit_s,
        "llama_cpp_seconds": llama_s,
        "llmkit_peak_rss_gib": llmkit_rss,
        "llama_cpp_peak_rss_gib": llama_rss,
        "llmkit_peak_anonymous_gib": llmkit_anon,
        "llama_cpp_peak_anonymous_gib": llama_anon,
        "llmkit_bytes": sum(f.stat().st_size for f in ours.glob("*.safetensors")),
        "llama_cpp_bytes": theirs.stat().st_size,
        **compare(ours, theirs),
    }
    os.unlink(theirs)
    weighted = f" with {args.imatrix}" if args.imatrix else ""
    lines = [
        f"{args.shape} to {args.mixture}{weighted}, {THREADS} threads: "
        f"llmkit {llmkit_s:.1f} s (peak RSS {llmkit_rss:.2f} GiB, "
        f"anonymous {llmkit_anon:.2f}), llama-quantize {llama_s:.1f} s ({llama_rss:.2f}, {llama_anon:.2f} GiB); "
        f"weights {result['llmkit_bytes'] / 1e6:,.0f} MB "
        f"against a {result['llama_cpp_bytes'] / 1e6:,.0f} MB file; same type for every tensor: "
        f"{result['same_types']}",
        f"{'tensor':<28} {'llmkit':>7} {'llama.cpp':>9} {'equal blocks':>12}",
    ]
    for r in result["tensors"]:
        eq = "-" if r["equal_blocks"] is None else f"{100 * r['equal_blocks']:.2f}%"
        lines.append(f"{r['tensor']:<28} {r['llmkit']:>7} {r['llama.cpp']:>9} {eq:>12}")
    report(result, args.json, lambda: print("\n".join(lines)))


if __name__ == "__main__":
    main()
