"""LoRA adapters: they start as the identity, merge into the same logits, train alone (also on quantized weights),
and round-trip with the `peft` library both ways."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.adapters import adapters, add_lora, lora_state_dict, merge_lora, trainable_count
from llmkit.config.presets import get_preset
from llmkit.errors import ConfigError
from llmkit.interop.load import load_model
from llmkit.interop.peft import load_peft, save_peft
from llmkit.models import build_model
from llmkit.quant import quantize as quantize_model


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
