"""One decoding step: append tokens to a cache and get their logits, optionally through torch.compile.

`decode_step(model, tokens, cache)` computes what `model(tokens, cache=cache)` does, without the input checks that
the public forward makes (the generators check their inputs once) and returns the hidden states too (multi-token
prediction drafts from them). The cache's SequenceState gives the new tokens their slots, positions and mask; the
step itself reads nothing back from the device, and every shape in it is fixed by the cache, so it compiles once.

With `compiled=True` the step runs through `torch.compile` with inductor's weight freezing: the weights become
constants, so the matmuls can use prepacked kernels and elementwise work is fused (BENCHMARKS.md has the figures).
The compiled step is built once per model (the first call takes tens of seconds) and assumes the weights no longer
change. MoE layers compile into the step: routing, sorting by expert and the experts' products trace into one graph
(in fp32 each assignment's expert weights are gathered, within GATHER_LIMIT; bf16 takes F.grouped_mm), so a new
routing never recompiles. Sparse attention (DSA) compiles too: the indexer's scores, the stable sort that picks each
query's keys and the gather of the selected latents trace into the same graph.

Without compilation, steps of a few tokens per row on an AVX2 CPU run all the blocks in one C++ call where the
model's parts allow it (`native`, see native.py; dense and mixture-of-experts feed-forwards): the same arithmetic
without per-operator dispatch, and for a tiny-width model several times faster than the compiled step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from llmkit.generate.native import NativeDecoder
from llmkit.layers.attention import AttentionMask, KVCache, LatentCache
from llmkit.models import Cache, DecoderLM, Step

_COMPILED: weakref.WeakKeyDictionary[DecoderLM, Callable[..., tuple[Tensor, Tensor]]] = weakref.WeakKeyDictionary()


def _core(
    model: DecoderLM,
    tokens: Tensor,
    positions: Tensor,
    allowed: Tensor,
    slots: Tensor,
    layers: list[Any],
    last: bool = False,
) -> tuple[Tensor, Tensor]:
    mask = AttentionMask(allowed=allowed, causal=True, query_slots=slots)
    h = model.run(tokens, Step(positions, mask, slots), layers)
    return model.logits(model.norm(h[:, -1:] if last else h)), h


def compiled_core(model: DecoderLM) -> Callable[..., tuple[Tensor, Tensor]]:
    """The step compiled for `model`. Freezing (and, on CPU, the C++ wrapper) must be on in inductor's global config
    when (re)compilation happens
    (passing it through torch.compile's options does not give the prepacked kernels), and dynamic shapes avoid a
    recompilation per batch size or cache length."""
    if model not in _COMPILED:
        from torch._inductor import config as inductor_config

        core = torch.compile(_core, dynamic=True)
        # on a CPU the graph's wrapper (allocations, kernel calls) is generated as C++ instead of Python: a tiny
        # model's step is mostly that wrapper, and it goes from ~0.8 to ~0.6 ms (BENCHMARKS.md, MoE). Not on CUDA,
        # whose Python wrapper is the tested path there.
        cpu = next(model.parameters()).device.type == "cpu"
        settings = {"freezing": True, "cpp_wrapper": cpu}

        def frozen(*args: Any) -> tuple[Tensor, Tensor]:
            with inductor_config.patch(settings):
                return core(*args)

        _COMPILED[model] = frozen
    return _COMPILED[model]


@torch.no_grad()
def decode_step(
    model: DecoderLM,
    tokens: Tensor,
    cache: Cache,
    valid: Tensor | None = None,
    compiled: bool = False,
    native: NativeDecoder | None = None,
    last: bool = False,
) -> tuple[Tensor, Tensor]:
    """Append tokens (B, T) (valid (B, T): False at padding) to the cache; returns logits (B, T, V) (with `last`,
    only the last position's (B, 1, V): a prompt's prefill needs no more) and the last block's hidden states
    (B, T, C), before the final norm. `native` (NativeDecoder.of(model)) runs the blocks of the steps it applies
    to in C++."""
    step = cache.state.advance(tokens.shape[1], valid)
    if native is not None and native.applies(tokens, step, cache.layers):
        h = native.run(tokens, step, cache.layers)
        return native.logits(model.norm(h[:, -1:] if last else h)), h
    assert step.mask.allowed is not None and step.slots is not None
    if compiled:
        return compiled_core(model)(model, tokens, step.positions, step.mask.allowed, step.slots, cache.layers, last)
    layers, allowed = _filled(cache.layers, step.mask.allowed, cache.state.length)
    return _core(model, tokens, step.positions, allowed, step.slots, layers, last)


def _filled(layers: list[Any], allowed: Tensor, length: int) -> tuple[list[Any], Tensor]:
    """The caches' first `length` slots (every slot filled so far) and the mask (B, 1, 1, S) over them, for an eager
    step: its attention then scores the tokens there are instead of every preallocated slot (a 48-token prefill into
    a cache made for 1,000 more took 1.5 ms a layer in SDPA, ~0.2 with this). Grouped-query and latent (MLA, DSA)
    caches. The compiled step keeps the whole buffers: fixed shapes, one compilation."""
    if length >= allowed.shape[-1] or not all(type(c) in (KVCache, LatentCache) for c in layers):
        return layers, allowed
    return [c.first(length) for c in layers], allowed[..., :length]
