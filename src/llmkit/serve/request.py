"""What a client asks the engine for, and the state of each sequence the engine generates for it.

A request is a prompt (token ids) and its own sampling settings; with n > 1 it becomes n sequences that share the
prompt (and, through the prefix cache, its cached blocks). A sequence's tokens are its prompt followed by what it
has generated; `computed` counts the tokens whose keys are in the cache. Prefill, decoding and recomputation after
preemption are then one operation: compute tokens[computed:] (or a chunk of them), and when that reaches the end,
sample the next token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import torch

from llmkit.errors import InputError
from llmkit.generate.sampling import Sampling
from llmkit.serve.reasoning import Reasoning, ThinkingBudget
from llmkit.serve.structured import Constraint
from llmkit.serve.text import TextOutput

# abort: the client went away; timeout: past the request's time limit; error: the model's logits or the request's
# sampling failed; shutdown: the server stopped before the request finished
FinishReason = Literal["stop", "length", "abort", "timeout", "error", "shutdown"]

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
Top = list[tuple[int, float]]  # the most likely tokens at one position and their log-probabilities, best first
TokenLogprob = tuple[float, Top]  # one token's log-probability and the alternatives at its position


class Refused(InputError):
    """A request that can never run (HTTP 400); `param` names the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings, as OpenAI's API names them (temperature 0 is greedy).

    logit_bias adds to the logits of given tokens before anything else; presence_penalty / frequency_penalty
    subtract from the logits of tokens already generated (once, or per occurrence); repetition_penalty divides
    them (CTRL) and counts the prompt too. stop: strings that end the text (not included in it). n: independent
    completions of the same prompt. seed: makes sampling repeatable.

    Log-probabilities are the model's own (log-softmax of its logits, before logit_bias, penalties, temperature
    and filters: what evaluation compares), or with tempered_logprobs those of the distribution sampled from
    (log-softmax of the logits over the temperature; nothing else may change it). Every generated token's is
    reported; top_logprobs adds that many most likely alternatives to each; prompt_logprobs (None: not computed)
    reports each prompt token's (the first's is None) with that many alternatives, computing the whole prompt (no
    prefix-cache hits). max_tokens 0 computes the prompt and generates nothing.

    constraint: what the generated text must be (a JSON schema, a regex, one of some choices, a grammar; see
    serve/structured.py); the sequence stops once the text is complete. priority: lower values are admitted first
    and preempted last (vLLM's semantics; serve/scheduler.py); it changes when a request runs, never its output.
    reasoning_budget: the most tokens the reply's thinking block (found as `reasoning` says) may take before its
    closing tag is forced (serve/reasoning.py's ThinkingBudget); None: no limit."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -100 bans, 100 forces
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    priority: int = 0
    reasoning_budget: int | None = None
    reasoning: Reasoning | None = None  # how the reply's thinking block is found, for reasoning_budget
    adapter: str | None = None  # the LoRA adapter the request chose (serve/adapters.py); None: the base model
    # the log-probabilities (generated tokens' and the prompt's) of the distribution sampled from, log-softmax of the
    # logits over the temperature, instead of the model's own: the policy of reinforcement learning (train/grpo.py)
    tempered_logprobs: bool = False

    def __post_init__(self) -> None:
        self.sampling  # validates the shared settings  # noqa: B018
        if self.max_tokens < 0:
            raise InputError(f"max_tokens={self.max_tokens} must be >= 0")
        for name in ("top_logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InputError(f"{name}={value} must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.n < 1:
            raise InputError(f"n={self.n} must be >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InputError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise InputError("logit_bias values must be in [-100, 100]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError("stop strings must be non-empty strings")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InputError(f"seed={self.seed} must be a 64-bit signed integer")
        if not -(2**31) <= self.priority < 2**31:
            raise InputError(f"priority={self.priority} must be a 32-bit signed integer")
        if self.reasoning_budget is not None and self.reasoning_budget < 1:
            raise InputError(f"reasoning_budget={self.reasoning_budget} must be >= 1")
        if self.tempered_logprobs:
            filters = (self.top_k or 0) > 0 or self.top_p not in (None, 1.0) or self.min_p not in (None, 0.0)
            changed = self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            if self.temperature <= 0 or filters or changed or self.constraint is not None:
                raise InputError(
                    "tempered_logprobs: the sampled distribution is the logits over the temperature only when the "
                    "temperature is above 0 and nothing else (filters, penalties, bias, a constraint) changes it"
                )

    @property
    def sampling(self) -> Sampling:
        top_k = None if self.top_k is None or self.top_k <= 0 else self.top_k  # OpenAI-style servers: -1 is off
        return Sampling(self.temperature, top_k, self.top_p, self.min_p, self.repetition_penalty)


class Status(Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its blocks given back; it will be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """A prompt and its settings, as the engine received it."""

    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float  # when the engine took it, on the engine's clock
    deadline: float | None = None  # the time (engine's clock) after which it is ended with finish reason "timeout"
    admitted: float | None = None  # when one of its sequences first got work (engine's clock): its time in queue


@dataclass
class Sequence:
    """One completion of a request: its tokens, how many of them are cached, and where it stands. Its blocks are
    the KV-cache manager's (serve/kv_manager.py), its timings the request's and the client's."""

    request: Request
    index: int  # which of the request's n completions
    tokens: list[int]
    generator: torch.Generator | None = None  # its own random stream (None: greedy)
    output: TextOutput = field(default_factory=lambda: TextOutput(None, ()))  # detokenizer, stop strings
    status: Status = Status.WAITING
    computed: int = 0  # tokens[:computed] have their keys in the cache
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, when the request asks for them
    matcher: Any = None  # with a constraint: its grammar's state after the generated tokens (llguidance's LLMatcher)
    error: str | None = None  # finish reason "error" caused by the request itself (its grammar, its sampling settings)
    cached: int | None = None  # prompt tokens found in the prefix cache at its first admission
    budget: ThinkingBudget | None = None  # with a reasoning budget: where its thinking block stands
    root: bytes = b""  # where its prefix-cache digest chain starts (its adapter's; the base model's is empty)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def key(self) -> tuple[str, int]:
        """Which sequence this is: its request and its index among the request's n."""
        return (self.request.id, self.index)


@dataclass(frozen=True)
class Delta:
    """What one step added to one sequence: new token ids, the text they complete (stop strings withheld), their
    log-probabilities, and the finish reason once the sequence is done."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    top_logprobs: list[Top] = field(default_factory=list)  # per new token, when the request asks for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with a sequence's first delta, when asked for
    error: str | None = None  # with finish reason "error": what in the request failed (None: the engine failed)
    stop: str | None = None  # with finish reason "stop": the stop string that ended the text (None: another end)
    cached_tokens: int = 0  # prompt tokens the prefix cache held, not computed

    @classmethod
    def of(
        cls,
        seq: Sequence,
        ids: list[int] | None = None,
        text: str = "",
        logprobs: list[float] | None = None,
        top: list[Top] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> Delta:
        """What a step added to `seq` (its finish reason and token counts as they stand)."""
        return cls(
            seq.request.id,
            seq.index,
            ids or [],
            text,
            logprobs or [],
            seq.finish_reason,
            seq.prompt_len,
            len(seq.generated),
            top or [],
            prompt_logprobs,
            seq.error,
            seq.output.matched,
            seq.cached or 0,
        )

    @classmethod
    def joined(cls, parts: list[Delta]) -> Delta:
        """One delta for what consecutive deltas of one sequence added (a step that gave it several tokens)."""
        first, last = parts[0], parts[-1]
        return dataclasses.replace(
            last,
            token_ids=[t for d in parts for t in d.token_ids],
            text="".join(d.text for d in parts),
            logprobs=[x for d in parts for x in d.logprobs],
            top_logprobs=[x for d in parts for x in d.top_logprobs],
            prompt_logprobs=first.prompt_logprobs,
        )


@dataclass
class Completion:
    """A finished sequence, as `Engine.generate` returns it."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int
    top_logprobs: list[Top] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, deltas: list[Delta]) -> Completion:
        """A finished sequence from all its deltas (the last one carries the finish reason)."""
        last = deltas[-1]
        assert last.finish_reason is not None, "the sequence has not finished"
        prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        return cls(
            last.request_id,
            last.index,
            [t for d in deltas for t in d.token_ids],
            "".join(d.text for d in deltas),
            [lp for d in deltas for lp in d.logprobs],
            last.finish_reason,
            last.prompt_tokens,
            [t for d in deltas for t in d.top_logprobs],
            prompt_logprobs,
        )
