"""The fine-tuning example: SmolLM2-135M-Instruct taught to translate German Bible verses into English through chat
messages, with LoRA and with full fine-tuning on the same data and time budget, scored with sacreBLEU before and
after on held-out verses.

    .venv/bin/python bench/finetune_translate.py [--minutes 20] [--train-pairs 6000] [--test 150] [--json]
    make finetune

1. The verse pairs of `llmkit prepare bible:de-en` (its train / test split) become chat lines,
   {"messages": [{"role": "user", "content": "Translate to English: <German verse>"},
                 {"role": "assistant", "content": "<English verse>"}]}, prepared with `llmkit prepare chat` and the
   GGUF file's chat template, so that the loss counts only the English answer.
2. BLEU of the model as it comes (the GGUF file dequantized to fp32): greedy decoding of each test verse's prompt.
3. `llmkit train` with LoRA (r 16, alpha 32 on q, k, v, o and the feed-forward projections), then with every weight
   training, each in its own process for --minutes (time and peak memory measured there), each scored the same way.
   The LoRA run's checkpoint is its adapters (PEFT's files); scoring loads it merged into the base.

Everything runs on this machine's CPU in fp32; the figures go to OUT/results.json and, as a table, to stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import smollm2_gguf, train_child

PROMPT = "Translate to English: "


def chat_lines(pairs: list[Any]) -> list[str]:
    return [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": PROMPT + p.source},
                    {"role": "assistant", "content": p.target},
                ]
            },
            ensure_ascii=False,
        )
        for p in pairs
    ]


def translate(checkpoint: Path | str, sources: list[str], batch: int, max_new: int) -> tuple[list[str], float]:
    """Greedy translations of `sources` by a checkpoint (prompts rendered with its chat template), and the seconds."""
    from llmkit.generate.decode import generate
    from llmkit.interop.load import load_model
    from llmkit.runs import resolve_checkpoint
    from llmkit.tokenizer import render_chat

    loaded = load_model(resolve_checkpoint(checkpoint), dtype=torch.float32, quantized=False)
    model, tok = loaded.model.eval(), loaded.tokenizer
    assert tok is not None
    start = time.perf_counter()
    order = sorted(range(len(sources)), key=lambda k: len(sources[k]))  # similar lengths batch together
    results: dict[int, str] = {}
    for i in range(0, len(order), batch):
        group = order[i : i + batch]
        prompts = [
            tok.encode(render_chat(tok, [{"role": "user", "content": PROMPT + sources[k]}]), add_bos=False)
            for k in group
        ]
        with torch.no_grad():
            gen = generate(model, prompts, max_new_tokens=max_new, eos_id=tok.eos_id)
        for k, ids in zip(group, gen.new_tokens, strict=True):
            results[k] = tok.decode(ids, skip_special=True).strip()
    out = [results[k] for k in range(len(sources))]
    return out, time.perf_counter() - start


def bleu(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    import sacrebleu

    return {
        "bleu": round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2),
    }


def train_run(config: dict[str, Any], out: Path) -> dict[str, Any]:
    """`llmkit train` on `config` in a child process: its wall time, peak resident memory and final losses."""
    out.mkdir(parents=True, exist_ok=True)
    seconds, peak, rows = train_child(config, out / "config.yaml")
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    return {
        "seconds": round(seconds, 1),
        "train_seconds": round(train_rows[-1]["time"], 1),
        "steps": train_rows[-1]["step"],
        "tokens": train_rows[-1]["tokens"],
        "tokens_per_s": round(train_rows[-1]["tokens"] / max(train_rows[-1]["time"], 1e-9), 1),
        "peak_rss_gib": round(peak, 2),
        "val_loss_first": evals[0]["val_loss"] if evals else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/finetune-bible")
    ap.add_argument("--minutes", type=float, default=20.0, help="training time of each run")
    ap.add_argument("--train-pairs", type=int, default=6000, help="verse pairs turned into chat lines")
    ap.add_argument("--test", type=int, default=150, help="held-out verses scored with sacreBLEU")
    ap.add_argument("--batch", type=int, default=8, help="conversations per step (packed rows of --seq-len)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=0, help="schedule length (0: estimated from --minutes)")
    ap.add_argument("--only", choices=["lora", "full"], default=None, help="run one of the two fine-tunings")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmkit.data.chat import ChatData, pack, prepare_chat
    from llmkit.data.pairs import DEFAULT, load_pairs, split_pairs

    gguf = smollm2_gguf()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = split_pairs(load_pairs(DEFAULT).pairs, 0.01, 0.02)  # the split `llmkit prepare bible:de-en` makes
    train_pairs = random.Random(0).sample(splits["train"], min(args.train_pairs, len(splits["train"])))
    test = splits["test"][: args.test]
    (out / "chat.jsonl").write_text("\n".join(chat_lines(train_pairs)) + "\n", encoding="utf-8")
    meta = prepare_chat(
        out / "chat.jsonl", out / "data", tokenizer=gguf, val_fraction=0.03, progress=False, overwrite=True
    )
    sources, references = [p.source for p in test], [p.target for p in test]
    max_new = 160
    results: dict[str, Any] = {
        "checkpoint": str(gguf),
        "train_conversations": meta["splits"]["train"]["examples"],
        "val_conversations": meta["splits"]["val"]["examples"],
        "test_verses": len(test),
        "threads": torch.get_num_threads(),
    }
    hyps, seconds = translate(gguf, sources, 16, max_new)
    results["before"] = {**bleu(hyps, references), "decode_seconds": round(seconds, 1), "sample": hyps[:3]}
    print(f"before: {results['before']}", flush=True)

    budget = args.minutes * 60
    common = {
        "model": {"checkpoint": str(gguf)},
        "data": {"dir": str(out / "data"), "seq_len": args.seq_len, "batch_size": args.batch},
        "schedule": {"kind": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1},
        "train": {
            "time_limit": budget,
            "eval_every": 10_000,
            "save_every": 10_000,
            "log_every": 5,
            "eval_tokens": 16384,
            "keep_last": 1,
            "progress": False,
        },
    }
    runs = {
        # example tokens/s measured on this machine (AMD, 2 cores) for 135M in fp32: about 95 (LoRA), 85 (full)
        "lora": (
            {"lora": {"r": 16, "alpha": 32, "targets": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]}},
            {"lr": 4e-4, "weight_decay": 0.0},
            95,
        ),
        "full": ({}, {"lr": 5e-5, "weight_decay": 0.0}, 85),
    }
    # the schedule's length: the steps the budget holds at that rate, a step holding the example tokens of
    # --batch packed rows (rows are not quite full: the next example often does not fit)
    split = ChatData(out / "data").split("train")
    rows = pack(split.lengths(), np.arange(len(split)), args.seq_len, packing=True)
    per_row = sum(min(int(n) - 1, args.seq_len) for n in split.lengths()) / len(rows)
    for name, (extra, optim, rate) in runs.items():
        if args.only and name != args.only:
            continue
        steps = args.steps or max(20, int(budget * rate / (args.batch * per_row)))
        cfg = {**common, **extra, "optim": optim}
        cfg["train"] = {**common["train"], "steps": steps, "out": str(out / name)}
        run = train_run(cfg, out / name)
        hyps, seconds = translate(out / name, sources, 16, max_new)
        results[name] = {**run, **bleu(hyps, references), "decode_seconds": round(seconds, 1), "sample": hyps[:3]}
        print(f"{name}: {results[name]}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    if args.json:
        print(json.dumps(results, indent=2, ensure_ascii=False))
        return
    print(f"\n{len(test)} held-out verses, greedy, sacreBLEU; training {args.minutes:g} min each on this CPU (fp32)")
    print("| model | BLEU | chrF | steps | tokens/s | train time | peak memory |")
    print("|---|---|---|---|---|---|---|")
    b = results["before"]
    print(f"| SmolLM2-135M-Instruct as it comes | {b['bleu']} | {b['chrf']} | | | | |")
    for name in ("lora", "full"):
        if name in results:
            r = results[name]
            print(
                f"| {name} | {r['bleu']} | {r['chrf']} | {r['steps']} | {r['tokens_per_s']} | "
                f"{r['train_seconds']:.0f} s | {r['peak_rss_gib']} GiB |"
            )
    print(f"reference: {references[0]}")
    for name in ("before", "lora", "full"):
        if name in results:
            print(f"{name}: {results[name]['sample'][0]}")


if __name__ == "__main__":
    main()
