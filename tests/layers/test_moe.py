import math

import pytest
import torch

from llmkit import MoEConfig
from llmkit.layers.extras import Extras, MoEStats
from llmkit.layers.mlp import MLP, SwiGLU
from llmkit.layers.moe import MoE, Router, router_z_loss, switch_aux_loss, update_router_bias

C = 16


def moe(**kw) -> MoE:
    cfg = MoEConfig(**{"n_experts": 4, "top_k": 2, "expert_hidden_dim": 24, **kw})
    m = MoE(C, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def stats_of(m: MoE, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
    """The layer's output and the statistics it reports for one call."""
    extras = Extras()
    y = m(x, extras)
    (stats,) = extras.moe
    return y, stats


def naive_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: route, then sum the gated outputs of the chosen experts (and the shared experts)."""
    xf = x.reshape(-1, C)
    r = m.router(xf)
    out = torch.zeros_like(xf)
    for t in range(xf.shape[0]):
        for j in range(m.cfg.top_k):
            e = int(r.experts[t, j])
            out[t] += r.weights[t, j] * m.experts.expert(e, xf[t : t + 1])[0]
    if m.shared is not None:
        out = out + m.shared(xf)
    return out.view_as(x)


def test_one_expert_top1_equals_its_mlp():
    m = moe(n_experts=1, top_k=1)
    mlp = SwiGLU(C, 24)
    with torch.no_grad():
        mlp.w1.weight.copy_(m.experts.w1[0])
        mlp.w3.weight.copy_(m.experts.w3[0])
        mlp.w2.weight.copy_(m.experts.w2[0])
    x = torch.randn(2, 5, C)
    torch.testing.assert_close(m(x), mlp(x))


def test_switch_relu_experts_top1():
    m = moe(n_experts=1, top_k=1, expert_kind="mlp", activation="relu", norm_topk=False)
    mlp = MLP(C, 24, "relu", bias=False)
    with torch.no_grad():
        mlp.w1.weight.copy_(m.experts.w1[0])
        mlp.w2.weight.copy_(m.experts.w2[0])
    x = torch.randn(3, C)
    torch.testing.assert_close(m(x), mlp(x))


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=1, norm_topk=False),  # Switch
        dict(top_k=2),  # GShard / Mixtral
        dict(
            n_experts=8,
            top_k=3,
            score_func="sigmoid",
            n_groups=4,
            topk_groups=2,
            score_bias=True,
            routed_scale=2.5,
            n_shared_experts=1,
        ),  # DeepSeek-V3
        dict(n_experts=8, top_k=3, n_shared_experts=2, norm_topk=False),  # DeepSeek-V2
    ],
)
def test_grouped_dispatch_equals_per_token_reference(kw):
    m = moe(**kw)
    if m.router.score_bias is not None:
        m.router.score_bias.normal_(0, 0.1)
    x = torch.randn(3, 7, C)
    torch.testing.assert_close(m(x), naive_moe(m, x), rtol=1e-5, atol=1e-6)


def test_router_variants():
    x = torch.randn(50, C)
    # softmax top-2, renormalised gates (Mixtral): gates sum to 1 and follow the probabilities' order
    r = moe(top_k=2).router(x)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(50))
    # Switch: the gate is the chosen expert's probability
    m1 = moe(top_k=1, norm_topk=False)
    r1 = m1.router(x)
    torch.testing.assert_close(r1.weights[:, 0], r1.probs.max(-1).values)
    # grouped: chosen experts come from the topk_groups best groups (ranked by the sum of their top-2 scores)
    mg = moe(n_experts=8, top_k=2, score_func="sigmoid", n_groups=4, topk_groups=1)
    rg = mg.router(x)
    groups = rg.experts // 2
    assert (groups[:, 0] == groups[:, 1]).all()  # one eligible group: both experts come from it
    scores = torch.sigmoid(rg.logits).view(50, 4, 2)
    torch.testing.assert_close(groups[:, 0], scores.topk(2, -1).values.sum(-1).argmax(-1))


def test_score_bias_changes_selection_but_not_gates():
    m = moe(n_experts=4, top_k=1, score_func="sigmoid", score_bias=True, norm_topk=False)
    x = torch.randn(40, C)
    before = m.router(x)
    m.router.score_bias[0] = 10.0  # expert 0 now always wins the selection
    after = m.router(x)
    assert (after.experts[:, 0] == 0).all()
    torch.testing.assert_close(after.weights[:, 0], torch.sigmoid(after.logits[:, 0]))  # gate: the unbiased score
    assert not torch.equal(before.experts, after.experts)


def test_aux_loss_equals_switch_formula_on_a_hand_computed_case():
    # 4 tokens, 2 experts, top-1: tokens 0, 1, 2 go to expert 0, token 3 to expert 1
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    experts = torch.tensor([[0], [0], [0], [1]])
    # f = (3/4, 1/4); P = (0.65, 0.35); loss = N * sum f_i P_i = 2 * (0.4875 + 0.0875) = 1.15
    assert switch_aux_loss(probs, experts, 2).item() == pytest.approx(1.15)
    # uniform routing gives the minimum, k
    uniform = torch.full((4, 2), 0.5)
    assert switch_aux_loss(uniform, torch.tensor([[0], [1], [0], [1]]), 2).item() == pytest.approx(1.0)


def test_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp: log 2 and log 4
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2)


def test_capacity_drops_assignments_beyond_each_experts_capacity():
    m = moe(n_experts=2, top_k=1, norm_topk=False, capacity_factor=1.0)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 10.0  # every token with x[0] > 0 prefers expert 0
    x = torch.randn(8, C)
    x[:, 0] = 1.0  # all 8 tokens choose expert 0; capacity = ceil(1.0 * 8 * 1 / 2) = 4
    assert m.capacity(8) == 4
    y, stats = stats_of(m, x)
    no_cap = moe(n_experts=2, top_k=1, norm_topk=False)
    no_cap.load_state_dict(m.state_dict())
    ref = no_cap(x)
    torch.testing.assert_close(y[:4], ref[:4])  # the first 4 tokens (in order) are served
    assert (y[4:] == 0).all()  # the rest are dropped: the residual carries them
    assert float(stats.dropped) == pytest.approx(0.5)


def test_capacity_serves_first_choices_before_second_choices():
    m = moe(n_experts=2, top_k=2, capacity_factor=0.5)  # capacity = ceil(0.5 * 4 * 2 / 2) = 2
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 5.0
    x = torch.randn(4, C)
    x[:, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0])  # tokens 0, 2 prefer expert 0; tokens 1, 3 prefer expert 1
    _, stats = stats_of(m, x)
    r = m.router(x)
    assert r.experts[:, 0].tolist() == [0, 1, 0, 1]
    # each expert gets its two first choices; every second choice is dropped
    assert float(stats.dropped) == pytest.approx(0.5)
    y = m(x)
    for t in range(4):
        e = int(r.experts[t, 0])
        expected = r.weights[t, 0] * m.experts.expert(e, x[t : t + 1])[0]
        torch.testing.assert_close(y[t], expected, rtol=1e-5, atol=1e-6)


def test_aux_loss_free_bias_update_lowers_overloaded_experts():
    m = moe(n_experts=4, top_k=1, score_func="sigmoid", score_bias=True, norm_topk=False)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 5.0
    x = torch.randn(64, C)
    x[:, 0] = 1.0  # all tokens choose expert 0
    extras = Extras()
    m.train()
    m(x, extras)
    load = extras.expert_load()
    assert load[m.layer].tolist() == [64.0, 0.0, 0.0, 0.0]
    update_router_bias(m, load, rate=0.01)
    assert m.router.score_bias is not None
    torch.testing.assert_close(m.router.score_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def test_empty_experts_are_skipped_and_gradients_flow():
    m = moe(n_experts=8, top_k=1)
    x = torch.randn(2, C, requires_grad=True)
    y, stats = stats_of(m, x)
    y.sum().backward()
    assert x.grad is not None and m.router.weight.grad is not None
    assert int((stats.counts > 0).sum()) <= 2


def test_router_runs_in_fp32_for_bf16_inputs():
    r = Router(C, MoEConfig(n_experts=4, top_k=2)).bfloat16()
    out = r(torch.randn(3, C).bfloat16())
    assert out.logits.dtype == torch.float32 and out.probs.dtype == torch.float32


def test_sequence_aux_loss_hand_computed():
    from llmkit.layers.moe import sequence_aux_loss

    # one sequence of 2 tokens, 2 experts, top-1: both tokens pick expert 0
    probs = torch.tensor([[[0.75, 0.25], [0.25, 0.75]]])
    experts = torch.tensor([[[0], [0]]])
    # f = E / (k T) * counts = 2 / 2 * (2, 0) = (2, 0); P = (0.5, 0.5); loss = 1.0
    assert sequence_aux_loss(probs, experts, 2).item() == pytest.approx(1.0)
    balanced = torch.tensor([[[0], [1]]])
    assert sequence_aux_loss(probs, balanced, 2).item() == pytest.approx(1.0 * 0.5 + 1.0 * 0.5)
    skewed = torch.tensor([[[0.9, 0.1], [0.9, 0.1]]])
    assert sequence_aux_loss(skewed, experts, 2).item() == pytest.approx(2 * 0.9)


def test_sequence_balance_is_per_sequence():
    m = moe(top_k=2, aux_loss_kind="sequence")
    x = torch.randn(3, 5, C)
    _, stats = stats_of(m, x)
    r = m.router(x.reshape(-1, C))
    from llmkit.layers.moe import sequence_aux_loss

    expected = sequence_aux_loss(r.probs.view(3, 5, 4), r.experts.view(3, 5, 2), 4)
    torch.testing.assert_close(stats.aux_loss, expected)


def test_router_state_stays_fp32_in_a_bf16_model():
    m = moe(n_experts=4, top_k=1, score_func="sigmoid", score_bias=True).bfloat16()
    assert m.router.weight.dtype == torch.bfloat16
    assert m.router.score_bias is not None and m.router.score_bias.dtype == torch.float32
    m.router.score_bias.fill_(0.5)
    m.train()
    extras = Extras()
    for _ in range(3):
        m(torch.randn(200, C).bfloat16(), extras)  # 600 tokens: a bf16 counter would stall at 256
    load = extras.expert_load()
    assert load[m.layer].dtype == torch.float32 and load[m.layer].sum().item() == 600
    update_router_bias(m, load, rate=1e-3)
    assert (m.router.score_bias != 0.5).all()  # a 1e-3 step on 0.5 is lost in bf16


def test_standalone_layers_are_initialised():
    m = MoE(C, MoEConfig(n_experts=4, top_k=2, expert_hidden_dim=8))
    out = m(torch.randn(2, 3, C))
    assert torch.isfinite(out).all() and out.abs().max() < 10


def test_the_three_ways_of_running_experts_agree():
    # a grouped matmul (one call, slices given as a tensor), each row with its own expert's gathered weights (few
    # rows, no host read-back), and one matmul per expert
    m = moe(n_experts=4, top_k=2)
    x = torch.randn(5, C)
    counts = torch.tensor([2, 0, 3, 0])  # rows 0-1 for expert 0, rows 2-4 for expert 2
    by_expert = m.experts._one_by_one(x, counts)
    torch.testing.assert_close(m.experts(x, counts), by_expert, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.experts._gathered(x, counts), by_expert, rtol=1e-5, atol=1e-6)


def test_group_score_max_ranks_groups_by_their_best_expert():
    # DeepSeek-V2's group_limited_greedy: a group with one strong expert beats a group with two fairly good ones,
    # where V3's sum of the two best picks the other group
    probs = torch.tensor([0.40, 0.01, 0.25, 0.24, 0.05, 0.05])  # groups of two: {0, 1}, {2, 3}, {4, 5}
    x = torch.zeros(1, C)
    x[0, 0] = 1.0  # the router's logits are its first column
    for score, group in (("max", 0), ("top2_sum", 1)):
        m = moe(n_experts=6, top_k=1, n_groups=3, topk_groups=1, group_score=score, norm_topk=False)
        with torch.no_grad():
            m.router.weight.zero_()
            m.router.weight[:, 0] = probs.log()  # softmax gives the probabilities back
        r = m.router(x)
        assert int(r.experts[0, 0]) // 2 == group, score
        torch.testing.assert_close(r.weights[0, 0], probs[2 * group])


def test_gated_shared_expert_scales_the_shared_output_per_token():
    m = moe(n_experts=4, top_k=2, n_shared_experts=2, shared_gate=True, norm_topk=False)
    assert m.shared_gate is not None and m.shared_gate.weight.shape == (1, C)
    x = torch.randn(2, 5, C)
    xf = x.reshape(-1, C)
    routed_only = naive_moe(m, x).reshape(-1, C) - m.shared(xf)
    expected = routed_only + torch.sigmoid(xf @ m.shared_gate.weight.T) * m.shared(xf)
    torch.testing.assert_close(m(x).reshape(-1, C), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(__import__("llmkit").errors.ConfigError, match="shared_gate=True needs n_shared_experts >= 1"):
        MoEConfig(shared_gate=True)
