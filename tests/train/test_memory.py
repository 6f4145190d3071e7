"""The memory check before training: a lower bound of a micro-batch's bytes against the memory available."""

from __future__ import annotations

import pytest
import torch

from llmkit.config.presets import get_preset
from llmkit.errors import ConfigError
from llmkit.train import memory
from llmkit.train.memory import Widths, available_bytes, check_fits

CPU = torch.device("cpu")


def test_available_memory_is_known_here():
    found = available_bytes(CPU)
    assert found is not None and found[0] > 0


def test_the_largest_batch_it_advises_fits_and_one_more_row_does_not(monkeypatch):
    """The advice in the message is consistent with the check itself."""
    cfg = get_preset("llama2-7b-tiny")
    monkeypatch.setattr(memory, "available_bytes", lambda device: (2**30, "available"))
    seq_len = 256
    with pytest.raises(ConfigError, match=r"data\.batch_size=1,000,000 cannot fit in memory") as info:
        check_fits(cfg, 10**6 * seq_len, CPU, "data.batch_size", 10**6, seq_len)
    fits = int(str(info.value).split("at most ")[1].split(" ")[0].replace(",", ""))
    assert fits > 0
    check_fits(cfg, fits * seq_len, CPU, "data.batch_size", fits, seq_len)
    with pytest.raises(ConfigError):
        check_fits(cfg, (fits + 1) * seq_len, CPU, "data.batch_size", fits + 1, seq_len)


def test_the_bound_is_below_what_a_training_step_really_uses():
    """A lower bound: the logits, their gradient and the residual stream alone; a real step needs more. Measured
    as the bytes autograd keeps for the backward pass of the tiny model on a batch (the saved tensors)."""
    from llmkit import build_model

    cfg = get_preset("llama2-7b-tiny")
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 64))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    widths = Widths.of(cfg)
    bound = tokens.numel() * widths.per_token()
    assert bound < saved + 2 * logits.numel() * 4  # the saved activations plus the logits' gradient
