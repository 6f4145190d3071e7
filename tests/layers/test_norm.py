import torch

from llmkit.config import NormConfig
from llmkit.layers.norm import LayerNorm, RMSNorm, build_norm
from llmkit.layers.residual import PostNorm, PreNorm, build_residual


def test_rmsnorm_formula():
    x = torch.randn(3, 5, 16)
    n = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.randn(16))
    ref = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * n.weight
    torch.testing.assert_close(n(x), ref)


def test_rmsnorm_computes_in_fp32_for_bf16_inputs():
    x = (torch.randn(64, 512) * 30).bfloat16()
    norm = RMSNorm(512).bfloat16()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    x32 = x.float()
    ref = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).bfloat16() * norm.weight
    assert torch.equal(out, ref)  # statistics in fp32, one rounding to bf16
    in_bf16 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    assert not torch.equal(out, in_bf16)  # what computing the statistics in bf16 would give


def test_layernorm_normalises_each_token_over_its_features():
    x = torch.randn(2, 3, 8) * 5 + 3
    y = LayerNorm(8)(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 3), atol=1e-5, rtol=0)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(y, (x - mean) / torch.sqrt(var + 1e-5), rtol=1e-5, atol=1e-5)
    assert LayerNorm(8, bias=False).bias is None


def test_build_norm_picks_the_kind():
    assert isinstance(build_norm(NormConfig(kind="rmsnorm"), 4), RMSNorm)
    assert isinstance(build_norm(NormConfig(kind="layernorm"), 4), LayerNorm)


def test_pre_and_post_norm_wiring():
    x = torch.randn(2, 3, 8)

    def f(h):
        return 2 * h + 1

    pre = build_residual(NormConfig(kind="layernorm", placement="pre"), 8, 0.0)
    post = build_residual(NormConfig(kind="layernorm", placement="post"), 8, 0.0)
    assert isinstance(pre, PreNorm) and isinstance(post, PostNorm)
    torch.testing.assert_close(pre(x, f), x + f(pre.norm(x)))  # x + Sublayer(norm(x))
    torch.testing.assert_close(post(x, f), post.norm(x + f(x)))  # LayerNorm(x + Sublayer(x))


def test_offset_rmsnorm_gain_is_one_plus_weight_and_starts_at_one():
    from llmkit.layers.norm import OffsetRMSNorm

    n = build_norm(NormConfig(kind="rmsnorm", eps=1e-6, unit_offset=True), 16)
    assert type(n) is OffsetRMSNorm and torch.equal(n.weight, torch.zeros(16))
    x = torch.randn(3, 16)
    torch.testing.assert_close(n(x), RMSNorm(16, eps=1e-6)(x))  # a fresh one is a plain RMSNorm
    with torch.no_grad():
        n.weight.copy_(torch.randn(16))
    ref = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * (1 + n.weight)
    torch.testing.assert_close(n(x), ref)


def test_unit_offset_needs_rmsnorm():
    import pytest

    from llmkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unit_offset=True is only supported with norm\.kind='rmsnorm'"):
        NormConfig(kind="layernorm", unit_offset=True)


def test_sandwich_norm_normalises_the_sublayer_input_and_output():
    from llmkit.layers.residual import SandwichNorm

    r = build_residual(NormConfig(kind="rmsnorm", placement="sandwich", eps=1e-6), 16, 0.0)
    assert type(r) is SandwichNorm
    with torch.no_grad():
        r.norm.weight.uniform_(0.5, 1.5)
        r.post_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 16)
    f = torch.nn.Linear(16, 16)
    torch.testing.assert_close(r(x, f), x + r.post_norm(f(r.norm(x))))
    # the sub-layer's contribution has the post-norm's scale whatever the sub-layer's
    big = r(x, lambda h: 1000 * f(h)) - x
    torch.testing.assert_close(big, r(x, f) - x, rtol=1e-4, atol=1e-4)


def test_soft_cap_is_the_identity_near_zero_and_bounded():
    from llmkit.layers.softcap import soft_cap

    x = torch.tensor([-1e4, -3.0, -1e-3, 0.0, 1e-3, 3.0, 1e4])
    y = soft_cap(x, 5.0)
    assert y.abs().max() <= 5.0 and torch.all(y[1:] >= y[:-1])
    torch.testing.assert_close(y[2:5], x[2:5], rtol=1e-6, atol=1e-9)
    assert soft_cap(x, None) is x
