"""An MTP module taught to draft on the model's own text (llmkit.train.own_text, drafting, `llmkit graft-mtp`): the
data is what the model says and its states there, the module trains alone in the training loop, learns to agree with
the model, and drafts chains whose output is exactly plain greedy decoding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import cast

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.errors import InputError
from llmkit.generate import generate, speculative_generate
from llmkit.interop.load import load_model
from llmkit.models import DecoderLM
from llmkit.models.cache import whole_sequence
from llmkit.runs import resolve_checkpoint
from llmkit.train.config import TrainConfig
from llmkit.train.data import TokenData
from llmkit.train.drafting import evaluate_drafter
from llmkit.train.graft import graft_mtp
from llmkit.train.loop import train
from llmkit.train.own_text import collect_own_text, model_states

from .conftest import tiny_config, train_on_own_text


@pytest.fixture(scope="module")
def pretrained(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pre") / "run"
    train(TrainConfig.from_dict(tiny_config(tiny_data, out, train={"steps": 30})))
    return out


def base_model(run: Path) -> DecoderLM:
    model = load_model(resolve_checkpoint(run)).model.eval()
    assert isinstance(model, DecoderLM)
    return model


def openings(data: Path, split: str, n: int, length: int = 8) -> list[list[int]]:
    stream = TokenData(data).split(split).tokens
    starts = torch.linspace(0, len(stream) - length - 1, n).long().tolist()
    return [[int(t) for t in stream[s : s + length]] for s in starts]


def test_graft_copies_the_last_block_and_starts_from_the_models_state(pretrained):
    model = base_model(pretrained)
    grafted = graft_mtp(model)
    assert grafted.cfg.mtp_depth == 1 and len(model.mtp) == 0
    for name, value in model.state_dict().items():
        assert torch.equal(grafted.state_dict()[name], value)
    last = model.blocks[-1].state_dict()
    for name, value in grafted.mtp[0].block.state_dict().items():
        assert torch.equal(value, last[name])
    C = model.cfg.d_model
    proj = grafted.mtp[0].proj.weight
    assert torch.equal(proj[:, C:], torch.eye(C)) and not proj[:, :C].any()  # [0 ; I]: the state alone at first
    with pytest.raises(InputError, match="already has"):
        graft_mtp(grafted)


def test_own_text_is_the_models_greedy_text_and_its_states_and_resumes_from_disk(
    pretrained, tiny_data, tmp_path, monkeypatch
):
    model = base_model(pretrained)
    starts = openings(tiny_data, "train", 5)
    text = collect_own_text(model, starts, tmp_path, new_tokens=12, batch=2, log=lambda _: None)
    assert text.tokens.shape == (5, 20) and text.hidden.shape == (5, 20, model.cfg.d_model)
    with torch.no_grad():
        expected = generate(model, starts, max_new_tokens=12).new_tokens
        h = model.run(text.tokens, whole_sequence(20, None, text.tokens.device))
        top = model.logits(model.norm(h)).topk(8, dim=-1)
    assert [r[8:] for r in text.tokens.tolist()] == expected
    torch.testing.assert_close(text.hidden.float(), h, rtol=1e-2, atol=1e-2)  # kept in bf16
    assert torch.equal(text.top_ids[..., 0].long(), top.indices[..., 0])
    assert len(list(tmp_path.glob("own-*.pt"))) == 3  # a file per batch of 2
    import llmkit.generate

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing should be generated again")

    monkeypatch.setattr(llmkit.generate, "generate", refuse)
    again = collect_own_text(model, starts, tmp_path, new_tokens=12, batch=2, log=lambda _: None)
    assert torch.equal(again.tokens, text.tokens)  # read back, nothing generated
    with pytest.raises(InputError, match="one"):
        collect_own_text(model, [[1, 2], [3]], tmp_path / "x", new_tokens=4)


def test_the_module_alone_learns_to_agree_with_the_model_and_chains_exactly(tmp_path):
    # a random model over random text: what it says next is a function of the context the module must learn
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=64)).eval()
    generator = torch.Generator().manual_seed(1)
    text = model_states(model, torch.randint(0, 64, (96, 24), generator=generator))
    held = model_states(model, torch.randint(0, 64, (16, 24), generator=generator))
    grafted = graft_mtp(model)
    trunk = {k: v.clone() for k, v in grafted.state_dict().items() if not k.startswith("mtp.")}
    before, _ = evaluate_drafter(grafted, held, 2)
    result = train_on_own_text(grafted, text, held, tmp_path, steps=150, lr=1e-2, unroll=2)
    assert result.steps == 150 and result.tokens == 150 * 8 * 24
    agreement, accepted = evaluate_drafter(grafted, held, 2)
    assert min(agreement) > max(before) + 0.3  # it learnt what the model says, at depth 2 from its own output
    assert 0.3 < accepted <= 2
    after = grafted.state_dict()
    assert all(torch.equal(after[k], v) for k, v in trunk.items())  # the trunk did not move
    saved = load_model(resolve_checkpoint(tmp_path / "run")).model.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in after.items())  # the run's checkpoint is the trained model
    prompts = held.tokens[:3, :10].tolist()
    with torch.no_grad():
        plain = generate(grafted, prompts, max_new_tokens=30).new_tokens
        for k in (1, 3):
            out = speculative_generate(grafted, prompts, max_new_tokens=30, k=k)
            assert out.new_tokens == plain
            assert out.accepted > 0


def test_graft_mtp_command_writes_a_drafting_checkpoint(pretrained, tiny_data, tmp_path, capsys):
    out = tmp_path / "drafting"
    args = [str(resolve_checkpoint(pretrained)), str(out), "--data", str(tiny_data), "--sequences", "8"]
    assert main(["graft-mtp", *args, "--opening", "8", "--new-tokens", "16", "--minutes", "0.05", "--unroll", "2"]) == 0
    printed = capsys.readouterr().out
    assert "agree with the model" in printed and f"llmkit generate {out} --mtp" in printed
    report = json.loads((out / "drafter.json").read_text())
    assert report["steps"] >= 1 and len(report["agreement"]) == 2
    model = load_model(out).model.eval()
    assert model.cfg.mtp_depth == 1
    assert (tmp_path / "drafting.text" / "train").is_dir()  # the collected text, kept for a rerun
    assert main(["generate", str(out), "--prompt", "ROMEO", "--mtp", "--speculate", "2", "--max-new-tokens", "8"]) == 0


def test_graft_mtp_command_refuses_bad_requests(pretrained, tiny_data, tmp_path, capsys):
    base = str(resolve_checkpoint(pretrained))
    for flag, value in [("--sequences", "1"), ("--unroll", "9"), ("--minutes", "0"), ("--steps", "0")]:
        assert main(["graft-mtp", base, str(tmp_path / "o"), "--data", str(tiny_data), flag, value]) == 2
        assert f"{flag} {value}" in capsys.readouterr().err
    other = tmp_path / "other"
    from llmkit.data.prepare import prepare

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a different text entirely, with its own vocabulary. " * 200)
    prepare(tmp_path / "corpus", other, vocab_size=300, progress=False)
    assert main(["graft-mtp", base, str(tmp_path / "o"), "--data", str(other)]) != 0
    assert "another tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_pruned_draft_keeps_the_chosen_blocks_and_learns_the_targets_distributions(tmp_path):
    from llmkit.quant import quantize
    from llmkit.train.drafting import agreement
    from llmkit.train.graft import prune

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=64, n_layers=4)).eval()
    with torch.no_grad():  # a peaked next-token distribution, as a trained model's (a random one's is nearly flat)
        cast(torch.Tensor, model.head.weight).mul_(8)
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(prune(model, [0, 1, 2, 3])(tokens), model(tokens))  # every block: the model
    draft = prune(model, [0, 3])
    assert draft.cfg.n_layers == 2
    for name, value in model.blocks[3].state_dict().items():
        assert torch.equal(draft.blocks[1].state_dict()[name], value)
    generator = torch.Generator().manual_seed(1)
    text = model_states(model, torch.randint(0, 64, (96, 24), generator=generator))
    held = model_states(model, torch.randint(0, 64, (16, 24), generator=generator))
    before, _ = agreement(draft, held, 3)
    result = train_on_own_text(draft, text, held, tmp_path, steps=150, lr=1e-3)
    after, accepted = agreement(draft, held, 3)
    assert result.steps == 150 and after > before + 0.1
    assert 0 < accepted <= 3
    low = quantize(draft, "int4", include_head=True).eval()  # drafting from int4 weights: the output is the target's
    prompts = held.tokens[:3, :10].tolist()
    with torch.no_grad():
        plain = generate(model, prompts, max_new_tokens=30).new_tokens
        out = speculative_generate(model, prompts, draft=low, max_new_tokens=30, k=3)
    assert out.new_tokens == plain and out.accepted > 0
    with pytest.raises(InputError, match="distinct blocks"):
        prune(model, [0, 0])
    with pytest.raises(InputError, match="distinct blocks"):
        prune(model, [4])


def test_distill_draft_command_writes_a_draft_that_speculates_exactly(pretrained, tiny_data, tmp_path, capsys):
    base = str(resolve_checkpoint(pretrained))
    out, work = tmp_path / "draft", tmp_path / "text"
    flags = ["--data", str(tiny_data), "--sequences", "8", "--opening", "8", "--new-tokens", "16", "--work", str(work)]
    assert main(["distill-draft", base, str(out), *flags, "--minutes", "0.05", "--keep", "-1", "--k", "2"]) == 0
    printed = capsys.readouterr().out
    assert "agrees with the model" in printed and f"--draft {out}" in printed
    report = json.loads((out / "drafter.json").read_text())
    assert report["steps"] >= 1 and len(report["agreement"]) == 1
    draft = load_model(out).model
    assert draft.cfg.n_layers == 1 and draft.cfg.mtp_depth == 0
    last = base_model(pretrained).blocks[-1].state_dict()
    assert set(draft.blocks[0].state_dict()) == set(last)  # the model's last block, trained since
    assert main(["quantize", str(out), str(tmp_path / "draft8"), "--to", "int8", "--include-head"]) == 0
    capsys.readouterr()
    common = ["generate", base, "--prompt", "ROMEO", "--max-new-tokens", "16", "--temperature", "0"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    for draft_path in (out, tmp_path / "draft8"):
        assert main([*common, "--draft", str(draft_path), "--speculate", "3"]) == 0
        assert capsys.readouterr().out == plain  # the model's own greedy text
    for keep in ("0,0", "5", "a"):
        assert main(["distill-draft", base, str(tmp_path / "x"), *flags, "--keep", keep]) == 2
        assert "--keep" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
