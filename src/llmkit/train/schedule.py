"""Learning-rate schedules, as pure functions step -> multiplier of the peak learning rate.

cosine    linear warm-up, then half a cosine down to min_lr_ratio            (GPT-3, LLaMA)
wsd       linear warm-up, constant, then a linear decay over the last part   (warmup-stable-decay, MiniCPM)
noam      min(step^-1/2, step * warmup^-3/2) * warmup^1/2                    ("Attention Is All You Need" §5.3,
                                                                               normalised to peak at 1)
constant  linear warm-up, then 1
"""

from __future__ import annotations

import math
from collections.abc import Callable

from llmkit.train.config import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """f(step) for 0-based optimizer steps (step 0 is the first update)."""
    warmup = cfg.warmup_steps

    def warm(s: int) -> float:
        return (s + 1) / (warmup + 1)

    if cfg.kind == "noam":
        return lambda s: min((s + 1) ** -0.5, (s + 1) * warmup**-1.5) * warmup**0.5

    if cfg.kind == "constant":
        return lambda s: warm(s) if s < warmup else 1.0

    if cfg.kind == "wsd":
        decay_start = max(warmup, int(total_steps * (1 - cfg.decay_fraction)))

        def wsd(s: int) -> float:
            if s < warmup:
                return warm(s)
            if s < decay_start:
                return 1.0
            frac = (s - decay_start) / max(1, total_steps - decay_start)
            return 1.0 - (1.0 - cfg.min_lr_ratio) * min(frac, 1.0)

        return wsd

    def cosine(s: int) -> float:
        if s < warmup:
            return warm(s)
        frac = min((s - warmup) / max(1, total_steps - warmup), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return cosine
