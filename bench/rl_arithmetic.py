"""The reinforcement-learning example: SmolLM2-135M-Instruct taught by GRPO to answer sums correctly, and by DPO on
pairs of its own answers ranked by the same rule; held-out accuracy before and after, scored with `llmkit eval`.

    .venv/bin/python bench/rl_arithmetic.py [--minutes 20] [--dpo-minutes 8] [--out runs/rl-arithmetic] [--json]
    make rl

1. The data, made here (no download): "What is 17 + 25?" for every pair of numbers from 1 to 30, each pair once in
   one of a few phrasings, with its answer, after the system message "Answer with the number only."; --test of them
   (chosen by a hash) are held out, written as an lm-evaluation-harness task (generate_until, the prompt in the
   model's chat template, greedy, up to 24 tokens, exact match on the last number of the answer).
2. The model as it comes (the GGUF file dequantized to fp32): `llmkit eval GGUF --tasks llmkit_arithmetic
   --include-path OUT/tasks`.
3. GRPO: `llmkit train` with rl.prompts (4 prompts a step, 8 completions each at temperature 0.7, up to 16 new
   tokens, the exact_answer reward: 1 when the last number is the sum), every weight training (AdamW, lr --lr),
   for --minutes of this CPU; then the same evaluation.
4. DPO on the model's own answers: 8 sampled answers to each of --dpo-prompts training problems, a correct one
   chosen and a wrong one rejected where both exist, `llmkit prepare preferences` (the reference log-probabilities
   from the GGUF file), `llmkit train` for --dpo-minutes; then the same evaluation.

Everything runs on this machine's CPU in fp32; the figures go to OUT/results.json and, as a table, to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import smollm2_gguf, train_child

MAX = 30  # operands from 1 to MAX
PHRASES = ["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "What do you get when you add {a} to {b}?"]
SYSTEM = "Answer with the number only."  # (also replaces SmolLM2's default system prompt: 16 tokens fewer a prompt)
TASK = "llmkit_arithmetic"


def problems() -> list[dict[str, Any]]:
    """Every sum of two numbers from 1 to MAX, each in one of the phrasings (chosen by a seeded generator)."""
    rng = random.Random(0)
    out = []
    for a in range(1, MAX + 1):
        for b in range(1, MAX + 1):
            question = rng.choice(PHRASES).format(a=a, b=b)
            out.append({"question": question, "answer": a + b})
    return out


def rank(problem: dict[str, Any]) -> int:
    """A problem's place in a fixed shuffled order (a hash of its question): the first --test are held out."""
    return int.from_bytes(hashlib.sha256(problem["question"].encode()).digest()[:8], "little")


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def write_data(out: Path, tokenizer: Any, test: int) -> dict[str, int]:
    """OUT/prompts.jsonl (GRPO's prompts, chat messages), OUT/tasks/ (the held-out problems as a task) and
    OUT/train_problems.json."""
    from llmkit.tokenizer import render_chat

    every = sorted(problems(), key=rank)
    tests, train = every[:test], every[test:]
    out.mkdir(parents=True, exist_ok=True)
    lines = [{"prompt": messages(p["question"]), "answer": p["answer"]} for p in train]
    (out / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (out / "train_problems.json").write_text(json.dumps(train))
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    docs = [
        {"prompt": render_chat(tokenizer, messages(p["question"]), add_generation_prompt=True),
         "answer": str(p["answer"])}
        for p in tests
    ]  # fmt: skip
    (tasks / f"{TASK}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {(tasks / f'{TASK}.jsonl').resolve()}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: '{{prompt}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['<|im_end|>']\n  do_sample: false\n  max_gen_toks: 24\n"
        "filter_list:\n  - name: last_number\n    filter:\n"
        "      - function: regex\n        regex_pattern: '(-?[0-9][0-9,]*)'\n        group_select: -1\n"
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1\n"
    )
    return {"train_problems": len(train), "test_problems": len(tests)}


def evaluate(checkpoint: Path | str, tasks: Path, out: Path, limit: int | None = None) -> dict[str, Any]:
    """`llmkit eval` on the held-out task in fp32: accuracy and seconds (the report in OUT/eval.json)."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    report = out / "eval.json"
    cmd = [sys.executable, "-m", "llmkit", "eval", str(checkpoint), "--tasks", TASK, "--include-path", str(tasks),
           "--dtype", "fp32", "--output", str(report), "--overwrite"]  # fmt: skip
    cmd += ["--limit", str(limit)] if limit else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llmkit eval failed:\n{done.stderr[-2000:]}")
    result = json.loads(report.read_text())
    accuracy = result["results"][TASK]["exact_match,last_number"]
    return {"accuracy": round(float(accuracy), 4), "eval_seconds": round(time.perf_counter() - start, 1)}


def train_run(config: dict[str, Any], out: Path) -> dict[str, Any]:
    """`llmkit train` on `config` in a fresh run folder `out`, in a child process: its wall time, peak resident memory
    and its metrics."""
    shutil.rmtree(out, ignore_errors=True)  # the example's own run folder: a fresh run each time
    out.mkdir(parents=True)
    seconds, peak, rows = train_child(config, out.parent / f"{out.name}.yaml")
    steps = [r for r in rows if "loss" in r]
    return {
        "seconds": round(seconds, 1),
        "train_seconds": round(steps[-1]["time"], 1),
        "steps": steps[-1]["step"],
        "tokens": steps[-1]["tokens"],
        "peak_rss_gib": round(peak, 2),
        "rows": rows,
    }


def self_ranked_pairs(gguf: Path, train: list[dict[str, Any]], prompts: int, out: Path) -> dict[str, Any]:
    """8 answers sampled from the model (temperature 0.7) to each of `prompts` training problems; where some are right
    and some wrong, one right answer is chosen and one wrong answer rejected (the exact_answer rule). Writes
    OUT/pairs.jsonl."""
    from llmkit.interop.load import load_model
    from llmkit.serve.config import EngineConfig
    from llmkit.serve.engine import Engine
    from llmkit.serve.request import SamplingParams
    from llmkit.tokenizer import render_chat
    from llmkit.train.rewards import Completion, exact_answer

    loaded = load_model(gguf, dtype=torch.float32, quantized=False)
    tok = loaded.tokenizer
    assert tok is not None
    engine = Engine(loaded.model, tok, EngineConfig(kv_memory=1 << 29, max_batch=256, step_tokens=2048))
    chosen = random.Random(1).sample(train, min(prompts, len(train)))
    ids = [
        tok.backend.encode(render_chat(tok, messages(p["question"]), add_generation_prompt=True),
                           add_special_tokens=False).ids
        for p in chosen
    ]  # fmt: skip
    start = time.perf_counter()
    with torch.no_grad():
        outs = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.7, n=8, seed=5))
    seconds = time.perf_counter() - start
    rng = random.Random(2)
    pairs = []
    for k, p in enumerate(chosen):
        answers = outs[8 * k : 8 * k + 8]
        right = [a.text for a in answers if exact_answer(Completion("", a.text, 0, "stop"), p)]
        wrong = [a.text for a in answers if not exact_answer(Completion("", a.text, 0, "stop"), p)]
        if right and wrong:
            pairs.append({"prompt": messages(p["question"]),
                          "chosen": [{"role": "assistant", "content": rng.choice(right)}],
                          "rejected": [{"role": "assistant", "content": rng.choice(wrong)}]})  # fmt: skip
    (out / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
    sampled = sum(len(o.token_ids) for o in outs)
    return {"prompts": len(chosen), "pairs": len(pairs), "sampled_tokens": sampled, "seconds": round(seconds, 1)}


def grpo_config(gguf: Path, out: Path, minutes: float, steps: int, lr: float) -> dict[str, Any]:
    return {
        "model": {"checkpoint": str(gguf)},
        "data": {"batch_size": 4},
        "optim": {"lr": lr, "weight_decay": 0.0, "beta2": 0.99},
        "schedule": {"kind": "constant", "warmup_steps": 3},
        "rl": {
            "prompts": str(out / "prompts.jsonl"),
            "group": 8,
            "max_new_tokens": 16,
            "temperature": 0.7,
            "rewards": ["exact_answer"],
            "val_fraction": 0.05,
            "eval_prompts": 32,
        },
        "train": {
            "steps": steps,
            "time_limit": minutes * 60,
            "eval_every": 25,
            "save_every": 10_000,
            "log_every": 1,
            "keep_last": 1,
            "progress": False,
            "precision": "fp32",
            "out": str(out / "grpo"),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/rl-arithmetic")
    ap.add_argument("--minutes", type=float, default=20.0, help="GRPO's training time")
    ap.add_argument("--steps", type=int, default=1000, help="GRPO's most steps (the time limit usually ends it)")
    ap.add_argument("--lr", type=float, default=2e-5, help="GRPO's learning rate (AdamW, every weight)")
    ap.add_argument("--dpo-minutes", type=float, default=8.0, help="DPO's training time (0: no DPO)")
    ap.add_argument("--dpo-prompts", type=int, default=192, help="training problems the model answers for DPO")
    ap.add_argument("--test", type=int, default=150, help="held-out problems")
    ap.add_argument("--only", choices=["grpo", "dpo"], default=None,
                    help="run one part (dpo: on an earlier run's data and results in --out)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmkit.data.prepare import load_tokenizer

    gguf = smollm2_gguf()
    out = Path(args.out)
    results: dict[str, Any] = {"checkpoint": str(gguf), "threads": torch.get_num_threads()}
    if args.only == "dpo":  # the rest of an earlier run's results, with its data
        results = json.loads((out / "results.json").read_text())
    else:
        results["data"] = write_data(out, load_tokenizer(gguf), args.test)
        results["before"] = evaluate(gguf, out / "tasks", out / "eval-before")
        print(f"before: {results['before']}", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.only != "dpo":
        grpo(gguf, out, args, results)
    if args.dpo_minutes > 0 and args.only != "grpo":
        dpo(gguf, out, args, results)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
        return
    table(results)


def grpo(gguf: Path, out: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    run = train_run(grpo_config(gguf, out, args.minutes, args.steps, args.lr), out / "grpo")
    rows = run.pop("rows")
    steps = [r for r in rows if "reward" in r]
    results["grpo"] = {
        **run,
        "reward_first_10": round(sum(r["reward"] for r in steps[:10]) / len(steps[:10]), 4),
        "reward_last_10": round(sum(r["reward"] for r in steps[-10:]) / len(steps[-10:]), 4),
        "completion_tokens": round(sum(r["completion_tokens"] for r in steps) / len(steps), 1),
        "max_logp_gap": max(r["logp_gap"] for r in steps),
        **evaluate(out / "grpo", out / "tasks", out / "eval-grpo"),
    }
    print(f"grpo: {results['grpo']}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def dpo(gguf: Path, out: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Pairs of the model's own answers, DPO on them, the same evaluation."""
    results["dpo_pairs"] = self_ranked_pairs(gguf, json.loads((out / "train_problems.json").read_text()),
                                             args.dpo_prompts, out)  # fmt: skip
    print(f"pairs: {results['dpo_pairs']}", flush=True)
    subprocess.run([sys.executable, "-m", "llmkit", "prepare", "preferences", str(out / "pairs.jsonl"),
                    "--checkpoint", str(gguf), "--out", str(out / "prefs"), "--overwrite"], check=True)  # fmt: skip
    config = {
        "model": {"checkpoint": str(gguf)},
        "data": {"dir": str(out / "prefs"), "seq_len": 128, "batch_size": 8},
        "optim": {"lr": 5e-6, "weight_decay": 0.0},
        "loss": {"preference": "dpo", "preference_beta": 0.1},
        "schedule": {"kind": "constant", "warmup_steps": 3},
        "train": {
            "steps": 1000,
            "time_limit": args.dpo_minutes * 60,
            "eval_every": 10_000,
            "save_every": 10_000,
            "log_every": 5,
            "keep_last": 1,
            "progress": False,
            "precision": "fp32",
            "out": str(out / "dpo"),
        },
    }
    run = train_run(config, out / "dpo")
    rows = run.pop("rows")
    last = [r for r in rows if "reward_accuracy" in r][-1]
    held = [r for r in rows if "val_reward_accuracy" in r]
    results["dpo"] = {**run, "reward_accuracy": round(last["reward_accuracy"], 3),
                      "val_reward_accuracy": round(held[-1]["val_reward_accuracy"], 3) if held else None,
                      **evaluate(out / "dpo", out / "tasks", out / "eval-dpo")}  # fmt: skip
    print(f"dpo: {results['dpo']}", flush=True)


def table(results: dict[str, Any]) -> None:
    n = results["data"]["test_problems"]
    print(f"\n{n} held-out sums, greedy, exact match on the last number (llmkit eval); fp32 on this CPU")
    print("| model | accuracy | steps | train time | tokens | peak memory |")
    print("|---|---|---|---|---|---|")
    print(f"| SmolLM2-135M-Instruct as it comes | {results['before']['accuracy']:.3f} | | | | |")
    for name in ("grpo", "dpo"):
        if name in results:
            r = results[name]
            print(f"| {name} | {r['accuracy']:.3f} | {r['steps']} | {r['train_seconds']:.0f} s | {r['tokens']:,} | "
                  f"{r['peak_rss_gib']} GiB |")  # fmt: skip


if __name__ == "__main__":
    main()
