"""Turning token lists into a batch: one padder for every generator, and the checks a prompt batch must pass.

left   [[1, 2, 3], [4]] -> [[1, 2, 3], [0, 0, 4]]    prompts of a decoder: every row's next token goes to the
                                                      same slot, so rows end together
right  [[1, 2, 3], [4]] -> [[1, 2, 3], [4, 0, 0]]    sources of an encoder (and training batches): rows start
                                                      together
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.models import DecoderLM
from llmkit.models.checks import check_tokens


def pad(
    rows: Sequence[Sequence[int]],
    side: Literal["left", "right"] = "left",
    pad_id: int = 0,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor]:
    """Token lists of any lengths -> (tokens (B, T) long, mask (B, T) bool, True at real tokens). A row may be
    empty (all padding)."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            tokens[b, cols] = torch.tensor(list(r), dtype=torch.long)
            mask[b, cols] = True
    return tokens.to(device), mask.to(device)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Left-pad prompts (each at least one token) to one (B, T) tensor; returns (tokens, mask)."""
    if not prompts:
        raise InputError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise InputError("a prompt is empty; give at least one token (e.g. the start token) per prompt")
    return pad(prompts, "left", pad_id)


def check_max_new_tokens(max_new_tokens: object) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")


def prepare_prompts(
    model: DecoderLM, prompts: Tensor | Sequence[Sequence[int]], padding_mask: Tensor | None, max_new_tokens: int
) -> tuple[Tensor, Tensor]:
    """Validated (tokens, mask) on the model's device: ids in the vocabulary, and room in the model's context for
    the longest prompt plus max_new_tokens."""
    check_max_new_tokens(max_new_tokens)
    if not isinstance(prompts, Tensor):
        prompts, padding_mask = pad_prompts(prompts)
    check_tokens(prompts, model.cfg.vocab_size, "prompts")
    device = model.device
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
