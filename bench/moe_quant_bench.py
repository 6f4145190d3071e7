"""Decoding a mixture of experts on the CPU with fp32, int8 and int4 experts: llmkit against transformers, one run.

    .venv/bin/python bench/moe_quant_bench.py [--new 64] [--repeats 3] [--layers 8]

The model is Mixtral's design at the reference config's widths (8 experts, top-2, SwiGLU experts 2048 wide, model
width 768, 12 query and 4 kv heads, vocab 32000, --layers layers; random weights after torch.manual_seed(0)), saved
once in transformers' format and loaded by both libraries. Greedy decoding of --new tokens after a 32-token prompt,
batch 1 and 8; the variants take turns --repeats times and the median counts. llmkit runs eager `generate`, whose
steps run in one C++ call (the router and only the chosen experts' rows of the stacked weights: cpu_moe.cpp), for
the fp32 weights and for `quantize(model, "int8" | "int4")` (experts, attention and head; int4 in groups of 32); and
the int4 model once more through the PyTorch modules alone (`QuantizedExperts` running each chosen expert on its
rows of the stacks through the AVX2 kernel, one operator at a time: what a step costs where the C++ step does not
apply). Reported:
tokens/s (the prompt's prefill included), the ratio to transformers, the bytes of weights a batch-1 step reads
(attention, norms, router, the head, and top_k / n_experts of the experts: 2 of 8) and the fraction of the
memory-bandwidth ceiling that reaches, measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch
from common import (
    RUNS,
    alternate,
    hf_greedy,
    hf_model,
    measure_limits,
    peak_rss_gib,
    reference_config,
    report,
)


def mixtral_config(layers: int) -> Any:
    from llmkit import MoEConfig

    cfg = reference_config()
    moe = MoEConfig(n_experts=8, top_k=2, expert_hidden_dim=cfg.ffn.hidden_dim, score_func="softmax", norm_topk=True)
    return dataclasses.replace(cfg, n_layers=layers, moe=moe)


def saved_model(directory: Path, layers: int) -> Path:
    from llmkit import build_model
    from llmkit.interop.hf import save_hf

    out = directory / f"mixtral-reference-{layers}l-hf"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        save_hf(build_model(mixtral_config(layers)), out, model_type="mixtral")
    return out


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 step reads: everything but the input embedding (untied) and the unchosen experts."""
    from llmkit.layers.moe import MoE

    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    total -= model.embed.weight.numel() * model.embed.weight.element_size()
    for m in model.modules():
        if isinstance(m, MoE):
            experts = sum(t.numel() * t.element_size() for t in m.experts.state_dict().values())
            total -= experts - experts * m.cfg.top_k // m.cfg.n_experts
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tmp", default=str(RUNS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from llmkit.generate import generate
    from llmkit.generate.backend import Backend
    from llmkit.generate.step import step_for
    from llmkit.interop.hf import load_hf
    from llmkit.quant import quantize

    directory = saved_model(Path(args.tmp), args.layers)
    limits = measure_limits(precisions=())
    fp32 = load_hf(directory).model.eval()
    models = {
        "fp32": fp32,
        "int8": quantize(load_hf(directory).model.eval(), "int8", include_head=True),
        "int4": quantize(load_hf(directory).model.eval(), "int4", group_size=32, include_head=True),
    }
    theirs = hf_model(directory)
    rows = []
    for batch in map(int, args.batches.split(",")):
        prompt = torch.randint(0, fp32.cfg.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(0))

        def ours(model: Any, prompt: torch.Tensor = prompt) -> list[list[int]]:
            return generate(model, prompt, max_new_tokens=args.new).tokens.tolist()

        def pytorch(model: Any, prompt: torch.Tensor = prompt) -> list[list[int]]:  # the PyTorch modules, eager
            step = step_for(model, Backend("eager"))
            return generate(model, prompt, max_new_tokens=args.new, step=step).tokens.tolist()

        variants = {name: (lambda m=m: ours(m)) for name, m in models.items()}
        variants["int4, PyTorch modules"] = lambda: pytorch(models["int4"])
        variants["transformers fp32"] = lambda prompt=prompt: hf_greedy(theirs, prompt, args.new).tolist()
        for fn in variants.values():  # warm up (builds the C++ extension on a first run)
            fn()
        seconds, outputs = alternate(variants, args.repeats)
        base = batch * args.new / seconds["transformers fp32"]
        for name, s in seconds.items():
            model = models.get(name.split(",")[0], fp32) if name != "transformers fp32" else fp32
            read = bytes_per_token(model)
            tps = batch * args.new / s
            rows.append(
                {
                    "weights": name,
                    "batch": batch,
                    "tokens_per_s": tps,
                    "vs_transformers": tps / base,
                    "mb_per_token": read / 1e6,
                    "bandwidth_fraction": tps / batch * read / limits.memory_read,
                    "same_tokens_as_transformers": outputs[name] == outputs["transformers fp32"],
                }
            )
    summary = {
        "params": sum(t.numel() for t in fp32.parameters()),
        **limits.as_dict(),
        "prompt": args.prompt,
        "new_tokens": args.new,
        "peak_rss_gib": peak_rss_gib(),
        "rows": rows,
    }

    def table() -> None:
        print(
            f"Mixtral design, {summary['params'] / 1e6:.0f}M parameters ({args.layers} layers); {limits}; prompt "
            f"{args.prompt}, {args.new} new tokens, greedy; median of {args.repeats}; peak RSS "
            f"{summary['peak_rss_gib']:.1f} GiB"
        )
        print(
            "| weights | batch | tokens/s | vs transformers | MB/token | of bandwidth | same tokens as transformers |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['weights']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['vs_transformers']:.2f}x | "
                f"{r['mb_per_token']:.0f} | {100 * r['bandwidth_fraction']:.0f}% | {r['same_tokens_as_transformers']} |"
            )

    report(summary, args.json, table)


if __name__ == "__main__":
    main()
