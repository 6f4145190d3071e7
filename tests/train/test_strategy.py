"""Fine-tuning strategies (llmkit.train.strategy): what trains, what a checkpoint holds, how one is read back; and the
loop running with one passed in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.models import DecoderLM
from llmkit.quant import quantize
from llmkit.runs import latest_checkpoint
from llmkit.train import checkpoint as ckpt
from llmkit.train.config import TrainConfig
from llmkit.train.loop import train
from llmkit.train.source import InMemory, TrainingError
from llmkit.train.strategy import Full, LoRA, Partial, QLoRA, from_config

from .conftest import tiny_config


def tiny(mtp_depth: int = 0) -> DecoderLM:
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320, mtp_depth=mtp_depth))
    assert isinstance(model, DecoderLM)
    return model


def trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_full_trains_and_saves_every_weight():
    model = tiny()
    strategy = Full()
    assert strategy.prepare(model) is None
    assert trainable(model) == {n for n, _ in model.named_parameters()}
    state = model.state_dict()
    assert strategy.saved(state) is state and strategy.adapter is None
    assert strategy.restore(model, state) is state


def test_partial_trains_what_is_named_and_saves_the_whole_model():
    model = tiny(mtp_depth=1)
    strategy = Partial(["mtp", "norm"])
    strategy.prepare(model)
    assert trainable(model) == {n for n, _ in model.named_parameters() if n.startswith(("mtp.", "norm."))}
    assert "norm.weight" in trainable(model)
    assert not any(n.startswith("normx") for n in trainable(model))  # a name, not a string prefix
    state = model.state_dict()
    assert strategy.saved(state) is state and strategy.adapter is None
    assert strategy.backward_factor is None
    with pytest.raises(TrainingError, match="no parameter is named nowhere"):
        Partial(["nowhere"]).prepare(tiny())


def test_lora_trains_and_saves_only_the_adapters_and_reads_them_back_over_the_base():
    model = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = LoRA(r=4, alpha=8.0, base="runs/base", targets=["wq", "wv"], seed=3)
    line = strategy.prepare(model)
    assert line is not None and "r=4" in line
    adapters = {n for n in model.state_dict() if n not in base}
    assert adapters and all(n.endswith((".lora.A", ".lora.B")) for n in adapters)
    assert {n.split(".")[-3] for n in adapters} == {"wq", "wv"}  # blocks.0.attn.wq.lora.A
    assert trainable(model) == adapters  # the base is frozen
    saved = strategy.saved(model.state_dict())
    assert set(saved) == adapters
    assert strategy.adapter == {"base": "runs/base", "quantized": False}
    changed = {k: v + 1 for k, v in saved.items()}
    restored = strategy.restore(model, changed)
    assert set(restored) == set(model.state_dict())
    assert all(torch.equal(restored[k], v) for k, v in changed.items())  # the adapters as saved
    assert all(torch.equal(restored[k], v) for k, v in base.items())  # the base as built
    again = tiny()
    LoRA(r=4, alpha=8.0, base="runs/base", targets=["wq", "wv"], seed=3).prepare(again)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in saved.items())  # its seed fixes the adapters


def test_qlora_adapts_a_quantized_base_and_says_so():
    model = quantize(tiny(), "int8")
    strategy = QLoRA(r=2, alpha=4.0, base="model.gguf", targets=["wq"])
    strategy.prepare(model)
    assert trainable(model) and all(".lora." in n for n in trainable(model))
    assert set(strategy.saved(model.state_dict())) == trainable(model)
    assert strategy.adapter == {"base": "model.gguf", "quantized": True}


def test_the_config_picks_the_strategy(tiny_data, tmp_path):
    base = tiny_config(tiny_data, tmp_path)
    assert isinstance(from_config(TrainConfig.from_dict(base), None), Full)
    partial = from_config(TrainConfig.from_dict({**base, "train": {**base["train"], "trainable": ["mtp"]}}), None)
    assert isinstance(partial, Partial) and partial.prefixes == ["mtp"]
    lora = TrainConfig.from_dict({**base, "model": {"checkpoint": "x"}, "lora": {"r": 4, "targets": ["wq"]}})
    chosen = from_config(lora, "/abs/x")
    assert type(chosen) is LoRA and chosen.base == "/abs/x" and chosen.targets == ["wq"]
    quantized = dataclasses.replace(lora, lora=dataclasses.replace(lora.lora, quantized=True))
    assert isinstance(from_config(quantized, "/abs/x"), QLoRA)


def test_the_loop_runs_the_strategy_it_is_given(tiny_data, tmp_path):
    """A model at hand and a strategy passed in: only what the strategy trains moves, its checkpoint holds what the
    strategy saves, and a resumed run reads it back and ends where an uninterrupted one does."""
    cfg = tiny_config(tiny_data, tmp_path / "whole", train={"steps": 6, "save_every": 3})

    def run(out: str, **train_section: object) -> DecoderLM:
        model = tiny()
        section = {**cfg["train"], "out": str(tmp_path / out), **train_section}
        strategy = LoRA(r=4, alpha=8.0, base="runs/base", targets=["wq", "wo"], seed=1)
        train(TrainConfig.from_dict({**cfg, "train": section}), source=InMemory(model), fine_tuning=strategy)
        return model

    frozen = tiny().state_dict()
    whole = run("whole")
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in frozen.items())  # the base did not move
    saved = ckpt.load(latest_checkpoint(tmp_path / "whole"), whole.cfg).model_state
    assert saved and all(".lora." in k for k in saved)
    run("halted", halt_at=3)
    state = ckpt.load(latest_checkpoint(tmp_path / "halted"), whole.cfg).state
    assert state.step == 3
    model = tiny()
    section = {**cfg["train"], "out": str(tmp_path / "halted")}
    strategy = LoRA(r=4, alpha=8.0, base="runs/base", targets=["wq", "wo"], seed=1)
    result = train(
        TrainConfig.from_dict({**cfg, "train": section}), resume=True, source=InMemory(model), fine_tuning=strategy
    )
    assert result.steps == 6
    assert all(torch.equal(model.state_dict()[k], v) for k, v in whole.state_dict().items())
