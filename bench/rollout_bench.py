"""Rollout speed: GRPO's sampling through llmkit's serving engine against batched `generate` and against
transformers' `generate` (what TRL's GRPOTrainer samples with when vLLM is not used), on the same prompts.

    .venv/bin/python bench/rollout_bench.py [--prompts 8] [--group 8] [--new 32] [--rounds 3] [--json]

SmolLM2-135M-Instruct in fp32 (the GGUF file dequantized, as GRPO trains it; transformers reads the same weights
converted), the worked example's chat prompts (bench/rl_arithmetic.py), --group samples of each at temperature 0.7,
exactly --new tokens each (the end token ignored, so every contender makes the same tokens). The engine runs as
GRPO runs it (Sampler.rollouts: the prompts computed once into the prefix cache, then n = group completions of
each, the batch-invariant C++ step, tempered log-probabilities); `generate` gets the prompts repeated group times
as one left-padded batch (its C++ step); transformers the same batch with do_sample. The contenders take turns for
--rounds rounds (medians), with the machine's memory bandwidth and fp32 matmul peak measured in the same run.
"""

from __future__ import annotations

import argparse
import platform
import random
from typing import Any

import torch
from common import alternate, hf_model, measure_limits, peak_rss_gib, report, smollm2_gguf, smollm2_hf
from rl_arithmetic import messages, problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmkit.generate.decode import generate
    from llmkit.interop.load import load_model
    from llmkit.serve.config import EngineConfig
    from llmkit.serve.engine import Engine
    from llmkit.serve.request import SamplingParams
    from llmkit.tokenizer import render_chat

    loaded = load_model(smollm2_gguf(), dtype=torch.float32, quantized=False)
    model, tok = loaded.model.eval(), loaded.tokenizer
    assert tok is not None
    chosen = random.Random(0).sample(problems(), args.prompts)
    prompts = [
        tok.backend.encode(render_chat(tok, messages(p["question"]), add_generation_prompt=True),
                           add_special_tokens=False).ids
        for p in chosen
    ]  # fmt: skip
    G, new = args.group, args.new
    engine = Engine(model, tok, EngineConfig(kv_memory=1 << 29, max_batch=256, step_tokens=2048))
    params = SamplingParams(max_tokens=new, temperature=0.7, n=G, seed=1, ignore_eos=True, tempered_logprobs=True)
    repeated = [p for p in prompts for _ in range(G)]

    def through_engine() -> int:
        # as GRPO's sampler does (llmkit.train.grpo.Sampler.rollouts): no prefix kept from the last round (the
        # weights would have changed), each prompt computed once into the prefix cache, then its group
        engine.weights_changed()
        with torch.no_grad():
            engine.generate(prompts, SamplingParams(max_tokens=0))
            outs = engine.generate(prompts, params)
        return sum(len(o.token_ids) for o in outs)

    def through_generate() -> int:
        with torch.no_grad():
            gen = generate(model, repeated, max_new_tokens=new, temperature=0.7, seed=1)
        return sum(len(t) for t in gen.new_tokens)

    contenders = {"engine": through_engine, "generate": through_generate}
    if not args.no_hf:
        hf = hf_model(smollm2_hf())
        lengths = [len(p) for p in repeated]
        width = max(lengths)
        ids = torch.tensor([[tok.eos_id or 0] * (width - n) + p for p, n in zip(repeated, lengths, strict=True)])
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])

        def through_transformers() -> int:
            torch.manual_seed(1)
            with torch.no_grad():
                out = hf.generate(
                    input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                    max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.eos_id,
                )  # fmt: skip
            return int((out.shape[1] - width) * out.shape[0])

        contenders["transformers"] = through_transformers
    for fn in contenders.values():  # warm-up: first calls build kernels and caches
        fn()
    limits = measure_limits(("fp32",), matmul_seconds=1.0)
    seconds, tokens = alternate(contenders, args.rounds)
    rates = {name: tokens[name] / seconds[name] for name in contenders}
    summary: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct fp32",
        "sequences": len(repeated),
        "new_tokens": new,
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "engine_over": {k: round(rates["engine"] / v, 2) for k, v in rates.items() if k != "engine"},
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "limits": limits.as_dict(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }

    def table() -> None:
        print(f"{len(prompts)} prompts x {G} samples, {new} new tokens each, temperature 0.7, {limits}")
        print("| sampler | seconds | tokens/s | engine's speed-up |")
        print("|---|---|---|---|")
        for name in contenders:
            ratio = "" if name == "engine" else f"{summary['engine_over'][name]}x"
            print(f"| {name} | {seconds[name]:.2f} | {rates[name]:.1f} | {ratio} |")

    report(summary, args.json, table)


if __name__ == "__main__":
    main()
