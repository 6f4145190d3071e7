from __future__ import annotations

import pytest
import yaml

from llmkit.cli import main
from llmkit.errors import ConfigError
from llmkit.train.config import apply_override, load_train_config

from .conftest import tiny_config


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3e-4\nmodel:\n  preset: gpt2-tiny\n")
    cfg = load_train_config(path, ["optim.lr=1e-3", "model.n_layers=3", "train.precision=bf16"])
    assert cfg.optim.lr == 1e-3 and cfg.train.precision == "bf16"
    assert cfg.model_config(vocab_size=300).n_layers == 3
    assert cfg.model_config(vocab_size=300).vocab_size == 300


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["optim.lr=-1"], "optim.lr=-1.0 must be > 0"),
        (["train.precision=fp8"], "train.precision='fp8' has the wrong type"),
        (["optim.learning_rate=1"], "unknown field(s) ['learning_rate'] in optim"),
        (["optim.lr"], "expected KEY=VALUE"),
        (["model.attention.n_heads=5"], "model: d_model=64 is not divisible by attention.n_heads=5"),
        (["train.halt_at=5000"], "train.halt_at=5000 must be between 1 and steps=1000"),
    ],
)
def test_bad_configs(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_train_config(None, overrides).model_config(vocab_size=256)
    assert fragment in str(e.value)


def test_override_into_nested_sections():
    d: dict = {}
    apply_override(d, "model.attention.n_kv_heads=2")
    apply_override(d, "train.time_limit=null")
    assert d == {"model": {"attention": {"n_kv_heads": 2}}, "train": {"time_limit": None}}


def test_prepare_train_generate_from_the_command_line(tiny_data, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tiny_data, tmp_path / "run", train={"steps": 10})))
    assert main(["train", str(path), "--set", "optim.lr=5e-3"]) == 0
    out = capsys.readouterr().out
    assert "done: 10 steps" in out and "val bits/char" in out and "loss plot" in out
    assert main(["generate", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "12", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:")
    main(["generate", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "12", "--seed", "1"])
    assert capsys.readouterr().out == first  # seeded sampling is repeatable
    assert main(["generate", str(tmp_path / "run"), "--temperature", "0", "--max-new-tokens", "5"]) == 0


def test_cli_errors(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_widths_derived_by_a_preset_follow_the_overrides():
    # sizes a preset leaves to be derived (head_dim, an MHA's n_kv_heads, an unset FFN width) follow the overridden
    # width and heads; sizes given explicitly, by the preset or the overrides, are kept
    cfg = load_train_config(None, ["model.preset=transformer-base", "model.d_model=256", "model.attention.n_heads=4"])
    m = cfg.model_config(vocab_size=300)
    assert (m.head_dim, m.n_kv_heads) == (64, 4)
    heads = ["model.attention.n_heads=8", "model.attention.n_kv_heads=4"]
    cfg = load_train_config(None, ["model.preset=llama2-7b-tiny", "model.d_model=256", *heads])
    m = cfg.model_config(vocab_size=300)
    assert (m.head_dim, m.n_kv_heads) == (32, 4)
    assert m.ffn_hidden_dim == 96  # the tiny preset gives its FFN width explicitly
    unset = load_train_config(None, ["model.preset=llama2-7b-tiny", "model.d_model=256", "model.ffn.hidden_dim=null"])
    assert unset.model_config(vocab_size=300).ffn_hidden_dim == 768  # LLaMA's rule for d_model 256
    kept = load_train_config(None, ["model.preset=llama2-7b-tiny", "model.attention.head_dim=8"])
    assert kept.model_config(vocab_size=300).head_dim == 8
