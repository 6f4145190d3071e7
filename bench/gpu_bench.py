"""llmkit on a GPU against transformers in its fastest form (static cache + torch.compile), the same random weights at
published shapes, in one run, with the card's HBM read bandwidth and bf16 matmul peak measured in the same run.

    python3 bench/gpu_bench.py [--shapes llama-3.2-1b,llama-3.1-8b] [--new 128] [--json]
    python3 bench/gpu_bench.py --device cpu --shapes tiny      # the bench's own code, on a CPU, in seconds

For each shape (bf16, built on the device: transformers' model with its random initialisation, llmkit's converted
from its state dict through llmkit's key map):
- decode at batch 1, 8 and 64: llmkit's serving engine (KernelRunner: paged-attention kernels, CUDA graphs) with
  B requests of a 32-token prompt, output tokens/s after the first token, and the fraction of the bandwidth ceiling
  (bytes of weights and cache each step reads, over the measured bandwidth), with the engine's median step time;
  transformers' `generate` with a static cache, which it compiles (--hf-batches, batch 1 by default: each batch
  compiles for a minute or more, so these rows come last);
- prefill of 512 and 2,048 tokens: llmkit's runner over one prompt chunk against transformers' forward, each as a
  fraction of the measured bf16 peak (2 x parameters x tokens + the causal attention's products);
- the serving engine at concurrency 1, 16 and 64 (512-token prompts, --new tokens each, all sent at once): output
  tokens/s and time to first token p50 / p95;
- the quantized KV caches (--kv-dtypes, int8 and fp8 by default; fp8 on a GPU only): decoding 32 requests of 1,024-token
  prompts with the cache in one-byte codes against the model's bf16 cache, output tokens/s after the first token and
  the blocks the same memory holds, each as a ratio to bf16's;
- on a GPU, the batch-invariant mode's cost (`--batch-invariant`: llmkit.kernels.invariant's products and norms,
  attention without key splits): decoding at batch 1 and serving 16 512-token prompts, as a fraction of the
  default mode's figures above.
Each part prints its row as it finishes, so a run cut short by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# published shapes (each model's config.json)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied=True),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936, tied=True),
    "llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False),
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=512, tied=False),  # the bench's own check
}


@dataclass
class Pair:
    """transformers' model and llmkit's, the same weights on the same device."""

    hf: Any
    ours: Any
    params: int  # parameters every decoding step reads (all but the embedding rows not looked up)
    shape: dict[str, Any]


def build(shape: str, device: str, dtype: torch.dtype) -> Pair:
    import transformers

    from llmkit import build_model
    from llmkit.interop.hf import config_from_hf, state_dict_from_hf

    s = SHAPES[shape]
    fields = dict(
        hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=s["tied"], rms_norm_eps=1e-5,
    )  # fmt: skip
    config = transformers.LlamaConfig(**fields)  # (rope_theta: a field before transformers 5, a kwarg it converts)
    torch.manual_seed(0)
    with torch.device(device):
        try:
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        except TypeError:  # transformers before 4.56 names it torch_dtype
            hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype).eval()
    hf_config = {**config.to_dict(), "model_type": "llama"}
    ours = build_model(config_from_hf(hf_config), device=device, dtype=dtype).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), hf_config))
    embed = s["vocab"] * s["hidden"]
    params = sum(p.numel() for p in ours.parameters()) - (0 if s["tied"] else embed)
    return Pair(hf, ours, params, s)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def limits(device: str) -> dict[str, float]:
    from llmkit.machine.perf import matmul_flops, memory_bandwidth

    if device == "cuda":
        return {
            "bf16_tflops": matmul_flops(torch.bfloat16, device, n=8192, seconds=1.0) / 1e12,
            "read_gbs": memory_bandwidth(device, mib=4096, seconds=1.0) / 1e9,
        }
    return {"bf16_tflops": matmul_flops(torch.bfloat16, device, n=1024, seconds=0.5) / 1e12,
            "read_gbs": memory_bandwidth(device, seconds=0.5) / 1e9}  # fmt: skip


def engine_for(
    pair: Pair, max_batch: int, invariant: bool = False, kv_dtype: str | None = None, kv_memory: int | None = None
) -> Any:
    """The serving engine over `pair`'s model, its cache `kv_memory` bytes (default: half the free memory, 40 GiB at
    most)."""
    from llmkit.serve.engine import Engine, EngineConfig

    if kv_memory is None:
        free = torch.cuda.mem_get_info()[0] if pair.ours.device.type == "cuda" else 1 << 30
        kv_memory = min(int(free * 0.5), 40 << 30)
    config = EngineConfig(
        kv_memory=kv_memory,
        max_batch=max_batch,
        step_tokens=4096,
        batch_invariant=invariant,
        kv_dtype=kv_dtype,
    )
    return Engine(pair.ours, None, config)


def run_engine(engine: Any, prompts: list[list[int]], new: int, device: str) -> dict[str, float]:
    """All prompts sent at once, stepped to the end: output tokens/s over the whole run and after each request's
    first token, time to first token p50 / p95, and the mean time of a step of decoding rows only."""
    from llmkit.serve.request import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    ids = [engine.add(p, params) for p in prompts]
    first: dict[str, float] = {}
    decode_steps: list[float] = []
    while engine.has_work:
        s0 = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        if len(first) == len(ids):  # every request has its first token: this was a decoding step
            decode_steps.append(now - s0)
        for d in deltas:
            first.setdefault(d.request_id, now - t0)
    total = time.perf_counter() - t0
    ttft = sorted(first[i] for i in ids)
    after_first = total - max(ttft)
    return {
        "tok_s": len(prompts) * new / total,
        "decode_tok_s": len(prompts) * (new - 1) / max(after_first, 1e-9) if new > 1 else 0.0,
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "step_ms": 1e3 * statistics.median(decode_steps) if decode_steps else 0.0,
    }


def hf_decode(pair: Pair, batch: int, prompt_len: int, new: int, device: str) -> float:
    """transformers' greedy generate with a static cache, which its `generate` compiles on a GPU (torch.compile's
    "reduce-overhead": CUDA graphs): output tokens/s after a warm-up call (which compiles)."""
    hf = pair.hf
    hf.generation_config.cache_implementation = "static"
    prompt = torch.randint(0, pair.shape["vocab"], (batch, prompt_len), device=device)

    def once() -> None:
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    once()
    sync(device)
    t0 = time.perf_counter()
    once()
    sync(device)
    return batch * new / (time.perf_counter() - t0)


def prefill(pair: Pair, T: int, device: str) -> dict[str, float]:
    """One prompt of T tokens through llmkit's runner (a fresh table) and through transformers' forward."""
    from llmkit.serve.forward import Row
    from llmkit.serve.model_runner import StepPlan

    engine = engine_for(pair, 1)
    bs = engine.pool.block_size
    tokens = torch.randint(0, pair.shape["vocab"], (T,)).tolist()
    plan = StepPlan((Row(tokens, 0, list(range(-(-T // bs)))),))
    x = torch.tensor([tokens], device=device)

    def ours() -> None:
        with torch.inference_mode():
            engine.runner.execute(plan)

    def theirs() -> None:
        with torch.inference_mode():
            pair.hf(x, use_cache=False)

    out = {}
    for name, fn in (("llmkit", ours), ("transformers", theirs)):
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        sync(device)
        out[name] = (time.perf_counter() - t0) / 3
    s = pair.shape
    attention = 2 * 2 * s["layers"] * s["hidden"] * T * T / 2  # q k^T and p v, causal half
    flops = 2 * pair.params * T + attention
    return {"tokens": T, "flops": flops, "llmkit_s": out["llmkit"], "transformers_s": out["transformers"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--hf-batches", default="1", help="batches of the transformers comparison (each compiles)")
    ap.add_argument("--kv-dtypes", default="int8,fp8", help="quantized KV caches to compare with bf16's ('': none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device, dtype = args.device, torch.bfloat16
    lim = limits(device)
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    emit: Callable[[dict[str, Any]], None] = (
        (lambda row: print(json.dumps(row), flush=True)) if args.json else (lambda row: print(_line(row), flush=True))
    )
    emit({"part": "machine", "card": card, **lim, "torch": torch.__version__})
    for shape in args.shapes.split(","):
        t0 = time.perf_counter()
        pair = build(shape, device, dtype)
        weight_bytes = pair.params * 2
        s = pair.shape
        kv_bytes_per_token = 2 * s["layers"] * s["kv_heads"] * (s["hidden"] // s["heads"]) * 2
        decoded: dict[int, float] = {}
        emit({"part": "build", "shape": shape, "params_b": pair.params / 1e9, "s": time.perf_counter() - t0})
        for batch in (1, 8, 64):
            engine = engine_for(pair, max(batch, 8))
            prompts = [torch.randint(0, pair.shape["vocab"], (32,)).tolist() for _ in range(batch)]
            run_engine(engine, prompts, 8, device)  # warm-up: compiles the kernels, captures the graphs
            r = run_engine(engine, prompts, args.new, device)
            # steps/s if a step took only the time to read the weights and the rows' keys and values once (the
            # rows' mean context: the prompt and half the new tokens)
            cache_bytes = batch * (32 + args.new / 2) * kv_bytes_per_token
            ceiling = lim["read_gbs"] * 1e9 / (weight_bytes + cache_bytes)
            step_s = r["step_ms"] / 1e3
            row = {"part": "decode", "shape": shape, "batch": batch, "llmkit_tok_s": r["decode_tok_s"],
                   "step_ms": r["step_ms"], "of_bandwidth": (1 / step_s) / ceiling if step_s else 0.0}  # fmt: skip
            emit(row)
            decoded[batch] = r["decode_tok_s"]
            del engine
            release()
        for T in (512, 2048):
            p = prefill(pair, T, device)
            peak = lim["bf16_tflops"] * 1e12
            emit({"part": "prefill", "shape": shape, "tokens": T,
                  "llmkit_tok_s": T / p["llmkit_s"], "llmkit_of_peak": p["flops"] / p["llmkit_s"] / peak,
                  "transformers_tok_s": T / p["transformers_s"],
                  "transformers_of_peak": p["flops"] / p["transformers_s"] / peak})  # fmt: skip
        served: dict[int, float] = {}
        for concurrency in (1, 16, 64):
            engine = engine_for(pair, max(concurrency, 8))
            prompts = [torch.randint(0, pair.shape["vocab"], (512,)).tolist() for _ in range(concurrency)]
            run_engine(engine, prompts[:1], 4, device)  # warm-up
            r = run_engine(engine, prompts, args.new, device)
            emit({"part": "serve", "shape": shape, "concurrency": concurrency, "tok_s": r["tok_s"],
                  "ttft_p50": r["ttft_p50"], "ttft_p95": r["ttft_p95"]})  # fmt: skip
            served[concurrency] = r["tok_s"]
            del engine
            release()
        if args.kv_dtypes:
            for row in kv_dtype_rows(pair, args.kv_dtypes.split(","), args.new, device):
                emit({"part": "kv cache", "shape": shape, **row})
        if device == "cuda":  # the batch-invariant mode's cost: decoding alone, and serving 16 512-token prompts
            for concurrency, prompt_len, before in ((1, 32, decoded[1]), (16, 512, served[16])):
                engine = engine_for(pair, max(concurrency, 8), invariant=True)
                prompts = [torch.randint(0, pair.shape["vocab"], (prompt_len,)).tolist() for _ in range(concurrency)]
                run_engine(engine, prompts, 8, device)  # warm-up: compiles the kernels, captures the graphs
                r = run_engine(engine, prompts, args.new, device)
                tok_s = r["decode_tok_s"] if concurrency == 1 else r["tok_s"]
                emit({"part": "batch-invariant", "shape": shape, "concurrency": concurrency,
                      "prompt": prompt_len, "tok_s": tok_s, "of_default": tok_s / before,
                      "ttft_p50": r["ttft_p50"]})  # fmt: skip
                del engine
                release()
        # last, as it compiles for minutes: a run cut short by its time limit loses only these rows
        for batch in (int(b) for b in args.hf_batches.split(",") if b):
            theirs = hf_decode(pair, batch, 32, args.new, device)
            emit({"part": "decode vs transformers", "shape": shape, "batch": batch, "llmkit_tok_s": decoded[batch],
                  "transformers_tok_s": theirs, "ratio": decoded[batch] / theirs})  # fmt: skip
        del pair
        release()


def kv_dtype_rows(pair: Pair, kv_dtypes: list[str], new: int, device: str) -> list[dict[str, Any]]:
    """Decoding 32 requests of 1,024-token prompts with the cache in the model's bf16 and in each of `kv_dtypes`, the
    same prompts and the same bytes of cache: output tokens/s after the first token and the pool's blocks, the
    quantized ones as ratios to bf16's (a GPU without fp8 refuses fp8: its row says why)."""
    prompts = [torch.randint(0, pair.shape["vocab"], (1024,)).tolist() for _ in range(32)]
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 1 << 30
    kv_memory = min(int(free * 0.3), 16 << 30)  # the same for each cache: its blocks count what the codes save
    rows: list[dict[str, Any]] = []
    base: dict[str, float] = {}
    for kv_dtype in [None, *kv_dtypes]:
        try:
            engine = engine_for(pair, 32, kv_dtype=kv_dtype, kv_memory=kv_memory)
        except Exception as e:  # (an fp8 cache on a GPU before compute capability 8.9)
            rows.append({"kv_dtype": kv_dtype, "refused": str(e)})
            continue
        run_engine(engine, prompts, 4, device)  # warm-up as timed: compiles the kernels, captures the graphs
        r = run_engine(engine, prompts, new, device)
        blocks = engine.pool.n_blocks
        del engine
        release()
        if kv_dtype is None:
            base = {"tok_s": r["decode_tok_s"], "blocks": blocks}
        tok_s = r["decode_tok_s"]
        rows.append({"kv_dtype": kv_dtype or "bf16", "decode_tok_s": tok_s, "step_ms": r["step_ms"],
                     "of_bf16": tok_s / base["tok_s"], "blocks_of_bf16": blocks / base["blocks"]})  # fmt: skip
    return rows


def release() -> None:
    """Let the engines no name holds (their caches and graphs) go before the next part sizes its own from the free
    memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _line(row: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


if __name__ == "__main__":
    main()
