import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llmkit import AttentionConfig, ConfigError, IndexerConfig, MLAConfig, ModelConfig, PositionConfig
from llmkit.layers.attention import (
    AttentionInputs,
    AttentionMask,
    DeepSeekSparseAttention,
    MultiHeadLatentAttention,
    Selection,
    attend,
    attend_selected,
    padding_mask,
)
from llmkit.layers.attention.mla import Latents
from llmkit.layers.rope import RotaryEmbedding, apply_rope
from llmkit.models import SequenceState

MLA = MLAConfig(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def cfg(topk: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=10,
        d_model=48,
        n_layers=1,
        attention=AttentionConfig(
            kind="dsa", n_heads=4, mla=MLA, indexer=IndexerConfig(n_heads=3, head_dim=8, topk=topk)
        ),
        position=PositionConfig(layout="interleaved"),
    )


def make(topk: int, absorb: bool | None = None) -> DeepSeekSparseAttention:
    return DeepSeekSparseAttention(cfg(topk), absorb=absorb).eval()


ROPE = RotaryEmbedding(4, 10000.0, 64)


def inputs(T: int, mask: AttentionMask | None = None) -> AttentionInputs:
    return AttentionInputs(mask or AttentionMask(causal=True), ROPE(torch.arange(T)))


def cached(state: SequenceState, T: int) -> AttentionInputs:
    """The next T slots of a cache, as a model's forward gives them to its layers."""
    step = state.advance(T)
    return AttentionInputs(step.mask, ROPE(step.positions), step.slots)


def test_topk_at_least_length_equals_dense_mla():
    dsa = make(topk=16)
    mla = MultiHeadLatentAttention(48, 4, MLA, rope_layout="interleaved", norm_eps=1e-5).eval()
    mla.load_state_dict({k: v for k, v in dsa.state_dict().items() if not k.startswith("indexer.")})
    x = torch.randn(2, 10, 48)
    mask = padding_mask(torch.tensor([[False] * 2 + [True] * 8, [True] * 10]), causal=True)
    torch.testing.assert_close(dsa(x, inputs(10, mask=mask)), mla(x, inputs(10, mask=mask)))


@pytest.mark.parametrize("absorb", [False, True])
def test_gather_path_selecting_every_allowed_key_equals_dense(absorb):
    # the shortcut above skips the gather when topk >= S; here the gather path itself runs over all causal keys
    dsa = make(topk=16)
    x = torch.randn(2, 9, 48)
    inp = inputs(9)
    q, _ = dsa.project_queries(x)
    q_nope, q_pe = q.split([dsa.dn, dsa.dr], dim=-1)
    q_pe = apply_rope(q_pe, inp.rope, "interleaved")
    c_kv, k_pe = dsa.project_latent(x, inp)
    index = torch.arange(9).expand(2, 9, 9)
    selection = Selection(index, torch.tril(torch.ones(9, 9, dtype=torch.bool)).expand(2, 9, 9))
    attend_path = dsa.attend_absorbed if absorb else dsa.attend_explicit
    latents = Latents(q_nope, q_pe, c_kv, k_pe)
    dense, _ = attend_path(latents, inp, None)
    gathered, _ = attend_path(latents, inp, selection)
    torch.testing.assert_close(gathered, dense, rtol=1e-5, atol=1e-5)


def test_gathered_attention_equals_dense_attention_masked_to_the_selection():
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 5)
    index = torch.stack([torch.randperm(10)[:3] for _ in range(12)]).view(2, 6, 3)
    valid = torch.rand(2, 6, 3) > 0.2
    out, w = attend_selected(q, k, v, index, valid, 0.3)
    allowed = torch.zeros(2, 6, 10, dtype=torch.bool)
    allowed.scatter_(-1, index, valid)
    ref, _ = attend(q, k, v, AttentionMask(allowed=allowed[:, None]), 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert w.shape == (2, 4, 6, 3)


def test_small_topk_gives_weight_only_to_the_selected_keys():
    dsa = make(topk=3)
    x = torch.randn(2, 10, 48)
    result = dsa.attention(x, inputs(10), need_weights=True)
    w, sel, scores = result.weights, result.selection, result.index_scores
    assert w is not None and sel is not None and scores is not None
    nonzero = w > 0
    assert (nonzero.sum(-1) <= 3).all()
    chosen = torch.zeros(2, 10, 10, dtype=torch.bool).scatter(-1, sel.index, sel.valid)
    assert (nonzero <= chosen[:, None]).all()  # weight only where selected
    assert nonzero[:, :, 5:].sum(-1).eq(3).all()  # once 3 keys are visible, exactly 3 get weight
    # the selected keys are the indexer's best causal keys
    causal = torch.tril(torch.ones(10, 10, dtype=torch.bool))
    best = scores.masked_fill(~causal, float("-inf")).sort(dim=-1, descending=True, stable=True).indices[..., :3]
    assert torch.equal(best.sort(-1).values[:, 5:], sel.index.sort(-1).values[:, 5:])


def test_indexer_scores_match_their_formula():
    dsa = make(topk=3)
    idx = dsa.indexer
    x, q_in = torch.randn(1, 5, 48), torch.randn(1, 5, 32)
    inp = inputs(5)
    scores = idx(x, q_in, inp)
    q = idx.wq(q_in).view(1, 5, 3, 8)
    q = torch.cat([dsa_rope(q[..., :4], inp), q[..., 4:]], -1)
    k = F.layer_norm(x @ idx.wk.weight.T, (8,), idx.k_norm.weight, idx.k_norm.bias, eps=1e-6)
    k = torch.cat([dsa_rope(k[:, :, None, :4], inp)[:, :, 0], k[..., 4:]], -1)  # rope on the first 4 dims
    w = (x @ idx.w_heads.weight.T) * 3**-0.5
    for t in range(5):
        for s in range(5):
            ref = sum(w[0, t, j] * torch.relu(q[0, t, j] @ k[0, s]) * 8**-0.5 for j in range(3))
            torch.testing.assert_close(scores[0, t, s], ref, rtol=1e-5, atol=1e-6)


def dsa_rope(x, inp):
    return apply_rope(x, inp.rope, "half")  # the indexer's rope uses the half layout


@pytest.mark.parametrize("absorb", [False, True])
def test_sparse_paths_agree_and_cached_decoding_equals_full(absorb):
    dsa = make(topk=4, absorb=absorb)
    x = torch.randn(2, 11, 48)
    full = dsa(x, inputs(11))
    other = make(topk=4, absorb=not absorb)
    other.load_state_dict(dsa.state_dict())
    torch.testing.assert_close(other(x, inputs(11)), full, rtol=1e-5, atol=1e-5)
    chooser = make(topk=4)
    chooser.load_state_dict(dsa.state_dict())
    cache, state = chooser.new_cache(2, 16), SequenceState.new(2, 16, None)
    steps = [chooser(x[:, :5], cached(state, 5), cache)]
    steps += [chooser(x[:, t : t + 1], cached(state, 1), cache) for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.index_k.shape == (2, 16, 8)
    assert dsa.cache_elements_per_token() == 24 + 4 + 8


def test_dsa_config_requires_an_indexer():
    with pytest.raises(ConfigError, match="indexer=None is required"):
        dataclasses.replace(cfg(4), attention=dataclasses.replace(cfg(4).attention, indexer=None))
