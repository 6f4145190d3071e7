"""A drafter trained by the one training loop on its model's own text (llmkit.train.own_text, drafting): the
collected text is a data source like a prepared folder, `model: {checkpoint, mtp_depth: 1}` grafts the module,
`train.trainable: [mtp]` trains it alone, and the run has checkpoints that resume exactly; `llmkit graft-mtp` is that
run, with --steps and --resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmkit.cli import main
from llmkit.interop.load import load_model
from llmkit.models import DecoderLM
from llmkit.runs import TRAINER_STATE_JSON, resolve_checkpoint, run_checkpoints
from llmkit.train.config import TrainConfig
from llmkit.train.data import TokenData
from llmkit.train.loop import TrainingError, train
from llmkit.train.own_text import collect_own_text

from .conftest import losses, tiny_config


@pytest.fixture(scope="module")
def pretrained(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pre") / "run"
    train(TrainConfig.from_dict(tiny_config(tiny_data, out, train={"steps": 20})))
    return out


@pytest.fixture(scope="module")
def own_text(pretrained: Path, tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained model's continuations of 8-token openings: 12 to train on, 4 held out."""
    loaded = load_model(resolve_checkpoint(pretrained))
    model = loaded.model.eval()
    assert isinstance(model, DecoderLM)
    work = tmp_path_factory.mktemp("work")
    for split, n in (("train", 12), ("val", 4)):
        stream = TokenData(tiny_data).split(split).tokens
        starts = torch.linspace(0, len(stream) - 9, n).long().tolist()
        openings = [[int(t) for t in stream[s : s + 8]] for s in starts]
        collect_own_text(model, openings, work / split, new_tokens=8, batch=4, tokenizer=loaded.tokenizer, log=print)
    return work


def drafter_config(text: Path, base: Path, out: Path, **train_section: object) -> dict:
    cfg = tiny_config(text, out, train={"steps": 6, "save_every": 2, "trainable": ["mtp"], **train_section})
    cfg["model"] = {"checkpoint": str(resolve_checkpoint(base)), "mtp_depth": 1}
    cfg["data"] = {"dir": str(text), "batch_size": 4, "seq_len": 16}
    cfg["loss"] = {"unroll": 2}
    return cfg


def test_a_grafted_drafter_trains_in_the_loop_with_checkpoints_and_resumes_exactly(own_text, pretrained, tmp_path):
    whole = tmp_path / "whole"
    result = train(TrainConfig.from_dict(drafter_config(own_text, pretrained, whole)))
    assert result.steps == 6 and result.tokens == 6 * 4 * 16 and result.val_loss is not None
    assert [p.name for p in run_checkpoints(whole)] == ["step-000002", "step-000004", "step-000006"]
    teacher = losses(whole, "teacher")
    assert len(teacher) == 6 and len(losses(whole, "feature")) == 6
    assert sum(teacher[3:]) < sum(teacher[:3])  # an epoch is 3 steps: the same rows, seen again, cost less
    trained = load_model(resolve_checkpoint(whole)).model.state_dict()
    base = load_model(resolve_checkpoint(pretrained)).model.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in base.items())  # the trunk did not move
    assert any(k.startswith("mtp.") for k in trained)

    halted = tmp_path / "halted"
    assert train(TrainConfig.from_dict(drafter_config(own_text, pretrained, halted, halt_at=4))).steps == 4
    assert json.loads((run_checkpoints(halted)[-1] / TRAINER_STATE_JSON).read_text())["step"] == 4
    resumed = train(TrainConfig.from_dict(drafter_config(own_text, pretrained, halted)), resume=True)
    assert resumed.steps == 6
    again = load_model(resolve_checkpoint(halted)).model.state_dict()
    assert all(torch.equal(again[k], v) for k, v in trained.items())  # bit for bit the uninterrupted run


def test_the_text_must_be_the_models(own_text, tmp_path):
    width = json.loads((own_text / "train" / "own_text.json").read_text())["width"]
    cfg = tiny_config(own_text, tmp_path / "r")
    cfg["model"] = {"preset": "llama2-7b-tiny", "d_model": 2 * width}
    cfg["data"] = {"dir": str(own_text), "batch_size": 4}
    with pytest.raises(TrainingError, match=f"states of a model {width} wide"):
        train(TrainConfig.from_dict(cfg))


def test_graft_mtp_command_trains_for_steps_and_resumes(pretrained, tiny_data, tmp_path, capsys):
    out = tmp_path / "drafting"
    base = [str(resolve_checkpoint(pretrained)), str(out), "--data", str(tiny_data), "--sequences", "8"]
    flags = ["--opening", "8", "--new-tokens", "8", "--unroll", "2"]
    assert main(["graft-mtp", *base, *flags, "--steps", "3"]) == 0
    assert json.loads((out / "drafter.json").read_text())["steps"] == 3
    assert [p.name for p in run_checkpoints(tmp_path / "drafting.run")] == ["step-000003"]
    capsys.readouterr()
    assert main(["graft-mtp", *base, *flags, "--steps", "5", "--overwrite"]) == 0  # a new run replaces the old
    assert json.loads((out / "drafter.json").read_text())["steps"] == 5
    assert main(["graft-mtp", *base, *flags, "--steps", "7", "--overwrite", "--resume"]) == 0
    assert [p.name for p in run_checkpoints(tmp_path / "drafting.run")][-1] == "step-000007"
    assert json.loads((out / "drafter.json").read_text())["steps"] == 7
    capsys.readouterr()
    shutil.rmtree(out)  # a run stopped before it wrote OUT: a new one must say whether to resume or replace it
    assert main(["graft-mtp", *base, *flags, "--steps", "3"]) != 0
    assert "--resume" in capsys.readouterr().err
