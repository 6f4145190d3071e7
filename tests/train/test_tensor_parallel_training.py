"""Training with tensor parallelism and FSDP2 on a 2-D mesh (`--parallel fsdp+tp --tp 2`, torchrun, gloo on
127.0.0.1): the split run follows one process's loss trajectory, alone (2 processes: one split) and sharded (4: two
splits of 2, FSDP across them); its checkpoints hold the whole model, which one process loads and resumes, and the
split run resumes bit-identically, from its own checkpoint or from one process's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import free_port

from llmkit.errors import ConfigError
from llmkit.interop.load import load_model
from llmkit.train.config import TrainConfig
from llmkit.train.loop import train

from .conftest import losses, tiny_config

pytestmark = pytest.mark.slow
STEPS = {"steps": 20, "eval_every": 10, "save_every": 10}


def torchrun(cfg: dict, path: Path, processes: int = 2, *flags: str) -> None:
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "-m", "llmkit", "train", str(path), "--parallel", "fsdp+tp",
           "--tp", "2", *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    train(TrainConfig.from_dict(tiny_config(tiny_data, out, data={"batch_size": 8}, train=STEPS)))
    return out


@pytest.fixture(scope="module")
def split(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("split") / "run"
    torchrun(tiny_config(tiny_data, out, data={"batch_size": 8}, train=STEPS), out.with_name("run.yaml"))
    return out


def _close(a: Path, b: Path) -> None:
    one, two = losses(a), losses(b)
    assert len(one) == len(two) == STEPS["steps"]
    assert max(abs(x - y) for x, y in zip(one, two, strict=True)) <= 1e-5
    assert abs(losses(a, "val_loss")[-1] - losses(b, "val_loss")[-1]) <= 1e-5


def test_split_training_follows_one_process(single, split):
    _close(single, split)


def test_split_and_sharded_training_follows_one_process(tiny_data, tmp_path, single):
    # 4 processes: 2 splits of the model, FSDP across them; each split reads half the global batch
    cfg = tiny_config(tiny_data, tmp_path / "run", data={"batch_size": 4}, train=STEPS)
    torchrun(cfg, tmp_path / "run.yaml", 4)
    _close(single, tmp_path / "run")


def test_split_checkpoint_is_the_whole_model(single, split):
    ours = load_model(split / "checkpoints" / "step-000020").model
    theirs = load_model(single / "checkpoints" / "step-000020").model
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    state = torch.load(split / "checkpoints" / "step-000020" / "trainer_state.pt", weights_only=False)["optimizer"]
    one = torch.load(single / "checkpoints" / "step-000020" / "trainer_state.pt", weights_only=False)["optimizer"]
    assert state["state"].keys() == one["state"].keys()
    for name, fields in one["state"].items():  # AdamW's moments whole, its step counts plain
        for field, t in fields.items():
            assert state["state"][name][field].shape == t.shape, (name, field)
            assert (state["state"][name][field] - t).abs().max().item() <= 1e-5, (name, field)


def _halted(cfg_dir: Path, out: Path, tiny_data: Path, split: bool) -> None:
    cfg = tiny_config(tiny_data, out, data={"batch_size": 8}, train={**STEPS, "halt_at": 10})
    if split:
        torchrun(cfg, cfg_dir / "halted.yaml")
    else:
        train(TrainConfig.from_dict(cfg))
    assert len(losses(out)) == 10


def test_split_run_resumes_bit_identically(tiny_data, tmp_path, split):
    _halted(tmp_path, tmp_path / "run", tiny_data, split=True)
    torchrun(tiny_config(tiny_data, tmp_path / "run", data={"batch_size": 8}, train=STEPS), tmp_path / "run.yaml",
             2, "--resume")  # fmt: skip
    assert losses(tmp_path / "run") == losses(split)


def test_checkpoints_resume_across_layouts(tiny_data, tmp_path, single, split):
    # the split run's checkpoint resumed by one process, and one process's by a split run
    _halted(tmp_path, tmp_path / "from-split", tiny_data, split=True)
    train(TrainConfig.from_dict(tiny_config(tiny_data, tmp_path / "from-split", data={"batch_size": 8}, train=STEPS)),
          resume=True)  # fmt: skip
    _close(single, tmp_path / "from-split")
    _halted(tmp_path, tmp_path / "from-one", tiny_data, split=False)
    torchrun(tiny_config(tiny_data, tmp_path / "from-one", data={"batch_size": 8}, train=STEPS), tmp_path / "r.yaml",
             2, "--resume")  # fmt: skip
    _close(single, tmp_path / "from-one")
    shutil.rmtree(tmp_path / "from-split")


def test_tp_settings_are_checked(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match=r"train.tp.*needs train.parallel='fsdp\+tp', not 'fsdp'"):
        TrainConfig.from_dict(tiny_config(tiny_data, tmp_path, train={"parallel": "fsdp", "tp": 2}))
    with pytest.raises(ConfigError, match=r"train.tp.*must be >= 2 with train.parallel='fsdp\+tp'"):
        TrainConfig.from_dict(tiny_config(tiny_data, tmp_path, train={"parallel": "fsdp+tp"}))
    with pytest.raises(ConfigError, match=r"train.compile.*not supported with train.parallel='fsdp\+tp'"):
        TrainConfig.from_dict(tiny_config(tiny_data, tmp_path, train={"parallel": "fsdp+tp", "tp": 2, "compile": True}))


def test_split_training_of_latent_attention_and_experts_follows_one_process(tiny_data, tmp_path):
    # DeepSeek-V3's family: latent attention split by heads, experts spread over the split (router biases updated
    # from the loads), an MTP module; its balance losses reach the loss through FSDP's wrapped blocks
    steps = {"steps": 8, "eval_every": 4, "save_every": 4}
    cfg = tiny_config(tiny_data, tmp_path / "one", model={"preset": "deepseek-v3-tiny"}, data={"batch_size": 8},
                      train=steps)  # fmt: skip
    train(TrainConfig.from_dict(cfg))
    torchrun({**cfg, "train": {**cfg["train"], "out": str(tmp_path / "split")}}, tmp_path / "split.yaml")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "split")
    assert len(one) == len(two) == 8 and max(abs(x - y) for x, y in zip(one, two, strict=True)) <= 1e-5
    assert all(a > 0 for a in losses(tmp_path / "split", "aux"))  # the balance losses are counted


def test_split_training_refuses_adapters_and_a_size_that_does_not_divide(tiny_data, tmp_path, single):
    def refused(cfg: dict, *flags: str) -> str:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(cfg))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "llmkit", "train", str(path), "--parallel", "fsdp+tp",
               *flags]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode != 0
        return done.stderr

    lora = tiny_config(tiny_data, tmp_path / "lora", lora={"r": 4})
    lora["model"] = {"checkpoint": str(single / "checkpoints" / "step-000020")}
    assert "train.parallel='fsdp+tp' trains every weight" in refused(lora, "--tp", "2")
    assert "--tp 3 does not divide the 2 processes torchrun started" in refused(
        tiny_config(tiny_data, tmp_path / "three"), "--tp", "3"
    )


def test_split_run_with_activation_checkpointing_saves_and_resumes(tiny_data, tmp_path, single):
    # blocks wrapped for recomputation name their parameters differently; the split's records use the plain names
    train_cfg = {**STEPS, "activation_checkpointing": True}
    cfg = tiny_config(tiny_data, tmp_path / "run", data={"batch_size": 8}, train={**train_cfg, "halt_at": 10})
    torchrun(cfg, tmp_path / "halted.yaml")
    torchrun(tiny_config(tiny_data, tmp_path / "run", data={"batch_size": 8}, train=train_cfg), tmp_path / "run.yaml",
             2, "--resume")  # fmt: skip
    _close(single, tmp_path / "run")
