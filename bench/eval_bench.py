"""What each precision costs SmolLM2-135M-Instruct, measured by `llmkit eval`'s pieces, and what `llmkit eval` costs
against lm-evaluation-harness's own `hf` model on the same weights, in one run.

    make eval-bench          # = .venv/bin/python bench/eval_bench.py
    .venv/bin/python bench/eval_bench.py [--questions 200] [--tokens 8192] [--timing-questions 250] [--json]

Quality, per variant of the same weights: fp32 and bf16 (the Q4_1 file dequantized), int8 (llmkit's, from fp32),
int4 (the Q4_1 file kept as it is), Q4_K_M (made from the same file by llama.cpp's llama-quantize, when
runs/llama.cpp/build/bin/llama-quantize exists: bash bench/build_llama_server.sh):

- perplexity and bits per byte on the first --tokens tokens of the held-out tenth of each play (`--perplexity
  shakespeare`: windows of 1024, stride 512), KL(fp32 || variant) per token (mean, 99th percentile) and top-1
  agreement with fp32 on the same windows;
- accuracy on llmkit's offline tasks (llmkit_shakespeare_next_line, llmkit_bible_de_en), the first --questions of
  each: acc (the most likely choice) and acc_norm (per byte), as lm-evaluation-harness defines them.

Then the other checkpoints the project trains, when they are there: the demo model (`make demo`: runs/demo; its own
tokenizer, so bits per byte and accuracy only) and the LoRA and full fine-tunes of the translation example (`make
finetune`: runs/finetune-bible/{lora,full}, KL against SmolLM2 too).

Speed: --timing-questions questions of llmkit_shakespeare_next_line (4 choices each: 4 log-likelihood requests) through
lm-evaluation-harness's `simple_evaluate`, once with llmkit's model class and once with its `hf` model, on the fp32
weights (the Q4_1 file dequantized, saved in transformers' format), batch 32 each, each side in its own process:
seconds per 1,000 requests, the ratio, peak memory, and the check that both give the same accuracy. The matmul rate
and memory bandwidth are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import ROOT, RUNS, measure_limits, peak_rss_gib, report, smollm2_gguf

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = ["llmkit_shakespeare_next_line", "llmkit_bible_de_en"]
LLAMA_QUANTIZE = ROOT / "runs/llama.cpp/build/bin/llama-quantize"
WINDOW, STRIDE = 1024, 512


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and what matters here (AVX-512, AMX), e.g. 'AMD EPYC
    (family 26; AVX-512)'."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", "").split()
    features = [f for f, flag in (("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag in flags] or ["AVX2"]
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}; {', '.join(features)})"


def held_out_text(tok: Any, tokens: int) -> str:
    """The first `tokens` tokens of the held-out tenth of each play, as `llmkit eval --perplexity shakespeare`."""
    from llmkit.evaluate.texts import first_tokens, read_text

    return first_tokens(tok, read_text("shakespeare"), tokens)


def variants(args: argparse.Namespace) -> dict[str, Any]:
    """Loaders of SmolLM2's variants, by name (each loads when called)."""
    from llmkit.interop.load import load_model
    from llmkit.quant import quantize

    gguf = smollm2_gguf()
    found: dict[str, Any] = {
        "fp32": lambda: load_model(gguf, quantized=False).model,
        "bf16": lambda: load_model(gguf, quantized=False, dtype=torch.bfloat16).model,
        "int8": lambda: quantize(load_model(gguf, quantized=False).model, "int8"),
        "int4 (Q4_1 file)": lambda: load_model(gguf).model,
    }
    q4km = RUNS / "SmolLM2.Q4_K_M.gguf"
    if LLAMA_QUANTIZE.is_file() and not q4km.is_file():
        RUNS.mkdir(parents=True, exist_ok=True)
        cmd = [str(LLAMA_QUANTIZE), "--allow-requantize", str(gguf), str(q4km), "Q4_K_M"]
        subprocess.run(cmd, check=True, capture_output=True)
    if q4km.is_file():
        found["Q4_K_M (llama-quantize)"] = lambda: load_model(q4km).model
    return found


def accuracy(model: Any, tok: Any, questions: int) -> dict[str, dict[str, float]]:
    from llmkit.evaluate.harness import HarnessModel, run_tasks

    lm = HarnessModel(model, tok, batch_size=32, progress=False)
    results = run_tasks(lm, TASKS, limit=questions)["results"]
    return {t: {"acc": results[t]["acc,none"], "acc_norm": results[t]["acc_norm,none"]} for t in TASKS}


def quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Perplexity, KL against fp32 and accuracy for each variant and each trained checkpoint that exists."""
    from llmkit.cli.common import load_decoder
    from llmkit.evaluate import divergence, perplexity
    from llmkit.interop.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(smollm2_gguf())
    assert tok is not None
    text = held_out_text(tok, args.tokens)
    loaders = variants(args)
    reference = loaders["fp32"]().eval()
    rows = []
    for name, load in loaders.items():
        if args.trained_only:
            break
        started = time.perf_counter()
        model = load().eval()
        d = divergence(model, reference, tok, text, window=WINDOW, stride=STRIDE)
        rows.append(
            {
                "model": f"SmolLM2-135M-Instruct {name}",
                **{k: d.summary()[k] for k in ("perplexity", "kl_mean", "kl_p99", "same_top1")},
                "bits_per_byte": d.model.bits_per_byte,
                "tasks": accuracy(model, tok, args.questions),
                "seconds": time.perf_counter() - started,
            }
        )
        print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    trained = {"demo model (runs/demo)": ROOT / "runs/demo"}
    for kind in ("lora", "full"):
        trained[f"SmolLM2 + translation, {kind} (runs/finetune-bible/{kind})"] = ROOT / f"runs/finetune-bible/{kind}"
    for name, path in trained.items():
        if not path.exists():
            rows.append({"model": name, "missing": True})
            continue
        started = time.perf_counter()
        model, own = load_decoder(str(path), "fp32")
        mine = held_out_text(own, args.tokens)
        row: dict[str, Any] = {"model": name}
        window = min(WINDOW, model.cfg.position.max_seq_len)
        if own.backend.get_vocab() == tok.backend.get_vocab():  # SmolLM2 fine-tuned: what it changed, as KL
            d = divergence(model, reference, tok, text, window=WINDOW, stride=STRIDE)
            row |= {k: d.summary()[k] for k in ("perplexity", "kl_mean", "kl_p99", "same_top1")}
            row["bits_per_byte"] = d.model.bits_per_byte
        else:  # another tokenizer: the same text, its own tokens
            p = perplexity(model, own, mine, window=window, stride=window // 2)
            row |= {"perplexity": p.perplexity, "bits_per_byte": p.bits_per_byte}
        row["tasks"] = accuracy(model, own, args.questions)
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
    return rows


def timing_side(side: str, questions: int, hf_dir: Path) -> dict[str, Any]:
    """One side of the speed comparison, in this process: llmkit's model class or the harness's `hf`."""
    import lm_eval

    from llmkit.evaluate.harness import HarnessModel, task_names

    manager = task_names()
    if side == "llmkit":
        from llmkit.cli.common import load_decoder

        model, tok = load_decoder(str(hf_dir), "fp32")
        lm: Any = HarnessModel(model, tok, batch_size=32, progress=False)
    else:
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=32)
    started = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[TASKS[0]], task_manager=manager, limit=questions, bootstrap_iters=0, log_samples=False
    )
    seconds = time.perf_counter() - started
    requests = 4 * out["n-samples"][TASKS[0]]["effective"]
    return {
        "side": side,
        "seconds": seconds,
        "requests": requests,
        "acc": out["results"][TASKS[0]]["acc,none"],
        "peak_rss_gib": peak_rss_gib(),
    }


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides, each in a child process (its own peak memory), llmkit first."""
    from common import smollm2_hf

    from llmkit.interop.gguf import load_gguf_tokenizer

    hf_dir = smollm2_hf()
    if not (hf_dir / "tokenizer.json").is_file():
        tok = load_gguf_tokenizer(smollm2_gguf())
        assert tok is not None
        tok.save(hf_dir)
    sides = {}
    for side in ("llmkit", "hf"):
        cmd = [sys.executable, __file__, "--side", side, "--timing-questions", str(args.timing_questions)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
    sides["ratio"] = sides["hf"]["seconds"] / sides["llmkit"]["seconds"]
    return sides


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=200, help="questions of each offline task per model")
    p.add_argument("--tokens", type=int, default=8192, help="held-out tokens for perplexity and KL")
    p.add_argument("--timing-questions", type=int, default=250, help="questions (x4 requests) timed on each side")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--trained-only", action="store_true", help="of the quality rows, only the trained checkpoints")
    p.add_argument("--side", choices=["llmkit", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.side:
        from common import smollm2_hf

        print(json.dumps(timing_side(args.side, args.timing_questions, smollm2_hf())))
        return
    limits = measure_limits()
    summary: dict[str, Any] = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "limits": str(limits),
    }
    if not args.trained_only:
        summary["timing"] = timing(args)
    if not args.skip_quality:
        summary["quality"] = quality(args)
    report(summary, args.json, lambda: table(summary, args))


def table(s: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"{s['cpu']}, {s['threads']} threads; {s['limits']}")
    t = s.get("timing", {})
    for side in [k for k in ("llmkit", "hf") if k in t]:
        r = t[side]
        print(
            f"{side:>7}: {r['requests']} requests in {r['seconds']:.1f} s ({1000 * r['seconds'] / r['requests']:.1f} s "
            f"per 1,000), acc {r['acc']:.3f}, peak memory {r['peak_rss_gib']:.2f} GiB"
        )
    if t:
        print(f"llmkit is {t['ratio']:.2f}x as fast as lm-evaluation-harness's hf model")
    if "quality" not in s:
        return
    print(
        "\n| model | perplexity | bits/byte | KL mean | KL p99 | same top-1 | next line acc / norm | "
        "Bible de-en acc / norm |\n|---|---|---|---|---|---|---|---|"
    )
    for r in s["quality"]:
        if r.get("missing"):
            print(f"| {r['model']} | not there: not run | | | | | | |")
            continue
        kl = (f"{r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {100 * r['same_top1']:.1f}%") if "kl_mean" in r else "| |"
        acc = " | ".join(f"{r['tasks'][t]['acc']:.3f} / {r['tasks'][t]['acc_norm']:.3f}" for t in TASKS)
        print(f"| {r['model']} | {r['perplexity']:.2f} | {r['bits_per_byte']:.3f} | {kl} | {acc} |")


if __name__ == "__main__":
    main()
