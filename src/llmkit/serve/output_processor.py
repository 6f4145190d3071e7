"""What a step's logits become, as vLLM v1's output processor: tokens, text and finished sequences.

    RunnerOutput ─► sample (grammar masks, each row's settings) ─► append: grammar, end of sequence, length,
                 └► judge the verified drafts (speculation.judge) ─┘            stop strings, text ─► Delta per row

It needs no model: the logits come in, the deltas go out. A row whose logits are NaN or +infinite (damaged weights,
an overflow), whose sampling fails or whose grammar refuses its token ends alone with finish reason "error"; -inf is
a token masked on purpose. Ending a sequence is the engine's (it gives the blocks back): `finish` is its callback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from llmkit.serve.config import EngineStats
from llmkit.serve.request import Delta, FinishReason, Sequence, Top
from llmkit.serve.runner_base import RunnerOutput
from llmkit.serve.sampler import sample
from llmkit.serve.scheduler import Work
from llmkit.serve.speculation import Drafter, Drafts, judge
from llmkit.serve.structured import allowed_tokens, one_line

log = logging.getLogger("llmkit.serve")

Finish = Callable[[Sequence, FinishReason], None]


@dataclass
class Processed:
    """A step's deltas, and for each verified row that goes on, the slots now computed (its token and the drafts
    it kept), which the engine gives the scheduler."""

    deltas: list[Delta] = field(default_factory=list)
    computed: list[tuple[Sequence, int]] = field(default_factory=list)


class OutputProcessor:
    """Turns the logits of the rows that reached the end of their known tokens into their next tokens."""

    def __init__(self, drafter: Drafter, eos_ids: set[int], max_len: int, stats: EngineStats, finish: Finish) -> None:
        self.drafter, self.eos_ids, self.max_len, self.stats, self.finish = drafter, eos_ids, max_len, stats, finish

    def process(self, rows: list[Work], output: RunnerOutput, drafts: dict[int, Drafts]) -> Processed:
        """rows: the step's work, in the plan's order; output: the runner's; drafts: each drafted row's, by index."""
        out = Processed()
        ready = [i for i, w in enumerate(rows) if w.samples and not output.failed(i)]
        for i in [i for i in ready if rows[i].seq.request.params.max_tokens == 0]:  # the prompt was all it asked for
            self.finish(rows[i].seq, "length")
            out.deltas.append(Delta.of(rows[i].seq, prompt_logprobs=rows[i].seq.prompt_logprobs))
        ready = [i for i in ready if rows[i].seq.request.params.max_tokens > 0]
        for i in (i for i in ready if i in output.verified):
            out.deltas.append(self._verified(rows[i], output.verified[i], drafts[i], out))
        plain = [i for i in ready if i in output.logits]
        if plain:
            out.deltas += self._sampled([rows[i] for i in plain], torch.stack([output.logits[i] for i in plain]))
        return out

    def _sampled(self, rows: list[Work], batch: Tensor) -> list[Delta]:
        """Rows' next tokens from their logits batch (B, V)."""
        deltas = []
        bad = (torch.isnan(batch) | torch.isposinf(batch)).any(dim=-1).tolist()
        for w in (w for w, b in zip(rows, bad, strict=True) if b):
            deltas.append(self._error(w.seq, "the model's logits are NaN or infinite"))
        keep = [i for i, b in enumerate(bad) if not b]
        if len(keep) < len(rows):
            rows, batch = [rows[i] for i in keep], batch[keep]
        if not rows:
            return deltas
        matchers = [w.seq.matcher for w in rows]
        allowed = None
        if any(m is not None for m in matchers):  # structured outputs: each grammar's next tokens
            allowed = allowed_tokens(matchers, batch.shape[-1])
        forced = [w.seq.budget.next_token() if w.seq.budget is not None else None for w in rows]
        if any(t is not None for t in forced):  # a thinking budget spent: its closing tag's next token, only
            allowed = np.ones(batch.shape, dtype=bool) if allowed is None else allowed
            for row, token in enumerate(forced):
                if token is not None:
                    allowed[row] = False
                    allowed[row, token] = True
        sampled = sample(batch, [w.seq for w in rows], allowed)
        for row, (w, token, logprob, top) in enumerate(
            zip(rows, sampled.tokens, sampled.logprobs, sampled.top, strict=True)
        ):
            if token is None or logprob is None:  # this row's settings or grammar failed (the sampler said why)
                deltas.append(self._error(w.seq, sampled.failed[row], request=True))
            else:
                deltas.append(self.append(w.seq, token, logprob, top))
        return deltas

    def _verified(self, w: Work, logits: Tensor, drafts: Drafts, out: Processed) -> Delta:
        """A row whose drafts were verified: the target's logits (1 + k, V) -> the tokens it keeps, as one delta."""
        seq = w.seq
        if bool((torch.isnan(logits) | torch.isposinf(logits)).any()):
            return self._error(seq, "the model's logits are NaN or infinite")
        verdict = judge(seq, drafts, logits)
        self.drafter.record(len(drafts.tokens), verdict.accepted, seq)
        parts = []
        for token, logprob, top in zip(verdict.tokens, verdict.logprobs, verdict.top, strict=True):
            parts.append(self.append(seq, token, logprob, top))
            if seq.finished:
                break
        if not seq.finished:  # its token and the accepted drafts are cached; the target's own token is the next one
            out.computed.append((seq, w.start + 1 + verdict.accepted))
        return Delta.joined(parts)

    def append(self, seq: Sequence, token: int, logprob: float, top: Top) -> Delta:
        """`token` joins `seq`: its grammar moves on, and the sequence finishes at the end of sequence, its length
        limit or a stop string, or when its grammar's text is complete."""
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        p = seq.request.params
        complete = False  # the constraint's text is complete: nothing may follow
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):  # the mask allowed it: a limit of the grammar engine
                why = f"the structured output's grammar failed at token {token}: {one_line(seq.matcher.get_error())}"
                return self._error(seq, why, request=True)
            complete = seq.matcher.is_stopped()
        eos = token in self.eos_ids and not p.ignore_eos  # its text is never shown
        length = not eos and (len(seq.generated) >= p.max_tokens or len(seq.tokens) >= self.max_len)
        text, stopped = seq.output.push(None if eos else token, final=eos or length or complete)
        if seq.budget is not None:
            seq.budget.push(token, text)
        reason: FinishReason | None = "stop" if eos or stopped or complete else "length" if length else None
        if reason is not None:
            self.finish(seq, reason)
        prompt = seq.prompt_logprobs if len(seq.generated) == 1 else None  # with the first token
        return Delta.of(seq, [token], text, [logprob], [top], prompt)

    def _error(self, seq: Sequence, why: str, request: bool = False) -> Delta:
        """End `seq` with finish reason "error"; `request`: the request caused it, and its client is told `why`."""
        log.error("request %s: %s; ending it", seq.request.id, why)
        self.stats.failed += 1
        if request:
            seq.error = why
        self.finish(seq, "error")
        return Delta.of(seq)
