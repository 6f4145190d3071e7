from dataclasses import replace

import pytest
import torch
from torch import nn

from llmkit import AttentionConfig, ModelConfig
from llmkit.errors import InputError
from llmkit.layers.attention import (
    AttentionInputs,
    AttentionMask,
    CrossAttention,
    CrossCache,
    GroupedQueryAttention,
    attend,
    causal_tril,
    padding_mask,
)
from llmkit.layers.extras import Extras
from llmkit.layers.rope import RotaryEmbedding
from llmkit.models import SequenceState

C, H, D = 32, 4, 8


def cross_attention() -> CrossAttention:
    """Cross-attention of a model with C wide, H heads of D dims."""
    cfg = ModelConfig(vocab_size=8, d_model=C, n_layers=1, attention=AttentionConfig(n_heads=H, head_dim=D))
    return CrossAttention(cfg).eval()


def gqa(n_kv: int, **kw) -> GroupedQueryAttention:
    return GroupedQueryAttention(C, H, n_kv, D, **kw).eval()


def causal(T: int) -> AttentionInputs:
    return AttentionInputs(mask=AttentionMask(causal=True))


def cached(state: SequenceState, T: int, rope: RotaryEmbedding) -> AttentionInputs:
    """The next T slots of a cache, as a model's forward gives them to its layers."""
    step = state.advance(T)
    return AttentionInputs(step.mask, rope(step.positions), step.slots)


def test_causal_tril_aligns_queries_with_the_last_keys():
    m = causal_tril(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("n_kv", [1, 2, 4])
@pytest.mark.parametrize(
    "mask",
    [
        None,
        AttentionMask(causal=True),
        padding_mask(torch.tensor([[True, True, True, False, False], [True] * 5])),
        padding_mask(torch.tensor([[False, False, True, True, True], [True] * 5]), causal=True),
    ],
)
def test_sdpa_and_explicit_paths_agree(n_kv, mask):
    q = torch.randn(2, H, 5, D)
    k, v = torch.randn(2, n_kv, 5, D), torch.randn(2, n_kv, 5, D)
    fast, none = attend(q, k, v, mask, D**-0.5)
    slow, w = attend(q, k, v, mask, D**-0.5, need_weights=True)
    assert none is None and w is not None
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    rows = w.sum(-1)
    fully_masked = rows == 0
    torch.testing.assert_close(rows[~fully_masked], torch.ones_like(rows[~fully_masked]))
    if mask is not None:
        dense = mask.dense(5, 5, q.device)
        assert dense is not None
        assert (w.masked_select(~dense.expand_as(w)) == 0).all()


def test_causal_mask_with_fewer_queries_than_keys():
    q, k, v = torch.randn(1, H, 2, D), torch.randn(1, H, 6, D), torch.randn(1, H, 6, D)
    fast, _ = attend(q, k, v, AttentionMask(causal=True), D**-0.5)
    _, w = attend(q, k, v, AttentionMask(causal=True), D**-0.5, need_weights=True)
    assert w is not None and (w[..., 0, 5] == 0).all() and (w[..., 1, 5] > 0).all()
    ref, _ = attend(q, k, v, AttentionMask(allowed=causal_tril(2, 6)[None, None]), D**-0.5)
    torch.testing.assert_close(fast, ref)


def test_mha_equals_torch_multihead_attention():
    attn = gqa(H, qkv_bias=True, out_bias=True)
    ref = nn.MultiheadAttention(C, H, bias=True, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]))
        ref.in_proj_bias.copy_(torch.cat([attn.wq.bias, attn.wk.bias, attn.wv.bias]))
        ref.out_proj.weight.copy_(attn.wo.weight)
        ref.out_proj.bias.copy_(attn.wo.bias)
    x = torch.randn(2, 7, C)
    future = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)  # nn.MultiheadAttention: True = not allowed
    expected, _ = ref(x, x, x, attn_mask=future, need_weights=False)
    torch.testing.assert_close(attn(x, causal(7)), expected, rtol=1e-5, atol=1e-5)


def naive_attention(x, wq, wks, wvs, wo, n_heads):
    """Per-head loop: head h uses key/value projection wks[h], wvs[h] (the same matrices for shared heads)."""
    T = x.shape[1]
    outs = []
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for h in range(n_heads):
        q = x @ wq[h * D : (h + 1) * D].T
        k, v = x @ wks[h].T, x @ wvs[h].T
        s = (q @ k.transpose(-1, -2)) / D**0.5
        outs.append(torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v)
    return torch.cat(outs, -1) @ wo.T


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_gqa_equals_per_head_reference(n_kv):
    # n_kv == H: plain MHA (every head its own k, v); n_kv == 1: MQA (one k, v shared by all heads)
    attn = gqa(n_kv)
    group = H // n_kv
    wk = [attn.wk.weight[(h // group) * D : (h // group + 1) * D] for h in range(H)]
    wv = [attn.wv.weight[(h // group) * D : (h // group + 1) * D] for h in range(H)]
    x = torch.randn(2, 6, C)
    ref = naive_attention(x, attn.wq.weight, wk, wv, attn.wo.weight, H)
    torch.testing.assert_close(attn(x, causal(6)), ref, rtol=1e-5, atol=1e-5)
    assert attn.cache_elements_per_token() == 2 * n_kv * D


def test_causal_output_ignores_future_tokens():
    attn = gqa(2, rope_dim=D)
    rope = RotaryEmbedding(D, 10000.0, 64)
    x = torch.randn(1, 8, C)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, C)
    inputs = AttentionInputs(mask=AttentionMask(causal=True), rope=rope(torch.arange(8)))
    torch.testing.assert_close(attn(x, inputs)[:, :5], attn(y, inputs)[:, :5])


@pytest.mark.parametrize("n_kv", [1, 4])
def test_cached_decoding_equals_full_attention(n_kv):
    attn = gqa(n_kv, rope_dim=D)
    rope = RotaryEmbedding(D, 10000.0, 64)
    x = torch.randn(2, 9, C)
    full = attn(x, AttentionInputs(mask=AttentionMask(causal=True), rope=rope(torch.arange(9))))
    cache, state = attn.new_cache(2, 16), SequenceState.new(2, 16, None)
    outs = [attn(x[:, :4], cached(state, 4, rope), cache)]
    for t in range(4, 9):
        outs.append(attn(x[:, t : t + 1], cached(state, 1, rope), cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.nbytes == 2 * 2 * n_kv * 16 * D * 4


@pytest.mark.parametrize("padded", [False, True])
def test_a_fresh_caches_unpadded_prefill_takes_the_fused_causal_path(padded, monkeypatch):
    """A prompt written into an empty cache without padding sees only its own keys, causally: SDPA gets the first T
    keys and is_causal (not a (T, S) mask over the whole preallocated cache), with the same result; a padded prompt
    and the tokens after it keep their masks."""
    attn = gqa(2, rope_dim=D)
    rope = RotaryEmbedding(D, 10000.0, 64)
    x = torch.randn(2, 6, C)
    full = attn(x, AttentionInputs(mask=AttentionMask(causal=True), rope=rope(torch.arange(6))))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((k.shape[2], attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    cache, state = attn.new_cache(2, 16), SequenceState.new(2, 16, None)
    valid = torch.ones(2, 4, dtype=torch.bool) if padded else None
    step = state.advance(4, valid)
    first = attn(x[:, :4], AttentionInputs(step.mask, rope(step.positions), step.slots), cache)
    second = attn(x[:, 4:], cached(state, 2, rope), cache)
    assert calls == [(16, False, False), (16, False, False)] if padded else [(4, True, True), (16, False, False)]
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-5, atol=1e-5)


def test_cache_overflow_is_a_clear_error():
    state = SequenceState.new(1, 4, None)
    with pytest.raises(InputError, match="the cache holds max_len=4 tokens"):
        state.advance(5)


def test_attention_weights_are_returned_through_extras():
    attn = gqa(2)
    extras = Extras(attention_weights=True)
    attn(torch.randn(1, 5, C), causal(5), extras=extras)
    (weights,) = extras.self_attention
    assert weights.shape == (1, H, 5, 5) and (weights.triu(1) == 0).all()
    assert not hasattr(attn, "last_weights")  # nothing is kept on the module


def test_cross_attention_ignores_padded_memory_and_caches_it():
    cross = cross_attention()
    x, memory = torch.randn(2, 3, C), torch.randn(2, 5, C)
    valid = torch.tensor([[True, True, True, False, False], [True] * 5])
    mask = AttentionMask(allowed=valid[:, None, None, :])
    out = cross(x, memory, mask)
    changed = memory.clone()
    changed[0, 3:] = 100.0
    torch.testing.assert_close(cross(x, changed, mask), out)
    cache = CrossCache()
    first = cross(x, memory, mask, cache)
    assert cache.k is not None and cache.k.shape == (2, H, 5, D)
    torch.testing.assert_close(cross(x, torch.zeros_like(memory), mask, cache), first)  # keys come from the cache


def test_layers_reject_wrong_widths_with_clear_errors():
    from llmkit import MoEConfig
    from llmkit.layers.moe import MoE

    with pytest.raises(
        InputError, match=r"GroupedQueryAttention expects input of shape \(batch, seq_len, 32\), got \(2, 5, 16\)"
    ):
        gqa(2)(torch.randn(2, 5, 16), causal(5))
    with pytest.raises(InputError, match="CrossAttention memory expects input of shape"):
        cross_attention()(torch.randn(1, 2, C), torch.randn(1, 3, 8), None)
    with pytest.raises(InputError, match=r"MoE expects input of shape \(\.\.\., 8\), got \(2, 3, 5\)"):
        MoE(8, MoEConfig(n_experts=2, top_k=1, expert_hidden_dim=4))(torch.randn(2, 3, 5))


def test_sliding_window_sees_only_the_most_recent_keys():
    attn = gqa(2, rope_dim=D, sliding_window=3)
    rope = RotaryEmbedding(D, 10000.0, 64)
    x = torch.randn(2, 8, C)
    out = attn(x, AttentionInputs(AttentionMask(causal=True), rope(torch.arange(8))))
    band = torch.tril(torch.ones(8, 8, dtype=torch.bool)) & ~torch.tril(torch.ones(8, 8, dtype=torch.bool), -3)
    full = gqa(2, rope_dim=D)
    full.load_state_dict(attn.state_dict())
    ref = full(x, AttentionInputs(AttentionMask(allowed=band[None, None]), rope(torch.arange(8))))
    torch.testing.assert_close(out, ref)
    cache, state = attn.new_cache(2, 12), SequenceState.new(2, 12, None)  # cached decoding applies the same window
    steps = [attn(x[:, :4], cached(state, 4, rope), cache)]
    for t in range(4, 8):
        steps.append(attn(x[:, t : t + 1], cached(state, 1, rope), cache))
    torch.testing.assert_close(torch.cat(steps, 1), out, rtol=1e-5, atol=1e-5)


def test_qk_norm_normalises_each_query_and_key_head_before_attending():
    from llmkit.config import NormConfig

    attn = gqa(2, qk_norm=NormConfig(kind="rmsnorm", eps=1e-6))
    assert attn.q_norm is not None and attn.k_norm is not None
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 6, C)

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # over each head's D dims
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q = rms((x @ attn.wq.weight.T).view(2, 6, H, D), attn.q_norm.weight).transpose(1, 2)
    k = rms((x @ attn.wk.weight.T).view(2, 6, 2, D), attn.k_norm.weight).transpose(1, 2).repeat_interleave(2, 1)
    v = (x @ attn.wv.weight.T).view(2, 6, 2, D).transpose(1, 2).repeat_interleave(2, 1)
    allowed = torch.ones(6, 6).tril().bool()
    s = (q @ k.transpose(-1, -2)) / D**0.5
    ref = (torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v).transpose(1, 2).reshape(2, 6, H * D)
    torch.testing.assert_close(attn(x, causal(6)), ref @ attn.wo.weight.T, rtol=1e-5, atol=1e-5)
    # scaling a head's projection leaves the scores unchanged: the norm removes it
    with torch.no_grad():
        attn.wq.weight.mul_(7.0)
    torch.testing.assert_close(attn(x, causal(6)), ref @ attn.wo.weight.T, rtol=1e-4, atol=1e-5)
    assert gqa(2).q_norm is None


def test_qk_norm_is_only_for_decoder_self_attention():
    from llmkit.config import EncoderConfig
    from llmkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"qk_norm=True is only supported with attention\.kind='gqa'"):
        AttentionConfig(kind="mla", qk_norm=True, mla=__import__("llmkit").MLAConfig())
    with pytest.raises(ConfigError, match="qk_norm is only supported in decoder-only models"):
        ModelConfig(
            vocab_size=8, d_model=C, n_layers=1, attention=AttentionConfig(qk_norm=True), encoder=EncoderConfig()
        )


def test_soft_capped_scores_and_a_scale_of_its_own():
    """softcap: scores become cap * tanh(scores / cap) before the softmax; scale replaces D^-0.5. Prefill (the
    explicit path) and one-query decoding (its own path) agree with a per-head reference."""
    from llmkit.layers.softcap import soft_cap

    attn = gqa(2, scale=0.3, softcap=1.5)
    x = torch.randn(2, 6, C)
    q = (x @ attn.wq.weight.T).view(2, 6, H, D).transpose(1, 2)
    k = (x @ attn.wk.weight.T).view(2, 6, 2, D).transpose(1, 2).repeat_interleave(2, 1)
    v = (x @ attn.wv.weight.T).view(2, 6, 2, D).transpose(1, 2).repeat_interleave(2, 1)
    s = soft_cap((q @ k.transpose(-1, -2)) * 0.3, 1.5)
    assert s.abs().max() < 1.5
    allowed = torch.ones(6, 6).tril().bool()
    ref = (torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v).transpose(1, 2).reshape(2, 6, H * D)
    ref = ref @ attn.wo.weight.T
    torch.testing.assert_close(attn(x, causal(6)), ref, rtol=1e-5, atol=1e-5)
    cache, state = attn.new_cache(2, 8), SequenceState.new(2, 8, None)
    rope = RotaryEmbedding(D, 10000.0, 64)
    outs = [attn(x[:, :5], cached(state, 5, rope), cache), attn(x[:, 5:], cached(state, 1, rope), cache)]
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-5, atol=1e-5)


def test_full_every_alternates_windowed_and_global_layers():
    a = AttentionConfig(n_heads=H, sliding_window=4, full_every=2)
    assert [a.window_of(i) for i in range(5)] == [4, None, 4, None, 4]
    assert AttentionConfig(n_heads=H, sliding_window=4).window_of(1) == 4
    cfg = ModelConfig(vocab_size=8, d_model=C, n_layers=4, attention=a)
    model = __import__("llmkit").build_model(cfg)
    assert [b.attn.sliding_window for b in model.blocks] == [4, None, 4, None]
    from llmkit.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a sliding_window"):
        AttentionConfig(full_every=2)


def test_window_layers_take_the_local_rope_tables():
    """position.local_theta (Gemma 3): the sliding-window layers rotate with their own base, the global ones with
    the model's; a local base equal to the global one changes nothing."""
    import dataclasses

    from llmkit import PositionConfig, build_model

    a = AttentionConfig(n_heads=H, head_dim=D, sliding_window=4, full_every=2)
    cfg = ModelConfig(vocab_size=16, d_model=C, n_layers=2, attention=a, position=PositionConfig(theta=1e6))
    torch.manual_seed(0)
    plain = build_model(cfg).eval()
    tokens = torch.randint(0, 16, (1, 10))

    def with_local(theta: float) -> torch.Tensor:
        m = build_model(dataclasses.replace(cfg, position=dataclasses.replace(cfg.position, local_theta=theta)))
        m.load_state_dict(plain.state_dict())
        assert m.rope_local is not None
        with torch.no_grad():
            return m.eval()(tokens)

    with torch.no_grad():
        base = plain(tokens)
    torch.testing.assert_close(with_local(1e6), base)
    assert not torch.allclose(with_local(1e4), base)


@pytest.mark.parametrize("window, softcap", [(None, None), (3, None), (None, 5.0)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_packed_rows_of_different_lengths_attend_as_each_row_alone(window, softcap, heads_first):
    """A ragged mask (one-query rows and longer rows packed into one row of queries) gives every query what
    attending within its own row gives, with the rows' keys laid out either way a cache holds them."""
    torch.manual_seed(0)
    H, K, S, D = 4, 2, 12, 8
    lengths, starts = (1, 1, 1, 5, 1, 3), [6, 2, 9, 0, 4, 7]  # each row's first new slot
    R, N = len(lengths), sum(lengths)
    k, v = torch.randn(R, K, S, D), torch.randn(R, K, S, D)
    if heads_first:  # stored (K, R, S, D), as a paged cache's gather gives them
        k, v = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
    q = torch.randn(1, H, N, D)
    slots = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])[None]  # (1, N)
    filled = torch.arange(S) < torch.tensor([s + n for s, n in zip(starts, lengths, strict=True)])[:, None]
    mask = AttentionMask(filled[:, None, None, :], causal=True, query_slots=slots, ragged=lengths).with_window(window)
    out, _ = attend(q, k, v, mask, scale=D**-0.5, softcap=softcap)
    # the row of 5 from slot 0 is a prompt's first chunk: attending to its first keys by causality alone is the same
    first = replace(mask, ragged_first=tuple(s == 0 for s in starts))
    assert [group.first for _, _, group in first.row_groups()] == [False, True, False, False]
    torch.testing.assert_close(attend(q, k, v, first, scale=D**-0.5, softcap=softcap)[0], out, atol=1e-5, rtol=1e-5)
    at = 0
    for r, n in enumerate(lengths):
        alone = AttentionMask(filled[r : r + 1, None, None, :], causal=True, query_slots=slots[:, at : at + n])
        ref, _ = attend(
            q[:, :, at : at + n], k[r : r + 1], v[r : r + 1], alone.with_window(window), D**-0.5, softcap=softcap
        )
        torch.testing.assert_close(out[:, :, at : at + n], ref, atol=1e-5, rtol=1e-5)
        at += n
