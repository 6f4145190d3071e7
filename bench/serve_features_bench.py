"""What structured outputs, tool calls and log-probabilities cost a server: `llmkit serve` on SmolLM2-135M-Instruct
(Q4_1, kept int4) under the same load with and without each, in one run, and the grammar engine's compile time.

    .venv/bin/python bench/serve_features_bench.py [--requests 16] [--rounds 2]

Loads (serve_bench.py's request sets: 32-512-token prompts cut from the plays, 16-256 output tokens, greedy), a
closed loop at concurrency 1 and 16, streamed, each variant on the same requests:
- completions: plain (`ignore_eos`), with `logprobs: 5`, and with a JSON schema (`response_format` json_schema: an
  object holding one string, so the text runs as long as the model keeps the string open);
- chat: plain, with two tools offered (`auto`: the same prompt, which the definitions lengthen by ~200 tokens, and no
  grammar), and with `tool_choice: "required"` (the call constrained by the grammar), compared with `auto`;
- completions, plain, from a second server started with `--batch-invariant` (every token through the C++ step).
The servers run without the prefix cache (every variant sends the same prompts). Output tokens/s counts the tokens
the server reports in `usage`, over the load's wall time; a constrained reply
ends when its grammar completes, so its requests may generate fewer tokens than the plain ones, and more of the
load is prefill: the median gap between tokens (ITL) shows what a step costs whatever the lengths. Variants run
interleaved, a different one first each round; the table gives medians over rounds and each variant's ratio to its
plain counterpart. Then the compile time of typical schemas (cache misses) in-process.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import ROOT, measure_limits, report, smollm2_gguf
from serve_bench import MODEL, ServerProcess, clients, corpus_tokens, request_set

STORY = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "summarize",
            "description": "Summarize a passage",
            "parameters": {
                "type": "object",
                "properties": {
                    "summary": {"type": "string"},
                    "speakers": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["summary", "speakers"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "count_lines",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        },
    },
]
# variant -> (endpoint, extra body fields)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("completions", {"ignore_eos": True}),
    "completions, logprobs 5": ("completions", {"ignore_eos": True, "logprobs": 5}),
    "completions, json_schema": (
        "completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}}},
    ),
    "chat": ("chat/completions", {"ignore_eos": True}),
    "chat, tools auto": ("chat/completions", {"tools": TOOLS, "ignore_eos": True}),  # the same prompt, no grammar
    "chat, tools required": ("chat/completions", {"tools": TOOLS, "tool_choice": "required"}),
    "completions, --batch-invariant": ("completions", {"ignore_eos": True}),
}
INVARIANT = "completions, --batch-invariant"  # served by the second server
BASELINE = {
    "completions, logprobs 5": "completions",
    "completions, json_schema": "completions",
    "chat, tools auto": "chat",
    "chat, tools required": "chat, tools auto",
    INVARIANT: "completions",
}


def one(port: int, endpoint: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> tuple[int, list[float]]:
    """One streamed greedy request: the completion tokens the server reports, and the gaps between its chunks after
    the first (one chunk per token)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if endpoint == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": "Continue this scene:\n" + prompt}]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", f"/v1/{endpoint}", json.dumps(body | extra), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    tokens, times = 0, []
    for raw in response:
        line = raw.strip()
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.perf_counter())
            tokens = event["usage"]["completion_tokens"] if event.get("usage") else tokens
    conn.close()
    return tokens, [b - a for a, b in itertools.pairwise(times[1:])]  # (chat's first chunk carries the role)


def load(port: int, variant: str, requests: list[tuple[str, int]], concurrency: int) -> dict[str, float]:
    """Output tokens/s of `requests` sent by `concurrency` clients in a closed loop, and the median gap between
    tokens (the step time those requests saw, whatever their lengths)."""
    endpoint, extra = VARIANTS[variant]
    results, seconds = clients(requests, concurrency, lambda prompt, n: one(port, endpoint, prompt, n, extra))
    gaps = [g for _, gs in results for g in gs]
    return {"tok_s": sum(n for n, _ in results) / seconds, "itl": statistics.median(gaps) if gaps else float("nan")}


def compile_times(n: int = 8) -> dict[str, float]:
    """Median milliseconds to compile a constraint llguidance has not seen (a property renamed each time), for a
    JSON schema of a nested object and for the two tools' forced-call grammar."""
    from llmkit.interop.load import load_model
    from llmkit.serve.structured import Constraint, Grammars
    from llmkit.serve.tools import Function, call_constraint

    loaded = load_model(smollm2_gguf())
    grammars = Grammars(loaded.tokenizer, loaded.model.cfg.vocab_size)
    grammars.compile(Constraint.json_schema({"type": "object"}))  # builds the tokenizer once
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        },
        "required": ["name", "age", "address"],
    }
    out = {}
    for label, make in (
        ("json_schema", lambda i: Constraint.json_schema({**person, "title": f"p{i}"})),
        (
            "tools",
            lambda i: call_constraint(
                [Function(f"{t['function']['name']}{i}", None, t["function"]["parameters"]) for t in TOOLS],
                "hermes",
                True,
            ),
        ),
    ):
        times = []
        for i in range(n):
            c = make(i)
            start = time.perf_counter()
            grammars.compile(c)
            times.append((time.perf_counter() - start) * 1e3)
        out[label] = statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tok, ids = corpus_tokens()
    limits = measure_limits(("fp32",))
    (ROOT / "runs/bench").mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).parent / "llmkit"), "serve", str(smollm2_gguf()), "--model-name", MODEL]
    # no prefix cache: every variant runs the same prompts, which a cache would serve to the later ones for free
    command += ["--kv-memory", "2GiB", "--max-batch", str(max(levels)), "--no-prefix-cache"]
    rows = []
    names = list(VARIANTS)
    with (
        ServerProcess("llmkit-features8721", [*command, "--port", "8721"], 8721),
        ServerProcess("llmkit-invariant8722", [*command, "--port", "8722", "--batch-invariant"], 8722),
    ):
        for port in (8721, 8722):
            one(port, "completions", "Warm up.", 4, {})
        for r in range(args.rounds):
            for c in levels:
                requests = request_set(ids, tok, args.requests, seed=1000 + 10 * r + c)
                for variant in names[r % len(names) :] + names[: r % len(names)]:
                    port = 8722 if variant == INVARIANT else 8721
                    rows.append({"round": r, "concurrency": c, "variant": variant, **load(port, variant, requests, c)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = {**limits.as_dict(), "rows": rows, "compile_ms": compile_times()}
    report(summary, args.json, lambda: print_table(summary, limits))


def print_table(summary: dict[str, Any], limits: Any) -> None:
    print(f"SmolLM2-135M-Instruct Q4_1 through llmkit serve; {limits}")
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in summary["rows"]:
        by.setdefault((r["concurrency"], r["variant"]), []).append(r)
    median = lambda c, v, key: statistics.median(r[key] for r in by[c, v])  # noqa: E731
    print(f"{'variant':32s} {'concurrency':>11s} {'out tok/s':>9s} {'vs plain':>8s} {'ITL p50':>8s} {'vs plain':>8s}")
    for c, variant in sorted(by):
        base = BASELINE.get(variant, variant)
        tok, itl = median(c, variant, "tok_s"), median(c, variant, "itl")
        print(
            f"{variant:32s} {c:11d} {tok:9.1f} {tok / median(c, base, 'tok_s'):7.2f}x "
            f"{itl * 1e3:6.1f}ms {itl / median(c, base, 'itl'):7.2f}x"
        )
    ms = summary["compile_ms"]
    print(
        f"compile (cache miss, median): nested JSON schema {ms['json_schema']:.1f} ms, two tools {ms['tools']:.1f} ms"
    )


if __name__ == "__main__":
    main()
