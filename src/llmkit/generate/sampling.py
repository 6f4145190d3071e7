"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

    greedy       argmax
    temperature  softmax(logits / T): T < 1 sharpens, T > 1 flattens
    top-k        keep the k most likely tokens
    top-p        keep the smallest set of most likely tokens whose probability adds up to p

Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.errors import InputError


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if temperature < 0:
        raise InputError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if top_k is not None and top_k < 1:
        raise InputError(f"top_k={top_k} must be >= 1, or None")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p={top_p} must be in (0, 1], or None")


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set the logits of tokens outside the top-k / top-p set to -inf. (B, V) -> (B, V)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token already >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The next token of each row. logits (B, V) -> (B,) long."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
