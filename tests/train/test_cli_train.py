from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml
from helpers import one_line_error

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


def write_config(tiny_data: Path, out: Path, **train: object) -> Path:
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tiny_data, out, train=train)))
    return path


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_resume_works(tiny_data, tmp_path, capsys, monkeypatch):
    """The second checkpoint fills the disk: one line naming it, the first checkpoint intact, the partial one
    removed at once (else the disk stays full); a step-N.tmp that a killed run left is removed at the next start."""
    import llmkit.train.checkpoint as ckpt

    config = write_config(tiny_data, tmp_path / "run", steps=12, save_every=6)
    save, calls = ckpt.torch_save, []

    def second_save_fills_the_disk(obj: object, path: Path) -> None:
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"the first megabytes of the optimizer state")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        save(obj, path)

    monkeypatch.setattr(ckpt, "torch_save", second_save_fills_the_disk)
    assert main(["train", str(config)]) == 1
    assert "trainer_state.pt: no space left on the device" in one_line_error(capsys.readouterr().err)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-000006"]
    monkeypatch.undo()
    killed = checkpoints / "step-000012.tmp"  # what a SIGKILL in the middle of a save leaves
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half a file")
    assert main(["train", str(config), "--resume"]) == 0
    assert f"removed {killed}" in capsys.readouterr().err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-000006", "step-000012"]


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_anything_is_built(
    tiny_data, tmp_path, capsys, monkeypatch
):
    """data.batch_size=100000000 used to run for minutes, then die in the allocator (or be killed outright)."""

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built: the batch should have been refused before")

    monkeypatch.setattr("llmkit.train.source.build_any", never)
    config = write_config(tiny_data, tmp_path / "run")
    assert main(["train", str(config), "--set", "data.batch_size=100000000"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "data.batch_size=100,000,000 cannot fit in memory" in line and "GiB" in line
    assert not (tmp_path / "run").exists()


def test_a_run_is_never_written_into_a_checkpoint_or_a_data_folder(tiny_data, tmp_path, capsys):
    from helpers import tiny_tokenizer

    from llmkit import build_model, get_preset
    from llmkit.interop.checkpoint import save_llmkit

    ck = save_llmkit(build_model(get_preset("llama2-7b-tiny")), tmp_path / "ck", tokenizer=tiny_tokenizer())
    before = sorted(p.name for p in ck.iterdir())
    config = write_config(tiny_data, tmp_path / "run")
    assert main(["train", str(config), "--set", f"train.out={ck}"]) == 2
    assert "is a checkpoint: a run is never written into one" in one_line_error(capsys.readouterr().err)
    assert sorted(p.name for p in ck.iterdir()) == before
    assert main(["train", str(config), "--set", f"train.out={tiny_data}"]) == 2
    assert "is a prepared data folder" in one_line_error(capsys.readouterr().err)
    assert main(["train", str(config), "--set", f"train.out={tiny_data / 'run'}"]) == 2
    assert "inside its input" in one_line_error(capsys.readouterr().err)


def test_a_device_that_is_not_there_is_one_line(tiny_data, tmp_path, capsys):
    config = write_config(tiny_data, tmp_path / "run")
    assert main(["train", str(config), "--set", "train.device=tpu:7"]) == 2
    assert "train.device 'tpu:7' is not a device" in one_line_error(capsys.readouterr().err)
