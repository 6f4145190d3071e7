"""Whether a training step can fit in memory at all, checked before anything is allocated.

A batch far too large for the machine otherwise runs for minutes while the data reader stacks rows, then dies in the
allocator (or is killed by the kernel without a word). `check_fits` compares a lower bound of what one micro-batch
needs with the memory available and refuses, naming the field and the largest value that could fit:

    batch    inputs and targets, int64:                         3 * 8 bytes a token (the reader's stacked rows too)
    logits   the (B, T, V) logits in fp32 and their gradient:   2 * 4 * V bytes a token
    blocks   the residual stream each block saves for backward: 2 * 4 * C bytes a token and layer
    weights  the parameters in fp32:                            4 bytes a parameter

Real use is several times higher (attention scores, MLP activations, gradients, AdamW's moments); a lower bound only
ever refuses what cannot fit, never a step that would have run. Available memory is MemAvailable (/proc/meminfo:
free plus reclaimable caches) on the CPU, or the GPU's free memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.models.rnn import RNNConfig


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """(bytes, what they are) of memory free for a step on `device`, or None when that cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available (MemAvailable)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of physical memory"
    except (OSError, ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class Widths:
    """What the per-token bound depends on: vocabulary, residual width, layers (encoder and decoder together)."""

    vocab: int
    width: int
    layers: int
    params: int

    @classmethod
    def of(cls, cfg: ModelConfig | RNNConfig) -> Widths:
        if isinstance(cfg, RNNConfig):
            return cls(cfg.vocab_size, cfg.d_hidden, cfg.n_layers * 2, 0)
        from llmkit.analysis import analyze

        return cls(cfg.vocab_size, cfg.d_model, cfg.n_layers, analyze(cfg, seq_len=1).params_total)

    def per_token(self) -> int:
        return 3 * 8 + 2 * 4 * self.vocab + 2 * 4 * self.width * self.layers


def check_fits(
    cfg: ModelConfig | RNNConfig, tokens: int, device: torch.device, field: str, value: int, unit_tokens: int
) -> None:
    """A ConfigError when a micro-batch of `tokens` tokens cannot fit in `device`'s free memory by the lower bound
    above. `field`=`value` is the setting that makes the batch this large; each unit of it is `unit_tokens` tokens
    (a row of seq_len tokens for data.batch_size, one token for data.batch_tokens)."""
    free = available_bytes(device)
    if free is None:
        return
    limit, what = free
    widths = Widths.of(cfg)
    need = tokens * widths.per_token() + 4 * widths.params
    if need <= limit:
        return
    fits = max(0, (limit - 4 * widths.params) // (widths.per_token() * unit_tokens))
    advice = f"at most {fits:,} could fit" if fits else "even 1 would not fit: use a smaller model or a larger machine"
    raise ConfigError(
        f"{field}={value:,} cannot fit in memory: one micro-batch of {tokens:,} tokens needs at least "
        f"{_gib(need)} (logits, activations, weights), more than the {_gib(limit)} {what}; {advice} "
        "(train.grad_accum keeps the effective batch)"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
