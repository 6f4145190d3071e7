"""Preference optimisation in the training loop: `llmkit prepare preferences` (answers marked as targets, the
reference's log-probabilities stored with the data and equal to the checkpoint's own), and DPO / IPO / SimPO runs,
full and LoRA, that learn a preference and refuse a reference from another checkpoint."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from llmkit.data.preferences import PreferenceData, prepare_preferences
from llmkit.errors import InputError
from llmkit.interop.hf import save_hf
from llmkit.interop.load import load_model
from llmkit.tokenizer import Tokenizer
from llmkit.train.config import TrainConfig
from llmkit.train.loop import train
from llmkit.train.preference import answer_logps
from llmkit.train.source import TrainingError

from .conftest import losses, with_sections

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question"]


def text_pair(k: int) -> dict:
    """A prompt of a few words; the chosen answer is always the same phrase, the rejected another."""
    rng = np.random.default_rng(k)
    prompt = " ".join(rng.choice(WORDS, size=3 + k % 4))
    return {"prompt": prompt, "chosen": " to be", "rejected": " is the question that"}


def chat_pair(k: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"be {k}?"}, {"role": "assistant", "content": "or"},
                   {"role": "user", "content": "not?"}],
        "chosen": [{"role": "assistant", "content": "to be"}],
        "rejected": [{"role": "assistant", "content": "that is the question"}],
    }  # fmt: skip


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def checkpoint(random_checkpoint: Path) -> Path:
    return random_checkpoint


@pytest.fixture(scope="module")
def pairs(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    source = write(root / "p.jsonl", [text_pair(k) for k in range(48)])
    prepare_preferences(source, root / "data", checkpoint=checkpoint, val_fraction=0.2, progress=False)
    return root / "data"


def run_config(pairs: Path, checkpoint: Path, out: Path, steps: int = 16, **sections: dict) -> TrainConfig:
    cfg: dict = {
        "model": {"checkpoint": str(checkpoint)},
        "data": {"dir": str(pairs), "seq_len": 32, "batch_size": 4},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 2},
        "train": {"steps": steps, "log_every": 1, "eval_every": steps, "save_every": steps, "progress": False,
                  "out": str(out)},
    }  # fmt: skip
    return TrainConfig.from_dict(with_sections(cfg, sections))


def test_answers_are_the_targets_and_the_reference_is_the_checkpoints_own(pairs, checkpoint):
    data = PreferenceData(pairs)
    tok = Tokenizer.from_dir(pairs)
    model = load_model(checkpoint, dtype=torch.float32).model.eval()
    train_split = data.split("train")
    n = len(train_split) // 2
    assert n + len(data.split("val")) // 2 == 48 and len(data.split("val")) and data.reference["train"].shape == (n, 2)
    for k in range(n):
        for side, answer in enumerate((" to be", " is the question that")):
            a, b = int(train_split.offsets[2 * k + side]), int(train_split.offsets[2 * k + side + 1])
            ids = torch.tensor(np.asarray(train_split.tokens[a:b], dtype=np.int64))
            flags = torch.tensor(np.asarray(train_split.targets[a:b]).astype(bool))
            assert tok.backend.decode(ids[flags].tolist(), skip_special_tokens=False).startswith(answer)
            assert int(ids[-1]) == tok.eos_id and flags[-1]  # a plain-text answer ends with end-of-sequence
            # the reference: this one sequence alone, unpadded, through the checkpoint
            with torch.no_grad():
                logits = model(ids[None, :-1])
            targets = torch.where(flags[1:], ids[1:], -100)
            expected, _ = answer_logps(logits, targets[None])
            assert data.reference["train"][k, side] == pytest.approx(float(expected), abs=1e-4)


def test_conversational_pairs_score_only_the_answers_turn(checkpoint, tmp_path):
    source = write(tmp_path / "c.jsonl", [chat_pair(k) for k in range(6)])
    prepare_preferences(source, tmp_path / "d", checkpoint=checkpoint, val_fraction=0.0, progress=False)
    data = PreferenceData(tmp_path / "d")
    tok = Tokenizer.from_dir(tmp_path / "d")
    split = data.split("train")
    for row, answer in ((0, "to be<|end|>\n"), (1, "that is the question<|end|>\n")):
        a, b = int(split.offsets[row]), int(split.offsets[row + 1])
        ids, flags = np.asarray(split.tokens[a:b]), np.asarray(split.targets[a:b]).astype(bool)
        # the answer's turn only, not the prompt's own assistant turn ("or")
        assert tok.backend.decode(ids[flags].tolist(), skip_special_tokens=False) == answer
        assert "<|assistant|>\nor<|end|>" in tok.backend.decode(ids[~flags].tolist(), skip_special_tokens=False)


def test_long_pairs_are_left_out_and_bad_lines_are_clear_errors(checkpoint, tmp_path):
    rows = [text_pair(k) for k in range(6)] + [{"prompt": "to " * 40, "chosen": " be", "rejected": " or"}]
    meta = prepare_preferences(write(tmp_path / "p.jsonl", rows), tmp_path / "d", checkpoint=checkpoint,
                               max_tokens=30, val_fraction=0.0, progress=False)  # fmt: skip
    assert meta["left_out"] == 1 and meta["splits"]["train"]["pairs"] == 6
    bad = {
        '{"prompt": "a", "chosen": "b"}': '"prompt", "chosen" and "rejected"',
        '{"prompt": "a", "chosen": "", "rejected": "c"}': "empty answer",
        '{"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}': "all be strings",
        '{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], '
        '"rejected": [{"role": "assistant", "content": "c"}]}': "chosen[0].role 'user'",
        "{not json": "not valid JSON",
    }
    for k, (line, message) in enumerate(bad.items()):
        (tmp_path / "bad.jsonl").write_text(json.dumps(text_pair(0)) + "\n" + line + "\n")
        with pytest.raises(InputError, match=re.escape(message)) as e:
            prepare_preferences(tmp_path / "bad.jsonl", tmp_path / f"bad{k}", checkpoint=checkpoint, progress=False)
        assert "bad.jsonl:2" in str(e.value)


def test_dpo_starts_at_log_2_and_learns_the_preference(pairs, checkpoint, tmp_path):
    """The policy starts as the reference (every reward 0, the loss log 2); on a consistent preference the reward
    margin and accuracy rise, on held-out pairs too."""
    result = train(run_config(pairs, checkpoint, tmp_path / "run", steps=20))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and abs(first["reward_margin"]) < 1e-4
    trained = [r for r in rows if "reward_margin" in r][-1]
    assert trained["reward_margin"] > 1.0 and trained["reward_accuracy"] == 1.0 and trained["loss"] < 0.4
    held = [r for r in rows if "val_reward_accuracy" in r][-1]
    assert held["val_reward_accuracy"] == 1.0 and held["val_loss"] < 0.4 and result.val_bpc is None


@pytest.mark.parametrize("kind", ["ipo", "simpo"])
def test_ipo_and_simpo_learn_it_too(pairs, checkpoint, tmp_path, kind):
    train(run_config(pairs, checkpoint, tmp_path / "run", steps=20, loss={"preference": kind, "preference_beta": 0.5}))
    assert losses(tmp_path / "run", "reward_accuracy")[-1] == 1.0
    assert losses(tmp_path / "run", "val_reward_accuracy")[-1] == 1.0


def test_lora_dpo_trains_the_adapters_only(pairs, checkpoint, tmp_path):
    result = train(run_config(pairs, checkpoint, tmp_path / "run", steps=20, lora={"r": 4, "alpha": 8},
                              optim={"lr": 1e-2}))  # fmt: skip
    assert result.checkpoint is not None and (result.checkpoint / "adapter_model.safetensors").is_file()
    assert losses(tmp_path / "run", "reward_margin")[-1] > 0.25
    assert losses(tmp_path / "run", "val_reward_accuracy")[-1] == 1.0
    assert losses(tmp_path / "run")[0] == pytest.approx(math.log(2), abs=1e-4)


def test_a_reference_from_another_checkpoint_is_refused(pairs, checkpoint, tmp_path):
    other = tmp_path / "other"
    model = load_model(checkpoint, dtype=torch.float32).model
    with torch.no_grad():
        model.head.weight.mul_(2)  # other weights, same shapes and tokenizer
    save_hf(model, other)
    Tokenizer.from_dir(checkpoint).save(other)
    with pytest.raises(TrainingError, match="differ from model\\.checkpoint"):
        train(run_config(pairs, other, tmp_path / "run"))
    with pytest.raises(TrainingError, match="set model\\.checkpoint"):
        train(TrainConfig.from_dict({**run_config(pairs, checkpoint, tmp_path / "r2").to_dict(),
                                     "model": {"preset": "llama2-7b-tiny"}}))  # fmt: skip
    with pytest.raises(TrainingError, match="data\\.seq_len to at least"):
        train(run_config(pairs, checkpoint, tmp_path / "r3", data={"seq_len": 4}))


def test_simpo_needs_no_reference(checkpoint, tmp_path):
    source = write(tmp_path / "p.jsonl", [text_pair(k) for k in range(12)])
    prepare_preferences(source, tmp_path / "d", checkpoint=checkpoint, reference=False, progress=False)
    with pytest.raises(TrainingError, match="needs the reference model's log-probabilities"):
        train(run_config(tmp_path / "d", checkpoint, tmp_path / "run"))
    train(run_config(tmp_path / "d", checkpoint, tmp_path / "run2", steps=4, loss={"preference": "simpo"}))
    assert len(losses(tmp_path / "run2")) == 4


def test_prepare_preferences_on_the_command_line(checkpoint, tmp_path, capsys):
    from llmkit.cli import main

    source = write(tmp_path / "p.jsonl", [text_pair(k) for k in range(5)])
    args = ["prepare", "preferences", str(source), "--out", str(tmp_path / "d")]
    assert main([*args, "--checkpoint", str(checkpoint), "--val-fraction", "0"]) == 0
    assert "train 5 pairs" in capsys.readouterr().out
    assert main(args) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_qlora_dpo_on_a_quantized_checkpoint(checkpoint, tmp_path):
    """The reference of an int8 checkpoint is its quantized model's; QLoRA (lora.quantized) starts there, at log 2,
    and learns; a run that would load it as float weights is refused."""
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.quant import quantize

    loaded = load_model(checkpoint, dtype=torch.float32)
    save_llmkit(quantize(loaded.model, "int8"), tmp_path / "q", tokenizer=loaded.tokenizer)
    source = write(tmp_path / "p.jsonl", [text_pair(k) for k in range(24)])
    meta = prepare_preferences(source, tmp_path / "d", checkpoint=tmp_path / "q", val_fraction=0.2, progress=False)
    assert meta["reference"]["quantized"] is True
    lora = {"r": 4, "alpha": 8, "quantized": True}
    train(run_config(tmp_path / "d", tmp_path / "q", tmp_path / "run", steps=12, lora=lora, optim={"lr": 1e-2}))
    assert losses(tmp_path / "run")[0] == pytest.approx(math.log(2), abs=1e-3)
    assert losses(tmp_path / "run", "reward_margin")[-1] > 0.1
    with pytest.raises(TrainingError, match=r"lora\.quantized=true"):
        train(run_config(tmp_path / "d", tmp_path / "q", tmp_path / "r2", lora={"r": 4, "alpha": 8}))
