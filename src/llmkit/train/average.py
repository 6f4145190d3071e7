"""Checkpoint averaging (Vaswani et al. 2017 §6.1: "the base models ... averaging the last 5 checkpoints"): the
element-wise mean of the weights of several checkpoints of one run, written as an ordinary llmkit checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from llmkit.errors import LLMKitError
from llmkit.interop.checkpoint import load_llmkit, save_llmkit
from llmkit.outputs import building, claim
from llmkit.runs import AVERAGED, run_checkpoints

FROM = "averaged_from.txt"  # the checkpoints an average was made of; marks the folder as one


def average_checkpoints(paths: list[Path], out: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Average the weights of `paths` (same architecture) into `out`, with the first one's tokenizers and
    settings. Floating-point tensors are averaged in fp32 and stored in their own dtype; integer buffers are taken
    from the newest checkpoint. `out` is built beside itself and renamed into place when complete; an existing
    checkpoint there is replaced only with `overwrite`."""
    if not paths:
        raise LLMKitError("no checkpoints to average")
    target = Path(out)
    output = claim(target, "checkpoint", inputs=paths, overwrite=overwrite)
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
    with building(output) as tmp:
        save_llmkit(
            model,
            tmp,
            tokenizer=first.tokenizer,
            source_tokenizer=first.source_tokenizer,
            generation_config=first.generation_config,
        )
        (tmp / FROM).write_text("".join(str(p) + "\n" for p in paths))
    return target


def average_run(
    run: str | os.PathLike[str], last: int, out: str | os.PathLike[str] | None = None, *, overwrite: bool = False
) -> Path:
    """Average the last `last` checkpoints of a run folder into RUN/averaged (or `out`)."""
    if last < 1:
        raise LLMKitError(f"last={last} must be >= 1")
    found = run_checkpoints(run)
    if len(found) < last:
        raise LLMKitError(f"{run} has {len(found)} complete checkpoints, fewer than the {last} to average")
    target = Path(out) if out is not None else Path(run) / AVERAGED
    # RUN/averaged belongs to the run: each average (after each training, say) replaces the one before
    owned = target.resolve() == (Path(run) / AVERAGED).resolve() and (target / FROM).is_file()
    with torch.no_grad():
        return average_checkpoints(found[-last:], target, overwrite=overwrite or owned)
