from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmkit.data.prepare import prepare

TEXT = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name.\n\n"
)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small prepared corpus: a few plays' worth of repeated verse, a 320-token vocabulary."""
    root = tmp_path_factory.mktemp("data")
    (root / "corpus").mkdir()
    for k in range(4):
        (root / "corpus" / f"doc{k}.txt").write_text(TEXT * (40 + 10 * k) + f"Exeunt {k}.\n")
    prepare(root / "corpus", root / "prepared", vocab_size=320, progress=False)
    return root / "prepared"


def losses(run: Path, key: str = "loss") -> list[float]:
    return [row[key] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in row]


def tiny_config(data_dir: Path, out: Path, **sections: dict) -> dict:
    cfg: dict = {
        "model": {"preset": "llama2-7b-tiny"},
        "data": {"dir": str(data_dir), "seq_len": 32, "batch_size": 4},
        "optim": {"lr": 3e-3},
        "schedule": {"warmup_steps": 3},
        "train": {
            "steps": 12,
            "log_every": 1,
            "eval_every": 6,
            "eval_tokens": 256,
            "save_every": 6,
            "progress": False,
            "out": str(out),
        },
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg
