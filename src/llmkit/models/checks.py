"""Input checks shared by the models: each raises InputError naming the argument, what it got and what is valid, so
a user never decodes a shape error from deep inside torch. They read values (token ids, positions) from the device,
so they run once at the public entry points, never inside a decode step."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import InputError


def check_tokens(tokens: Any, vocab_size: int, name: str = "tokens") -> None:
    """Raise InputError unless tokens is a (B, T) integer tensor with ids in [0, vocab_size) and T >= 1."""
    if not isinstance(tokens, Tensor):
        raise InputError(f"{name} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise InputError(f"{name} must have shape (batch, seq_len), got {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise InputError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.shape[1] == 0:
        raise InputError(f"{name} is empty (seq_len 0); give at least one token")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"{name} contains id {bad}, outside the vocabulary [0, {vocab_size})")


def check_mask(mask: Tensor | None, tokens: Tensor, name: str = "padding_mask") -> Tensor | None:
    """Validate a (B, T) padding mask (True or 1 = real token) shaped like tokens; returns it as bool."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(tokens.shape):
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise InputError(
            f"{name} must be a (batch, seq_len) tensor shaped like the tokens {tuple(tokens.shape)}, got {shape}"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.is_complex():
        raise InputError(f"{name} must be bool (True = real token) or 0/1 integers, got dtype {mask.dtype}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise InputError(f"{name} must hold only 0 and 1 (1 = real token)")
    return mask.bool()


def check_segments(segments: Any, tokens: Tensor) -> Tensor:
    """Validate packed-example ids: an integer tensor shaped like the tokens; returns it as long."""
    if not isinstance(segments, Tensor) or tuple(segments.shape) != tuple(tokens.shape):
        shape = tuple(segments.shape) if isinstance(segments, Tensor) else type(segments).__name__
        raise InputError(
            f"segments must be a (batch, seq_len) tensor shaped like the tokens {tuple(tokens.shape)}, got {shape}"
        )
    if segments.dtype.is_floating_point or segments.dtype == torch.bool or segments.is_complex():
        raise InputError(f"segments must hold integer example ids, got dtype {segments.dtype}")
    return segments.long()


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        raise InputError(f"label_smoothing={label_smoothing} must be in [0, 1)")


def check_positions(positions: Tensor, cfg: ModelConfig) -> None:
    """Positions must be non-negative integers, and below max_seq_len where a table is indexed."""
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
        raise InputError(f"positions must be integers, got dtype {positions.dtype}")
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0:
        raise InputError(f"positions must be >= 0, got {lo}")
    limit = cfg.position.max_seq_len
    if cfg.position.kind in ("learned", "rope") and hi >= limit:
        raise InputError(f"position {hi} is beyond the model's context: position.max_seq_len={limit}")


def check_cache_args(model: nn.Module, batch: object, max_len: object, dtype: torch.dtype | None) -> torch.dtype:
    """Validate new_cache arguments; returns the cache dtype (the model's unless given, and it must match)."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"new_cache needs {name} to be an int >= 1, got {value!r}")
    model_dtype = next(model.parameters()).dtype
    if dtype is not None and dtype != model_dtype:
        raise InputError(
            f"cache dtype {dtype} differs from the model's {model_dtype}; attention needs both in one dtype "
            "(convert the model with .to(dtype) instead)"
        )
    return model_dtype
