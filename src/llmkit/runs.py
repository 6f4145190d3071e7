"""The layout of a training run folder, read by training, generation, translation and the command line.

    OUT/config.yaml                       the training config, as run
    OUT/checkpoints/step-000500/          a complete checkpoint: an llmkit checkpoint plus the trainer's state
    OUT/checkpoints/latest                the name of the newest complete checkpoint
    OUT/averaged/                         the mean of the last checkpoints' weights (`llmkit average`)
    OUT/metrics.jsonl, loss.png, tensorboard/

A checkpoint folder counts as complete when both its model (llmkit.json) and its trainer state are there: they are
written into a temporary folder and renamed into place together (see train/checkpoint.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmkit.errors import LLMKitError
from llmkit.interop.checkpoint import FORMAT_FILE

CHECKPOINTS = "checkpoints"
LATEST = "latest"
AVERAGED = "averaged"
TRAINER_STATE = "trainer_state.pt"
TRAINER_STATE_JSON = "trainer_state.json"


def checkpoint_dir(run: str | os.PathLike[str]) -> Path:
    return Path(run) / CHECKPOINTS


def is_run(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a training run folder (rather than a checkpoint or a file)."""
    return checkpoint_dir(path).is_dir()


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / TRAINER_STATE).is_file() and (checkpoint / FORMAT_FILE).is_file()


def latest_checkpoint(run: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run folder, or None. `latest` names it; when that file is gone or names a
    checkpoint that is not there (removed by hand, say, because it was damaged), the newest complete one."""
    pointer = checkpoint_dir(run) / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise LLMKitError(
                f"{pointer} does not hold a checkpoint name (its bytes are not text): write the name of one of the "
                "run's checkpoints in it (e.g. step-000500), or remove it to use the newest"
            ) from None
        if _STEP.fullmatch(name) and is_complete(checkpoint_dir(run) / name):
            return checkpoint_dir(run) / name
    complete = [p for p in run_checkpoints(run) if is_complete(p)]
    return complete[-1] if complete else None


# a checkpoint folder's name: not step-000500.tmp (unfinished) nor step-000500.old-<pid> (being replaced)
_STEP = re.compile(r"step-\d+")


def run_checkpoints(run: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints of a run folder, oldest first."""
    found = checkpoint_dir(run).glob("step-*")
    return sorted(p for p in found if _STEP.fullmatch(p.name) and p.is_dir() and (p / FORMAT_FILE).is_file())


def resolve_checkpoint(path: str | os.PathLike[str], *, averaged: bool = True) -> Path:
    """A run folder -> its averaged checkpoint when there is one and `averaged` is set, else its latest; any other
    path unchanged."""
    p = Path(path)
    if not is_run(p):
        return p
    if averaged and (p / AVERAGED / FORMAT_FILE).is_file():
        return p / AVERAGED
    latest = latest_checkpoint(p)
    if latest is None:
        raise LLMKitError(f"{p} is a training run without a complete checkpoint")
    return latest
