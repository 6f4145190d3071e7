"""One decoding step: append tokens to a cache and get their logits, by one of three backends chosen once.

    step = choose_step(model)               the C++ step where the model allows it, else eager PyTorch (backend.py)
    step = CompiledStep(model)              torch.compile's step (a one-time compilation, then faster steps)
    logits, hidden = step(tokens, cache)    tokens (B, T) appended to the cache

A step computes what `model(tokens, cache=cache)` does, without the input checks that the public forward makes (the
generators check their inputs once), and returns the hidden states too (multi-token prediction drafts from them). The
cache's SequenceState gives the new tokens their slots, positions and mask; the step itself reads nothing back from
the device, and every shape in it is fixed by the cache, so it compiles once. The backend is chosen when a session,
drafter or command is set up and passed in, as gpt-fast compiles its step from outside the model:

- `DecodeStep`: PyTorch's modules, eager; the reference the other two equal.
- `CompiledStep`: the step through `torch.compile` with inductor's weight freezing: the weights become constants, so
  the matmuls can use prepacked kernels and elementwise work is fused (BENCHMARKS.md has the figures). It compiles
  at its first call (tens of seconds) and assumes the weights no longer change; keep the object to reuse the
  compilation. MoE layers compile into the step: routing, sorting by expert and the experts' products trace into one
  graph (in fp32 each assignment's expert weights are gathered, within GATHER_LIMIT; bf16 takes F.grouped_mm), so a
  new routing never recompiles. Sparse attention (DSA) compiles too: the indexer's scores, the stable sort that picks
  each query's keys and the gather of the selected latents trace into the same graph.
- `NativeStep`: steps of a few tokens per row on an AVX2 CPU run all the blocks in one C++ call
  (llmkit.quant.native_step; dense and mixture-of-experts feed-forwards): the same arithmetic without per-operator
  dispatch, and for a tiny-width model several times faster than the compiled step. Other steps (a long prefill)
  run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from llmkit.errors import GenerationError
from llmkit.generate.backend import Backend, resolve
from llmkit.layers.attention import AttentionMask, KVCache, LatentCache
from llmkit.models import Cache, DecoderLM, Step
from llmkit.quant.native_step import GIVEN_TOKENS, MAX_TOKENS, NativeDecoder


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


class DecodeStep:
    """The eager step of `model`: step(tokens (B, T), cache, valid (B, T) False at padding, last, given) -> logits
    (B, T, V) (with `last`, only the last position's (B, 1, V): a prompt's prefill needs no more) and the last
    block's hidden states (B, T, C), before the final norm. `given`: the tokens are given (a prompt, a text to
    score), not generated; the C++ step multiplies them otherwise (NativeStep)."""

    native: NativeDecoder | None = None  # the C++ blocks this step runs (NativeStep), for drafters that reuse them

    def __init__(self, model: DecoderLM) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(
        self, tokens: Tensor, cache: Cache, valid: Tensor | None = None, last: bool = False, given: bool = False
    ) -> tuple[Tensor, Tensor]:
        step = cache.state.advance(tokens.shape[1], valid)
        return self.run(tokens, step, cache, last, given)

    def run(self, tokens: Tensor, step: Step, cache: Cache, last: bool, given: bool = False) -> tuple[Tensor, Tensor]:
        """The step's tokens at `step` (their slots, positions and mask, already advanced in the cache)."""
        assert step.mask.allowed is not None and step.slots is not None
        layers, allowed = _filled(cache.layers, step.mask.allowed, cache.state.length)
        return _core(self.model, tokens, step.positions, allowed, step.slots, layers, last)


class CompiledStep(DecodeStep):
    """The step through torch.compile, compiled at the first call. Freezing (and, on CPU, the C++ wrapper) must be
    on in inductor's global config when (re)compilation happens (passing it through torch.compile's options does not
    give the prepacked kernels), and dynamic shapes avoid a recompilation per batch size or cache length."""

    def __init__(self, model: DecoderLM) -> None:
        super().__init__(model)
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

        self.core: Callable[..., tuple[Tensor, Tensor]] = frozen

    def run(self, tokens: Tensor, step: Step, cache: Cache, last: bool, given: bool = False) -> tuple[Tensor, Tensor]:
        assert step.mask.allowed is not None and step.slots is not None
        return self.core(self.model, tokens, step.positions, step.mask.allowed, step.slots, cache.layers, last)


class NativeStep(DecodeStep):
    """The blocks of the steps the C++ step takes (`native.applies`: a few tokens per row into fp32 caches) in one
    C++ call, and the output head of a few rows too; other steps eagerly.

    `invariant` (batch-invariant decoding): every token goes through the C++ step, a prompt in pieces of
    GIVEN_TOKENS (other steps in pieces of MAX_TOKENS), and the head through row-invariant products, so a token's
    logits are the same bits whether it is decoded alone, in a batch, among a speculative round's drafts, and
    whatever the prompt's chunking: greedy output then equals the serving engine's in its batch-invariant mode, and
    speculation's equals plain decoding's. Given tokens (`given`: a prompt, a text scored) are multiplied in integer
    panels where the weights are GGUF blocks and the CPU has AVX512-VNNI, generated ones in the decoding kernels
    (NativeDecoder.run_tokens), as the engine does. A prompt's prefill costs more that way than the eager step's
    (BENCHMARKS.md, batch invariance). A step the C++ blocks do not take runs eagerly, or, when the mode is
    `required`, raises.
    """

    def __init__(
        self, model: DecoderLM, native: NativeDecoder, invariant: bool = False, required: bool = False
    ) -> None:
        super().__init__(model)
        self.native, self.invariant, self.required = native, invariant, required

    @torch.no_grad()
    def __call__(
        self, tokens: Tensor, cache: Cache, valid: Tensor | None = None, last: bool = False, given: bool = False
    ) -> tuple[Tensor, Tensor]:
        count, piece = tokens.shape[1], GIVEN_TOKENS if given else MAX_TOKENS
        if not self.invariant or count <= piece:
            return super().__call__(tokens, cache, valid, last, given)
        parts = [
            super(NativeStep, self).__call__(
                tokens[:, i : i + piece], cache, None if valid is None else valid[:, i : i + piece], last, given
            )
            for i in range(0, count, piece)
        ]
        # every piece's hidden states (a scored text reads them all), the logits of the last position with `last`
        logits = parts[-1][0] if last else torch.cat([p[0] for p in parts], dim=1)
        return logits, torch.cat([p[1] for p in parts], dim=1)

    def run(self, tokens: Tensor, step: Step, cache: Cache, last: bool, given: bool = False) -> tuple[Tensor, Tensor]:
        native = self.native
        assert native is not None
        most = GIVEN_TOKENS if self.invariant and given else MAX_TOKENS
        if not native.applies(tokens, step, cache.layers, most):
            if self.invariant and self.required:
                raise GenerationError(
                    "batch-invariant decoding runs every step in C++, and this step does not fit it "
                    f"({tokens.shape[1]} tokens per row into {type(cache.layers[0]).__name__} caches)"
                )
            return super().run(tokens, step, cache, last)
        h = native.run(tokens, step, cache.layers, given)
        return native.logits(self.model.norm(h[:, -1:] if last else h), self.invariant), h


def choose_step(model: DecoderLM, compiled: bool = False, invariant: bool | None = None) -> DecodeStep:
    """The step to decode `model` with: the backend `resolve` decides (compiled when asked, else the C++ step where
    the model allows it, batch-invariant unless `invariant` is False, else eager), as a DecodeStep."""
    return step_for(model, resolve(model, compiled, invariant))


def step_for(model: DecoderLM, backend: Backend) -> DecodeStep:
    """The DecodeStep that runs `backend` for `model`."""
    if backend.kind == "compiled":
        return CompiledStep(model)
    if backend.native is None:
        return DecodeStep(model)
    return NativeStep(model, backend.native, backend.invariant, backend.required)


def _filled(layers: list[Any], allowed: Tensor, length: int) -> tuple[list[Any], Tensor]:
    """The caches' first `length` slots (every slot filled so far) and the mask (B, 1, 1, S) over them, for an eager
    step: its attention then scores the tokens there are instead of every preallocated slot (a 48-token prefill into
    a cache made for 1,000 more took 1.5 ms a layer in SDPA, ~0.2 with this). Grouped-query and latent (MLA, DSA)
    caches. The compiled step keeps the whole buffers: fixed shapes, one compilation."""
    if length >= allowed.shape[-1] or not all(type(c) in (KVCache, LatentCache) for c in layers):
        return layers, allowed
    return [c.first(length) for c in layers], allowed[..., :length]
