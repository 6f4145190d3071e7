"""Muon (optim.name: muon): its orthogonalisation against the SVD, which parameters it trains, its step against its
definition, and a run that learns and resumes bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import llmkit
from llmkit.errors import ConfigError
from llmkit.train.config import OptimConfig, TrainConfig
from llmkit.train.loop import train
from llmkit.train.optim import MuonWithAdamW, build_optimizer, is_hidden_matrix

from .conftest import losses, tiny_config

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")

NS = (3.4445, -4.775, 2.0315)  # torch's (and Keller Jordan's) quintic Newton-Schulz coefficients


@pytest.mark.parametrize("shape", [(64, 64), (96, 64), (64, 256), (300, 100)])
def test_the_newton_schulz_orthogonalisation_keeps_the_svd_s_directions_and_brings_the_values_near_one(shape):
    """Muon's update is U V^T of the momentum's SVD U S V^T, approximately: five quintic Newton-Schulz iterations
    (in bf16) apply a polynomial to the singular values and keep the singular vectors. Stated bounds: in the SVD's
    bases the result is diagonal to 2% (bf16 rounding), and every direction with a singular value at least a tenth of
    the largest comes out between 0.6 and 1.2 (the coefficients trade exactness for speed: about 0.68 to 1.14)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(0)
    g = torch.randn(shape)
    r = _zeropower_via_newtonschulz(g, NS, 5, 1e-7).double()
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    d = u.T @ r @ vh.T  # the result in the SVD's bases
    diagonal = d.diagonal()
    assert (d - torch.diag(diagonal)).norm() / d.norm() < 0.02
    large = s >= 0.1 * s.max()
    assert large.sum() >= min(shape) // 2
    assert diagonal[large].min() >= 0.6 and diagonal[large].max() <= 1.2
    assert (r - u @ vh).norm() / (u @ vh).norm() < 0.3  # near U V^T itself, as far as those values allow


@pytest.mark.parametrize("preset", ["llama2-7b-tiny", "deepseek-v3-tiny"])
def test_muon_trains_the_hidden_matrices_and_adamw_the_rest(preset):
    model = llmkit.build_model(llmkit.get_preset(preset))
    optimizer = build_optimizer(model, OptimConfig(name="muon"))
    assert isinstance(optimizer, MuonWithAdamW)
    muon, adamw = ({id(p) for g in part.param_groups for p in g["params"]} for part in optimizer.parts)
    names = {id(p): name for name, p in model.named_parameters()}
    assert not muon & adamw and muon | adamw == set(names)  # every parameter once
    on_muon = sorted(names[i] for i in muon)
    assert on_muon and all(n.startswith(("blocks.", "mtp.")) and n.endswith("weight") for n in on_muon)
    assert all(model.get_parameter(n).dim() == 2 for n in on_muon)
    for name in ("embed.weight", "head.weight", "norm.weight"):
        assert id(model.get_parameter(name)) in adamw
    if preset == "deepseek-v3-tiny":  # a mixture's router and its experts' stacked matrices stay with AdamW
        assert id(model.get_parameter("blocks.1.ffn.router.weight")) in adamw
        assert id(model.get_parameter("blocks.1.ffn.experts.w1")) in adamw
        assert id(model.get_parameter("blocks.1.ffn.shared.w1.weight")) in muon
    matrix = model.get_parameter("blocks.0.attn.wo.weight")
    assert not is_hidden_matrix("blocks.0.attn.wo.lora_A.weight", matrix)  # LoRA's factors: not Muon's


def test_a_muon_step_is_its_definition():
    """One step on a hidden matrix: p <- p (1 - lr wd) - lr 0.2 sqrt(max(out, in)) NS(nesterov momentum), the
    momentum m <- beta m + (1 - beta) g (from zero), the Nesterov update g + beta (m - g) (Jordan et al.; the scale
    is Moonshot's, matching AdamW's update size)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset("llama2-7b-tiny"))
    cfg = OptimConfig(name="muon", lr=0.01, weight_decay=0.1, muon_momentum=0.9)
    optimizer = build_optimizer(model, cfg)
    w = model.get_parameter("blocks.0.ffn.w1.weight")
    before = w.detach().clone()
    model(torch.randint(0, 256, (2, 16))).float().pow(2).mean().backward()
    g = w.grad.detach().clone()
    optimizer.step()
    m = (1 - cfg.muon_momentum) * g
    update = g + cfg.muon_momentum * (m - g)
    scale = cfg.lr * 0.2 * math.sqrt(max(w.shape))
    expected = before * (1 - cfg.lr * cfg.weight_decay) - scale * _zeropower_via_newtonschulz(update, NS, 5, 1e-7)
    # to 1% of the step's unit: the iterations run in bf16, where an input a rounding away flips a few last bits
    # (the momentum without Nesterov's look-ahead, or the raw gradient, is 8-11% away)
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=0.01 * scale)


def _run(data: Path, out: Path, resume: bool = False, **sections: dict):
    sections["optim"] = {"name": "muon", **sections.get("optim", {})}
    return train(TrainConfig.from_dict(tiny_config(data, out, **sections)), resume=resume)


def test_a_muon_run_learns(tiny_data, tmp_path):
    _run(tiny_data, tmp_path / "r", train={"steps": 25, "eval_every": 25})
    values = losses(tmp_path / "r")
    assert sum(values[-5:]) / 5 < values[0] - 1.0, values


@pytest.mark.parametrize("preset", ["llama2-7b-tiny", "deepseek-v3-tiny"])
def test_a_muon_run_resumes_bit_for_bit(tiny_data, tmp_path, preset):
    # deepseek-v3-tiny: a mixture (router bias updates, experts with AdamW) and an MTP module beside Muon's matrices
    _run(tiny_data, tmp_path / "a", model={"preset": preset}, train={"steps": 12})
    _run(tiny_data, tmp_path / "b", model={"preset": preset}, train={"steps": 12, "halt_at": 6})
    result = _run(tiny_data, tmp_path / "b", resume=True, model={"preset": preset}, train={"steps": 12})
    assert result.steps == 12
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # bit for bit


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"lora": {"r": 4}, "model": {"checkpoint": "x"}}, "LoRA's factors train with adamw"),
        ({"train": {"parallel": "fsdp"}}, "splits across processes"),
        ({"optim": {"muon_momentum": 1.0}}, "muon_momentum"),
    ],
)
def test_muon_refuses_what_it_cannot_do(tiny_data, tmp_path, sections, message):
    cfg = tiny_config(tiny_data, tmp_path / "r", **sections)
    cfg["optim"]["name"] = "muon"
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(cfg)
