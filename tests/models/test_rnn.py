"""The RNN encoder-decoder with attention: cached decoding equals teacher forcing, padding is ignored, attention
weights are a distribution over the real source tokens, and it learns."""

from __future__ import annotations

import pytest
import torch

from llmkit.errors import ConfigError, InputError
from llmkit.layers.extras import Extras
from llmkit.models import RNNConfig, RNNSeq2Seq, build_any


def tiny(cell="lstm", align="general", **kw) -> RNNSeq2Seq:
    torch.manual_seed(0)
    cfg = RNNConfig(vocab_size=40, d_embed=16, d_hidden=24, n_layers=2, cell=cell, align=align, dropout=0.0, **kw)
    m = build_any(cfg)
    assert isinstance(m, RNNSeq2Seq)
    return m.eval()


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("align", ["dot", "general", "additive"])
def test_step_by_step_decoding_equals_teacher_forcing(cell, align):
    m = tiny(cell, align)
    source = torch.randint(3, 40, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 3:] = False
    target = torch.randint(3, 40, (3, 6))
    with torch.no_grad():
        full = m(source, target, source_mask=mask)
        memory = m.encode(source, mask)
        cache = m.new_cache(3, 8)
        steps = [m.decode(target[:, t : t + 1], memory, source_mask=mask, cache=cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 6 and cache.nbytes > 0


def test_source_padding_changes_nothing_for_real_tokens():
    m = tiny()
    source = torch.randint(3, 40, (1, 5))
    target = torch.randint(3, 40, (1, 4))
    padded = torch.cat([source, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    with torch.no_grad():
        alone = m(source, target)
        with_pad = m(padded, target, source_mask=mask)
    torch.testing.assert_close(with_pad, alone, rtol=1e-5, atol=1e-5)


def test_attention_is_a_distribution_over_real_source_tokens():
    m = tiny(align="additive")
    source = torch.randint(3, 40, (2, 6))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    extras = Extras(attention_weights=True)
    with torch.no_grad():
        m(source, torch.randint(3, 40, (2, 5)), source_mask=mask, extras=extras)
    (w,) = extras.cross_attention
    assert w.shape == (2, 5, 6)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 5))
    assert float(w[1, :, 4:].abs().max()) == 0.0


def test_cache_reorder_follows_beams():
    m = tiny()
    source = torch.randint(3, 40, (2, 5))
    with torch.no_grad():
        memory = m.encode(source)
        cache = m.new_cache(2, 4)
        m.decode(torch.ones(2, 1, dtype=torch.long), memory, cache=cache)
        cache.reorder(torch.tensor([1, 1]))
        after = m.decode(torch.full((2, 1), 5), memory[[1, 1]], cache=cache)
        ref_cache = m.new_cache(1, 4)
        m.decode(torch.ones(1, 1, dtype=torch.long), memory[1:], cache=ref_cache)
        ref = m.decode(torch.full((1, 1), 5), memory[1:], cache=ref_cache)
    torch.testing.assert_close(after[0], ref[0])
    torch.testing.assert_close(after[1], ref[0])


def test_it_learns_to_reverse_a_sequence():
    torch.manual_seed(0)
    m = build_any(RNNConfig(vocab_size=12, d_embed=32, d_hidden=64, n_layers=1, dropout=0.0))
    assert isinstance(m, RNNSeq2Seq)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    first = last = 0.0
    for step in range(150):
        src = torch.randint(3, 12, (32, 6))
        loss = m.loss(src, src.flip(1), start_id=1).total
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    assert last < 0.25 * first


def test_config_and_input_errors():
    with pytest.raises(ConfigError, match="d_hidden=25 must be even"):
        RNNConfig(d_hidden=25)
    with pytest.raises(ConfigError, match="cell='rnn' has the wrong type"):
        RNNConfig(cell="rnn")  # type: ignore[arg-type]
    m = tiny()
    with pytest.raises(InputError, match="outside the vocabulary"):
        m(torch.tensor([[3, 99]]), torch.tensor([[1]]))
    with pytest.raises(InputError, match="memory must be"):
        m.decode(torch.tensor([[1]]), torch.zeros(1, 3, 7))
    with pytest.raises(InputError, match="no real tokens"):
        m.encode(torch.tensor([[3, 4]]), torch.tensor([[False, False]]))
