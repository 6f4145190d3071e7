"""Distillation (`loss.distill_from`): a small model learns a teacher's next-token distributions, which makes it a
draft model for speculative decoding of that teacher."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmkit.generate import generate, speculative_generate
from llmkit.interop.load import load_model
from llmkit.runs import resolve_checkpoint
from llmkit.train.config import TrainConfig
from llmkit.train.distill import candidates, distillation_kl, top_k_cross_entropy
from llmkit.train.loop import TrainingError, train

from .conftest import losses, tiny_config

STUDENT = {"preset": "llama2-7b-tiny", "n_layers": 1, "d_model": 32, "attention": {"n_heads": 2, "n_kv_heads": 1}}


def test_the_top_k_term_is_the_cross_entropy_against_the_teachers_renormalised_top_k():
    """Against a direct computation, position by position: the teacher's top-k probabilities renormalised, the
    student's log-probabilities over the batch's candidate tokens (the union of every position's top-k)."""
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 3, 40, generator=g), torch.randn(2, 3, 40, generator=g)
    top_logits, top_ids = teacher.topk(4, dim=-1)  # (2, 3, 4)
    ids, index = candidates(top_ids)
    assert torch.equal(ids[index], top_ids.long())
    got = top_k_cross_entropy(student[..., ids], index, top_logits)
    union = sorted(set(top_ids.flatten().tolist()))
    expected = []
    for b in range(2):
        for t in range(3):
            p = F.softmax(top_logits[b, t], -1)
            log_q = F.log_softmax(student[b, t, union], -1)
            expected.append(-sum(p[j] * log_q[union.index(int(top_ids[b, t, j]))] for j in range(4)))
    torch.testing.assert_close(got, torch.stack(expected).mean())
    # k = V: the whole distribution, whose cross-entropy is the KL plus the teacher's entropy (the same gradient)
    top_logits, top_ids = teacher.topk(40, dim=-1)
    ids, index = candidates(top_ids)
    full = top_k_cross_entropy(student[..., ids], index, top_logits)
    p = F.softmax(teacher, -1)
    entropy = -(p * p.log()).sum(-1).mean()
    torch.testing.assert_close(full, distillation_kl(student, teacher, torch.zeros(2, 3, dtype=torch.long)) + entropy)


def test_the_kl_term_is_the_teachers_divergence_over_counted_positions():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    targets = torch.tensor([[1, 2, -100, 3, 4], [-100, -100, 5, 6, 7]])
    keep = targets != -100
    p, log_q = F.softmax(t[keep] / 2.0, -1), F.log_softmax(s[keep] / 2.0, -1)
    expected = (p * (p.log() - log_q)).sum(-1).mean() * 4.0
    torch.testing.assert_close(distillation_kl(s, t, targets, temperature=2.0), expected)
    assert distillation_kl(t, t, targets).abs() < 1e-6


@pytest.fixture(scope="module")
def teacher(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("teacher") / "run"
    train(TrainConfig.from_dict(tiny_config(tiny_data, out, train={"steps": 12})))
    return out


def test_a_distilled_draft_learns_the_teachers_distributions_and_drafts_exactly(tiny_data, teacher, tmp_path):
    cfg = tiny_config(tiny_data, tmp_path / "d", train={"steps": 12}, loss={"distill_from": str(teacher)})
    cfg["model"] = STUDENT
    train(TrainConfig.from_dict(cfg))
    kl = losses(tmp_path / "d", "kl")
    assert kl[-1] < kl[0] and losses(tmp_path / "d")[0] == pytest.approx(kl[0])  # distill_weight 1: the KL alone
    target = load_model(resolve_checkpoint(teacher)).model.eval()
    draft = load_model(resolve_checkpoint(tmp_path / "d")).model.eval()
    prompt = [[5, 17, 42, 8]]
    with torch.no_grad():
        plain = generate(target, prompt, max_new_tokens=20).new_tokens
        out = speculative_generate(target, prompt, draft=draft, max_new_tokens=20, k=3)
    assert out.new_tokens == plain and out.accepted > 0


def test_a_teacher_with_another_vocabulary_is_an_error(tiny_data, teacher, tmp_path):
    import dataclasses

    from llmkit.config.presets import get_preset
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.models import build_model

    other = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=500))
    save_llmkit(other, tmp_path / "other")
    cfg = tiny_config(tiny_data, tmp_path / "d", loss={"distill_from": str(tmp_path / "other")})
    cfg["model"] = STUDENT
    with pytest.raises(TrainingError, match="vocabulary"):
        train(TrainConfig.from_dict(cfg))
