"""Scoring continuations: log p(continuation | context) for many (context, continuation) pairs, each distinct
context computed once.

    score(model, [(context_ids, continuation_ids), ...], max_length=2048) -> [Scored(logprob, greedy), ...]

A multiple-choice question asks for the same context once per choice, and a causal model's state after the context
does not depend on what follows it. So the pairs are grouped by context:

    contexts (distinct, left-padded) ──► one forward into a KV cache; the output head reads only each context's
                                         last position: the distribution of its continuations' first tokens
    cache rows repeated per continuation ──► the continuations (right-padded) fed after them, one forward for all
    hidden states at the continuation's positions ──► norm and output head, a bounded number of rows at a time

lm-evaluation-harness's `hf` model instead runs every context + continuation through the model and the output head at
every position; the numbers are the same (tests/evaluation/test_harness.py), and an n-choice question costs one context
instead of n, with the head (49,152 rows for SmolLM2) applied to the continuation's tokens only.

Windows, as lm-evaluation-harness makes them: a pair longer than max_length + 1 tokens loses tokens at the left of
its context; a continuation longer than max_length cannot be scored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.prompts import pad
from llmkit.generate.sessions import DecoderSession
from llmkit.generate.step import DecodeStep, choose_step
from llmkit.models import DecoderLM

# The most token rows a batch holds (continuations times their cached length, padding included): it bounds the
# cache and the attention of one forward; a single longer pair still runs, alone.
BATCH_TOKENS = 32_768
# The most positions whose logits (V wide, in fp32) exist at once.
HEAD_ROWS = 1024

Pair = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class Scored:
    """logprob: the sum over the continuation's tokens of log p(token | everything before it); greedy: every one of
    them is the most likely token at its position (what lm-evaluation-harness calls is_greedy)."""

    logprob: float
    greedy: bool


def window(
    context: Sequence[int], continuation: Sequence[int], max_length: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, continuation) as the model sees them: context + continuation cut to its last max_length + 1 tokens
    (the last one is predicted, never fed), the prefix what comes before the continuation."""
    if not continuation:
        raise InputError("a continuation to score is empty: it needs at least one token")
    if len(continuation) > max_length:
        raise InputError(
            f"a continuation of {len(continuation)} tokens does not fit the model's window of {max_length} tokens"
        )
    full = [*context, *continuation][-(max_length + 1) :]
    prefix = tuple(full[: len(full) - len(continuation)])
    if not prefix:
        raise InputError("a continuation to score needs at least one token of context (e.g. the start token)")
    return prefix, tuple(continuation)


Unit = tuple[tuple[int, ...], list[int]]  # a context and the indices of the pairs continuing it (one batch's share)


@torch.no_grad()
def score(
    model: DecoderLM,
    pairs: Sequence[Pair],
    *,
    max_length: int,
    batch_size: int = 32,
    step: DecodeStep | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Scored]:
    """Each pair's Scored, in order. batch_size: the most continuations per forward; step: the decoding backend
    (choose_step's when None); progress(n) is called as n more pairs are done."""
    if batch_size < 1:
        raise InputError(f"batch_size {batch_size} must be at least 1")
    windows = [window(c, x, max_length) for c, x in pairs]
    vocab = model.cfg.vocab_size
    if any(t < 0 or t >= vocab for prefix, cont in windows for t in (*prefix, *cont)):
        raise InputError(f"a token id is outside the model's vocabulary of {vocab}: is the tokenizer the model's?")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (prefix, _) in enumerate(windows):
        groups.setdefault(prefix, []).append(i)
    lengths = [len(c) for _, c in windows]
    # longest first, as the harness orders them: similar lengths share a batch, and memory runs out early if at all
    order = sorted(groups.items(), key=lambda g: -(len(g[0]) + max(lengths[i] for i in g[1])))
    run = step if step is not None else choose_step(model)
    out: list[Scored | None] = [None] * len(pairs)
    for batch in _batches(order, lengths, batch_size):
        rows = [i for _, indices in batch for i in indices]
        for i, scored in zip(rows, _score_batch(model, run, batch, [windows[i][1] for i in rows]), strict=True):
            out[i] = scored
        if progress is not None:
            progress(len(rows))
    assert all(s is not None for s in out)
    return [s for s in out if s is not None]


def _batches(order: list[Unit], lengths: list[int], batch_size: int) -> Iterator[list[Unit]]:
    """The contexts in `order` with their continuations, a batch at a time: at most batch_size continuations, and
    rows x (longest context + longest continuation) at most BATCH_TOKENS (the batch's cache). A context with more
    continuations than fit is split over several batches (its tokens computed once in each)."""
    batch: list[Unit] = []
    rows = context = continuation = 0
    for prefix, indices in order:
        for i in indices:
            c, x = max(context, len(prefix)), max(continuation, lengths[i])
            if batch and (rows + 1 > batch_size or (rows + 1) * (c + x) > BATCH_TOKENS):
                yield batch
                batch, rows, c, x = [], 0, len(prefix), lengths[i]
            if not batch or batch[-1][0] != prefix:
                batch.append((prefix, []))
            batch[-1][1].append(i)
            rows, context, continuation = rows + 1, c, x
    if batch:
        yield batch


def _score_batch(
    model: DecoderLM, step: DecodeStep, batch: list[Unit], continuations: list[tuple[int, ...]]
) -> list[Scored]:
    """One batch: its contexts into a cache at once, then every continuation after its own context's row."""
    device = next(model.parameters()).device
    tokens, mask = pad([prefix for prefix, _ in batch], "left", device=device)
    longest = max(len(c) for c in continuations)
    session = DecoderSession(model, tokens, mask, room=longest - 1, step=step)
    owner = torch.tensor([g for g, (_, indices) in enumerate(batch) for _ in indices], device=device)
    first = session.logits.float().log_softmax(-1).index_select(0, owner)  # (R, V): each continuation's first token
    targets = [torch.tensor(c, device=device) for c in continuations]
    logprob = first.gather(1, torch.stack([t[:1] for t in targets])).squeeze(1)  # (R,)
    greedy = first.argmax(-1) == torch.stack([t[0] for t in targets])
    if longest > 1:
        session.reorder(owner)
        fed, valid = pad([c[:-1] for c in continuations], "right", device=device)
        _, hidden = session.feed(fed, valid, last=True, given=True)  # (R, longest - 1, C): the head is applied below
        rest_logprob, rest_greedy = _rest(model, hidden, valid, [t[1:] for t in targets])
        logprob, greedy = logprob + rest_logprob, greedy & rest_greedy
    return [Scored(float(lp), bool(g)) for lp, g in zip(logprob.tolist(), greedy.tolist(), strict=True)]


def _rest(model: DecoderLM, hidden: Tensor, valid: Tensor, targets: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The log-probabilities (R,) of each row's tokens after its first (targets[r], predicted at the valid positions
    of hidden's row r), and whether each row's were all the most likely: the head HEAD_ROWS positions at a time."""
    rows = valid.nonzero()[:, 0]  # (M,) the row of every valid position, row-major as hidden[valid] orders them
    states, wanted = hidden[valid], torch.cat(targets)
    logprob = torch.zeros(valid.shape[0], device=hidden.device)
    misses = torch.zeros(valid.shape[0], dtype=torch.long, device=hidden.device)
    for a in range(0, states.shape[0], HEAD_ROWS):
        logp = model.logits(model.norm(states[a : a + HEAD_ROWS])).float().log_softmax(-1)
        want = wanted[a : a + HEAD_ROWS]
        logprob.index_add_(0, rows[a : a + HEAD_ROWS], logp.gather(1, want.unsqueeze(1)).squeeze(1))
        misses.index_add_(0, rows[a : a + HEAD_ROWS], (logp.argmax(-1) != want).long())
    return logprob, misses == 0
