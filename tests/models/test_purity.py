"""Models are pure: a forward call returns what it computes and leaves every module as it found it (no attribute
set, no buffer changed), in training and in inference, with and without a cache; side outputs come back through
`Extras` only."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from llmkit import build_model, get_preset
from llmkit.config.presets import PRESETS
from llmkit.layers.extras import Extras
from llmkit.models import DecoderLM, EncoderDecoder

TINY = [n for n in PRESETS if n.endswith("-tiny")]


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Every module's attributes (by identity) and every buffer's values."""
    state: dict[str, Any] = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                state[f"{name}.{key}"] = {k: id(v) for k, v in value.items()}
            else:
                state[f"{name}.{key}"] = id(value)
        for key, buf in module.named_buffers(recurse=False):
            state[f"{name}.buffer.{key}"] = buf.detach().clone()
    return state


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys(), sorted(set(before) ^ set(after))
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key


@pytest.mark.parametrize("name", TINY)
def test_forward_leaves_every_module_as_it_was(name):
    cfg = get_preset(name)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 7))
    for training in (True, False):
        model.train(training)
        before = snapshot(model)
        extras = Extras(attention_weights=True, indexer="sparse" if cfg.attention.kind == "dsa" else "off")
        if isinstance(model, EncoderDecoder):
            model(tokens, tokens, extras=extras)
            model.loss(tokens, tokens, start_id=1).total.backward()
            cache = model.new_cache(2, 8)
            with torch.no_grad():
                model.decode(tokens[:, :3], model.encode(tokens), cache=cache)
        else:
            assert isinstance(model, DecoderLM)
            model(tokens, extras=extras)
            model.loss(tokens, start_id=1, extras=Extras()).total.backward()
            cache = model.new_cache(2, 10)
            with torch.no_grad():
                model(tokens[:, :4], cache=cache)
                model(tokens[:, 4:5], cache=cache)
        assert extras.self_attention, "attention weights come back through Extras"
        model.zero_grad(set_to_none=True)  # gradients are the one thing a backward pass is meant to leave
        assert_unchanged(before, snapshot(model))


def test_moe_statistics_come_back_only_when_asked():
    cfg = get_preset("deepseek-v3-tiny")
    model = build_model(dataclasses.replace(cfg, mtp_depth=0)).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 6))
    extras = Extras()
    model(tokens, extras=extras)
    moe_layers = cfg.n_layers - cfg.moe.first_dense_layers if cfg.moe else 0
    assert [s.layer for s in extras.moe] == list(range(cfg.n_layers - moe_layers, cfg.n_layers))
    assert all(int(s.counts.sum()) == 2 * 6 * cfg.moe.top_k for s in extras.moe)  # every assignment counted
