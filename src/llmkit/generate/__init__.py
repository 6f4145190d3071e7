"""Autoregressive generation with a KV cache: prefill the prompts, then decode one token at a time.

    prompts (left-padded) ──► prefill: one forward over every prompt token, filling the cache
                         ──► decode: feed the last token, read the next-token logits, choose, repeat

Each step costs one token's worth of compute because the keys and values of earlier tokens are read from the cache
instead of recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.sampling import check_sampling, filter_logits, next_token
from llmkit.models import DecoderLM


@dataclass
class Generation:
    """tokens: (B, T + N) the left-padded prompts followed by the generated tokens; new_tokens: per row, the
    generated ids up to and including the first end-of-sequence token."""

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


@torch.no_grad()
def generate(
    model: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    padding_mask: Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Sequence[int] | None = None,
    seed: int | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` after each prompt. temperature 0 is greedy; a seed makes sampling repeatable.
    prompts: a (B, T) tensor (with padding_mask for left padding) or a list of token lists of any lengths."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    check_sampling(temperature, top_k, top_p)
    if not isinstance(prompts, Tensor):
        prompts, padding_mask = pad_prompts(prompts)
    device = model.embed.weight.device
    tokens = prompts.to(device)
    mask = padding_mask.to(device).bool() if padding_mask is not None else torch.ones_like(tokens, dtype=torch.bool)
    B, T = tokens.shape
    limit = model.cfg.position.max_seq_len
    if model.cfg.position.kind in ("learned", "rope") and int(mask.sum(1).max()) + max_new_tokens > limit:
        raise InputError(
            f"the longest prompt ({int(mask.sum(1).max())} tokens) plus max_new_tokens={max_new_tokens} exceeds the "
            f"model's context position.max_seq_len={limit}"
        )
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    cache = model.new_cache(B, T + max(max_new_tokens, 1))
    logits = model(tokens, padding_mask=mask, cache=cache)[:, -1].float()  # prefill
    new: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    out = [tokens]
    for step in range(max_new_tokens):
        nxt = next_token(logits, temperature, top_k, top_p, generator)  # (B,)
        if eos:  # finished rows keep emitting their end token
            nxt = torch.where(done, torch.full_like(nxt, next(iter(eos))), nxt)
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                new[b].append(t)
        done |= torch.tensor([t in eos for t in nxt.tolist()], device=device)
        out.append(nxt.unsqueeze(1))
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(nxt.unsqueeze(1), cache=cache)[:, -1].float()  # decode one token
    return Generation(torch.cat(out, dim=1), new)


__all__ = ["Generation", "filter_logits", "generate", "next_token", "pad_prompts"]
