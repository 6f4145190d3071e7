"""Checkpoint averaging (Vaswani et al. 2017 §6.1: "the base models ... averaging the last 5 checkpoints"): the
element-wise mean of the weights of several checkpoints of one run, written as an ordinary llmkit checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from llmkit.errors import LLMKitError
from llmkit.interop.checkpoint import load_llmkit, save_llmkit
from llmkit.runs import AVERAGED, run_checkpoints


def average_checkpoints(paths: list[Path], out: str | os.PathLike[str]) -> Path:
    """Average the weights of `paths` (same architecture) into `out`, with the first one's tokenizers and
    settings. Floating-point tensors are averaged in fp32 and stored in their own dtype; integer buffers are taken
    from the newest checkpoint."""
    if not paths:
        raise LLMKitError("no checkpoints to average")
    first = load_llmkit(paths[0])
    model = first.model
    arch = model.cfg.architecture()
    states = [model.state_dict()]
    for p in paths[1:]:
        other = load_llmkit(p)
        if other.model.cfg.architecture() != arch:
            raise LLMKitError(f"{p} has another architecture than {paths[0]}: only one run's checkpoints average")
        states.append(other.model.state_dict())
    averaged = {}
    for name, value in states[0].items():
        if value.is_floating_point():
            averaged[name] = (sum(s[name].float() for s in states) / len(states)).to(value.dtype)
        else:
            averaged[name] = states[-1][name]
    model.load_state_dict(averaged)
    target = Path(out)
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_llmkit(
        model,
        tmp,
        tokenizer=first.tokenizer,
        source_tokenizer=first.source_tokenizer,
        generation_config=first.generation_config,
    )
    (tmp / "averaged_from.txt").write_text("".join(str(p) + "\n" for p in paths))
    if target.exists():
        shutil.rmtree(target)
    tmp.replace(target)
    return target


def average_run(run: str | os.PathLike[str], last: int, out: str | os.PathLike[str] | None = None) -> Path:
    """Average the last `last` checkpoints of a run folder into RUN/averaged (or `out`)."""
    if last < 1:
        raise LLMKitError(f"last={last} must be >= 1")
    found = run_checkpoints(run)
    if len(found) < last:
        raise LLMKitError(f"{run} has {len(found)} complete checkpoints, fewer than the {last} to average")
    with torch.no_grad():
        return average_checkpoints(found[-last:], out if out is not None else Path(run) / AVERAGED)
