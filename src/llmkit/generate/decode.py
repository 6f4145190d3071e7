"""Autoregressive generation with a KV cache: prefill the prompts, then decode one token at a time.

    prompts (left-padded) ──► prefill: one forward over every prompt token, filling the cache
                         ──► decode: feed the last token, read the next-token logits, choose, repeat

Each step costs one token's worth of compute, because the keys and values of earlier tokens come from the cache
instead of being recomputed. Rows stop on their own: at an end-of-sequence token, a stop sequence of token ids, or a
stop string (with a tokenizer); finished rows keep the batch shape but emit nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.sampling import Sampling, next_token
from llmkit.generate.step import decode_step
from llmkit.models import DecoderLM
from llmkit.models.common import check_tokens
from llmkit.tokenizer import Tokenizer


@dataclass
class Generation:
    """tokens: (B, T + N) the left-padded prompts followed by the generated tokens (finished rows padded with their
    end token); new_tokens: per row, the generated ids (up to and including an end token, without a stop string)."""

    tokens: Tensor
    new_tokens: list[list[int]]


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Left-pad token lists to one (B, T) tensor; returns (tokens, mask) with mask True at real tokens."""
    if not prompts:
        raise InputError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise InputError("a prompt is empty; give at least one token (e.g. the start token) per prompt")
    T = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        tokens[b, T - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[b, T - len(p) :] = True
    return tokens, mask


def prepare_prompts(
    model: DecoderLM, prompts: Tensor | Sequence[Sequence[int]], padding_mask: Tensor | None, max_new_tokens: int
) -> tuple[Tensor, Tensor]:
    """Validated (tokens, mask) on the model's device."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if not isinstance(prompts, Tensor):
        prompts, padding_mask = pad_prompts(prompts)
    check_tokens(prompts, model.cfg.vocab_size, "prompts")
    device = model.embed.weight.device
    tokens = prompts.to(device)
    mask = padding_mask.to(device).bool() if padding_mask is not None else torch.ones_like(tokens, dtype=torch.bool)
    if tuple(mask.shape) != tuple(tokens.shape):
        raise InputError(f"padding_mask {tuple(mask.shape)} does not match prompts {tuple(tokens.shape)}")
    longest = int(mask.sum(1).max())
    limit = model.cfg.position.max_seq_len
    if model.cfg.position.kind in ("learned", "rope") and longest + max_new_tokens > limit:
        raise InputError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} exceeds the model's "
            f"context position.max_seq_len={limit}"
        )
    return tokens, mask


def _ends_with(seq: list[int], stops: Sequence[Sequence[int]]) -> bool:
    return any(len(s) and len(seq) >= len(s) and seq[-len(s) :] == list(s) for s in stops)


def _has_string(seq: list[int], stops: Sequence[str], tokenizer: Tokenizer | None) -> bool:
    return bool(stops) and tokenizer is not None and any(x in tokenizer.decode(seq) for x in stops)


@torch.no_grad()
def stream(
    model: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    padding_mask: Tensor | None = None,
    sampling: Sampling | None = None,
    eos_id: int | Sequence[int] | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: Tokenizer | None = None,
    seed: int | None = None,
    compiled: bool = False,
) -> Iterator[list[int | None]]:
    """Generate step by step: yields, per step, each row's new token (None once the row has finished)."""
    s = sampling or Sampling()
    if stop_strings and tokenizer is None:
        raise InputError("stop_strings need a tokenizer to read the generated text")
    tokens, mask = prepare_prompts(model, prompts, padding_mask, max_new_tokens)
    B, T = tokens.shape
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    generator = torch.Generator(device=tokens.device).manual_seed(seed) if seed is not None else None
    cache = model.new_cache(B, T + max(max_new_tokens, 1))
    history = tokens.masked_fill(~mask, -1) if s.repetition_penalty != 1.0 else None
    logits = decode_step(model, tokens, cache, mask if not bool(mask.all()) else None, compiled)[0][:, -1]
    new: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        nxt = next_token(logits, s, generator=generator, history=history)  # (B,)
        emitted: list[int | None] = []
        for b, t in enumerate(nxt.tolist()):
            if done[b]:
                emitted.append(None)
                continue
            new[b].append(t)
            emitted.append(t)
            if t in eos or _ends_with(new[b], stop_sequences) or _has_string(new[b], stop_strings, tokenizer):
                done[b] = True
        yield emitted
        if all(done) or step == max_new_tokens - 1:
            return
        if history is not None:
            history = torch.cat([history, nxt.unsqueeze(1)], dim=1)
        logits = decode_step(model, nxt.unsqueeze(1), cache, compiled=compiled)[0][:, -1]


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
    compiled: bool = False,
) -> Generation:
    """Generate up to `max_new_tokens` after each prompt (a (B, T) tensor with padding_mask for left padding, or a
    list of token lists of any lengths). temperature 0 is greedy; a seed makes sampling repeatable; compiled=True
    decodes through torch.compile (faster after a one-time compilation)."""
    sampling = Sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    if not isinstance(prompts, Tensor):
        prompts, padding_mask = pad_prompts(prompts)
    steps = list(
        stream(model, prompts, max_new_tokens=max_new_tokens, padding_mask=padding_mask, sampling=sampling,
               eos_id=eos_id, stop_sequences=stop_sequences, stop_strings=stop_strings, tokenizer=tokenizer,
               seed=seed, compiled=compiled)
    )  # fmt: skip
    B = prompts.shape[0]
    new: list[list[int]] = [[] for _ in range(B)]
    fill = [0] * B
    for emitted in steps:
        for b, t in enumerate(emitted):
            if t is not None:
                new[b].append(t)
                fill[b] = t
    columns = [[t if t is not None else fill[b] for b, t in enumerate(emitted)] for emitted in steps]
    out = torch.tensor(columns, dtype=torch.long).t() if columns else torch.zeros(B, 0, dtype=torch.long)
    if stop_strings and tokenizer is not None:
        new = [_cut_stop(tokenizer, row, stop_strings) for row in new]
    return Generation(torch.cat([prompts.cpu(), out], dim=1), new)


def _cut_stop(tokenizer: Tokenizer, row: list[int], stops: Sequence[str]) -> list[int]:
    """Drop the tokens that complete a stop string (the text before it is kept)."""
    for n in range(len(row) + 1):
        if any(s in tokenizer.decode(row[:n]) for s in stops):
            return row[: n - 1]
    return row
