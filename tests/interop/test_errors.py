"""Each way a checkpoint can be wrong gives a message that names what is wrong."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmkit import build_model, get_preset
from llmkit.errors import ConfigError, LLMKitError
from llmkit.interop.hf import family_for, load_hf, save_hf
from llmkit.interop.keymap import MappingError
from llmkit.interop.safetensors_io import CheckpointError

from .hf_models import build_hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf("llama", tmp_path_factory.mktemp("err"))


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def edit_weights(d: Path, drop: str | None = None, add: dict | None = None) -> None:
    sd = load_file(str(d / "model.safetensors"))
    if drop:
        sd.pop(drop)
    sd.update(add or {})
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_config(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no config.json"):
        load_hf(d)


def test_missing_model_type(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    edit_config(d, model_type=None)
    with pytest.raises(ConfigError, match=r"config.json has no model_type; supported: llama, mistral, qwen2"):
        load_hf(d)


def test_unknown_model_type(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    edit_config(d, model_type="falcon")
    with pytest.raises(ConfigError, match=r"model_type 'falcon' is not supported; supported: llama"):
        load_hf(d)


def test_missing_tensor_is_named(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    edit_weights(d, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(MappingError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(d)


def test_unexpected_tensor_is_named(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    edit_weights(d, add={"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)})
    with pytest.raises(MappingError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        load_hf(d)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    edit_config(d, intermediate_size=72)
    with pytest.raises(MappingError) as e:
        load_hf(d)
    assert "model.layers.0.mlp.gate_proj.weight has shape [80, 64] but the config implies [72, 64]" in str(e.value)


def test_truncated_file(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"is truncated: its tensors need .* bytes but the file has"):
        load_hf(d)
    (d / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"too short for a safetensors header"):
        load_hf(d)


def test_no_weights_and_missing_shard(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has neither model.safetensors nor model.safetensors.index.json"):
        load_hf(d)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"lists model-00001-of-00002.safetensors, which is missing"):
        load_hf(d)


def test_unsupported_options_are_refused(tmp_path, llama):
    d = copy(llama, tmp_path / "c")
    edit_config(d, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}, rope_scaling=None)
    with pytest.raises(ConfigError, match=r"rope type 'longrope' is not supported"):
        load_hf(d)
    edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, hidden_act="quick_gelu")
    with pytest.raises(ConfigError, match=r"hidden_act='quick_gelu' is not supported"):
        load_hf(d)


def test_not_a_directory(tmp_path):
    with pytest.raises(LLMKitError, match=r"is not a directory"):
        load_hf(tmp_path / "nothing")


def test_saving_names_the_field_a_model_type_cannot_hold(tmp_path):
    llama = get_preset("llama2-7b-tiny")
    windowed = build_model(dataclasses.replace(llama, attention=dataclasses.replace(llama.attention, sliding_window=8)))
    with pytest.raises(ConfigError, match=r"attention.sliding_window=8 cannot be written as model_type 'llama': Llama"):
        save_hf(windowed, tmp_path / "a", model_type="llama")
    with pytest.raises(ConfigError, match=r"attention.qkv_bias=False cannot be written as model_type 'qwen2': Qwen2"):
        save_hf(windowed, tmp_path / "b", model_type="qwen2")
    with pytest.raises(ConfigError, match=r"norm.kind='rmsnorm' cannot be written as model_type 'gpt2': GPT-2 is"):
        save_hf(windowed, tmp_path / "c", model_type="gpt2")
    with pytest.raises(ConfigError, match=r"moe=None cannot be written as model_type 'mixtral': Mixtral routes"):
        save_hf(windowed, tmp_path / "d", model_type="mixtral")
    gpt2 = get_preset("gpt2-tiny")
    grouped = dataclasses.replace(gpt2, attention=dataclasses.replace(gpt2.attention, n_kv_heads=1))
    with pytest.raises(ConfigError, match=r"attention.n_kv_heads=1 cannot be written as model_type 'gpt2' \(its "):
        save_hf(build_model(grouped), tmp_path / "e", model_type="gpt2")


def test_a_config_json_with_values_llmkit_cannot_hold_is_refused():
    family = family_for("deepseek_v3")
    with pytest.raises(ConfigError, match=r"config.json scoring_func='softmax' is not supported: DeepSeek-V3 routes"):
        family.config_from_hf({"model_type": "deepseek_v3", "scoring_func": "softmax"})
    marian = {"model_type": "marian", "vocab_size": 32, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1}
    marian.update(encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=4, decoder_attention_heads=8)
    with pytest.raises(ConfigError, match=r"encoder_attention_heads=4 differs from decoder_attention_heads=8"):
        family_for("marian").config_from_hf(marian)


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "longrope"),
        ("stablelm", {"use_parallel_residual": True}, "use_parallel_residual=True is not supported"),
        ("stablelm", {"qk_layernorm": True}, "qk_layernorm=True is not supported"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 50}, "not a multiple of moe_intermediate_size=24"),
        (
            "qwen2_moe",
            {"decoder_sparse_step": 2, "num_hidden_layers": 4},
            "llmkit supports dense layers only before the first",
        ),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ("qwen3_moe", {"num_experts": 0, "num_local_experts": 0}, "a dense model"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported for deepseek_v2"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
        ("gemma", {"hidden_act": "xielu"}, "hidden_activation=.xielu. is not supported"),
    ],
)
def test_what_a_family_cannot_hold_is_refused_by_name(tmp_path, model_type, changes, message):
    from llmkit.interop.hf import config_from_hf

    base = {
        "phi3": dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80),
        "stablelm": dict(
            vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80
        ),
        "qwen2_moe": dict(
            vocab_size=96,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=80,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
        ),
        "gemma": dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80),
    }
    hf = {"model_type": model_type, **base.get(model_type, base["qwen2_moe"])}
    if model_type.startswith("deepseek"):
        from .hf_models import DEEPSEEK

        hf = {"model_type": model_type, **DEEPSEEK, "n_routed_experts": 8}
    if model_type == "qwen3_moe":
        hf.pop("shared_expert_intermediate_size")
    config_from_hf(dict(hf))  # the base reads
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**hf, **changes})
