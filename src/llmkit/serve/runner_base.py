"""What every model runner takes and gives (model_runner.py has the CPU's runners and the choice between them,
kernel_runner.py the GPU's): a frozen plan of rows in, typed logits out, and the grouping of rows into forwards
with a failing group retried row by row. Shapes: B rows, V vocabulary, C model dim, k a row's drafts."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from llmkit.models.decoder import DecoderLM
from llmkit.serve.adapters import Adapters
from llmkit.serve.forward import Forward, Row, run_rows
from llmkit.serve.lockstep import RanksLost
from llmkit.serve.paged import PagedCache

log = logging.getLogger("llmkit.serve")


@dataclass(frozen=True)
class StepPlan:
    """The rows one step computes, in the scheduler's order (decoding rows first, then prompt chunks)."""

    rows: tuple[Row, ...]

    @property
    def decoding(self) -> list[int]:
        """The rows of one new token (with or without drafts)."""
        return [i for i, r in enumerate(self.rows) if len(r.tokens) == 1]

    @property
    def chunks(self) -> list[int]:
        """The rows of several new tokens: prompt chunks."""
        return [i for i, r in enumerate(self.rows) if len(r.tokens) > 1]


@dataclass(frozen=True)
class RunnerOutput:
    """What a step's forward gave, by row index of the plan: `logits` (V,) after the last token of each row without
    drafts; `verified` (1 + k, V) after the token of each row with k drafts and after each draft; `hidden` the
    last-block states (n, C) of every token the row computed, drafts included; `prompt` the logits (prompt_n, V) of
    the prompt tokens whose log-probabilities the row's request asked for. A row in neither `logits` nor
    `verified` failed (its forward raised even alone)."""

    logits: dict[int, Tensor] = field(default_factory=dict)
    verified: dict[int, Tensor] = field(default_factory=dict)
    hidden: dict[int, Tensor] = field(default_factory=dict)
    prompt: dict[int, Tensor | None] = field(default_factory=dict)

    def failed(self, i: int) -> bool:
        return i not in self.logits and i not in self.verified


class ModelRunner(ABC):
    """A model over a paged cache, with the backend its constructor chose. `execute` runs a plan; subclasses say how
    the plan's rows are grouped into forwards (`groups`) and how one group runs (`forward`)."""

    def __init__(self, model: DecoderLM, cache: PagedCache, block_size: int) -> None:
        self.model, self.cache, self.block_size = model, cache, block_size

    kind = "PyTorch"  # what runs the steps, in words (the server says it when it starts)
    invariant = False  # whether a row's bits do not depend on the rows beside it (nor on the prompt's chunking)
    # whether a generated token's keys and values are the ones a prompt holding it would get, so that the blocks
    # holding them may serve later prompts from the prefix cache
    shares_generated = True

    @abstractmethod
    def groups(self, plan: StepPlan) -> list[list[int]]:
        """The plan's rows (indices) grouped into forwards."""

    @abstractmethod
    def forward(self, rows: list[Row]) -> Forward:
        """The model over `rows`, writing their keys and values into the cache."""

    # per-request LoRA adapters (serve/adapters.py), when the engine serves them: a group of rows this runner takes
    # with their adapters (`takes_adapters`) runs as it is; otherwise the rows that chose one run through the
    # PyTorch forward with the adapters' hooks (`adapted`), the others as this runner runs them
    adapters: Adapters | None = None

    def takes_adapters(self, rows: list[Row]) -> bool:
        """Whether `forward` adds the adapters' updates to these rows itself (the C++ step's runners do)."""
        return False

    def execute(self, plan: StepPlan) -> RunnerOutput:
        out = RunnerOutput()
        for group, forward in self._forwards(plan):
            try:
                self._add(out, plan, group, forward([plan.rows[i] for i in group]))
            except RanksLost:
                raise  # the ranks are out of step: nothing is retried
            except Exception as e:
                if len(group) == 1:
                    log.error("request %s failed: %s: %s; ending it", plan.rows[group[0]].request, type(e).__name__, e)
                    continue
                log.warning("a batch of %d rows failed (%s: %s); computing them one by one", len(group),
                            type(e).__name__, e)  # fmt: skip
                for i in group:
                    try:
                        self._add(out, plan, [i], forward([plan.rows[i]]))
                    except RanksLost:
                        raise
                    except Exception as e:
                        log.error("request %s failed: %s: %s; ending it", plan.rows[i].request, type(e).__name__, e)
        return out

    def _forwards(self, plan: StepPlan) -> list[tuple[list[int], Callable[[list[Row]], Forward]]]:
        """The step's groups of rows and what runs each: the rows that chose an adapter apart, through `adapted`."""
        groups = [g for g in self.groups(plan) if g]
        if self.adapters is None:
            return [(g, self.forward) for g in groups]
        out: list[tuple[list[int], Callable[[list[Row]], Forward]]] = []
        for g in groups:
            base = [i for i in g if plan.rows[i].adapter is None]
            own = [i for i in g if plan.rows[i].adapter is not None]
            if own and self.takes_adapters([plan.rows[i] for i in g]):
                out.append((g, self.forward))
                continue
            out += [(base, self.forward)] if base else []
            out += [(own, self.adapted)] if own else []
        return out

    def adapted(self, rows: list[Row]) -> Forward:
        """Rows that chose adapters, through the PyTorch forward with the adapters' updates."""
        assert self.adapters is not None
        with self.adapters.rows([r.adapter for r in rows], [len(r.tokens) for r in rows]):
            return run_rows(self.model, self.cache, self.block_size, rows)

    @staticmethod
    def _add(out: RunnerOutput, plan: StepPlan, group: list[int], f: Forward) -> None:
        for j, i in enumerate(group):
            (out.verified if plan.rows[i].drafts else out.logits)[i] = f.logits[j]
            out.hidden[i], out.prompt[i] = f.hidden[j], f.prompt[j]


class TokenRunner(ModelRunner):
    """A runner that also runs tokens as rows of their own and verifies rows with drafts (their 1 + k tokens in the
    step): what speculation drafts and verifies with (the C++ step's runners, the GPU's kernel runner)."""

    @abstractmethod
    def token_states(self, tokens: Tensor, slots: Tensor, table: Tensor) -> Tensor:
        """Tokens (N,), each a row of its own: token n in slot slots[n] of the sequence whose blocks are table[n]
        (N, nb), seeing its slots up to its own, writing its keys -> last-block states (N, C)."""

    def token_logits(self, h: Tensor, invariant: bool = True) -> Tensor:
        """token_states' states (N, C) -> logits (N, V), as a verified row's are computed (`invariant`: each row's
        bits its own, where the runner's head can)."""
        return self.model.logits(self.model.norm(h))
