"""Recipes: what follows a training run, in the order `llmkit train` runs it.

    train(cfg)                          the training loop (llmkit.train.loop), checkpoints in train.out
    -> average the last checkpoints     when train.average_last > 0 (Vaswani et al. 2017 §6.1), into OUT/averaged
    -> score the test split             for sentence-pair data with translate.score_test: beam search, sacreBLEU

Each step is a function of its own (`train`, `average_run`, `score_test`); a recipe only chains them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmkit.data.bitexts import is_parallel
from llmkit.train.average import average_run
from llmkit.train.config import TrainConfig
from llmkit.train.loop import Result, train
from llmkit.translate.scores import score_test


@dataclass
class Finished:
    """A training run and the steps after it."""

    training: Result
    averaged: Path | None = None  # the averaged checkpoint (train.average_last)
    test_scores: dict[str, Any] | None = None  # sentence pairs: BLEU, chrF and more on the test split


def train_and_evaluate(cfg: TrainConfig, *, resume: bool = False) -> Finished:
    """Train, then average the last checkpoints and score the test split when the config asks for them. Only the
    main process of a distributed run does the steps after training; an interrupted run stops after training."""
    done = Finished(train(cfg, resume=resume))
    if done.training.interrupted or not done.training.main:
        return done
    t, tr = cfg.train, cfg.translate
    if t.average_last:
        done.averaged = average_run(t.out, t.average_last)
        if t.progress:
            print(f"averaged the last {t.average_last} checkpoints: {done.averaged}")
    if is_parallel(cfg.data.dir) and tr.score_test:
        checkpoint = done.averaged or done.training.checkpoint or Path(t.out)
        done.test_scores = score_test(checkpoint, cfg.data.dir, settings=tr, out=t.out, progress=t.progress)
    return done
