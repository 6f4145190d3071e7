"""Perplexity in sliding windows and the divergence from a reference: every token scored once, the numbers a
direct forward gives, KL 0 against itself and small but positive for an int8 copy, and clear errors."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from helpers import TEXT, byte_tokenizer
from hypothesis import given
from hypothesis import strategies as st

import llmkit
from llmkit.errors import InputError
from llmkit.evaluate.perplexity import check_same_vocabulary, divergence, perplexity, spans, text_tokens
from llmkit.quant import quantize


@pytest.fixture(scope="module")
def tiny():
    tok = byte_tokenizer()
    cfg = llmkit.get_preset("llama2-7b-tiny")
    position = dataclasses.replace(cfg.position, max_seq_len=256)
    cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, position=position)
    torch.manual_seed(0)
    return llmkit.build_model(cfg).eval(), tok


@given(n=st.integers(2, 300), window=st.integers(2, 64), data=st.data())
def test_every_token_after_the_start_is_scored_exactly_once(n, window, data):
    stride = data.draw(st.integers(1, window))
    if n < window:
        with pytest.raises(InputError, match="shorter than one window"):
            spans(n, window, stride)
        return
    scored = []
    for begin, end, first in spans(n, window, stride):
        assert begin < first <= end and end - begin <= window
        assert first == 1 or first - begin >= max(1, window - stride)  # context before each scored token
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_perplexity_is_what_one_forward_gives(tiny):
    model, tok = tiny
    ids = text_tokens(tok, TEXT)
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]])).float().log_softmax(-1)[0]
    nll = -float(logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum())
    result = perplexity(model, tok, TEXT, window=len(ids), stride=len(ids))
    assert result.tokens == len(ids) - 1
    assert result.nll == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(nll / math.log(2) / len(TEXT.encode()), rel=1e-5)
    windowed = perplexity(model, tok, TEXT, window=24, stride=8)  # more context per token cannot be this far off
    assert windowed.tokens == result.tokens
    assert windowed.perplexity == pytest.approx(result.perplexity, rel=0.2)


def test_kl_against_itself_is_zero_and_against_int8_small_and_positive(tiny):
    model, tok = tiny
    same = divergence(model, copy.deepcopy(model), tok, TEXT, window=32, stride=16)
    assert torch.is_grad_enabled()  # the two models' generators, consumed in turn, leave the caller's grad mode
    assert float(same.kl.max()) == 0.0
    assert same.same_top1 == 1.0
    assert same.summary()["perplexity_change"] == 0.0
    int8 = quantize(copy.deepcopy(model), "int8")
    d = divergence(int8, model, tok, TEXT, window=32, stride=16)
    summary = d.summary()
    assert 0 < summary["kl_mean"] < 0.05
    assert summary["kl_median"] <= summary["kl_p90"] <= summary["kl_p99"] <= summary["kl_p99.9"] <= summary["kl_max"]
    assert d.same_top1 > 0.8
    assert d.reference.nll == pytest.approx(perplexity(model, tok, TEXT, window=32, stride=16).nll, rel=1e-5)


def test_a_reference_with_another_tokenizer_is_refused(tiny):
    _, tok = tiny
    from helpers import tiny_tokenizer

    with pytest.raises(InputError, match="same vocabulary"):
        check_same_vocabulary(tok, tiny_tokenizer())
    check_same_vocabulary(tok, byte_tokenizer())  # the same vocabulary, another object: accepted


def test_a_text_shorter_than_one_window_is_refused(tiny):
    model, tok = tiny
    with pytest.raises(InputError, match=r"shorter than one window of 200: give a longer text or a smaller --window"):
        perplexity(model, tok, "To be, or not to be", window=200, stride=100)
