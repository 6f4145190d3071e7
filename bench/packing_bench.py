"""Chat fine-tuning: packing examples into full rows (none attending to another) against one example per row padded
to the longest of the batch, on the same conversations and model, in one run: example tokens per second (what
training learns from; padding is not counted), and the share of each batch that is padding.

    .venv/bin/python bench/packing_bench.py [--data runs/finetune-bible/data] [--steps 6] [--lora]

The data is a prepared chat folder (`make finetune` writes one: SmolLM2's chat template over Bible verse pairs);
the model is its checkpoint (SmolLM2-135M-Instruct from the GGUF file, fp32). Each variant trains --steps steps
(the first is left out of the rate: it warms the allocator up), alternating twice so that a slow spell of a shared
machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, smollm2_gguf


def rate(data: Path, packing: bool, args: argparse.Namespace) -> tuple[float, float]:
    """(example tokens per second over steps 2.., padding share of the batches) of one short run."""
    from llmkit.train.config import TrainConfig
    from llmkit.train.loop import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = {
            "model": {"checkpoint": str(smollm2_gguf())},
            "data": {"dir": str(data), "seq_len": args.seq_len, "batch_size": args.batch, "packing": packing},
            "optim": {"lr": 1e-5},
            "train": {"steps": args.steps, "progress": False, "out": out, "save_every": 10_000, "eval_every": 10_000},
        }
        if args.lora:
            cfg["lora"] = {"r": 16, "alpha": 32, "targets": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]}
        trainer = Trainer(TrainConfig.from_dict(cfg))
        real = slots = 0
        seconds = 0.0
        for step in range(args.steps):
            args_, n = trainer.task.batch(step, 0)
            start = time.perf_counter()
            trainer.set_lr(step)
            trainer.train_step(step)
            if step:  # the first step warms up
                seconds += time.perf_counter() - start
                real += n
            slots += args_[0].numel()
        pad = 1 - sum(int((trainer.task.batch(s, 0)[0][2] >= 0).sum()) for s in range(args.steps)) / slots
        trainer.close()
    return real / seconds, pad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT / "runs/finetune-bible/data"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (r 16) instead of every weight")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    data = Path(args.data)
    if not (data / "meta.json").is_file():
        raise SystemExit(f"{data} holds no prepared chat data: run `make finetune` (or bench/finetune_translate.py)")
    torch.manual_seed(0)
    runs: dict[str, list[tuple[float, float]]] = {"packed": [], "padded": []}
    for _ in range(2):
        for name in runs:
            runs[name].append(rate(data, name == "packed", args))
    summary = {
        name: {"tokens_per_s": round(statistics.median(r[0] for r in v), 1), "padding": round(v[0][1], 3)}
        for name, v in runs.items()
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"SmolLM2-135M, fp32, batch {args.batch}, seq_len {args.seq_len}, {'LoRA' if args.lora else 'full'}")
    print("| rows | example tokens/s | padding |")
    print("|---|---|---|")
    for name, r in summary.items():
        print(f"| {name} | {r['tokens_per_s']} | {100 * r['padding']:.0f}% |")


if __name__ == "__main__":
    main()
