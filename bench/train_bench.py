"""Training throughput: llmkit against Hugging Face transformers, same config, same weights, same batches, one run.

    .venv/bin/python bench/train_bench.py [--steps 12] [--batch 4] [--seq-len 256] [--data runs/data/shakespeare]

The model is the reference LLaMA-style config (768 wide, 12 layers, 12 heads, 4 KV heads, SwiGLU 2048, vocab 32000,
untied: 124.7M parameters). llmkit builds it, and transformers' LlamaForCausalLM gets the same initial weights through
llmkit's converter. Each variant trains in its own process (so its peak memory is its own) with AdamW on identical
batches; the first two steps are warm-up and not timed. The same run measures the machine's matmul peak (fp32 and
bf16) and memory bandwidth, and reports tokens/s, the ratio to transformers fp32, peak RSS, MFU (model FLOPs per token
x tokens/s over the measured matmul peak of the precision used), and how far each loss curve is from llmkit fp32's.

`--optimizers` instead trains the demo (configs/demo.yaml: five minutes, the schedule fitted to them) twice, with
AdamW and with Muon (optim.name=muon: Muon for the hidden matrices, AdamW for the rest, the same learning rate;
llmkit/train/optim.py), one after the other in one run, and reports each run's validation bits per character,
steps and tokens:

    .venv/bin/python bench/train_bench.py --optimizers [--minutes 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import (
    ROOT,
    RUNS,
    SHAKESPEARE,
    Limits,
    ensure_prepared,
    hf_model,
    measure_limits,
    peak_rss_gib,
    reference_config,
    reference_hf,
    report,
    timed,
)

# llmkit variants run as llmkit's trainer does, with perf.tune_allocator(); "hf-bf16-alloc" shows what transformers
# gains from the same allocator setting (a user of transformers alone does not get it)
VARIANTS = ["hf-fp32", "hf-bf16", "hf-bf16-alloc", "llmkit-fp32", "llmkit-bf16"]
WARMUP_STEPS = 2


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant; returns its per-step losses and throughput."""
    from llmkit import build_model
    from llmkit.interop.hf import config_from_hf
    from llmkit.machine.perf import tune_allocator
    from llmkit.models import DecoderLM
    from llmkit.train.config import OptimConfig
    from llmkit.train.data import TokenData, train_batch
    from llmkit.train.optim import build_optimizer

    lib, precision = variant.split("-")[:2]
    if lib == "llmkit" or variant.endswith("-alloc"):
        assert tune_allocator()
    cfg = reference_config()
    if lib == "hf":
        directory = reference_hf(Path(args.tmp))
        assert config_from_hf(json.loads((directory / "config.json").read_text())).architecture() == cfg.architecture()
        model = hf_model(directory)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    else:
        torch.manual_seed(0)  # the weights reference_hf saved for transformers
        model = build_model(cfg)
        assert isinstance(model, DecoderLM)  # (the reference config is a decoder)
        optimizer = build_optimizer(model, OptimConfig(lr=args.lr, weight_decay=0.1))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return model.loss(y, inputs=x).total

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    model.train()
    data = TokenData(args.data)
    losses, times = [], []
    for i in range(args.steps):
        x, y = train_batch(data, args.seq_len, args.batch, seed=0, step=i, micro=0)
        seconds, loss = timed(partial(step, x, y))
        times.append(seconds)
        losses.append(float(loss))
    timed_steps = times[WARMUP_STEPS:]
    return {
        "variant": variant,
        "losses": losses,
        "tokens_per_s": args.batch * args.seq_len * len(timed_steps) / sum(timed_steps),
        "peak_rss_gib": peak_rss_gib(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--data", default=str(SHAKESPEARE))
    p.add_argument("--tmp", default=str(RUNS))
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--optimizers", action="store_true", help="the demo with AdamW and with Muon instead")
    p.add_argument("--minutes", type=float, default=5.0, help="with --optimizers: each run's training time")
    args = p.parse_args()
    if args.optimizers:
        return optimizers(args)
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    if args.variant:  # a child process
        print(json.dumps(run_variant(args.variant, args)))
        return
    ensure_prepared(Path(args.data), "shakespeare")
    from llmkit import build_model
    from llmkit.analysis import analyze

    limits = measure_limits()
    flops_per_token = 3 * analyze(reference_config(), seq_len=args.seq_len).flops_per_token
    results = {}
    for variant in VARIANTS:
        child = ["--variant", variant, "--steps", str(args.steps), "--batch", str(args.batch)]
        child += ["--seq-len", str(args.seq_len), "--lr", str(args.lr), "--data", args.data, "--tmp", args.tmp]
        out = subprocess.run([sys.executable, __file__, *child], capture_output=True, text=True, check=True)
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
                "mfu": r["tokens_per_s"] * flops_per_token / limits.matmul_flops[precision],
                "peak_rss_gib": r["peak_rss_gib"],
                "loss_first": r["losses"][0],
                "loss_last": r["losses"][-1],
                "max_abs_loss_diff_vs_llmkit_fp32": max(diff),
            }
        )
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        **limits.as_dict(),
        "config": {
            "params": sum(p.numel() for p in build_model(reference_config(), device="meta").parameters()),
            "batch": args.batch,
            "seq_len": args.seq_len,
            "steps": args.steps,
        },
        "results": rows,
    }
    report(summary, args.json, lambda: print_table(summary, limits, args))


def optimizers(args: argparse.Namespace) -> None:
    """The demo's run with each optimizer: validation bits per character at the end of the same training time."""
    ensure_prepared(Path(args.data), "shakespeare", "--vocab-size", "4096")
    limits = measure_limits(("fp32", "bf16"))
    rows = []
    for name in ("adamw", "muon"):
        out = Path(args.tmp) / f"demo-{name}"
        sets = [f"optim.name={name}", f"train.out={out}", f"train.time_limit={args.minutes * 60:g}",
                f"data.dir={args.data}"]  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)  # (a run folder with checkpoints is only resumed)
        command = [sys.executable, "-m", "llmkit", "train", "configs/demo.yaml"]
        subprocess.run([*command, *(a for s in sets for a in ("--set", s))], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        evals = [row for row in log if "val_bpc" in row]
        steps = [row for row in log if "loss" in row]  # (the last evaluation: at the end of the time)
        rows.append({"optimizer": name, "val_bpc": evals[-1]["val_bpc"], "val_loss": evals[-1]["val_loss"],
                     "steps": steps[-1]["step"], "tokens": steps[-1].get("tokens"),
                     "bpc_by_step": [(row["step"], row["val_bpc"]) for row in evals]})  # fmt: skip
    summary = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               **limits.as_dict(), "minutes": args.minutes, "results": rows}  # fmt: skip

    def table() -> None:
        print(f"the demo (configs/demo.yaml), {args.minutes:g} minutes each; {limits}")
        print("| optimizer | validation bits/char | val loss | steps | tokens |")
        print("|---|---|---|---|---|")
        for r in rows:
            tokens = f"{r['tokens']:,}" if r["tokens"] else "-"
            print(f"| {r['optimizer']} | {r['val_bpc']:.4f} | {r['val_loss']:.4f} | {r['steps']} | {tokens} |")
        for r in rows:
            print(r["optimizer"], "bits/char by step:", ", ".join(f"{s}: {b:.3f}" for s, b in r["bpc_by_step"]))

    report(summary, args.json, table)


def print_table(summary: dict[str, Any], limits: Limits, args: argparse.Namespace) -> None:
    """The table BENCHMARKS.md quotes."""
    print(f"machine: {summary['machine']}")
    print(f"measured: {limits}")
    print(
        f"model: {summary['config']['params'] / 1e6:.1f}M parameters, batch {args.batch} x {args.seq_len}, "
        f"{args.steps} steps ({WARMUP_STEPS} warm-up)"
    )
    print(
        f"{'variant':<12} {'tokens/s':>9} {'vs HF fp32':>10} {'MFU':>6} {'peak RSS':>9} {'loss 1st':>9} "
        f"{'loss last':>9} {'max |loss - llmkit fp32|':>25}"
    )
    for r in summary["results"]:
        print(
            f"{r['variant']:<12} {r['tokens_per_s']:>9.1f} {r['vs_hf_fp32']:>9.2f}x {100 * r['mfu']:>5.1f}% "
            f"{r['peak_rss_gib']:>7.2f} G {r['loss_first']:>9.4f} {r['loss_last']:>9.4f} "
            f"{r['max_abs_loss_diff_vs_llmkit_fp32']:>25.4f}"
        )


if __name__ == "__main__":
    main()
