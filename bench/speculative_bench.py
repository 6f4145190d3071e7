"""Speculative decoding on a trained model: plain greedy against a small draft model and against the target's own
multi-token-prediction module, with the acceptance rates and speed-ups, and the check that every variant's greedy
output is token for token the plain output.

    .venv/bin/python bench/speculative_bench.py          # trains both models the first time (~7 minutes)

A quick check that it runs, with briefly trained models kept apart from the real ones:

    .venv/bin/python bench/speculative_bench.py --train-seconds 10 --tmp /tmp/spec --prompts 1 --new 8 --repeats 1

The target is the demo model (configs/demo.yaml: LLaMA-style, 256 wide, 6 layers) with one MTP module added
(mtp_depth 1, trained with weight 0.3); the draft is a 2-layer, 128-wide model of the same family on the same
tokenizer. Both train on the prepared Shakespeare data for --train-seconds (400) each and are kept under --tmp
(runs/bench/; --retrain to redo).

Then, for each prompt (a speaker's name, as in the plays), batch 1: generate --new tokens greedily with the target
alone, with the draft proposing k tokens per round, and with the MTP module proposing one. A sampled run (temperature
1) reports acceptance too: there, speculative sampling keeps the target's distribution exactly (tested in
tests/generate/test_speculative.py), not its tokens.

transformers' assisted generation (`assistant_model=`) is the reference where it applies: the target and draft are
exported to transformers' Llama format and timed in the same run. transformers has no counterpart for the MTP drafter.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import ROOT, RUNS, SHAKESPEARE, ensure_prepared, hf_greedy, hf_model, median_time

PROMPTS = ["ROMEO:", "JULIET:", "KING HENRY V:", "HAMLET:", "FIRST CITIZEN:", "LADY MACBETH:"]
DRAFT_MODEL = [
    "model.d_model=128",
    "model.n_layers=2",
    "model.attention.n_heads=4",
    "model.attention.n_kv_heads=2",
    "model.ffn.hidden_dim=352",
]


def ensure_trained(name: str, overrides: list[str], args: argparse.Namespace) -> Path:
    """The latest checkpoint of the demo config with `overrides`, trained in `args.tmp`/NAME unless it is there."""
    from llmkit.interop.load import load_model
    from llmkit.runs import latest_checkpoint
    from llmkit.train.config import load_train_config
    from llmkit.train.loop import train

    out = Path(args.tmp) / name
    latest = latest_checkpoint(out)
    if not args.retrain and latest is not None:
        try:
            load_model(latest)
            return latest
        except Exception as exc:  # a damaged earlier run: train again
            print(f"{out}: {exc}; training again")
    shutil.rmtree(out, ignore_errors=True)
    settings = [f"data.dir={SHAKESPEARE}", f"train.out={out}", f"train.time_limit={args.train_seconds}"]
    cfg = load_train_config(ROOT / "configs/demo.yaml", [*overrides, *settings])
    print(f"training {name} ...", flush=True)
    result = train(cfg)
    print(f"{name}: {result.steps} steps, {result.seconds:.0f} s, val bpc {result.val_bpc:.4f}", flush=True)
    assert result.checkpoint is not None
    return result.checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--k", default="2,4", help="draft lengths to try, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--train-seconds", type=int, default=400, help="training time of each model")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to run")
    p.add_argument("--tmp", default=str(RUNS), help="where the trained models and their exports are kept")
    args = p.parse_args()
    ensure_prepared(SHAKESPEARE, "shakespeare", "--vocab-size", "4096")
    from llmkit.generate import Sampling, generate, speculative_generate
    from llmkit.interop.hf import save_hf
    from llmkit.interop.load import load_model
    from llmkit.models import DecoderLM, build_model

    T1 = Sampling(temperature=1.0)  # acceptance when sampling at temperature 1

    target_dir = ensure_trained("spec-target", ["model.mtp_depth=1"], args)
    draft_dir = ensure_trained("spec-draft", DRAFT_MODEL, args)
    torch.set_grad_enabled(False)
    loaded = load_model(target_dir)
    target, tok = loaded.model.eval(), loaded.tokenizer
    draft = load_model(draft_dir).model.eval()
    assert tok is not None
    assert isinstance(target, DecoderLM) and isinstance(draft, DecoderLM)
    ks = [int(k) for k in args.k.split(",")]

    # transformers' assisted generation on the same weights (the MTP module has no Llama counterpart: dropped)
    plain_target = build_model(dataclasses.replace(target.cfg, mtp_depth=0))
    plain_target.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("mtp.")})
    hf_dirs = {}
    for name, model in (("target", plain_target), ("draft", draft)):
        hf_dirs[name] = Path(args.tmp) / f"spec-{name}-hf"
        save_hf(model, hf_dirs[name], model_type="llama")
    hf_target, hf_draft = hf_model(hf_dirs["target"]), hf_model(hf_dirs["draft"])

    rows: dict[str, dict[str, list[float]]] = {}

    def record(name: str, seconds: float, n: int, accept: float | None, same: bool) -> None:
        r = rows.setdefault(name, {"tok_s": [], "accept": [], "same": []})
        r["tok_s"].append(n / seconds)
        if accept is not None:
            r["accept"].append(accept)
        r["same"].append(float(same))

    def one_prompt(prompt: list[list[int]]) -> None:
        ids = torch.tensor(prompt)
        s, plain = median_time(lambda: generate(target, prompt, max_new_tokens=args.new), args.repeats)
        ref = plain.new_tokens[0]
        record("target alone", s, len(ref), None, True)
        for k in ks:
            drafted = partial(speculative_generate, target, prompt, draft=draft, max_new_tokens=args.new, k=k)
            s, out = median_time(drafted, args.repeats)
            record(f"draft model, k={k}", s, len(out.new_tokens[0]), out.acceptance_rate, out.new_tokens[0] == ref)
            out = speculative_generate(target, prompt, draft=draft, max_new_tokens=args.new, k=k, sampling=T1, seed=0)
            rows[f"draft model, k={k}"].setdefault("accept_t1", []).append(out.acceptance_rate)
        s, out = median_time(lambda: speculative_generate(target, prompt, max_new_tokens=args.new), args.repeats)
        record("MTP module, k=1", s, len(out.new_tokens[0]), out.acceptance_rate, out.new_tokens[0] == ref)
        out = speculative_generate(target, prompt, max_new_tokens=args.new, sampling=T1, seed=0)
        rows["MTP module, k=1"].setdefault("accept_t1", []).append(out.acceptance_rate)

        def hf(**extra: Any) -> list[int]:
            return hf_greedy(hf_target, ids, args.new, **extra)[0, ids.shape[1] :].tolist()

        s, hf_out = median_time(hf, args.repeats)
        record("transformers, target alone", s, args.new, None, hf_out == ref)
        for k in ks:
            kw = dict(assistant_model=hf_draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
            s, hf_out = median_time(partial(hf, **kw), args.repeats)
            record(f"transformers assisted, k={k}", s, args.new, None, hf_out == ref)

    prompts = PROMPTS[: args.prompts]
    for text in prompts:
        one_prompt([tok.encode(text)])
    base = statistics.mean(rows["target alone"]["tok_s"])
    print(
        f"\ntarget {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M parameters (with its MTP module), "
        f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M; batch 1, fp32, {args.new} new tokens, "
        f"{len(prompts)} prompts, median of {args.repeats} per prompt"
    )
    print("| drafter | tokens/s | speed-up | acceptance (greedy) | acceptance (temperature 1) | same tokens as plain |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        tok_s = statistics.mean(r["tok_s"])
        acc = f"{100 * statistics.mean(r['accept']):.1f}%" if r["accept"] else "-"
        acc1 = f"{100 * statistics.mean(r['accept_t1']):.1f}%" if r.get("accept_t1") else "-"
        same = f"{int(sum(r['same']))}/{len(r['same'])}"
        print(f"| {name} | {tok_s:.1f} | {tok_s / base:.2f}x | {acc} | {acc1} | {same} |")


if __name__ == "__main__":
    main()
