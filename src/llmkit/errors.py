"""Errors raised by llmkit's public API.

Every error names what was wrong (the field or argument, and its value) and what would have been valid, so that a
user never has to decode a shape mismatch from deep inside torch.
"""

from __future__ import annotations


class LLMKitError(Exception):
    """Base class of llmkit's errors."""


class ConfigError(LLMKitError, ValueError):
    """A configuration value is invalid (names the field, the value and what would be valid)."""


class InputError(LLMKitError, ValueError):
    """A tensor or argument passed to a model or layer is invalid (names the argument, its shape or value)."""
