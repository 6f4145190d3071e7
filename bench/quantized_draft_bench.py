"""Speculative decoding of SmolLM2-135M in fp32 with its own Q4_1 file kept int4 as the draft, against plain fp32
decoding, in one run.

    .venv/bin/python bench/quantized_draft_bench.py [--new 128] [--prompts 4] [--repeats 3] [--k 3,4,6]

The target is the GGUF file dequantized to fp32 (`load_gguf(quantized=False)`), the draft the same file kept as int4
groups (`load_gguf(quantized=True)`): the same weights up to the file's own rounding, so the draft agrees with the
target on most tokens, at a third of its step's cost. Greedy, --new tokens after --prompts 48-token spans spread over
the last play, batch 1; plain and speculative runs take turns
--repeats times and the median counts. Reported: tokens/s (each prompt's prefill included: the draft's own prefill is
part of speculation's cost), acceptance, the speed-up, and whether the output is the plain fp32 output token for
token (it must be: greedy speculation is exact).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from common import alternate, measure_limits, report, smollm2_gguf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", default="3,4,6", help="draft tokens per round, one row each")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from llmkit.data.corpus import shakespeare
    from llmkit.generate import generate, speculative_generate
    from llmkit.interop.gguf import load_gguf

    torch.set_grad_enabled(False)
    gguf = smollm2_gguf()
    limits = measure_limits(precisions=())
    fp32 = load_gguf(gguf, quantized=False)
    target, tokenizer = fp32.model.eval(), fp32.tokenizer
    assert tokenizer is not None
    draft = load_gguf(gguf, quantized=True).model.eval()
    ids = tokenizer.encode(shakespeare()[-1].text)
    prompts = [ids[s : s + 48] for s in torch.linspace(1000, len(ids) - 1000, args.prompts).long().tolist()]
    ks = [int(k) for k in args.k.split(",")]
    stats: dict[int, list[float]] = {}

    def plain() -> list[list[int]]:
        return [generate(target, [q], max_new_tokens=args.new).new_tokens[0] for q in prompts]

    def speculative(k: int) -> list[list[int]]:
        out = []
        for q in prompts:
            g = speculative_generate(target, [q], draft=draft, max_new_tokens=args.new, k=k)
            stats.setdefault(k, []).append(g.acceptance_rate)
            out.append(g.new_tokens[0])
        return out

    variants: dict[str, Any] = {"plain fp32": plain} | {f"k={k}": (lambda k=k: speculative(k)) for k in ks}
    for fn in variants.values():  # warm up
        fn()
    seconds, outputs = alternate(variants, args.repeats)
    tokens = args.new * len(prompts)
    rows = [
        {
            "decoding": name,
            "tokens_per_s": tokens / s,
            "speed_up": seconds["plain fp32"] / s,
            "acceptance": None if name == "plain fp32" else sum(stats[int(name[2:])]) / len(stats[int(name[2:])]),
            "same_output_as_plain": outputs[name] == outputs["plain fp32"],
        }
        for name, s in seconds.items()
    ]
    summary = {**limits.as_dict(), "new_tokens": args.new, "prompts": len(prompts), "rows": rows}

    def table() -> None:
        print(f"SmolLM2-135M fp32 target, int4 draft (the same Q4_1 file); {limits}; batch 1, {args.new} new tokens")
        print("| decoding | tokens/s | acceptance | speed-up | output = plain |")
        print("|---|---|---|---|---|")
        for r in rows:
            acc = "" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
            print(
                f"| {r['decoding']} | {r['tokens_per_s']:.1f} | {acc} | {r['speed_up']:.2f}x | "
                f"{r['same_output_as_plain']} |"
            )

    report(summary, args.json, table)


if __name__ == "__main__":
    main()
