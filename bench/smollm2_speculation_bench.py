"""Speculative decoding on a real model: an MTP module grafted onto SmolLM2-135M-Instruct and trained with the trunk
frozen (self-speculation), against plain greedy decoding, in one run: tokens/s, acceptance rate, speed-up, and the
check that the output is token for token the plain output.

    .venv/bin/python bench/smollm2_speculation_bench.py [--sequences 800] [--own-minutes 12] [--chain 1,2,3,4]
    .venv/bin/python bench/smollm2_speculation_bench.py --baselines     # also the earlier grafts and the draft model

The module taught on the model's own text (`llmkit graft-mtp`, llmkit/train/own_text.py, drafting.py): SmolLM2 continues
--sequences 48-token openings from Shakespeare's plays (train split) for 208 tokens (an int4 copy writes them); its
states and top-8 logits there are the data; the module (block copied from the last block) learns the model's
distribution of the token after next and to stand in for its next state, also from its own outputs (--unroll), so it
drafts k tokens in a chain. Kept in runs/bench/smollm2-mtp-own (the text in runs/bench/smollm2-own-text; --retrain to
redo).

A draft model distilled from the target (`llmkit distill-draft`, llmkit/train/graft.py prune): SmolLM2's embedding, head
and blocks --keep (the first four and the last), trained on the same own text to match its next-token distributions for
--pruned-minutes, then drafting from an int8 copy (head included) k tokens a round (runs/bench/smollm2-pruned-draft).

--baselines adds what an earlier stop measured: the graft trained through `llmkit train` on the plays' text for
--minutes (`model: {checkpoint: SmolLM2.gguf, mtp_depth: 1}`, `train.trainable: [mtp]`), once learning the text's
tokens (`loss.mtp_target: data`) and once the model's distributions there (`mtp_target: model`), one draft a round,
in runs/bench/smollm2-mtp-{data,model}; and a draft model of SmolLM2's family at 256 wide and 4 layers (16M
parameters) distilled from it for --draft-minutes (runs/bench/smollm2-draft), --k drafts a round.

The prompts are 48-token openings from the plays' validation split, continued for --new tokens at batch 1, fp32,
with llmkit's C++ decode steps (--compiled adds torch.compile's steps). What bounds the gain: at batch 1 a decoding
step reads every weight once (538 MB in fp32; the memory bandwidth is measured in the same run), and verifying k + 1
tokens reads them once too, so a round yields 1 + (drafts accepted) tokens for about one step's time plus the k
drafts: each one block and the 49,152-row output head, read as an int4 copy (`draft_head_bits=4`, the output
unchanged).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from functools import partial
from pathlib import Path

import torch
from common import ROOT, RUNS, alternate, measure_limits, smollm2_gguf

DATA = ROOT / "runs/data/shakespeare-smollm2"


def timed_run(out: Path, seconds: float, tokens_per_s: float) -> dict[str, object]:
    """The train section of a run of about `seconds`: a schedule sized from the expected rate (8 x 256 tokens a step),
    stopped by the time limit if the rate was optimistic, one checkpoint at the end."""
    return {
        "steps": max(20, int(seconds * tokens_per_s / 2048)),
        "time_limit": seconds,
        "eval_every": 10_000,
        "eval_tokens": 16384,
        "save_every": 10_000,
        "keep_last": 1,
        "out": str(out),
    }


def ensure_grafted(gguf: Path, args: argparse.Namespace, target: str) -> Path:
    """The grafted checkpoint whose module learnt `target` (data | model), trained in runs/bench/smollm2-mtp-TARGET
    unless it is there."""
    from llmkit.runs import latest_checkpoint
    from llmkit.train.config import TrainConfig
    from llmkit.train.loop import train

    out = RUNS / f"smollm2-mtp-{target}"
    if not args.retrain and latest_checkpoint(out) is not None:
        return out
    shutil.rmtree(out, ignore_errors=True)
    seconds = args.minutes * 60
    cfg = {
        "model": {"checkpoint": str(gguf), "mtp_depth": 1},
        "data": {"dir": str(DATA), "seq_len": 256, "batch_size": 8},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "schedule": {"kind": "cosine", "warmup_steps": 10},
        "loss": {"mtp_weight": 1.0, "mtp_target": target},
        "train": {**timed_run(out, seconds, 250), "trainable": ["mtp"]},  # ~250 tokens/s: the trunk runs forward only
    }
    result = train(TrainConfig.from_dict(cfg))
    print(f"grafted MTP ({target}): {result.steps} steps, {result.tokens:,} tokens, {result.seconds:.0f} s", flush=True)
    return out


def ensure_own_text_drafter(gguf: Path, args: argparse.Namespace) -> Path:
    """The module taught on the model's own text (`llmkit graft-mtp`: --sequences continuations written by an int4
    copy, --own-minutes of training, chains of --unroll), in runs/bench/smollm2-mtp-own unless it is there."""
    from llmkit.cli.training import DrafterTraining, OwnText, graft_mtp

    out = RUNS / "smollm2-mtp-own"
    if not args.retrain and (out / "drafter.json").is_file():
        return out
    graft_mtp(
        str(gguf),
        str(out),
        data=str(DATA),
        unroll=args.unroll,
        overwrite=True,  # reached with --retrain, or when OUT is not a finished drafter
        text=OwnText(sequences=args.sequences, work=str(RUNS / "smollm2-own-text")),
        training=DrafterTraining(minutes=args.own_minutes),
    )
    return out


def ensure_pruned_draft(gguf: Path, args: argparse.Namespace) -> Path:
    """A draft made of SmolLM2's embedding, head and blocks --keep, distilled on the same own text for
    --pruned-minutes (`llmkit distill-draft`), in runs/bench/smollm2-pruned-draft unless it is there."""
    from llmkit.cli.training import DrafterTraining, OwnText, distill_draft

    out = RUNS / "smollm2-pruned-draft"
    if not args.retrain and (out / "drafter.json").is_file():
        return out
    distill_draft(
        str(gguf),
        str(out),
        data=str(DATA),
        keep=args.keep,
        k=4,
        overwrite=True,  # reached with --retrain, or when OUT is not a finished drafter
        text=OwnText(sequences=args.sequences, work=str(RUNS / "smollm2-own-text")),
        training=DrafterTraining(minutes=args.pruned_minutes),
    )
    return out


def ensure_distilled(gguf: Path, target: Path, args: argparse.Namespace) -> Path:
    """A small draft model of SmolLM2's family (256 wide, 4 layers, its tokenizer) distilled from the target for
    --draft-minutes, in runs/bench/smollm2-draft unless it is there."""
    from llmkit.interop.load import load_model
    from llmkit.runs import latest_checkpoint
    from llmkit.train.config import TrainConfig
    from llmkit.train.loop import train

    out = RUNS / "smollm2-draft"
    if not args.retrain and latest_checkpoint(out) is not None:
        return out
    shutil.rmtree(out, ignore_errors=True)
    model = load_model(gguf, quantized=False).model.cfg.to_dict()
    model.update(d_model=256, n_layers=4, mtp_depth=0)
    model["attention"].update(n_heads=4, n_kv_heads=2, head_dim=64)
    model["ffn"].update(hidden_dim=704)
    seconds = args.draft_minutes * 60
    cfg = {
        "model": model,
        "data": {"dir": str(DATA), "seq_len": 256, "batch_size": 8},
        "optim": {"lr": 2e-3},
        "schedule": {"kind": "cosine", "warmup_steps": 20},
        "loss": {"distill_from": str(target), "distill_weight": 0.8},
        "train": timed_run(out, seconds, 350),  # ~350 tokens/s: the teacher's forward dominates
    }
    result = train(TrainConfig.from_dict(cfg))
    print(f"distilled draft: {result.steps} steps, {result.tokens:,} tokens, {result.seconds:.0f} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=800, help="continuations the own-text module learns from")
    p.add_argument("--own-minutes", type=float, default=12.0, help="training time of the own-text module")
    p.add_argument("--unroll", type=int, default=3, help="the chain depth the own-text module trains for")
    p.add_argument("--chain", default="1,2,3,4", help="draft lengths k timed for the own-text module")
    p.add_argument("--baselines", action="store_true", help="also the text-trained grafts and the distilled draft")
    p.add_argument("--pruned-minutes", type=float, default=12.0, help="distillation of the pruned draft (0: none)")
    p.add_argument("--keep", default="0,1,2,3,29", help="SmolLM2's blocks the pruned draft keeps")
    p.add_argument("--minutes", type=float, default=8.0, help="training time of each baseline graft")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft-minutes", type=float, default=8.0, help="distillation time of the draft (0: none)")
    p.add_argument("--k", type=int, default=3, help="tokens the draft model proposes per round")
    p.add_argument("--compiled", action="store_true", help="also time torch.compile's steps (minutes of compiling)")
    p.add_argument("--train-only", action="store_true", help="train what is missing, then stop")
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from llmkit.data.prepare import prepare
    from llmkit.generate import MTPDraft, choose_step, generate, speculative_generate
    from llmkit.interop.load import load_model
    from llmkit.runs import resolve_checkpoint
    from llmkit.train.data import TokenData

    gguf = smollm2_gguf()
    if not (DATA / "meta.json").is_file():
        prepare("shakespeare", DATA, tokenizer=gguf)
    runs = {"own": ensure_own_text_drafter(gguf, args)}
    pruned_run = ensure_pruned_draft(gguf, args) if args.pruned_minutes > 0 else None
    draft_run = None
    if args.baselines:
        runs.update({target: ensure_grafted(gguf, args, target) for target in ("data", "model")})
        draft_run = ensure_distilled(gguf, resolve_checkpoint(runs["data"]), args) if args.draft_minutes > 0 else None
    if args.train_only:
        return
    limits = measure_limits(["fp32"], matmul_seconds=0.5)
    torch.set_grad_enabled(False)
    models = {target: load_model(resolve_checkpoint(run)).model.eval() for target, run in runs.items()}
    model = models["own"]
    draft = load_model(resolve_checkpoint(draft_run)).model.eval() if draft_run is not None else None
    pruned = None
    if pruned_run is not None:  # drafting from an int8 copy of it (head included): a tenth of a step's bytes. (An
        # int4 copy drafts nonsense: the distilled blocks' logits move by ~25 under int4's rounding; not understood)
        from llmkit.quant import quantize

        pruned = quantize(load_model(pruned_run).model.eval(), "int8", include_head=True)
    weight_bytes = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if not n.startswith("mtp."))
    val = TokenData(DATA).split("val").tokens
    starts = torch.linspace(0, len(val) - 1000, args.prompts).long().tolist()
    prompts = [[int(t) for t in val[s : s + 48]] for s in starts]

    rows: dict[str, dict[str, list[float]]] = {}
    for compiled in (False, True) if args.compiled else (False,):
        tag = "compiled" if compiled else "C++ steps"
        # every model's steps and the MTP drafts' low-bit copies are made once and serve every prompt
        steps = {name: choose_step(m, compiled) for name, m in models.items()}
        low4 = MTPDraft(model, steps["own"].native, head_bits=4)
        low8 = MTPDraft(models["model"], steps["model"].native, head_bits=8) if args.baselines else None
        pruned_step = choose_step(pruned, compiled) if pruned is not None else None
        draft_step = choose_step(draft, compiled) if draft is not None else None
        for prompt in prompts:
            run = partial(speculative_generate, prompts=[prompt], max_new_tokens=args.new)
            variants = {"plain": partial(generate, model, [prompt], max_new_tokens=args.new, step=steps["own"])}
            for k in (int(k) for k in args.chain.split(",")):
                variants[f"MTP taught on the model's own text, k={k}, int4 draft head"] = partial(
                    run, model, draft=low4, k=k, step=steps["own"]
                )
            if args.baselines:
                variants["MTP learnt from the text"] = partial(run, models["data"], step=steps["data"])
                variants["MTP self-distilled on the text"] = partial(run, models["model"], step=steps["model"])
                variants["the same, int8 draft head"] = partial(run, models["model"], draft=low8, step=steps["model"])
            if pruned is not None:
                for k in (int(k) for k in args.chain.split(",") if int(k) > 1):
                    name = f"draft distilled from the model's blocks {args.keep} on its own text, int8, k={k}"
                    variants[name] = partial(run, model, draft=pruned, k=k, step=steps["own"], draft_step=pruned_step)
            if draft is not None:
                variants[f"distilled draft model, k={args.k}"] = partial(
                    run, model, draft=draft, k=args.k, step=steps["own"], draft_step=draft_step
                )
            for fn in variants.values():  # warm-up (and the compilation)
                fn()
            seconds, results = alternate(variants, args.repeats)
            plain = results["plain"].new_tokens[0]
            for name, result in results.items():
                n = len(result.new_tokens[0])
                r = rows.setdefault(f"{name} ({tag})", {"tok_s": [], "accept": [], "same": []})
                r["tok_s"].append(n / seconds[name])
                if name != "plain":
                    r["accept"].append(result.acceptance_rate)
                    r["same"].append(float(result.new_tokens[0] == plain))
    summary = {
        "limits": limits.as_dict(),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "rows": {k: {m: round(statistics.mean(v), 3) if v else None for m, v in r.items()} for k, r in rows.items()},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    bw = limits.memory_read
    print(f"SmolLM2-135M-Instruct + grafted MTP module, batch 1, fp32, {args.new} new tokens, {len(prompts)} prompts")
    print(
        f"{limits}: the ceiling of one step per token is {bw / weight_bytes:.1f} tokens/s ({weight_bytes / 1e6:.0f} MB)"
    )
    print("| decoding | tokens/s | acceptance | speed-up | output = plain |")
    print("|---|---|---|---|---|")
    for tag in ("C++ steps", "compiled"):
        if f"plain ({tag})" not in rows:
            continue
        base = statistics.mean(rows[f"plain ({tag})"]["tok_s"])
        for key, r in rows.items():
            if not key.endswith(f"({tag})"):
                continue
            rate = statistics.mean(r["tok_s"])
            accept = f"{statistics.mean(r['accept']):.2f}" if r["accept"] else ""
            same = ("yes" if all(r["same"]) else "NO") if r["same"] else ""
            print(f"| {key} | {rate:.1f} | {accept} | {rate / base:.2f}x | {same} |")


if __name__ == "__main__":
    main()
