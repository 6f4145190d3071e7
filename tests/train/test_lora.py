"""LoRA: adapters that start as the identity, merge into the same logits, train alone (also on quantized weights),
checkpoint as PEFT's files, resume exactly, and round-trip with the `peft` library both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmkit.adapters import adapters, add_lora, lora_state_dict, merge_lora, trainable_count
from llmkit.errors import ConfigError
from llmkit.interop.load import load_model
from llmkit.interop.peft import load_peft, save_peft
from llmkit.models import build_model
from llmkit.presets import get_preset
from llmkit.quant import quantize as quantize_model
from llmkit.runs import resolve_checkpoint
from llmkit.train.config import TrainConfig
from llmkit.train.loop import Trainer, TrainingError, train

from .conftest import losses, tiny_config


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every adapter a non-zero B (a trained adapter), reproducibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapters(model).values():
            m.B.copy_(torch.randn(m.B.shape, generator=g) * 0.05)


@pytest.mark.parametrize(
    ("preset", "targets"),
    [("llama2-7b-tiny", ["wq", "wv", "w2"]), ("deepseek-v3-tiny", ["wq_a", "wkv_b", "wo"]), ("gpt2-tiny", ["wo"])],
)
def test_zero_b_is_the_base_model_and_merging_keeps_the_logits(preset, targets):
    torch.manual_seed(0)
    model = build_model(get_preset(preset)).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        base = model(x)
        names = add_lora(model, r=4, alpha=8, targets=targets)
        assert torch.equal(model(x), base)  # B = 0: exactly the base model
        randomize(model)
        adapted = model(x)
        assert not torch.allclose(adapted, base, atol=1e-4)
        assert sorted(merge_lora(model)) == sorted(names)
        assert not adapters(model) and not any(".lora." in k for k in model.state_dict())
        torch.testing.assert_close(model(x), adapted, atol=2e-5, rtol=2e-5)


def test_only_the_adapters_train_and_an_unknown_target_is_an_error():
    torch.manual_seed(0)
    model = build_model(get_preset("llama2-7b-tiny"))
    names = add_lora(model, r=2, alpha=4, targets=["wq", "wv"])
    assert len(names) == 2 * model.cfg.n_layers
    trainable, total = trainable_count(model)
    per = sum(m.A.numel() + m.B.numel() for m in adapters(model).values())
    assert trainable == per and total > 20 * per
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(lora_state_dict(model))
    with pytest.raises(ConfigError, match=r"q_proj is not a projection of this model; its projections are .*wq"):
        add_lora(build_model(get_preset("llama2-7b-tiny")), r=2, alpha=4, targets=["q_proj"])


def test_adapters_on_int4_weights_get_gradients_through_every_layer():
    """QLoRA: the frozen int4 layers pass gradients to the adapters before them."""
    torch.manual_seed(0)
    model = quantize_model(build_model(get_preset("llama2-7b-tiny")), "int4", group_size=32)
    add_lora(model, r=2, alpha=4, targets=["wq", "wo", "w2"])
    randomize(model)
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    model.loss(x, inputs=x).total.backward()
    for name, m in adapters(model).items():
        assert m.A.grad is not None and m.A.grad.abs().sum() > 0, name
    # the backward of a quantized layer multiplies by its dequantized weights: compare with the float twin
    float_twin = build_model(get_preset("llama2-7b-tiny"))
    float_twin.load_state_dict({k: v for k, v in dequantized_state(model).items() if ".lora." not in k}, strict=True)
    add_lora(float_twin, r=2, alpha=4, targets=["wq", "wo", "w2"])
    with torch.no_grad():
        for name, m in adapters(float_twin).items():
            m.A.copy_(adapters(model)[name].A)
            m.B.copy_(adapters(model)[name].B)
    float_twin.loss(x, inputs=x).total.backward()
    a = adapters(model)["blocks.0.attn.wq"].A.grad
    b = adapters(float_twin)["blocks.0.attn.wq"].A.grad
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def dequantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A quantized model's state as float weights (each quantized layer's weight dequantized)."""
    from llmkit.quant.linear import QuantizedLinear

    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    state = {n + ".weight": m.dequantize(torch.float32) for n, m in quantized.items()}
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[0] not in quantized:
            state[name] = p.detach()
    return state


# ---- PEFT


def peft_or_skip():
    return pytest.importorskip("peft", reason="needs the peft library (the dev extra installs it)")


def test_llmkit_adapters_load_in_peft_onto_transformers_with_the_same_logits(tmp_path):
    peft = peft_or_skip()
    from transformers import AutoModelForCausalLM

    from llmkit.interop.hf import save_hf

    torch.manual_seed(0)
    model = build_model(get_preset("llama2-7b-tiny")).eval()
    save_hf(model, tmp_path / "hf")
    add_lora(model, r=4, alpha=8, targets=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    randomize(model)
    save_peft(model, model.cfg, tmp_path / "adapter", base=str(tmp_path / "hf"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, model(x), atol=1e-5, rtol=1e-5)
        with theirs.disable_adapter():  # the adapters matter: without them the logits differ
            assert not torch.allclose(theirs(x).logits, model(x), atol=1e-3)


def test_adapters_peft_wrote_load_in_llmkit_with_the_same_logits(tmp_path):
    peft = peft_or_skip()
    from transformers import AutoModelForCausalLM

    from llmkit.interop.hf import save_hf

    torch.manual_seed(0)
    save_hf(build_model(get_preset("llama2-7b-tiny")), tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    config = peft.LoraConfig(r=3, lora_alpha=7, target_modules=["k_proj", "o_proj", "up_proj"], lora_dropout=0.0)
    theirs = peft.get_peft_model(hf, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    theirs.save_pretrained(tmp_path / "adapter")
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        expected = theirs.eval()(x).logits
    ours = load_model(tmp_path / "hf").model.eval()
    names = load_peft(ours, ours.cfg, tmp_path / "adapter")
    assert len(names) == 3 * ours.cfg.n_layers
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
    # a folder PEFT saved loads directly (base_model_name_or_path is the local HF folder), merged
    merged = load_model(tmp_path / "adapter").model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), expected, atol=2e-5, rtol=2e-5)


# ---- training runs with adapters


@pytest.fixture(scope="module")
def pretrained(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pre") / "run"
    train(TrainConfig.from_dict(tiny_config(tiny_data, out, train={"steps": 6})))
    return out


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
