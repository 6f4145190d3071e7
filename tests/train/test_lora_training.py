"""LoRA and QLoRA runs: only the adapters train, they are saved as PEFT's files, a run resumes exactly, and the
settings are checked (the adapters themselves: tests/adapters/test_lora.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmkit.errors import ConfigError
from llmkit.interop.load import load_model
from llmkit.quant import quantize as quantize_model
from llmkit.runs import resolve_checkpoint
from llmkit.train.config import TrainConfig
from llmkit.train.loop import Trainer, TrainingError, train

from .conftest import losses, pretrain, tiny_config


@pytest.fixture(scope="module")
def pretrained(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pretrain(tiny_data, tmp_path_factory, steps=6)


def lora_config(data: Path, out: Path, base: Path, **lora: object) -> dict:
    cfg = tiny_config(data, out, train={"steps": 8, "save_every": 4, "eval_every": 4})
    cfg["model"] = {"checkpoint": str(base)}
    cfg["lora"] = {"r": 4, "alpha": 8, "targets": ["wq", "wv", "w2"], **lora}
    cfg["optim"]["lr"] = 1e-2
    return cfg


def test_a_lora_run_trains_only_adapters_saves_them_as_peft_files_and_resumes_exactly(tiny_data, pretrained, tmp_path):
    cfg = lora_config(tiny_data, tmp_path / "a", pretrained)
    trainer = Trainer(TrainConfig.from_dict(cfg))
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == trainable and len(trainable) == 2 * 3 * trainer.model.cfg.n_layers
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if ".lora." not in k}
    trainer.run()
    trainer.close()
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the base is frozen
    first, last = losses(tmp_path / "a")[0], losses(tmp_path / "a")[-1]
    assert last < first
    ckpt = resolve_checkpoint(tmp_path / "a")
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    assert (ckpt / "adapter_model.safetensors").stat().st_size < 200_000
    # resumed from the halfway checkpoint: bit for bit the same run
    b = lora_config(tiny_data, tmp_path / "b", pretrained)
    train(TrainConfig.from_dict({**b, "train": {**b["train"], "halt_at": 4}}))
    train(TrainConfig.from_dict(b), resume=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    # the checkpoint loads as the base with the adapters folded in; `llmkit merge` writes that as a checkpoint
    from llmkit.cli import main

    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        expected = trainer.model.eval()(x)
        torch.testing.assert_close(load_model(ckpt).model.eval()(x), expected, atol=2e-5, rtol=2e-5)
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "merged")]) == 0
    merged = load_model(tmp_path / "merged").model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), expected, atol=2e-5, rtol=2e-5)
    assert main(["merge", str(pretrained), str(tmp_path / "nothing")]) == 2  # no adapters there


def test_qlora_trains_adapters_on_a_quantized_checkpoint(tiny_data, pretrained, tmp_path):
    from llmkit.interop.checkpoint import save_llmkit

    loaded = load_model(resolve_checkpoint(pretrained))
    save_llmkit(quantize_model(loaded.model, "int8"), tmp_path / "q", tokenizer=loaded.tokenizer)
    with pytest.raises(TrainingError, match=r"quantized weights.*lora.quantized"):
        Trainer(TrainConfig.from_dict({**lora_config(tiny_data, tmp_path / "x", tmp_path / "q"), "lora": {"r": 0}}))
    cfg = lora_config(tiny_data, tmp_path / "r", tmp_path / "q", quantized=True)
    result = train(TrainConfig.from_dict(cfg))
    assert result.steps == 8 and losses(tmp_path / "r")[-1] < losses(tmp_path / "r")[0]
    meta = json.loads((resolve_checkpoint(tmp_path / "r") / "llmkit.json").read_text())
    assert meta["adapter"]["quantized"] is True


def test_lora_settings_are_checked(tiny_data, pretrained, tmp_path):
    cfg = tiny_config(tiny_data, tmp_path / "r")
    with pytest.raises(ConfigError, match=r"set model.checkpoint"):
        TrainConfig.from_dict({**cfg, "lora": {"r": 4}})
    with pytest.raises(ConfigError, match=r"lora.dropout"):
        TrainConfig.from_dict({**lora_config(tiny_data, tmp_path / "r", pretrained), "lora": {"r": 4, "dropout": 1.5}})
    with pytest.raises(ConfigError, match=r"lora.targets: w9 is not a projection"):
        Trainer(TrainConfig.from_dict(lora_config(tiny_data, tmp_path / "r", pretrained, targets=["w9"])))
