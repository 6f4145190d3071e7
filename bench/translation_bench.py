"""The Transformer against the RNN it replaced, on the same data, tokenizer, training loop, optimizer and wall-clock
budget: training tokens/s and test BLEU / chrF after the same number of minutes.

    .venv/bin/python bench/translation_bench.py            # trains whatever has not been trained (~45 minutes)
    .venv/bin/python bench/translation_bench.py --retrain  # trains both again

A quick check that it runs trains a few steps, apart from the real runs: `--runs /tmp/tr --set train.steps=3
--set train.save_every=1 --set train.eval_tokens=1024 --set translate.test_pairs=8`.

Both runs use the default parallel corpus (German -> English Bible verses, `llmkit prepare bible:de-en`) and their
configs in configs/ (translate.yaml: a 3+3-layer, 256-wide post-norm Transformer; translate-rnn.yaml: a 2-layer
bidirectional LSTM encoder and a 2-layer LSTM decoder with attention), each for train.time_limit seconds of training,
then the last 3 checkpoints averaged and the test split translated with beam 4, length penalty 0.6. Tokens/s counts
real source and target tokens (no padding). Runs go to runs/translate and runs/translate-rnn (--runs puts them
elsewhere; --set overrides a value of both configs).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from common import ROOT, ensure_prepared, llmkit_cli

DATA = ROOT / "runs/data/bible-de-en"
MODELS = {  # name: (config, the run's folder under --runs)
    "Transformer (post-norm, 3+3 layers, d 256)": ("configs/translate.yaml", "translate"),
    "LSTM + attention (2+2 layers, 512 states)": ("configs/translate-rnn.yaml", "translate-rnn"),
}


def summary(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "tokens_per_s" in r]
    vals = [r for r in rows if "val_loss" in r]
    last = train_rows[-1]
    scores = json.loads((run / "test_scores.json").read_text())
    from llmkit.interop.load import load_model

    params = sum(p.numel() for p in load_model(run / "averaged").model.parameters())
    return {
        "params": params,
        "steps": last["step"],
        "seconds": last["time"],
        "tokens_per_s": last["tokens"] / last["time"],
        "val_loss": vals[-1]["val_loss"],
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "decode_seconds": scores["decode_seconds"],
        "sentences": scores["sentences"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--runs", default=str(ROOT / "runs"), help="the folder the two runs go in")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as in llmkit train, for both")
    args = p.parse_args()
    ensure_prepared(DATA, "bible:de-en")
    runs = {name: (config, Path(args.runs).resolve() / folder) for name, (config, folder) in MODELS.items()}
    for config, run in runs.values():
        if args.retrain or not (run / "test_scores.json").is_file():
            shutil.rmtree(run, ignore_errors=True)
            overrides = [f"data.dir={DATA}", f"train.out={run}", *args.set]
            llmkit_cli("train", config, *(x for kv in overrides for x in ("--set", kv)))
    out = {name: summary(run) for name, (_, run) in runs.items()}
    first = next(iter(out.values()))
    print(f"German -> English, {first['sentences']} test verses, beam 4, length penalty 0.6, sacreBLEU 13a\n")
    print("| model | parameters | training | steps | tokens/s | val loss | test BLEU | test chrF | test decoding |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in out.items():
        print(
            f"| {name} | {s['params'] / 1e6:.1f}M | {s['seconds'] / 60:.0f} min | {s['steps']:,} | "
            f"{s['tokens_per_s']:,.0f} | {s['val_loss']:.3f} | {s['bleu']:.2f} | {s['chrf']:.2f} | "
            f"{s['decode_seconds']:.0f} s |"
        )


if __name__ == "__main__":
    main()
