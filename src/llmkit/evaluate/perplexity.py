"""Perplexity over a text with a sliding window, and how far a model's next-token distributions are from a
reference's on the same tokens (what a quantization or a merge cost).

    tokens = [start] + tokenizer.encode(text)
    window 1: tokens[0 : W]           scores tokens 1 .. W-1
    window 2: tokens[S : S + W]       scores the tokens after window 1's, each with at least W - S tokens before it
                                      (at least one: with S = W, a window starts at the last token of the one
                                      before)
    ...                               every token after the start token is scored exactly once

Per token: -log p (nats); perplexity = exp(mean), bits per byte = sum / ln 2 / the text's UTF-8 bytes (comparable
across tokenizers). Against a reference with the same vocabulary, per token KL(reference || model) =
sum_v p_ref(v) (log p_ref(v) - log p_model(v)), and whether the two most likely tokens agree; reported as
llama.cpp's `llama-perplexity --kl-divergence` reports them (mean, median, high percentiles, maximum, top-1
agreement) with the change in perplexity. With kv_dtype "int8" or "fp8" the model's keys and values are kept as the
serving engine's --kv-dtype keeps them (QuantizedKVCache), so that the divergence from the same model with its own
cache is what that cache costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.step import DecodeStep, choose_step
from llmkit.layers.attention.cache import KV_CODES, KVCache, QuantizedKVCache
from llmkit.models import DecoderLM
from llmkit.models.cache import Cache
from llmkit.tokenizer import Tokenizer

HEAD_ROWS = 512  # positions whose logits (V wide, fp32) exist at once, per model


def spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first): window tokens[begin:end] scores tokens[first:end], for n tokens (the first never scored)."""
    if window < 2:
        raise InputError(f"the window {window} must hold at least 2 tokens (one to predict from, one predicted)")
    if not 0 < stride <= window:
        raise InputError(f"the stride {stride} must be between 1 and the window ({window})")
    if n < window:
        raise InputError(
            f"the text is {n - 1} tokens, shorter than one window of {window}: give a longer text or a smaller --window"
        )
    out, begin, done = [], 0, 1
    while done < n:
        end = min(begin + window, n)
        out.append((begin, end, done))
        done, begin = end, min(begin + stride, end - 1)  # at least one token before the next one scored
    return out


def new_cache(model: DecoderLM, length: int, kv_dtype: str | None = None) -> Cache:
    """A cache for one sequence of `length` tokens, its keys and values in the model's dtype or, with kv_dtype
    "int8" or "fp8", as those codes and scales (grouped-query attention only)."""
    cache = model.new_cache(1, length)
    if kv_dtype is None:
        return cache
    if kv_dtype not in KV_CODES:
        raise InputError(f"kv_dtype must be one of {', '.join(KV_CODES)} or None (the model's dtype), not {kv_dtype!r}")
    if not all(type(c) is KVCache for c in cache.layers):
        raise InputError(f"an {kv_dtype} KV cache is for grouped-query attention; this model's layers cache otherwise")
    codes = KV_CODES[kv_dtype][0]
    cache.layers = [QuantizedKVCache.like(c, codes) for c in cast(list[KVCache], cache.layers)]
    return cache


def scored_logprobs(
    model: DecoderLM,
    tokens: list[int],
    window: int,
    stride: int,
    *,
    step: DecodeStep | None = None,
    kv_dtype: str | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """(log-softmax (M, V) fp32, targets (M,)) for every scored token, HEAD_ROWS at a time, window after window
    (the keys and values cached as `new_cache` keeps them). Gradients are off while it computes, and never across a
    `yield`: two of these consumed in turn (`divergence`) would otherwise restore each other's grad mode in the
    wrong order and leave it off for the caller."""
    run = step if step is not None else choose_step(model)
    device = next(model.parameters()).device
    for begin, end, first in spans(len(tokens), window, stride):
        ids = torch.tensor([tokens[begin:end]], device=device)
        with torch.no_grad():
            _, hidden = run(ids, new_cache(model, end - begin, kv_dtype), None, last=True, given=True)
        states = hidden[0, first - 1 - begin : end - 1 - begin]
        targets = ids[0, first - begin :]
        for a in range(0, states.shape[0], HEAD_ROWS):
            with torch.no_grad():
                logp = model.logits(model.norm(states[a : a + HEAD_ROWS])).float().log_softmax(-1)
            yield logp, targets[a : a + HEAD_ROWS]


@dataclass(frozen=True)
class Perplexity:
    """tokens: how many were scored; nll: their summed negative log-likelihood (nats); bytes: the text's UTF-8 size."""

    tokens: int
    nll: float
    bytes: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes


@dataclass(frozen=True)
class Divergence:
    """The model against a reference on the same tokens: KL(reference || model) per token (nats), top-1 agreement."""

    model: Perplexity
    reference: Perplexity
    kl: Tensor  # (tokens,)
    same_top1: float

    def summary(self) -> dict[str, float]:
        q = np.percentile(self.kl.double().numpy(), [50, 90, 99, 99.9]).tolist()  # torch.quantile stops at 16M
        return {
            "kl_mean": float(self.kl.double().mean()),
            "kl_median": q[0],
            "kl_p90": q[1],
            "kl_p99": q[2],
            "kl_p99.9": q[3],
            "kl_max": float(self.kl.max()),
            "same_top1": self.same_top1,
            "perplexity": self.model.perplexity,
            "reference_perplexity": self.reference.perplexity,
            "perplexity_change": self.model.perplexity - self.reference.perplexity,
        }


def text_tokens(tok: Tokenizer, text: str) -> list[int]:
    """The text's tokens after a start token (the beginning-of-text token, else the end-of-text one), which gives
    the first token something to be predicted from."""
    start = tok.bos_id if tok.bos_id is not None else tok.eos_id
    if start is None:
        raise InputError("the tokenizer has no beginning- or end-of-text token to start the text with")
    return [start, *tok.encode(text, add_bos=False)]


def perplexity(
    model: DecoderLM,
    tok: Tokenizer,
    text: str,
    *,
    window: int,
    stride: int,
    step: DecodeStep | None = None,
    progress: Callable[[int], None] | None = None,
    kv_dtype: str | None = None,
) -> Perplexity:
    """The model's perplexity and bits per byte on `text` (sliding windows; see the module's doc)."""
    tokens = text_tokens(tok, text)
    nll = 0.0
    for logp, targets in scored_logprobs(model, tokens, window, stride, step=step, kv_dtype=kv_dtype):
        nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        if progress is not None:
            progress(len(targets))
    return Perplexity(len(tokens) - 1, nll, len(text.encode("utf-8")))


def check_same_vocabulary(tok: Tokenizer, reference: Tokenizer) -> None:
    """An InputError unless the two tokenizers map the same texts to the same ids (KL compares distributions over
    the same tokens)."""
    mine, theirs = tok.backend.get_vocab(), reference.backend.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise InputError(
            f"the reference's tokenizer is not the model's ({len(theirs):,} tokens against {len(mine):,}; e.g. "
            f"{', '.join(f'{t!r} -> {i}' for t, i in differ)}): KL divergence compares next-token distributions over "
            "the same vocabulary, so the reference must share the model's tokenizer"
        )


def divergence(
    model: DecoderLM,
    reference: DecoderLM,
    tok: Tokenizer,
    text: str,
    *,
    window: int,
    stride: int,
    step: DecodeStep | None = None,
    reference_step: DecodeStep | None = None,
    progress: Callable[[int], None] | None = None,
    kv_dtype: str | None = None,
) -> Divergence:
    """The model (its keys and values cached as `kv_dtype` says) against the reference (in its own dtype; it may be
    the model itself) on the same windows of `text`, position by position."""
    tokens = text_tokens(tok, text)
    nll = ref_nll = 0.0
    kls: list[Tensor] = []
    agree = 0
    mine = scored_logprobs(model, tokens, window, stride, step=step, kv_dtype=kv_dtype)
    theirs = scored_logprobs(reference, tokens, window, stride, step=reference_step)
    for (logp, targets), (ref, _) in zip(mine, theirs, strict=True):
        vocab = min(logp.shape[-1], ref.shape[-1])  # a head padded past the tokenizer's ids adds no probability
        logp, ref = logp[:, :vocab], ref[:, :vocab]
        nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        ref_nll -= float(ref.gather(1, targets.unsqueeze(1)).sum())
        terms = torch.where(ref.isneginf(), 0.0, ref.exp() * (ref - logp))  # a token the reference rules out adds 0
        kls.append(terms.sum(-1).clamp(min=0).cpu())
        agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
        if progress is not None:
            progress(len(targets))
    n, size = len(tokens) - 1, len(text.encode("utf-8"))
    return Divergence(Perplexity(n, nll, size), Perplexity(n, ref_nll, size), torch.cat(kls), agree / n)
