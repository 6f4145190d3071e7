import pytest
import torch

from llmkit import get_preset
from llmkit.interop.keymap import (
    Identity,
    MappingError,
    Reshape,
    RopeToHalf,
    Rule,
    Split,
    Stack,
    Transpose,
    check_against,
    expand,
)
from llmkit.layers.rope import RotaryEmbedding, apply_rope


@pytest.mark.parametrize(
    ("transform", "theirs"),
    [
        (Identity(), [torch.randn(3, 4)]),
        (Transpose(), [torch.randn(3, 4)]),
        (Split((2, 2, 4), dim=0, then=Transpose()), [torch.randn(5, 8)]),
        (Stack(), [torch.randn(3, 4) for _ in range(5)]),
        (Reshape((1, 7)), [torch.randn(1, 7)]),
        (RopeToHalf(n_heads=2), [torch.randn(16, 5)]),
    ],
)
def test_transforms_invert(transform, theirs):
    ours = transform.to_ours(theirs)
    back = transform.to_theirs(ours)
    assert len(back) == len(theirs)
    for a, b in zip(back, theirs, strict=True):
        assert torch.equal(a, b)


def test_rope_permutation_turns_interleaved_rows_into_half_rows():
    # a projection whose rows feed interleaved-pair RoPE gives the same scores as its permuted rows with half RoPE
    H, D, C = 2, 8, 6
    w = torch.randn(H * D, C)
    x = torch.randn(1, 5, C)
    rope = RotaryEmbedding(D, 10000.0, 16)(torch.arange(5))
    q_inter = apply_rope((x @ w.T).view(1, 5, H, D), rope, "interleaved")
    w_half = RopeToHalf(H).to_ours([w])[0]
    q_half = apply_rope((x @ w_half.T).view(1, 5, H, D), rope, "half")
    scores = lambda q: q @ q.transpose(-1, -2)  # noqa: E731
    torch.testing.assert_close(scores(q_half), scores(q_inter))


def test_expand_runs_over_layers_and_experts():
    cfg = get_preset("deepseek-v3-tiny")  # 3 layers, the first dense, 16 experts, one MTP module
    rules = [
        Rule("blocks.{i}.ffn.w1.weight", "L.{i}.dense", where="dense"),
        Rule("blocks.{i}.ffn.experts.w1", "L.{i}.e.{e}", Stack(), where="moe"),
        Rule("mtp.{i}.proj.weight", "L.{i}.eh", where="mtp", offset=lambda c: c.n_layers),
        Rule("head.weight", "lm_head", when=lambda c: c.tie_embeddings),
    ]
    concrete = expand(rules, cfg)
    assert [c.theirs for c in concrete if c.ours[0].endswith("w1.weight")] == [("L.0.dense",)]
    experts = [c for c in concrete if "experts" in c.ours[0]]
    assert [c.ours[0] for c in experts] == ["blocks.1.ffn.experts.w1", "blocks.2.ffn.experts.w1"]
    assert experts[0].theirs == tuple(f"L.1.e.{e}" for e in range(16))
    assert [c.theirs for c in concrete if c.ours[0].startswith("mtp")] == [("L.3.eh",)]
    assert not any(c.ours[0] == "head.weight" for c in concrete)  # the tiny preset is untied


def test_check_against_reports_everything_at_once():
    rules = expand([Rule("a", "x"), Rule("b", "y", Transpose())], get_preset("gpt2-tiny"))
    with pytest.raises(MappingError) as e:
        check_against(rules, {"a": (2, 3), "b": (4, 5)}, {"y": (4, 5), "z": (1,)}, lambda n: False, "ckpt")
    msg = str(e.value)
    assert "missing tensors: x" in msg and "unexpected tensors: z" in msg
    assert "y has shape [4, 5] but the config implies [5, 4]" in msg
