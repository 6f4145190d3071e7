"""The C++ decode step fails closed: each layer built with each option either gives PyTorch's logits and caches
through the C++ step or is declined (and decodes in PyTorch), and an option, parameter or config field that
llmkit.quant.lowering's LOWERED does not declare makes it decline."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from llmkit import get_preset
from llmkit.config import ModelConfig, MoEConfig
from llmkit.config.position import RopeScaling
from llmkit.config.presets import PRESETS
from llmkit.generate import DecodeStep, NativeStep, choose_step, generate
from llmkit.generate.backend import resolve
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.quant import native, quantize
from llmkit.quant.native_step import NativeDecoder
from quant.test_native_decode import PROMPTS, model_of, run_both

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llmkit's AVX2 extension (x86 CPU, compiler)")


def change(name: str, **fields: Any) -> ModelConfig:
    """A preset with fields replaced, named by path: change("llama2-7b-tiny", **{"attention.qkv_bias": True})."""
    cfg = get_preset(name)
    for path, value in fields.items():
        *parents, leaf = path.split(".")
        objects = [cfg]
        for p in parents:
            objects.append(getattr(objects[-1], p))
        new = dataclasses.replace(objects[-1], **{leaf: value})
        for obj, p in zip(reversed(objects[:-1]), reversed(parents), strict=True):
            new = dataclasses.replace(obj, **{p: new})
        cfg = new
    return cfg


LLAMA, MIXTRAL = "llama2-7b-tiny", "mixtral-8x7b-tiny"
# each option of the layers a decoder is built from, one at a time, and whether the C++ step computes it
OPTIONS: dict[str, tuple[ModelConfig, bool]] = {
    "mha": (change(LLAMA, **{"attention.n_kv_heads": 4}), True),
    "mqa": (change(LLAMA, **{"attention.n_kv_heads": 1}), True),
    "qkv-bias": (change(LLAMA, **{"attention.qkv_bias": True}), True),
    "out-bias": (change(LLAMA, **{"attention.out_bias": True}), True),
    "attention-dropout": (change(LLAMA, **{"attention.dropout": 0.1}), True),
    "sliding-window": (change(LLAMA, **{"attention.sliding_window": 5}), True),
    "full-every-2": (change(LLAMA, **{"attention.sliding_window": 5, "attention.full_every": 2}), True),
    "qk-norm": (change(LLAMA, **{"attention.qk_norm": True}), True),
    "attention-softcap": (change(LLAMA, **{"attention.softcap": 3.0}), False),
    "attention-scale": (change(LLAMA, **{"attention.scale": 0.1}), False),
    "mla": (get_preset("deepseek-v2-lite-tiny"), False),
    "dsa": (get_preset("deepseek-v3.2-tiny"), False),
    "rope-interleaved": (change(LLAMA, **{"position.layout": "interleaved"}), True),
    "partial-rope": (change(LLAMA, **{"position.rope_fraction": 0.5}), True),
    "rope-yarn": (change(LLAMA, **{"position.scaling": RopeScaling("yarn", 4.0, 64)}), True),
    "learned-positions": (change(LLAMA, **{"position.kind": "learned"}), True),
    "sinusoidal-positions": (change(LLAMA, **{"position.kind": "sinusoidal"}), True),
    "no-positions": (change(LLAMA, **{"position.kind": "none"}), True),
    "local-rope-base": (
        change(LLAMA, **{"attention.sliding_window": 5, "attention.full_every": 2, "position.local_theta": 100.0}),
        False,
    ),
    "layernorm": (change(LLAMA, **{"norm.kind": "layernorm"}), True),
    "layernorm-no-bias": (change(LLAMA, **{"norm.kind": "layernorm", "norm.bias": False}), True),
    "norm-eps": (change(LLAMA, **{"norm.eps": 1e-2}), True),
    "offset-rmsnorm": (change(LLAMA, **{"norm.unit_offset": True}), False),
    "post-norm": (change(LLAMA, **{"norm.placement": "post"}), False),
    "sandwich-norm": (change(LLAMA, **{"norm.placement": "sandwich"}), False),
    "mlp-relu": (change(LLAMA, **{"ffn.kind": "mlp", "ffn.activation": "relu"}), True),
    "mlp-gelu-bias": (change(LLAMA, **{"ffn.kind": "mlp", "ffn.activation": "gelu", "ffn.bias": True}), True),
    "geglu-tanh": (change(LLAMA, **{"ffn.activation": "gelu_tanh"}), True),
    "swiglu-bias": (change(LLAMA, **{"ffn.bias": True}), True),
    "tied-head": (change(LLAMA, tie_embeddings=True), True),
    "head-bias": (change(LLAMA, head_bias=True), True),
    "logit-softcap": (change(LLAMA, logit_softcap=0.5), True),
    "scaled-embeddings": (change(LLAMA, scale_embeddings=True), True),
    "mtp-module": (change(LLAMA, mtp_depth=1), True),
    "moe": (get_preset(MIXTRAL), True),
    "moe-first-dense": (change(MIXTRAL, **{"moe.first_dense_layers": 1}), True),
    "moe-sigmoid-groups": (
        change(MIXTRAL, **{"moe.n_experts": 8, "moe.score_func": "sigmoid", "moe.n_groups": 4, "moe.topk_groups": 2}),
        True,
    ),
    "moe-shared-gated": (change(MIXTRAL, **{"moe.n_shared_experts": 1, "moe.shared_gate": True}), True),
    "moe-mlp-experts": (change(MIXTRAL, **{"moe.expert_kind": "mlp", "moe.activation": "relu"}), True),
    "moe-unnormalised": (change(MIXTRAL, **{"moe.norm_topk": False, "moe.routed_scale": 2.0}), True),
    "moe-capacity": (change(MIXTRAL, **{"moe.capacity_factor": 1.25}), False),
}


def equal_through_both(model: nn.Module) -> None:
    ref, nat, ref_cache, nat_cache = run_both(model, PROMPTS, 4)
    for a, b in zip(ref, nat, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    for la, lb in zip(ref_cache.layers, nat_cache.layers, strict=True):
        torch.testing.assert_close(lb.k, la.k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_layer_option_is_computed_by_the_cpp_step_or_declined(name):
    cfg, computed = OPTIONS[name]
    model = model_of(cfg)
    assert (NativeDecoder.of(model) is not None) == computed
    if computed:
        assert type(choose_step(model)) is NativeStep
        equal_through_both(model)
    else:
        assert type(choose_step(model)) is DecodeStep


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_layers_are_lowered_and_a_kernel_the_step_lacks_is_declined(method):
    model = quantize(model_of(get_preset(LLAMA)), method, group_size=32, include_head=True)
    assert NativeDecoder.of(model) is not None
    exact = quantize(model_of(get_preset(LLAMA)), method, group_size=32, kernel="dequant")
    assert NativeDecoder.of(exact) is None


@pytest.mark.parametrize("name", [n for n in PRESETS if n.endswith("-tiny") and get_preset(n).encoder is None])
def test_every_tiny_decoder_preset_matches_pytorch_or_is_declined(name):
    model = model_of(get_preset(name))
    if NativeDecoder.of(model) is not None:
        equal_through_both(model)


def test_an_option_the_declaration_does_not_list_makes_the_step_decline(monkeypatch):
    """An attention option added later (here: its output scaled by `out_scale`) that the C++ step does not compute:
    the model decodes in PyTorch, with the option's effect. The lowering that checked a list of attributes it knew
    took this model and decoded it without the factor."""
    model = model_of(get_preset(LLAMA))
    prompts = [[5, 17, 99, 3], [8, 8, 1]]
    before = generate(model, prompts, max_new_tokens=8).new_tokens
    forward = GroupedQueryAttention.forward

    def scaled(self: GroupedQueryAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        return forward(self, *args, **kwargs) * getattr(self, "out_scale", 1.0)

    monkeypatch.setattr(GroupedQueryAttention, "forward", scaled)
    for block in model.blocks:
        block.attn.out_scale = 3.0
    assert NativeDecoder.of(model) is None
    after = generate(model, prompts, max_new_tokens=8).new_tokens
    assert after == generate(model, prompts, max_new_tokens=8, step=DecodeStep(model)).new_tokens
    assert after != before  # the option changes the output, so ignoring it would have shown


def test_a_model_with_lora_adapters_decodes_with_them():
    """attach_lora gives a projection a `lora` submodule and a forward hook that adds its update: neither is in the
    C++ step, which declines. (The lowering before LOWERED took an eval-mode model's nn.Linear and dropped the
    update: what `llmkit generate` loads is in eval mode.)"""
    from llmkit.adapters.lora import attach_lora

    model = model_of(get_preset(LLAMA))
    attach_lora(model, ["blocks.0.attn.wq", "blocks.1.ffn.w2"], r=4, alpha=8.0)
    model.eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "B") and isinstance(m.B, nn.Parameter):
                m.B.normal_(0.0, 0.5)
    assert NativeDecoder.of(model) is None
    prompts = [[5, 17, 99, 3], [8, 8, 1]]
    with_lora = generate(model, prompts, max_new_tokens=8).new_tokens
    assert with_lora == generate(model, prompts, max_new_tokens=8, step=DecodeStep(model)).new_tokens


def test_a_forward_hook_makes_the_step_decline():
    model = model_of(get_preset(LLAMA))
    handle = model.blocks[0].ffn.w1.register_forward_hook(lambda module, args, out: out * 2)
    assert NativeDecoder.of(model) is None
    handle.remove()
    assert NativeDecoder.of(model) is not None


def test_a_parameter_or_config_field_the_declaration_does_not_list_makes_the_step_decline():
    model = model_of(get_preset(LLAMA))
    assert NativeDecoder.of(model) is not None
    model.blocks[1].ffn_residual.norm.register_parameter("shift", nn.Parameter(torch.zeros(model.cfg.d_model)))
    assert NativeDecoder.of(model) is None

    @dataclasses.dataclass(frozen=True)
    class TemperedMoE(MoEConfig):  # a routing option MoEConfig might gain
        router_temperature: float = 2.0

    moe = model_of(get_preset(MIXTRAL))
    assert NativeDecoder.of(moe) is not None
    layer = moe.blocks[0].ffn
    layer.router.cfg = layer.cfg = TemperedMoE(**dataclasses.asdict(layer.cfg))
    assert NativeDecoder.of(moe) is None


# the tiny decoder presets whose every block the C++ step computes: a lowering rule lost (a layer's option no longer
# declared in LOWERED) moves a preset out of this set, and its decoding and serving silently to PyTorch; a rule added
# moves one in. Either way this list is updated on purpose. Not lowered: latent attention (DeepSeek), Gemma's
# embedding scale, soft caps and sliding windows.
MUST_LOWER = {
    "gpt2-medium-tiny", "gpt2-tiny", "gpt3-175b-tiny", "llama2-70b-tiny", "llama2-7b-tiny", "mixtral-8x22b-tiny",
    "mixtral-8x7b-tiny", "qwen1.5-moe-a2.7b-tiny", "qwen3-0.6b-tiny",
}  # fmt: skip


@pytest.mark.parametrize("name", [n for n in PRESETS if n.endswith("-tiny") and get_preset(n).encoder is None])
def test_the_presets_that_must_lower_do_in_generation_and_serving(name):
    """Which tiny presets decode through the C++ step is a fact the tests state, for `generate` (choose_step) and
    the serving engine (its model runner) alike."""
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.model_runner import NativeRunner

    model = model_of(get_preset(name))
    lowered = name in MUST_LOWER
    assert (NativeDecoder.of(model) is not None) == lowered
    assert resolve(model).kind == ("native" if lowered else "eager")
    assert isinstance(choose_step(model), NativeStep) == lowered
    assert isinstance(Engine(model, None, EngineConfig(kv_memory=1 << 22)).runner, NativeRunner) == lowered
