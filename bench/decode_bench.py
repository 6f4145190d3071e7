"""Decoding throughput: llmkit against transformers' `generate` (with its KV cache), same weights, one run.

    .venv/bin/python bench/decode_bench.py [--model ref|smollm2|mixtral|deepseek-v3|deepseek-v3.2] [--new 64]
        [--prompt 32] [--repeats 3] [--device cuda]

Models: "ref", the reference LLaMA-style config (124.7M parameters, random weights, identical in both libraries
through llmkit's converter), "smollm2", the real SmolLM2-135M-Instruct GGUF file (dequantized), and two mixtures of
experts at tiny widths with their real expert counts: "mixtral" (8 experts, top-2) and "deepseek-v3" (MLA attention,
256 routed experts in 8 groups, top-8 from the best 4 groups, one shared expert), and "deepseek-v3.2", the latter
with DeepSeek-V3.2's sparse attention (a lightning indexer picks each query's 8 keys). Greedy
decoding of --new tokens after a --prompt-token prompt, batch 1 and 8, in fp32 and bf16. The machine is shared and
noisy, so the variants run alternately --repeats times and the median counts. llmkit runs eagerly and compiled
(`generate(step=CompiledStep(model))`: torch.compile with weight freezing; the one-time compilation is reported
apart). The same run measures memory bandwidth: the ceiling of decoding is bandwidth / bytes of weights read per
step, and the "of bandwidth" column is the compiled steps/s over that ceiling.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    DTYPES,
    RUNS,
    Limits,
    alternate,
    hf_greedy,
    hf_model,
    measure_limits,
    reference_hf,
    report,
    smollm2_hf,
    timed,
)


def moe_hf(preset: str, model_type: str, **moe: Any) -> Callable[[Path], Path]:
    """A tiny-width MoE preset with its expert counts set to the real model's (`moe` fields), random weights after
    torch.manual_seed(0), saved once in transformers' format."""

    def make(directory: Path) -> Path:
        from llmkit import build_model, get_preset
        from llmkit.interop.hf import save_hf

        out = directory / f"{preset}-experts-hf"
        if not (out / "config.json").is_file():
            cfg = get_preset(preset)
            assert cfg.moe is not None
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))
            torch.manual_seed(0)
            save_hf(build_model(cfg), out, model_type=model_type)
        return out

    return make


MODELS = {  # each saves its model in transformers' format, once
    "ref": reference_hf,
    "smollm2": smollm2_hf,
    "mixtral": moe_hf("mixtral-8x7b-tiny", "mixtral"),  # 8 experts, top-2
    "deepseek-v3": moe_hf("deepseek-v3-tiny", "deepseek_v3", n_experts=256, top_k=8, n_groups=8, topk_groups=4),
    # the same with DeepSeek-V3.2's sparse attention: the indexer keeps each query's 8 best keys
    "deepseek-v3.2": moe_hf("deepseek-v3.2-tiny", "deepseek_v32", n_experts=256, top_k=8, n_groups=8, topk_groups=4),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="ref")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--tmp", default=str(RUNS))
    p.add_argument("--device", default="cpu", help="where both libraries run (cpu, cuda)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from llmkit.generate import CompiledStep, generate
    from llmkit.interop.hf import load_hf

    directory = MODELS[args.model](Path(args.tmp))
    limits = measure_limits(precisions=(), device=args.device)  # decoding is bound by memory reads, not FLOP/s
    rows = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        ours = load_hf(directory, dtype=dtype, device=args.device).model.eval()
        theirs = hf_model(directory, dtype).to(args.device)
        weight_bytes = sum(t.numel() * t.element_size() for t in ours.state_dict().values())
        compiled = CompiledStep(ours)  # one compilation per model, kept across batches
        embed_bytes = ours.embed.weight.numel() * ours.embed.weight.element_size()
        # an embedding lookup reads one row per token: untied, the table is not read per step
        read_per_step = weight_bytes - (0 if ours.cfg.tie_embeddings else embed_bytes)
        for batch in map(int, args.batches.split(",")):
            g = torch.Generator().manual_seed(batch)
            prompt = torch.randint(0, ours.cfg.vocab_size, (batch, args.prompt), generator=g).to(args.device)

            def run_ours(ours: Any = ours, prompt: torch.Tensor = prompt) -> list[list[int]]:
                return generate(ours, prompt, max_new_tokens=args.new).tokens.tolist()

            def run_compiled(
                ours: Any = ours, prompt: torch.Tensor = prompt, step: CompiledStep = compiled
            ) -> list[list[int]]:
                return generate(ours, prompt, max_new_tokens=args.new, step=step).tokens.tolist()

            def run_theirs(theirs: Any = theirs, prompt: torch.Tensor = prompt) -> list[list[int]]:
                return hf_greedy(theirs, prompt, args.new).tolist()

            run_ours(), run_theirs()  # warm up
            compile_s, _ = timed(run_compiled)  # compiles at the first batch (batch and length are dynamic)
            variants = {"llmkit": run_ours, "compiled": run_compiled, "transformers": run_theirs}
            seconds, outputs = alternate(variants, args.repeats)
            tok = {k: batch * args.new / s for k, s in seconds.items()}
            ceiling = limits.memory_read / read_per_step
            rows.append(
                {
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
                }
            )
    summary = {
        "model": args.model,
        "params": sum(p.numel() for p in ours.parameters()),
        **limits.as_dict(),
        "prompt": args.prompt,
        "new_tokens": args.new,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "rows": rows,
    }
    report(summary, args.json, lambda: print_table(summary, limits, args))


def print_table(summary: dict[str, Any], limits: Limits, args: argparse.Namespace) -> None:
    """The table BENCHMARKS.md quotes."""
    print(
        f"model {args.model}: {summary['params'] / 1e6:.1f}M parameters; {limits}; "
        f"prompt {args.prompt}, {args.new} new tokens, greedy; median of {args.repeats}"
    )
    print(
        f"{'dtype':<5} {'batch':>5} {'transformers':>12} {'llmkit':>8} {'ratio':>6} {'compiled':>9} {'ratio':>6} "
        f"{'of bandwidth':>12} {'compile s':>9} {'same tokens (eager/compiled)':>29}"
    )
    for r in summary["rows"]:
        same = f"{r['same_tokens']}/{r['compiled_same_tokens']}"
        print(
            f"{r['dtype']:<5} {r['batch']:>5} {r['transformers_tokens_per_s']:>12.1f} {r['llmkit_tokens_per_s']:>8.1f} "
            f"{r['ratio']:>5.2f}x {r['compiled_tokens_per_s']:>9.1f} {r['compiled_ratio']:>5.2f}x "
            f"{100 * r['bandwidth_fraction']:>11.1f}% {r['compile_seconds']:>9.0f} {same:>29}"
        )


if __name__ == "__main__":
    main()
