"""What the batch-invariant mode (the default wherever the C++ step runs) costs against --no-batch-invariant.

For each GGUF file, in one process per mode (so that neither warms the other's caches):
- serving: 16 greedy requests with prompts of 16-400 tokens (1,956 in all), added at once to one engine, N new
  tokens each: wall time, output tokens/s, median time to first token;
- `generate`: a 512-token prompt's prefill (tokens/s) and decoding 64 tokens after a 32-token prompt.

    python bench/invariance_bench.py FILE.gguf [FILE.gguf ...] [--new 48]

Prints a Markdown table: each mode's figures and the ratio invariant / not. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LENGTHS = [16, 400, 40, 100, 250, 24, 60, 180, 32, 300, 80, 20, 140, 50, 200, 64]


def measure(path: str, invariant: bool, new: int) -> dict[str, float]:
    """The figures of one mode (run in a process of its own by main)."""
    import torch

    from llmkit.generate import choose_step, generate
    from llmkit.interop.load import load_model
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.request import SamplingParams

    model = load_model(path).model.eval()
    torch.manual_seed(0)
    prompts = [torch.randint(100, model.cfg.vocab_size, (n,)).tolist() for n in LENGTHS]
    config = EngineConfig(kv_memory=512 << 20, batch_invariant=invariant)

    def serve(batch: list[list[int]], count: int) -> tuple[float, list[float]]:
        engine = Engine(model, None, config)
        params = SamplingParams(max_tokens=count, temperature=0.0)
        start, first = time.perf_counter(), {}
        for p in batch:
            engine.add(p, params)
        while engine.has_work:
            for d in engine.step():
                first.setdefault(d.request_id, time.perf_counter() - start)
        return time.perf_counter() - start, sorted(first.values())

    serve(prompts[:2], 4)  # warm-up
    total, ttft = serve(prompts, new)
    step = choose_step(model, invariant=invariant)
    long = torch.randint(100, model.cfg.vocab_size, (1, 512))
    with torch.inference_mode():
        generate(model, long[:, :64], max_new_tokens=1, step=step)
        t = time.perf_counter()
        generate(model, long, max_new_tokens=1, step=step)
        prefill = 512 / (time.perf_counter() - t)
        t = time.perf_counter()
        generate(model, long[:, :32], max_new_tokens=65, step=step)
        decode = 64 / (time.perf_counter() - t)
    return {"serve_s": total, "serve_tps": len(prompts) * new / total, "ttft": ttft[len(ttft) // 2],
            "prefill": prefill, "decode": decode}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--new", type=int, default=48, help="new tokens per serving request")
    parser.add_argument("--one", choices=["invariant", "plain"], help=argparse.SUPPRESS)  # a child process's mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.files[0], args.one == "invariant", args.new)))
        return
    print("| file | mode | serve 16 requests (s) | output tok/s | median TTFT (s) | prefill 512 tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for f in args.files:
        runs = {}
        for mode in ("invariant", "plain"):
            cmd = [sys.executable, __file__, f, "--new", str(args.new), "--one", mode]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[mode] = json.loads(out.strip().splitlines()[-1])
        a, b = runs["invariant"], runs["plain"]
        name = Path(f).name
        for mode, r in (("default (invariant)", a), ("--no-batch-invariant", b)):
            print(f"| {name} | {mode} | {r['serve_s']:.2f} | {r['serve_tps']:.1f} | {r['ttft']:.2f} | "
                  f"{r['prefill']:.0f} | {r['decode']:.1f} |")  # fmt: skip
        ratio = {k: a[k] / b[k] for k in a}
        print(f"| {name} | invariant / not | {1 / ratio['serve_s']:.2f}x the speed | {ratio['serve_tps']:.2f}x | "
              f"{ratio['ttft']:.2f}x | {ratio['prefill']:.2f}x | {ratio['decode']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
