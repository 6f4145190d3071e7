"""Device names from the command line and configs, checked once against what this machine has."""

from __future__ import annotations

import torch

from llmkit.errors import InputError

KNOWN = "cpu, cuda, cuda:N or mps"


def check_device(spec: str, name: str = "--device") -> torch.device:
    """The torch device `spec` names, if this machine has it; an InputError naming the flag or field `name`
    otherwise (torch's own errors are an AssertionError "Torch not compiled with CUDA enabled" at the first tensor
    moved, or a list of twenty device types for a typo)."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"{name} {spec!r} is not a device: use {KNOWN}") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise InputError(f"{name} {spec!r}: CUDA is not available here ({why}); use cpu instead")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise InputError(f"{name} {spec!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise InputError(f"{name} {spec!r}: Apple's MPS is not available here; use cpu instead")
        return device
    raise InputError(f"{name} {spec!r}: llmkit runs on {KNOWN}, not on {device.type} devices")
