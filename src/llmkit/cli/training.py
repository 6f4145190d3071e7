"""Training commands: train a model from a YAML config, average a run's last checkpoints, merge LoRA adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Literal


def train(
    config: str | None = None,
    *,
    set_: list[str] | None = None,
    resume: bool = False,
    parallel: Literal["none", "ddp", "fsdp"] | None = None,
) -> int:
    """Train a model on prepared data: progress bar, metrics, loss plot, checkpoints.

    config: a YAML training config (sections model, data, optim, schedule, train, loss); defaults if omitted.
    set_: override a config value, e.g. --set optim.lr=3e-4 --set model.n_layers=6 (repeatable).
    resume: continue from the latest checkpoint in train.out, exactly where it stopped.
    parallel: data parallelism under torchrun: ddp or fsdp (the same as --set train.parallel=...).
    """
    from llmkit.recipes import train_and_evaluate
    from llmkit.train.config import load_train_config

    overrides = list(set_ or [])
    if parallel is not None:
        overrides.append(f"train.parallel={parallel}")
    cfg = load_train_config(config, overrides)
    done = train_and_evaluate(cfg, resume=resume)
    result = done.training
    if not result.main:  # another process of a torchrun launch: the main one reports
        return 0
    state = "interrupted; resume with --resume" if result.interrupted else "done"
    bpc = f", val bits/char {result.val_bpc:.4f}" if result.val_bpc is not None else ""
    loss = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    print(f"{state}: {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s{loss}{bpc}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    if done.test_scores is not None:
        print(f"test scores: {Path(cfg.train.out) / 'test_scores.json'}")
    print(f"loss plot: {Path(cfg.train.out) / 'loss.png'}")
    return 0


def average(run: str, *, last: int = 5, out: str | None = None) -> int:
    """Average the weights of a run's last checkpoints (as the paper did for its base models).

    run: a training run folder.
    last: how many of its newest checkpoints to average.
    out: where to write the averaged checkpoint (default RUN/averaged).
    """
    from llmkit.train.average import average_run

    path = average_run(run, last, out)
    print(f"averaged the last {last} checkpoints of {run} -> {path}")
    return 0


def merge(run: str, out: str) -> int:
    """Fold a LoRA run's adapters into its base checkpoint's weights: a plain checkpoint, as fast as the base.

    run: a LoRA fine-tuning run (its latest checkpoint), one of its checkpoints, or a folder PEFT saved.
    out: where to write the merged llmkit checkpoint (`llmkit convert` turns it into Hugging Face's or GGUF).
    """
    from llmkit.errors import InputError
    from llmkit.interop.checkpoint import read_meta, save_llmkit
    from llmkit.interop.load import load_model
    from llmkit.runs import resolve_checkpoint

    path = resolve_checkpoint(run)
    adapters = (path / "adapter_config.json").is_file()
    if not adapters or ((path / "llmkit.json").is_file() and not read_meta(path).get("adapter")):
        raise InputError(f"{path} holds no LoRA adapters (train with lora.r > 0, or give a folder PEFT saved)")
    loaded = load_model(path)
    save_llmkit(
        loaded.model,
        out,
        tokenizer=loaded.tokenizer,
        hf_model_type=loaded.hf_model_type,
        hf_config=loaded.hf_config,
        generation_config=loaded.generation_config,
    )
    for note in loaded.notes:
        print(note)
    print(f"merged checkpoint: {out}")
    return 0
