"""Choosing the next token from logits.

    repetition penalty  divide the positive logits (multiply the negative ones) of tokens already in the sequence
                        by the penalty (Keskar et al. 2019, CTRL)
    temperature         softmax(logits / T): T < 1 sharpens, T > 1 flattens; T = 0 is greedy (argmax)
    top-k               keep the k most likely tokens
    top-p               keep the smallest set of most likely tokens whose probability adds up to p (nucleus)
    min-p               keep tokens at least min_p times as likely as the most likely one

`distribution` gives the final probabilities (speculative sampling needs them for both models); `draw` picks from
probabilities and `next_token` from logits: every generator chooses its tokens through these. Shapes: B rows,
V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import GenerationError, InputError


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens. The default is greedy decoding."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InputError(f"{name}={value} must be a finite number")
        if self.temperature < 0:
            raise InputError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"top_k={self.top_k} must be >= 1, or None")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p={self.top_p} must be in (0, 1], or None")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min_p={self.min_p} must be in [0, 1], or None")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 is none)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Penalties are applied in float32, whose range is about 1e-38..3e38: a penalty of 1e-300 would be 0 there, and
# -inf * 0 is NaN. Beyond these bounds a penalty only makes a seen token more certainly first or last anyway.
_PENALTY_RANGE = (1e-30, 1e30)


def penalize_repetition(logits: Tensor, history: Tensor | None, penalty: float) -> Tensor:
    """logits (B, V); history (B, L) token ids already in each sequence (negative ids are ignored). The result is
    never NaN or +inf for finite (or -inf) logits, whatever the penalty: overflows saturate at float32's largest."""
    if penalty == 1.0 or history is None or history.numel() == 0:
        return logits
    penalty = min(max(penalty, _PENALTY_RANGE[0]), _PENALTY_RANGE[1])
    V = logits.shape[-1]
    index = torch.where(history >= 0, history, V)  # padding goes to a spare column, dropped below
    seen = torch.zeros(logits.shape[0], V + 1, dtype=torch.bool, device=logits.device).scatter_(-1, index, True)
    seen = seen[:, :V]
    out = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return torch.nan_to_num(out, posinf=torch.finfo(out.dtype).max, neginf=float("-inf"))


def filter_logits(
    logits: Tensor, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None
) -> Tensor:
    """Set the logits of tokens outside the top-k / top-p / min-p sets to -inf. (B, V) -> (B, V)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the mass before this token already reaches p
        drop_sorted[..., 0] = False  # the most likely token always stays (a p below float32's range would drop it)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None and min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def distribution(logits: Tensor, s: Sampling, history: Tensor | None = None) -> Tensor:
    """The probabilities a sampling rule draws from. logits (B, V) -> (B, V) fp32. Greedy: one-hot on the argmax."""
    logits = penalize_repetition(logits.float(), history, s.repetition_penalty)
    if s.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    # softmax(x / T) = softmax((x - max x) / T): dividing the gaps to the best logit, which are <= 0, cannot overflow
    # however small T is (x / 1e-300 is inf, and inf - inf NaN), and T is kept at or above float32's smallest
    # normal number (1e-300 would be 0 there, and 0 / 0 NaN); as T -> 0 this is the one-hot on the argmax.
    top = logits.amax(dim=-1, keepdim=True)
    gaps = logits - torch.where(top.isfinite(), top, 0.0)  # (B, V)
    temperature = max(s.temperature, torch.finfo(gaps.dtype).tiny)
    return filter_logits(gaps / temperature, s.top_k, s.top_p, s.min_p).softmax(dim=-1)


def draw(probs: Tensor, greedy: bool, generator: torch.Generator | None = None) -> Tensor:
    """One token per row from probabilities (..., V) -> (...) long: the most likely, or a sample."""
    if greedy:
        return probs.argmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def check_finite(logits: Tensor, step: int) -> None:
    """A GenerationError naming the step unless every logit is a number or -inf (a token masked on purpose): NaN or
    +inf logits come from damaged weights or an overflow in low precision, and sampling from them would fail deep
    inside torch (or greedy decoding would print garbage without a word)."""
    if bool(logits.amax() < float("inf")):  # the usual case in one reduction: a NaN makes the max NaN, +inf is it
        return
    bad = torch.isnan(logits) | torch.isposinf(logits)
    if bool(bad.any()):
        rows = bad.flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise GenerationError(
            f"the model's logits at decoding step {step} (rows {rows}) are NaN or infinite: its weights are damaged "
            "or its activations overflowed (try --dtype fp32)"
        )


def next_token(
    logits: Tensor,
    temperature: float | Sampling = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    history: Tensor | None = None,
) -> Tensor:
    """The next token of each row. logits (B, V) -> (B,) long."""
    s = temperature if isinstance(temperature, Sampling) else Sampling(temperature, top_k, top_p)
    if s.greedy:
        return penalize_repetition(logits.float(), history, s.repetition_penalty).argmax(dim=-1)
    return draw(distribution(logits, s, history), False, generator)
