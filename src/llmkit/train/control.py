"""What a run needs around its steps: stopping cleanly on a signal, mixed precision, and optimizer-state names that
are the same in a checkpoint whatever wraps the model."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import torch


class StopSignal:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step; a second one interrupts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def fast_bf16(device: torch.device) -> bool:
    """Whether the device multiplies bf16 matrices natively (a GPU with bf16, a CPU with AVX-512 or AMX): without
    that, bf16 autocast on a CPU is emulated and many times slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' becomes bf16 where the device has fast bf16 and fp32 elsewhere; the others stay as they are."""
    if precision != "auto":
        return precision
    return "bf16" if fast_bf16(device) else "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 / fp16 autocast on the device, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _rekey(raw: dict[str, Any], rename: Any) -> dict[str, Any]:
    return {
        "state": {rename(k): v for k, v in raw.get("state", {}).items()},
        "param_groups": [{**g, "params": [rename(p) for p in g["params"]]} for g in raw.get("param_groups", [])],
    }


def checkpoint_keys(optimizer_state: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    """A name-keyed optimizer state of the training module (parameters under `prefix`) -> the model's names."""
    return _rekey(optimizer_state, lambda n: n.removeprefix(prefix))


def wrapper_keys(optimizer_state: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    """The inverse of `checkpoint_keys`: a checkpoint's optimizer state -> the training module's names."""
    return _rekey(optimizer_state, lambda n: prefix + n)
