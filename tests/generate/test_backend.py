"""The one place that decides how a model's steps run (llmkit.generate.backend.resolve): generate's steps and the
serving engine's runners are what it says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import llmkit
from llmkit.errors import InputError
from llmkit.generate import CompiledStep, DecodeStep, NativeStep, choose_step
from llmkit.generate.backend import Backend, resolve
from llmkit.generate.step import step_for
from llmkit.quant import native
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.model_runner import InvariantRunner, NativeRunner, TorchRunner


def _model(preset: str) -> llmkit.DecoderLM:
    torch.manual_seed(0)
    cfg = dataclasses.replace(llmkit.get_preset(preset), n_layers=1)
    return llmkit.build_model(cfg).eval()


@pytest.mark.skipif(not native.available(), reason="needs llmkit's C++ decode step (an AVX2 CPU)")
def test_a_lowered_model_runs_in_cpp_batch_invariant_unless_told_otherwise():
    model = _model("llama2-7b-tiny")
    default, off, required = resolve(model), resolve(model, invariant=False), resolve(model, invariant=True)
    assert (default.kind, default.invariant, default.required) == ("native", True, False)
    assert (off.kind, off.invariant, off.required) == ("native", False, False)
    assert (required.kind, required.invariant, required.required) == ("native", True, True)
    step = choose_step(model)
    assert isinstance(step, NativeStep) and step.invariant and not step.required
    assert isinstance(step_for(model, required), NativeStep) and step_for(model, required).required
    off_step = step_for(model, off)
    assert isinstance(off_step, NativeStep) and not off_step.invariant
    kv = 1 << 22
    assert type(Engine(model, None, EngineConfig(kv_memory=kv)).runner) is InvariantRunner
    assert type(Engine(model, None, EngineConfig(kv_memory=kv, batch_invariant=False)).runner) is NativeRunner


def test_a_model_the_cpp_step_does_not_take_runs_eagerly_and_refuses_invariance():
    """Latent attention (DeepSeek) does not lower: eager steps and the PyTorch runner; asking for invariance is an
    error that says what the C++ step needs, from generate and from the engine alike."""
    model = _model("deepseek-v3-tiny")
    assert resolve(model) == Backend("eager")
    assert type(choose_step(model)) is DecodeStep
    assert type(Engine(model, None, EngineConfig(kv_memory=1 << 22)).runner) is TorchRunner
    with pytest.raises(InputError, match="needs llmkit's C\\+\\+ decode step: an x86 CPU with AVX2"):
        choose_step(model, invariant=True)
    with pytest.raises(InputError, match="needs llmkit's C\\+\\+ decode step"):
        Engine(model, None, EngineConfig(kv_memory=1 << 22, batch_invariant=True))


def test_compiling_is_a_backend_of_its_own_and_excludes_invariance():
    model = _model("llama2-7b-tiny")
    assert resolve(model, compiled=True) == Backend("compiled")
    assert isinstance(choose_step(model, compiled=True), CompiledStep)
    with pytest.raises(InputError, match=r"not through torch\.compile"):
        resolve(model, compiled=True, invariant=True)
