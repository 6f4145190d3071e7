"""A run's time budget, a strategy the loop is given: train.time_limit ends the run, and with train.fit_to_time the
learning-rate schedule is fitted to the limit, so that it decays to its end inside the time instead of being cut off.

The step time is measured after FIT_SKIP steps (allocations, caches and compilation make the first steps slow) over
at least FIT_WINDOW steps and FIT_SHARE of the time limit, and FIT_MARGIN of the remaining time is kept for
evaluations and saves. The schedule then advances by steps or by the share of that time spent, whichever is ahead, so
it ends inside the limit even when steps become slower than measured (a busy machine). Every process of a
distributed run computes the same (the mean of their clocks), and every call here is made by all of them.
"""

from __future__ import annotations

import torch

from llmkit.train.parallel import Runtime, agree, all_reduce_sum

FIT_SKIP, FIT_WINDOW, FIT_SHARE, FIT_MARGIN = 3, 10, 0.05, 0.1


class TimeBudget:
    """limit: train.time_limit in seconds (None: no limit); fit: train.fit_to_time; steps: train.steps, the most a
    fitted schedule may plan; planned: the steps a resumed run's schedule was fitted to (None: not yet fitted);
    first: the step the run starts from."""

    def __init__(
        self, limit: float | None, fit: bool, steps: int, rt: Runtime, planned: int | None, first: int
    ) -> None:
        self.limit, self.steps, self.rt = limit, steps, rt
        self.fit = fit and limit is not None
        self.fitting = self.fit and not planned
        self.since = (first + FIT_SKIP, 0.0)  # where the step time is measured from: a step, the elapsed seconds then

    def out_of_time(self, elapsed: float) -> bool:
        return self.limit is not None and elapsed >= self.limit

    def fitted(self, step: int, elapsed: float) -> int | None:
        """After `step` steps in `elapsed` seconds: the number of steps the schedule is now fitted to, when this step
        fixes it (once per run), else None."""
        if not self.fitting:
            return None
        if step == self.since[0]:
            self.since = (step, elapsed)
            return None
        if step < self.since[0] + FIT_WINDOW or not self._measured_enough(elapsed):
            return None
        self.fitting = False
        return self._fit(step, elapsed)

    def schedule_step(self, step: int, elapsed: float, planned: int | None) -> int:
        """Where the learning-rate schedule stands after `step` steps: `step`, or for a schedule fitted to the limit,
        the share of the time spent (the limit less FIT_MARGIN), in steps, when that is ahead."""
        if not (self.fit and planned and self.limit):
            return step
        mean = float(all_reduce_sum(self._tensor(elapsed), self.rt)[0]) / self.rt.world
        return max(step, min(planned, int(planned * mean * (1 + FIT_MARGIN) / self.limit)))

    def _fit(self, step: int, elapsed: float) -> int:
        """The number of steps whose schedule ends inside the limit, from the step time measured since `since`."""
        assert self.limit is not None
        measured = self._tensor((elapsed - self.since[1]) / (step - self.since[0]), elapsed)
        step_time, mean_elapsed = (all_reduce_sum(measured, self.rt) / self.rt.world).tolist()
        fitted = step + int((self.limit - mean_elapsed) / (step_time * (1 + FIT_MARGIN)))
        return max(step + 1, min(self.steps, fitted))

    def _measured_enough(self, elapsed: float) -> bool:
        """Whether the step time has been measured over FIT_SHARE of the limit (all processes agree)."""
        return agree(elapsed - self.since[1] >= FIT_SHARE * (self.limit or 0.0), self.rt)

    def _tensor(self, *values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.rt.device)
