from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmkit.data.prepare import prepare
from llmkit.models import DecoderLM
from llmkit.train.config import TrainConfig
from llmkit.train.loop import Result, train
from llmkit.train.own_text import OwnText, save_own_text
from llmkit.train.source import InMemory

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
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
    return with_sections(cfg, sections)


def with_sections(cfg: dict, sections: dict) -> dict:
    """A config dict with each of `sections`' settings put over its own (other settings of a section kept)."""
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def train_on_own_text(
    model: DecoderLM,
    text: OwnText,
    held: OwnText,
    out: Path,
    *,
    steps: int,
    lr: float,
    device: str = "auto",
    **loss: object,
) -> Result:
    """`model` trained in the training loop on `text` (held-out: `held`) in rows of 8, as the commands do (AdamW
    without weight decay, warm-up, a cosine to zero): its MTP modules alone when it has some."""
    save_own_text(out / "text" / "train", text, opening=0)
    save_own_text(out / "text" / "val", held, opening=0)
    cfg = {
        "data": {"dir": str(out / "text"), "batch_size": 8},
        "optim": {"lr": lr, "beta2": 0.999, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 20, "min_lr_ratio": 0.0},
        "loss": loss,
        "train": {
            "steps": steps,
            "trainable": ["mtp"] if len(model.mtp) else None,
            "progress": False,
            "eval_every": steps,
            "save_every": steps,
            "out": str(out / "run"),
            "device": device,
        },
    }
    result = train(TrainConfig.from_dict(cfg), source=InMemory(model))
    model.eval()
    return result


def pretrain(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory, steps: int) -> Path:
    """A run of the tiny model trained `steps` steps on the tiny corpus, to start fine-tuning or grafting from."""
    out = tmp_path_factory.mktemp("pre") / "run"
    train(TrainConfig.from_dict(tiny_config(tiny_data, out, train={"steps": steps})))
    return out


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama with the byte-level tokenizer of tests/helpers.py and a chat template, as a Hugging Face
    folder (the tests read it, never write into it)."""
    import dataclasses

    import torch
    from helpers import tiny_tokenizer

    import llmkit
    from llmkit.interop.hf import save_hf

    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    cfg = dataclasses.replace(llmkit.get_preset("llama2-7b-tiny"), vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("ckpt") / "model"
    save_hf(llmkit.build_model(cfg), out)
    tok.save(out)
    return out
