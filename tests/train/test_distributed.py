"""Two processes (torchrun, gloo on CPU) follow the loss trajectory of one process with the same global batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import free_port

from llmkit.train.config import TrainConfig
from llmkit.train.loop import train

from .conftest import losses, tiny_config

pytestmark = pytest.mark.slow


def torchrun(cfg: dict, path: Path, parallel: str) -> None:
    path.write_text(yaml.safe_dump(cfg))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "llmkit",
        "train",
        str(path),
        "--parallel",
        parallel,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    cfg = tiny_config(tiny_data, out, data={"batch_size": 8}, train={"steps": 8, "eval_every": 4, "save_every": 4})
    train(TrainConfig.from_dict(cfg))
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(tiny_data, tmp_path, single, parallel):
    cfg = tiny_config(
        tiny_data, tmp_path / "run", data={"batch_size": 4}, train={"steps": 8, "eval_every": 4, "save_every": 4}
    )
    torchrun(cfg, tmp_path / "run.yaml", parallel)
    one, two = losses(single), losses(tmp_path / "run")
    assert len(one) == len(two) == 8
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= 1e-5
    assert abs(losses(single, "val_loss")[-1] - losses(tmp_path / "run", "val_loss")[-1]) <= 1e-5


def test_fsdp_checkpoint_resumes_in_one_process(tiny_data, tmp_path, single):
    cfg = tiny_config(
        tiny_data,
        tmp_path / "run",
        data={"batch_size": 4},
        train={"steps": 8, "halt_at": 4, "eval_every": 4, "save_every": 4},
    )
    torchrun(cfg, tmp_path / "run.yaml", "fsdp")
    assert len(losses(tmp_path / "run")) == 4
    resumed = tiny_config(
        tiny_data, tmp_path / "run", data={"batch_size": 8}, train={"steps": 8, "eval_every": 4, "save_every": 4}
    )
    train(TrainConfig.from_dict(resumed), resume=True)
    one, two = losses(single), losses(tmp_path / "run")
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= 1e-5
