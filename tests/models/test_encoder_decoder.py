import dataclasses

import pytest
import torch
from torch import nn

from llmkit import EncoderConfig, InputError, build_model, get_preset
from llmkit.models import EncoderDecoder, shift_right
from llmkit.models.seq2seq import DecoderCall


def paper_tiny() -> EncoderDecoder:
    m = build_model(dataclasses.replace(get_preset("transformer-base-tiny"), dropout=0.0))
    assert isinstance(m, EncoderDecoder)
    return m.eval()


def copy_mha(ours, ref: nn.MultiheadAttention) -> None:
    ref.in_proj_weight.copy_(torch.cat([ours.wq.weight, ours.wk.weight, ours.wv.weight]))
    ref.in_proj_bias.copy_(torch.cat([ours.wq.bias, ours.wk.bias, ours.wv.bias]))
    ref.out_proj.weight.copy_(ours.wo.weight)
    ref.out_proj.bias.copy_(ours.wo.bias)


def copy_ffn(ours, layer) -> None:
    layer.linear1.weight.copy_(ours.w1.weight)
    layer.linear1.bias.copy_(ours.w1.bias)
    layer.linear2.weight.copy_(ours.w2.weight)
    layer.linear2.bias.copy_(ours.w2.bias)


@torch.no_grad()
def reference_for(m: EncoderDecoder) -> nn.Transformer:
    cfg = m.cfg
    assert cfg.encoder is not None and cfg.ffn.hidden_dim is not None
    ref = nn.Transformer(
        d_model=cfg.d_model,
        nhead=cfg.attention.n_heads,
        num_encoder_layers=cfg.encoder.n_layers,
        num_decoder_layers=cfg.n_layers,
        dim_feedforward=cfg.ffn.hidden_dim,
        dropout=0.0,
        activation="relu",
        batch_first=True,
        norm_first=False,
        layer_norm_eps=cfg.norm.eps,
    ).eval()
    # the paper's post-norm stacks have no final norm; torch.nn.Transformer always adds one
    ref.encoder.norm, ref.decoder.norm = nn.Identity(), nn.Identity()
    for ours, layer in zip(m.encoder, ref.encoder.layers, strict=True):
        copy_mha(ours.attn, layer.self_attn)
        copy_ffn(ours.ffn, layer)
        layer.norm1.load_state_dict(ours.attn_residual.norm.state_dict())
        layer.norm2.load_state_dict(ours.ffn_residual.norm.state_dict())
    for ours, layer in zip(m.decoder, ref.decoder.layers, strict=True):
        copy_mha(ours.attn, layer.self_attn)
        copy_mha(ours.cross, layer.multihead_attn)
        copy_ffn(ours.ffn, layer)
        layer.norm1.load_state_dict(ours.attn_residual.norm.state_dict())
        layer.norm2.load_state_dict(ours.cross_residual.norm.state_dict())
        layer.norm3.load_state_dict(ours.ffn_residual.norm.state_dict())
    return ref


def test_paper_configuration_matches_torch_nn_transformer():
    m = paper_tiny()
    ref = reference_for(m)
    src, tgt = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 7))
    src_valid = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    tgt_valid = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    # identical inputs: llmkit's scaled embedding + sinusoids for both sides
    src_x = m.inputs(m.embed, src, torch.arange(9).unsqueeze(0))
    tgt_x = m.inputs(m.embed, tgt, torch.arange(7).unsqueeze(0))
    expected = ref(
        src_x,
        tgt_x,
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.bool),
        src_key_padding_mask=~src_valid,
        tgt_key_padding_mask=~tgt_valid,
        memory_key_padding_mask=~src_valid,
        tgt_is_causal=True,
    )
    memory = m.encode(src, src_valid)
    ours = m.decoder_states(DecoderCall(tgt, memory, src_valid, tgt_valid))  # the decoder's output, before the head
    real = tgt_valid
    torch.testing.assert_close(ours[real], expected[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        memory[src_valid],
        ref.encoder(src_x, src_key_padding_mask=~src_valid)[src_valid],
        rtol=1e-5,
        atol=1e-5,
    )


def test_paper_details():
    m = paper_tiny()
    cfg = m.cfg
    assert m.head is None and m.src_embed is None  # one matrix for source, target and output projection
    tokens = torch.tensor([[5]])
    x = m.inputs(m.embed, tokens, torch.zeros(1, 1, dtype=torch.long))
    pe0 = torch.tensor([0.0, 1.0] * (cfg.d_model // 2))  # sin(0), cos(0), ...
    torch.testing.assert_close(x[0, 0], m.embed.weight[5] * cfg.d_model**0.5 + pe0)


def test_padding_does_not_change_outputs_at_real_positions():
    m = paper_tiny()
    src, tgt = torch.randint(1, 256, (1, 6)), torch.randint(1, 256, (1, 5))
    src_pad = torch.cat([src, torch.zeros(1, 4, dtype=torch.long)], 1)
    src_valid = torch.tensor([[True] * 6 + [False] * 4])
    tgt_pad = torch.cat([tgt, torch.zeros(1, 3, dtype=torch.long)], 1)
    tgt_valid = torch.tensor([[True] * 5 + [False] * 3])
    plain = m(src, tgt)
    padded = m(src_pad, tgt_pad, source_mask=src_valid, target_mask=tgt_valid)
    torch.testing.assert_close(padded[:, :5], plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.encode(src_pad, src_valid)[:, :6], m.encode(src), rtol=1e-5, atol=1e-5)


def test_cached_decoding_equals_full_decoding():
    m = paper_tiny()
    src, tgt = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 6))
    src_valid = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    memory = m.encode(src, src_valid)
    full = m.decode(tgt, memory, source_mask=src_valid)
    cache = m.new_cache(2, 10)
    steps = [m.decode(tgt[:, :2], memory, source_mask=src_valid, cache=cache)]
    steps += [m.decode(tgt[:, t : t + 1], memory, source_mask=src_valid, cache=cache) for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.cross[0].k is not None  # memory keys/values computed once and kept


def test_loss_uses_teacher_forcing():
    m = paper_tiny()
    src, tgt = torch.randint(0, 256, (2, 8)), torch.randint(2, 256, (2, 6))
    out = m.loss(src, tgt, start_id=1, label_smoothing=0.1)
    logits = m(src, shift_right(tgt, 1))
    ref = nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), label_smoothing=0.1)
    torch.testing.assert_close(out.total, ref)


def test_padded_targets_give_the_unpadded_loss():
    m = paper_tiny()
    src, tgt = torch.randint(2, 256, (1, 6)), torch.randint(2, 256, (1, 5))
    plain = m.loss(src, tgt, start_id=1)
    right = m.loss(
        src,
        torch.cat([tgt, torch.zeros(1, 2, dtype=torch.long)], 1),
        start_id=1,
        target_mask=torch.tensor([[True] * 5 + [False] * 2]),
    )
    left = m.loss(
        src,
        torch.cat([torch.zeros(1, 2, dtype=torch.long), tgt], 1),
        start_id=1,
        target_mask=torch.tensor([[False] * 2 + [True] * 5]),
    )
    torch.testing.assert_close(right.ce, plain.ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(left.ce, plain.ce, rtol=1e-5, atol=1e-5)


def test_cache_batch_mismatch_is_a_clear_error():
    m = paper_tiny()
    memory = m.encode(torch.randint(0, 256, (2, 4)))
    with pytest.raises(InputError, match="the cache was made for batch 1, target has batch 2"):
        m.decode(torch.randint(0, 256, (2, 1)), memory, cache=m.new_cache(1, 4))


def test_separate_source_vocabulary():
    cfg = dataclasses.replace(get_preset("transformer-base-tiny"), encoder=EncoderConfig(n_layers=1, vocab_size=50))
    m = build_model(cfg)
    assert isinstance(m, EncoderDecoder) and m.src_embed is not None
    m(torch.randint(0, 50, (1, 4)), torch.randint(0, 256, (1, 3)))
    with pytest.raises(InputError, match="source contains id 60, outside the vocabulary"):
        m(torch.tensor([[60]]), torch.tensor([[1]]))


def test_bad_memory_is_a_clear_error():
    m = paper_tiny()
    with pytest.raises(InputError, match="memory must be"):
        m.decode(torch.tensor([[1, 2]]), torch.randn(1, 3, 7))
