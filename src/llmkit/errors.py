"""Errors raised by llmkit's public API.

Every error names what was wrong (the field or argument, and its value) and what would have been valid, so that a
user never has to decode a shape mismatch from deep inside torch.
"""

from __future__ import annotations

import os
import re


class LLMKitError(Exception):
    """Base class of llmkit's errors."""


class ConfigError(LLMKitError, ValueError):
    """A configuration value is invalid (names the field, the value and what would be valid)."""


class InputError(LLMKitError, ValueError):
    """A tensor or argument passed to a model or layer is invalid (names the argument, its shape or value)."""


class OutputError(LLMKitError, ValueError):
    """A command may not write where it was asked to: over its own input, over an existing output without
    --overwrite, or over something of another kind (see llmkit.outputs)."""


class GenerationError(LLMKitError, RuntimeError):
    """Decoding cannot go on: the model's outputs are not numbers (names the step)."""


def os_error_in(e: Exception, path: str | os.PathLike[str]) -> OSError | None:
    """The OSError inside an error a Rust library (safetensors, tokenizers) raised as its own type, whose message
    ends in "(os error 28)": an OSError naming `path`, so that it is reported as one; None when there is none."""
    found = re.search(r"\(os error (\d+)\)", str(e))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def check_features(x: object, dim: int, name: str, ndim: int | None = 3) -> None:
    """Raise InputError unless x is a tensor whose last dim is `dim` and, when `ndim` is given, has that many dims
    ((B, T, C) for a sequence layer); ndim None accepts any leading dims."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise InputError(f"{name} expects a torch.Tensor, got {type(x).__name__}")
    if (ndim is not None and len(shape) != ndim) or len(shape) == 0 or shape[-1] != dim:
        expected = f"(batch, seq_len, {dim})" if ndim == 3 else f"(..., {dim})"
        raise InputError(f"{name} expects input of shape {expected}, got {tuple(shape)}")
