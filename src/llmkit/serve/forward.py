"""The PyTorch forward of a serving step, as a function of plain inputs: which tokens each row computes, from which
slot, through which cache blocks. The model runner (model_runner.py) calls it with its plan's rows; under tensor
parallelism (lockstep.py) every rank calls it with the same inputs, which is why nothing here reads the engine.

Rows of one length run as a batch (B, T); rows of different lengths as one packed row (1, N) whose attention runs
row by row (AttentionMask.ragged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.layers.attention.mask import AttentionMask
from llmkit.models.cache import Step
from llmkit.models.decoder import DecoderLM
from llmkit.serve.paged import PagedCache, Pages
from llmkit.serve.scheduler import Work


@dataclass(frozen=True)
class Row:
    """One row of a step: `tokens` go to slots start.., through the cache blocks `table`; the log-probabilities
    of the prompt tokens that its first `prompt_n` states predict are wanted (0: none); `drafts` follow the row's
    one token, to be verified (speculation.py); `request`: its request's id, for messages; its first `given`
    tokens are the prompt's (given, not generated: the batch-invariant runner multiplies them otherwise)."""

    tokens: list[int]
    start: int
    table: list[int]
    prompt_n: int = 0
    drafts: tuple[int, ...] = ()
    request: str = ""
    given: int = 0
    adapter: str | None = None  # the LoRA adapter its request chose (serve/adapters.py)


@dataclass(frozen=True)
class Forward:
    """What a step's forward gives for each row: its last-block states (count, C), its logits ((V,) after its last
    token; (1 + k, V) after its token and each of its k drafts), and its prompt-token logits (prompt_n, V) or
    None."""

    hidden: list[Tensor]
    logits: list[Tensor]
    prompt: list[Tensor | None]


def prompt_count(w: Work) -> int:
    """How many of `w`'s states predict prompt tokens whose log-probabilities its request asked for."""
    if w.seq.prompt_logprobs is None or w.seq.request.params.prompt_logprobs is None:
        return 0
    return max(0, min(w.count, w.seq.prompt_len - 1 - w.start))


def row_of(w: Work, table: list[int], drafts: tuple[int, ...] = ()) -> Row:
    tokens = w.seq.tokens[w.start : w.start + w.count]
    given = max(0, min(w.count, w.seq.prompt_len - w.start))
    adapter = w.seq.request.params.adapter
    return Row(tokens, w.start, table, prompt_count(w), drafts, w.seq.request.id, given, adapter)


def prompt_logits(
    model: DecoderLM, hidden: list[Tensor], counts: list[int], head: Callable[[Tensor], Tensor] | None = None
) -> list[Tensor | None]:
    """The logits (n, V) of each row's first n states (None where n is 0), through `head` (final-normed states ->
    logits; default the model's own)."""
    head = head or model.logits
    return [head(model.norm(h[:n])) if n > 0 else None for h, n in zip(hidden, counts, strict=True)]


def run_rows(model: DecoderLM, cache: PagedCache, block_size: int, rows: list[Row]) -> Forward:
    """The model over `rows`, writing their keys and values into `cache`."""
    dev = model.device
    bs = block_size
    counts = [len(r.tokens) for r in rows]
    starts = torch.tensor([r.start for r in rows], device=dev)  # (B,) each row's first new slot
    nb = max(len(r.table) for r in rows)
    table = torch.tensor([r.table + r.table[:1] * (nb - len(r.table)) for r in rows], device=dev)  # (B, nb), padded
    filled = torch.arange(nb * bs, device=dev) < (starts + torch.tensor(counts, device=dev))[:, None]
    if len(set(counts)) == 1:
        T = counts[0]
        tokens = torch.tensor([r.tokens for r in rows], device=dev)  # (B, T)
        positions = starts[:, None] + torch.arange(T, device=dev)  # (B, T): logical slots, which are positions
        pages = Pages.of(table, positions, bs)
        mask = AttentionMask(allowed=filled[:, None, None, :], causal=T > 1, query_slots=positions)
        h = model.run(tokens, Step(positions, mask, positions), cache.views(pages))  # (B, T, C)
        hidden, last = list(h), h[:, -1]
    else:
        tokens = torch.tensor([t for r in rows for t in r.tokens], device=dev)
        positions = torch.cat([torch.arange(r.start, r.start + len(r.tokens), device=dev) for r in rows])[None]
        row = torch.repeat_interleave(torch.arange(len(rows), device=dev), torch.tensor(counts, device=dev))  # (N,)
        pages = Pages(table, table[row, positions[0] // bs][None], positions % bs)
        first = tuple(r.start == 0 for r in rows)  # chunks from a prompt's start: causality alone decides
        mask = AttentionMask(
            filled[:, None, None, :], causal=True, query_slots=positions, ragged=tuple(counts), ragged_first=first
        )
        h = model.run(tokens[None], Step(positions, mask, positions), cache.views(pages))  # (1, N, C)
        hidden = list(h[0].split(counts))
        last = h[0, torch.tensor(counts, device=dev).cumsum(0) - 1]  # each row's last query
    prompt = prompt_logits(model, hidden, [r.prompt_n for r in rows])
    return Forward(hidden, list(model.logits(model.norm(last))), prompt)
