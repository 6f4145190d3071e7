import pytest
import torch

from llmkit import MLAConfig, get_preset
from llmkit.layers.attention import AttentionInputs, AttentionMask, MultiHeadLatentAttention, padding_mask
from llmkit.layers.extras import Extras
from llmkit.layers.rope import RotaryEmbedding, apply_rope
from llmkit.models import SequenceState, build_model

C, H = 48, 4
MLA = MLAConfig(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def make(mla: MLAConfig = MLA, absorb: bool | None = None) -> MultiHeadLatentAttention:
    m = MultiHeadLatentAttention(C, H, mla, rope_layout="interleaved", absorb=absorb).eval()
    with torch.no_grad():  # non-trivial norm gains so that a misplaced norm shows
        m.kv_norm.weight.uniform_(0.5, 1.5)
        if mla.q_lora_rank:
            m.q_norm.weight.uniform_(0.5, 1.5)
    return m


def twin(m: MultiHeadLatentAttention, absorb: bool | None) -> MultiHeadLatentAttention:
    """The same weights, with the attention path fixed to `absorb`."""
    other = MultiHeadLatentAttention(
        C, H, MLAConfig(**{**MLA.to_dict(), "q_lora_rank": m.q_lora_rank}), rope_layout="interleaved", absorb=absorb
    ).eval()
    other.load_state_dict(m.state_dict())
    return other


ROPE = RotaryEmbedding(MLA.qk_rope_head_dim, 10000.0, 64)


def inputs(T: int, mask: AttentionMask | None = None) -> AttentionInputs:
    return AttentionInputs(mask or AttentionMask(causal=True), ROPE(torch.arange(T)))


def cached(state: SequenceState, T: int) -> AttentionInputs:
    """The next T slots of a cache, as a model's forward gives them to its layers."""
    step = state.advance(T)
    return AttentionInputs(step.mask, ROPE(step.positions), step.slots)


def naive_mla(m: MultiHeadLatentAttention, x: torch.Tensor, inp: AttentionInputs) -> torch.Tensor:
    """DeepSeek-V2's formulas (§2.1), head by head:
    q_h = [c' W_qc^h, R c' W_qr^h], k_h = [c W_kc^h, R x W_kr], v_h = c W_v^h, c = norm(x W_c)."""
    dn, dr, dv, r = m.dn, m.dr, m.dv, m.r
    c_q = m.q_norm(x @ m.wq_a.weight.T)  # (B, T, q_lora)
    q_all = (c_q @ m.wq_b.weight.T).view(*x.shape[:2], H, dn + dr)
    kv_a = x @ m.wkv_a.weight.T
    c = m.kv_norm(kv_a[..., :r])
    k_rope = apply_rope(kv_a[..., r:].unsqueeze(2), inp.rope, "interleaved")[:, :, 0]  # shared by all heads
    w_kv = m.wkv_b.weight.view(H, dn + dv, r)
    T = x.shape[1]
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))
    outs = []
    for h in range(H):
        q = torch.cat(
            [q_all[:, :, h, :dn], apply_rope(q_all[:, :, h : h + 1, dn:], inp.rope, "interleaved")[:, :, 0]],
            -1,
        )
        k = torch.cat([c @ w_kv[h, :dn].T, k_rope], -1)
        v = c @ w_kv[h, dn:].T
        s = (q @ k.transpose(-1, -2)) * m.scale
        outs.append(torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v)
    return torch.cat(outs, -1) @ m.wo.weight.T


def test_explicit_path_matches_the_formulas():
    m = make(absorb=False)
    x = torch.randn(2, 7, C)
    torch.testing.assert_close(m(x, inputs(7)), naive_mla(m, x, inputs(7)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora", [32, None])
def test_absorbed_path_equals_explicit_path(q_lora):
    m = make(MLAConfig(kv_lora_rank=24, q_lora_rank=q_lora, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6))
    x = torch.randn(2, 7, C)
    mask = padding_mask(torch.tensor([[False, True, True, True, True, True, True], [True] * 7]), causal=True)
    explicit = twin(m, False)(x, inputs(7, mask=mask))
    absorbed = twin(m, True)(x, inputs(7, mask=mask))
    torch.testing.assert_close(absorbed, explicit, rtol=1e-5, atol=1e-5)


def test_cached_absorbed_decoding_equals_full_explicit_pass():
    m = make()
    x = torch.randn(2, 9, C)
    full = m(x, inputs(9))  # no cache: explicit path
    cache, state = m.new_cache(2, 12), SequenceState.new(2, 12, None)
    steps = [m(x[:, :3], cached(state, 3), cache)] + [m(x[:, t : t + 1], cached(state, 1), cache) for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    # the cache holds only the latent and the shared rope key
    assert cache.c_kv.shape == (2, 12, MLA.kv_lora_rank) and cache.k_pe.shape == (2, 12, MLA.qk_rope_head_dim)


def test_weights_agree_between_paths():
    m = make()
    x = torch.randn(1, 5, C)
    explicit, absorbed = Extras(attention_weights=True), Extras(attention_weights=True)
    twin(m, False)(x, inputs(5), extras=explicit)
    twin(m, True)(x, inputs(5), extras=absorbed)
    torch.testing.assert_close(absorbed.self_attention[0], explicit.self_attention[0], rtol=1e-5, atol=1e-6)


def test_softmax_scale_includes_yarn_mscale_squared():
    import dataclasses
    import math

    from llmkit.layers.attention.mla import mla_softmax_scale

    cfg = get_preset("deepseek-v3")  # yarn factor 40, mscale_all_dim 1.0
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert mla_softmax_scale(cfg) == pytest.approx(192**-0.5 * mscale**2)
    plain = dataclasses.replace(cfg, position=dataclasses.replace(cfg.position, scaling=None))
    assert mla_softmax_scale(plain) == pytest.approx(192**-0.5)
    lite = get_preset("deepseek-v2-lite")  # mscale_all_dim 0.707
    assert mla_softmax_scale(lite) == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1.0) ** 2)


def test_deepseek_v3_caches_576_elements_per_token_per_layer():
    model = build_model(get_preset("deepseek-v3"), device="meta")
    attn = model.blocks[0].attn
    assert isinstance(attn, MultiHeadLatentAttention)
    assert attn.cache_elements_per_token() == 512 + 64 == 576


def test_path_choice_follows_cost_decode_absorbed_long_prefill_explicit():
    mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    m = MultiHeadLatentAttention(64, 4, mla)
    assert m.absorb_cheaper(1, 64)
    assert m.absorb_cheaper(1, 4096)
    assert not m.absorb_cheaper(4096, 4096)
    assert not m.absorb_cheaper(512, 512)
