"""train.fit_to_time: a time budget sets the schedule's length, so the learning rate finishes its decay inside the
budget on a fast machine and on a slow one (the demo's cosine was cut at 74% when steps were fixed)."""

from __future__ import annotations

import json
import math

import pytest

from llmkit.errors import ConfigError
from llmkit.runs import TRAINER_STATE_JSON, latest_checkpoint
from llmkit.train import loop
from llmkit.train.config import TrainConfig
from llmkit.train.loop import FIT_MARGIN, FIT_SHARE, FIT_SKIP, FIT_WINDOW, train

from .conftest import tiny_config


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


class StepClock:
    """A clock that moves only when a training step runs: `seconds(step)` per step. With it the fitted schedule is
    the same on any machine, however fast or busy (a real clock made this test fail on a loaded CI machine)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds) -> None:
        self.now, self.seconds = 0.0, seconds
        real = loop.Trainer.train_step

        def timed_step(trainer, step):
            self.now += self.seconds(step)
            return real(trainer, step)

        monkeypatch.setattr(loop.Trainer, "train_step", timed_step)
        monkeypatch.setattr(loop.Trainer, "clock", staticmethod(lambda: self.now))


def test_the_schedule_is_fitted_to_the_time_limit_and_decays_to_its_end(tiny_data, tmp_path, monkeypatch):
    StepClock(monkeypatch, lambda step: 0.05)
    cfg = tiny_config(
        tiny_data,
        tmp_path / "fit",
        train={"steps": 100_000, "time_limit": 6, "fit_to_time": True, "eval_every": 10_000, "save_every": 10_000},
        schedule={"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1},
    )
    result = train(TrainConfig.from_dict(cfg))
    planned = json.loads((latest_checkpoint(tmp_path / "fit") / TRAINER_STATE_JSON).read_text())["planned_steps"]
    # the step time, measured after FIT_SKIP steps over FIT_SHARE of the limit, leaves (6 s - elapsed) / (0.05 s x
    # (1 + FIT_MARGIN)) more steps; the schedule ends there, before the time limit
    measured_at = FIT_SKIP + max(FIT_WINDOW, math.ceil(FIT_SHARE * 6 / 0.05))
    assert planned == measured_at + int((6 - measured_at * 0.05) / (0.05 * (1 + FIT_MARGIN)))
    assert result.steps == planned and result.seconds < 6
    lrs = [r["lr"] for r in rows(tmp_path / "fit") if "lr" in r]
    assert lrs[-1] == pytest.approx(0.1 * cfg["optim"]["lr"], rel=0.05)  # the decay reached its floor


def test_fit_to_time_needs_a_time_limit(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="fit_to_time"):
        TrainConfig.from_dict(tiny_config(tiny_data, tmp_path / "x", train={"fit_to_time": True}))


def test_steps_that_become_slower_move_the_schedule_by_time(tiny_data, tmp_path, monkeypatch):
    """A machine that gets busy after the fit (here: every step after the 40th takes three times as long) would cut
    the schedule; it advances by the time spent instead, so the decay still ends inside the limit."""
    StepClock(monkeypatch, lambda step: 0.02 if step < 40 else 0.06)
    cfg = tiny_config(
        tiny_data,
        tmp_path / "slow",
        train={"steps": 100_000, "time_limit": 5, "fit_to_time": True, "eval_every": 10_000, "save_every": 10_000},
        schedule={"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1},
    )
    result = train(TrainConfig.from_dict(cfg))
    planned = json.loads((latest_checkpoint(tmp_path / "slow") / TRAINER_STATE_JSON).read_text())["planned_steps"]
    assert result.steps < planned and result.seconds < 5
    lrs = [r["lr"] for r in rows(tmp_path / "slow") if "lr" in r]
    assert lrs[-1] == pytest.approx(0.1 * cfg["optim"]["lr"], rel=0.1)
