"""Autoregressive generation with a KV cache: prefill the prompts, then decode one token at a time.

    prompts (left-padded) ──► prefill: one forward over every prompt token, filling the cache
                         ──► decode: feed the last token, read the next-token logits, choose, repeat

Each step costs one token's worth of compute, because the keys and values of earlier tokens come from the cache
instead of being recomputed. Rows stop on their own (stops.py); finished rows keep the batch shape but emit
nothing more. The same loop serves encoder-decoder models (seq2seq.py): only the session differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.generate.prompts import pad_prompts, prepare_prompts
from llmkit.generate.sampling import Sampling, check_finite, next_token
from llmkit.generate.sessions import DecoderSession, Session
from llmkit.generate.step import DecodeStep
from llmkit.generate.stops import Rows, StopRule
from llmkit.machine.perf import tune_allocator
from llmkit.models import DecoderLM
from llmkit.tokenizer import Tokenizer


@dataclass
class Generation:
    """tokens: (B, T + N) the left-padded prompts followed by the generated tokens (finished rows padded with their
    last token); new_tokens: per row, the generated ids (up to and including an end token, without a stop string)."""

    tokens: Tensor
    new_tokens: list[list[int]]


def sample_steps(
    session: Session,
    max_new_tokens: int,
    sampling: Sampling,
    rows: Rows,
    generator: torch.Generator | None = None,
    history: Tensor | None = None,
) -> Iterator[list[int | None]]:
    """The decoding loop: choose each row's next token from the session's logits, feed it back, repeat. Yields,
    per step, each row's new token (None once the row has finished). history (B, L): tokens the repetition
    penalty counts (negative ids are ignored), or None."""
    for step in range(max_new_tokens):
        check_finite(session.logits, step)
        nxt = next_token(session.logits, sampling, generator=generator, history=history)  # (B,)
        yield rows.push_all(nxt.tolist())
        if rows.finished or step == max_new_tokens - 1:
            return
        if history is not None:
            history = torch.cat([history, nxt.unsqueeze(1)], dim=1)
        session.feed(nxt.unsqueeze(1))


def run_session(
    session: Session,
    max_new_tokens: int,
    stop: StopRule,
    sampling: Sampling | None = None,
    seed: int | None = None,
) -> list[list[int]]:
    """The decoding loop to the end: each row's generated tokens (up to and including its end token)."""
    rows = Rows(stop, session.logits.shape[0])
    for _ in sample_steps(session, max_new_tokens, sampling or Sampling(), rows, seeded(seed, session.device)):
        pass
    return rows.tokens


def seeded(seed: int | None, device: torch.device) -> torch.Generator | None:
    return torch.Generator(device=device).manual_seed(seed) if seed is not None else None


def _start(
    model: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    padding_mask: Tensor | None,
    max_new_tokens: int,
    sampling: Sampling,
    step: DecodeStep | None,
) -> tuple[DecoderSession, Tensor | None]:
    """The prompts prefilled into a session, and the tokens the repetition penalty counts (None without one)."""
    # A prompt's activations are large (a 512-token prefill of a 1.5B model frees and allocates 2.3 GiB of them):
    # reused from the heap, not faulted in afresh (perf.tune_allocator; 100 -> 125 tokens/s there, BENCHMARKS.md).
    tune_allocator()
    tokens, mask = prepare_prompts(model, prompts, padding_mask, max_new_tokens)
    session = DecoderSession(model, tokens, mask, max_new_tokens, step)
    return session, tokens.masked_fill(~mask, -1) if sampling.repetition_penalty != 1.0 else None


@torch.no_grad()
def stream(
    model: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    padding_mask: Tensor | None = None,
    sampling: Sampling | None = None,
    stop: StopRule | None = None,
    seed: int | None = None,
    step: DecodeStep | None = None,
) -> Iterator[list[int | None]]:
    """Generate step by step: yields, per step, each row's new token (None once the row has finished under the
    `stop` rule: an end token, a stop sequence or string; see stops.py). `step`: the decoding backend (step.py;
    choose_step's when None)."""
    s = sampling or Sampling()
    session, history = _start(model, prompts, padding_mask, max_new_tokens, s, step)
    rows = Rows(stop or StopRule(), session.logits.shape[0])
    yield from sample_steps(session, max_new_tokens, s, rows, seeded(seed, session.device), history)


def generate(
    model: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    padding_mask: Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: Tokenizer | None = None,
    seed: int | None = None,
    step: DecodeStep | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` after each prompt (a (B, T) tensor with padding_mask for left padding, or a
    list of token lists of any lengths). temperature 0 is greedy; a seed makes sampling repeatable; `step` is the
    decoding backend (step.py): e.g. a CompiledStep(model), kept across calls, decodes through torch.compile (faster
    after a one-time compilation); choose_step's when None."""
    sampling = Sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    rule = StopRule.of(eos_id, stop_sequences, stop_strings, tokenizer)
    if not isinstance(prompts, Tensor):
        prompts, padding_mask = pad_prompts(prompts)
    with torch.no_grad():
        session, history = _start(model, prompts, padding_mask, max_new_tokens, sampling, step)
        rows = Rows(rule, prompts.shape[0])
        run = sample_steps(session, max_new_tokens, sampling, rows, seeded(seed, session.device), history)
        new, columns = collect(list(run), prompts.shape[0])
    return Generation(torch.cat([prompts.cpu(), columns], dim=1), [rule.cut(row) for row in new])


def collect(steps: list[list[int | None]], batch: int) -> tuple[list[list[int]], Tensor]:
    """Per-step emissions -> (each row's tokens, (B, steps) tensor with finished rows repeating their last token)."""
    new: list[list[int]] = [[] for _ in range(batch)]
    fill = [0] * batch
    columns = []
    for emitted in steps:
        for b, t in enumerate(emitted):
            if t is not None:
                new[b].append(t)
                fill[b] = t
        columns.append([t if t is not None else fill[b] for b, t in enumerate(emitted)])
    out = torch.tensor(columns, dtype=torch.long).t() if columns else torch.zeros(batch, 0, dtype=torch.long)
    return new, out
