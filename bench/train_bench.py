"""Training throughput: llmkit against Hugging Face transformers, same config, same weights, same batches, one run.

    .venv/bin/python bench/train_bench.py [--steps 12] [--batch 4] [--seq-len 256] [--data runs/data/shakespeare]

The model is the reference LLaMA-style config (768 wide, 12 layers, 12 heads, 4 KV heads, SwiGLU 2048, vocab 32000,
untied: 124.7M parameters). llmkit builds it, and transformers' LlamaForCausalLM gets the same initial weights through
llmkit's converter. Each variant trains in its own process (so its peak memory is its own) with AdamW on identical
batches; the first two steps are warm-up and not timed. The same run measures this machine's matmul peak (fp32 and
bf16) and memory bandwidth, and reports tokens/s, the ratio to transformers fp32, peak RSS, MFU (model FLOPs per token
x tokens/s over the measured matmul peak of the precision used), and how far each loss curve is from llmkit fp32's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# llmkit variants run as llmkit's trainer does, with perf.tune_allocator(); "hf-bf16-alloc" shows what transformers
# gains from the same allocator setting (a user of transformers alone does not get it)
VARIANTS = ["hf-fp32", "hf-bf16", "hf-bf16-alloc", "llmkit-fp32", "llmkit-bf16"]


def model_config():  # type: ignore[no-untyped-def]
    from llmkit import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig

    return ModelConfig(
        vocab_size=32000,
        d_model=768,
        n_layers=12,
        attention=AttentionConfig(n_heads=12, n_kv_heads=4),
        ffn=FFNConfig(kind="swiglu", hidden_dim=2048),
        position=PositionConfig(kind="rope", max_seq_len=2048),
        norm=NormConfig(kind="rmsnorm", eps=1e-5),
    )


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    """Train one variant; returns its per-step losses and throughput."""
    import transformers

    from llmkit import build_model
    from llmkit.interop.hf import config_from_hf, save_hf
    from llmkit.perf import tune_allocator
    from llmkit.train.config import OptimConfig
    from llmkit.train.data import TokenData, train_batch
    from llmkit.train.optim import build_optimizer

    lib, precision = variant.split("-")[:2]
    if lib == "llmkit" or variant.endswith("-alloc"):
        assert tune_allocator()
    torch.manual_seed(0)
    cfg = model_config()
    ours = build_model(cfg)
    if lib == "hf":
        tmp = Path(args.tmp) / "hf-init"
        if not (tmp / "config.json").is_file():
            save_hf(ours, tmp, model_type="llama")
        model = transformers.LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        assert config_from_hf(json.loads((tmp / "config.json").read_text())).architecture() == cfg.architecture()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    else:
        model = ours
        optimizer = build_optimizer(model, OptimConfig(lr=args.lr, weight_decay=0.1))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return model.loss(y, inputs=x).total

    model.train()
    data = TokenData(args.data)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    losses, times = [], []
    for step in range(args.steps):
        x, y = train_batch(data, args.seq_len, args.batch, seed=0, step=step, micro=0)
        start = time.perf_counter()
        with autocast:
            loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    timed = times[2:]
    tokens = args.batch * args.seq_len
    return {
        "variant": variant,
        "losses": losses,
        "tokens_per_s": tokens * len(timed) / sum(timed),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--data", default=str(ROOT / "runs/data/shakespeare"))
    p.add_argument("--tmp", default=str(ROOT / "runs/bench"))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args()
    if args.variant:  # a child process
        print(json.dumps(run_variant(args.variant, args)))
        return
    if not (Path(args.data) / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "llmkit", "prepare", "--out", args.data], check=True)
    from llmkit.analysis import analyze
    from llmkit.perf import matmul_flops, memory_bandwidth

    peak = {"fp32": matmul_flops(torch.float32, seconds=2.0), "bf16": matmul_flops(torch.bfloat16, seconds=2.0)}
    bandwidth = memory_bandwidth(seconds=1.0)
    flops_per_token = 3 * analyze(model_config(), seq_len=args.seq_len).flops_per_token
    results = {}
    for variant in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
            "--seq-len",
            str(args.seq_len),
            "--lr",
            str(args.lr),
            "--data",
            args.data,
            "--tmp",
            args.tmp,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["hf-fp32"]["tokens_per_s"]
    reference = results["llmkit-fp32"]["losses"]
    rows = []
    for variant, r in results.items():
        precision = variant.split("-")[1]  # fp32 / bf16
        diff = [abs(a - b) for a, b in zip(r["losses"], reference, strict=True)]
        rows.append(
            {
                "variant": variant,
                "tokens_per_s": r["tokens_per_s"],
                "vs_hf_fp32": r["tokens_per_s"] / base,
                "mfu": r["tokens_per_s"] * flops_per_token / peak[precision],
                "peak_rss_gib": r["peak_rss_gib"],
                "loss_first": r["losses"][0],
                "loss_last": r["losses"][-1],
                "max_abs_loss_diff_vs_llmkit_fp32": max(diff),
            }
        )
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "matmul_gflops": {k: v / 1e9 for k, v in peak.items()},
        "memory_read_gbs": bandwidth / 1e9,
        "config": {
            "params": sum(
                p.numel() for p in __import__("llmkit").build_model(model_config(), device="meta").parameters()
            ),
            "batch": args.batch,
            "seq_len": args.seq_len,
            "steps": args.steps,
        },
        "results": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"machine: {summary['machine']}")
    print(
        f"measured: fp32 matmul {peak['fp32'] / 1e9:.0f} GFLOP/s, bf16 matmul {peak['bf16'] / 1e9:.0f} GFLOP/s, "
        f"memory read {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"model: {summary['config']['params'] / 1e6:.1f}M parameters, batch {args.batch} x {args.seq_len}, "
        f"{args.steps} steps (2 warm-up)"
    )
    print(
        f"{'variant':<12} {'tokens/s':>9} {'vs HF fp32':>10} {'MFU':>6} {'peak RSS':>9} {'loss 1st':>9} "
        f"{'loss last':>9} {'max |loss - llmkit fp32|':>25}"
    )
    for r in rows:
        print(
            f"{r['variant']:<12} {r['tokens_per_s']:>9.1f} {r['vs_hf_fp32']:>9.2f}x {100 * r['mfu']:>5.1f}% "
            f"{r['peak_rss_gib']:>7.2f} G {r['loss_first']:>9.4f} {r['loss_last']:>9.4f} "
            f"{r['max_abs_loss_diff_vs_llmkit_fp32']:>25.4f}"
        )


if __name__ == "__main__":
    main()
