"""Chat fine-tuning: conversations rendered with a chat template, the loss counted on the assistant's tokens only, and
examples packed into rows without attending to one another."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmkit.config.presets import get_preset
from llmkit.data.chat import ChatData, pack, prepare_chat, row_arrays
from llmkit.errors import ConfigError, InputError
from llmkit.interop.load import load_model
from llmkit.models import build_model
from llmkit.runs import resolve_checkpoint
from llmkit.tokenizer import Tokenizer
from llmkit.train.config import TrainConfig
from llmkit.train.loop import train

from .conftest import losses, tiny_config

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def conversation(k: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Verse."},
            {"role": "user", "content": f"Romeo {k}?"},
            {"role": "assistant", "content": f"But soft {k}."},
            {"role": "user", "content": "Juliet?"},
            {"role": "assistant", "content": "The sun."},
        ]
    }


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus's tokenizer with a chat template (so a run pretrained on that corpus can be fine-tuned)."""
    tok = Tokenizer.from_dir(tiny_data)
    assert tok is not None
    tok.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("tok")
    tok.save(out)
    return out


@pytest.fixture(scope="module")
def chat_data(chat_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat")
    lines = [json.dumps(conversation(k)) for k in range(60)]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare_chat(root / "c.jsonl", root / "data", tokenizer=chat_tokenizer, val_fraction=0.1, progress=False)
    return root / "data"


def test_only_the_assistants_tokens_are_targets(chat_data):
    data = ChatData(chat_data)
    tok = Tokenizer.from_dir(chat_data)
    split = data.split("train")
    assert len(split) + len(data.split("val")) == 60 and len(data.split("val")) > 0
    for k in range(3):
        a, b = int(split.offsets[k]), int(split.offsets[k + 1])
        ids, flags = np.asarray(split.tokens[a:b]), np.asarray(split.targets[a:b]).astype(bool)
        said = tok.decode(ids[flags].tolist())
        assert said.startswith("But soft") and said.endswith("The sun.<|end|>\n"), said
        assert "Romeo" not in said and "<|assistant|>" not in said
        assert "Romeo" in tok.decode(ids[~flags].tolist())


def test_changing_a_target_outside_the_assistants_turns_changes_nothing(chat_data):
    """The loss of a batch whose non-assistant targets are replaced by other tokens is bit-identical; changing an
    assistant target changes it."""
    split = ChatData(chat_data).split("train")
    rows = pack(split.lengths(), np.arange(8), 240, packing=True)
    x, y, seg = (torch.from_numpy(a) for a in row_arrays(split, rows, 240, 0))
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320)).eval()

    def loss_of(targets_next: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        return model.loss(torch.where(flags, targets_next, -100), inputs=x, segments=seg).total

    # the full next-token stream: assistant targets as prepared, the rest the real next tokens (inputs shifted)
    flags = y != -100
    nxt = torch.where(flags, y, torch.cat([x[:, 1:], x[:, :1]], dim=1))
    base = loss_of(nxt, flags)
    user = (~flags & (seg >= 0)).nonzero()
    changed = nxt.clone()
    changed[user[:, 0], user[:, 1]] = (changed[user[:, 0], user[:, 1]] + 7) % 320
    assert torch.equal(loss_of(changed, flags), base)
    said = flags.nonzero()[0]
    changed = nxt.clone()
    changed[said[0], said[1]] = (changed[said[0], said[1]] + 7) % 320
    assert not torch.equal(loss_of(changed, flags), base)


@pytest.mark.parametrize("preset", ["llama2-7b-tiny", "gpt2-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny"])
def test_packed_examples_never_attend_to_one_another(preset):
    """Each example of a packed row gives the logits it gives alone; changing one example's tokens changes no other's
    logits (dense, learned positions, MLA with MoE, sparse attention)."""
    cfg = get_preset(preset)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in (5, 9, 3)]
    row = torch.cat(parts, dim=1)
    seg = torch.cat([torch.full((1, p.shape[1]), k) for k, p in enumerate(parts)], dim=1)
    with torch.no_grad():
        packed = model(row, segments=seg)
        at = 0
        for p in parts:
            n = p.shape[1]
            torch.testing.assert_close(packed[:, at : at + n], model(p), atol=1e-5, rtol=1e-5)
            at += n
        other = row.clone()
        other[0, 5:14] = (other[0, 5:14] + 1) % cfg.vocab_size  # the middle example
        changed = model(other, segments=seg)
    torch.testing.assert_close(changed[:, :5], packed[:, :5], atol=1e-6, rtol=0)
    torch.testing.assert_close(changed[:, 14:], packed[:, 14:], atol=1e-6, rtol=0)
    assert not torch.allclose(changed[:, 5:14], packed[:, 5:14])


def test_the_mtp_loss_never_predicts_across_examples():
    """Targets on the first example only: the packed row's MTP loss is the first example's alone, whatever the second
    example holds (an MTP module near the boundary would otherwise predict the next example's tokens)."""
    cfg = get_preset("deepseek-v3-tiny")
    assert cfg.mtp_depth >= 1
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in (6, 7))
    labels_a = torch.cat([a[:, 1:], torch.full((1, 1), -100)], dim=1)  # a's next tokens; none after its last
    labels = torch.cat([labels_a, torch.full((1, 7), -100)], dim=1)
    seg = torch.tensor([[0] * 6 + [1] * 7])
    with torch.no_grad():
        alone = model.loss(labels_a, inputs=a).mtp
        packed = model.loss(labels, inputs=torch.cat([a, b], dim=1), segments=seg).mtp
        other = model.loss(labels, inputs=torch.cat([a, (b + 1) % cfg.vocab_size], dim=1), segments=seg).mtp
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other, alone, atol=1e-5, rtol=1e-5)


def test_every_example_is_seen_once_per_epoch_and_batches_are_a_function_of_the_step(chat_data, tmp_path):
    from llmkit.train.parallel import setup
    from llmkit.train.tasks import ChatTask

    cfg = TrainConfig.from_dict(tiny_config(chat_data, tmp_path / "r", data={"seq_len": 240, "batch_size": 2}))
    rt = setup("none", "cpu")
    task = ChatTask(cfg, rt)
    n = len(task.chat.split("train"))
    seen: list[int] = []
    k = 0
    while len(seen) < n:
        seen += task._row(k)
        k += 1
    assert sorted(seen) == list(range(n))
    again = ChatTask(cfg, rt)
    (x1, y1, s1), n1 = task.batch(5, 0)
    (x2, y2, s2), n2 = again.batch(5, 0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(s1, s2) and n1 == n2
    assert int(s1.max()) >= 1  # packed: at least two examples share a row


def test_chat_fine_tuning_from_a_checkpoint_starts_at_the_loaded_models_loss(tiny_data, chat_data, tmp_path):
    pre = tmp_path / "pre"
    train(TrainConfig.from_dict(tiny_config(tiny_data, pre, train={"steps": 6})))
    cfg = tiny_config(chat_data, tmp_path / "ft", data={"seq_len": 240, "batch_size": 2}, train={"steps": 4})
    cfg["model"] = {"checkpoint": str(pre)}
    result = train(TrainConfig.from_dict(cfg))
    assert result.val_loss is not None and np.isfinite(result.val_loss)
    from llmkit.train.parallel import setup
    from llmkit.train.tasks import ChatTask

    (x, y, seg), _ = ChatTask(TrainConfig.from_dict(cfg), setup("none", "cpu")).batch(0, 0)
    model = load_model(resolve_checkpoint(pre)).model.eval()
    with torch.no_grad():
        logits = model(x, segments=seg)
        expected = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    assert losses(tmp_path / "ft")[0] == pytest.approx(expected, abs=1e-5)


def test_padding_instead_of_packing_gives_one_example_per_row(chat_data, tmp_path):
    from llmkit.train.parallel import setup
    from llmkit.train.tasks import ChatTask

    cfg = tiny_config(chat_data, tmp_path / "r", data={"seq_len": 240, "batch_size": 3, "packing": False})
    task = ChatTask(TrainConfig.from_dict(cfg), setup("none", "cpu"))
    (x, _, seg), n = task.batch(0, 0)
    assert int(seg.max()) == 0 and x.shape[1] <= 240
    assert n == int((seg >= 0).sum())


def test_bad_conversations_are_clear_errors(chat_tokenizer, tiny_data, tmp_path):
    bad = {
        "not valid JSON": "{oops",
        'non-empty "messages" list': json.dumps({"text": "hi"}),
        "is not one of": json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        "no assistant message": json.dumps({"messages": [{"role": "user", "content": "x"}]}),
    }
    for message, line in bad.items():
        (tmp_path / "c.jsonl").write_text(json.dumps(conversation(0)) + "\n" + line + "\n")
        with pytest.raises(InputError, match=message) as info:
            prepare_chat(tmp_path / "c.jsonl", tmp_path / "out", tokenizer=chat_tokenizer, progress=False)
        assert "c.jsonl:2" in str(info.value)
    (tmp_path / "c.jsonl").write_text(json.dumps(conversation(0)) + "\n")
    with pytest.raises(ConfigError, match="no chat template"):
        prepare_chat(tmp_path / "c.jsonl", tmp_path / "out", tokenizer=tiny_data, progress=False)


def test_prepare_chat_on_the_command_line(chat_tokenizer, tmp_path, capsys):
    from llmkit.cli import main

    (tmp_path / "c.jsonl").write_text("".join(json.dumps(conversation(k)) + "\n" for k in range(5)))
    assert (
        main(
            [
                "prepare",
                "chat",
                str(tmp_path / "c.jsonl"),
                "--tokenizer",
                str(chat_tokenizer),
                "--out",
                str(tmp_path / "d"),
            ]
        )
        == 0
    )
    assert "train 5 conversations" in capsys.readouterr().out
    assert main(["prepare", "chat", str(tmp_path / "c.jsonl")]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_a_chat_run_resumes_bit_for_bit(chat_data, tmp_path):
    def cfg(out, **train_section):
        c = tiny_config(chat_data, out, data={"seq_len": 240, "batch_size": 2}, train={"steps": 6, "save_every": 3})
        c["train"].update(train_section)
        return TrainConfig.from_dict(c)

    train(cfg(tmp_path / "a"))
    train(cfg(tmp_path / "b", halt_at=3))
    train(cfg(tmp_path / "b"), resume=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
