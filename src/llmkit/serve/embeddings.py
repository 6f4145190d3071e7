"""Embeddings for /v1/embeddings: any decoder llmkit loads, pooled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from llmkit.models.decoder import DecoderLM
from llmkit.serve.request import Refused


def check_input(model: DecoderLM, prompt: list[int]) -> None:
    """Refused unless `prompt` is token ids the model can embed."""
    if not prompt:
        raise Refused("the input is empty", "input")
    if len(prompt) > model.max_seq_len:
        raise Refused(f"the input ({len(prompt)} tokens) exceeds the model's context of {model.max_seq_len}", "input")
    V = model.cfg.vocab_size
    if any(not isinstance(t, int) or not 0 <= t < V for t in prompt):
        raise Refused(f"token ids must be integers in [0, {V})", "input")


@torch.inference_mode()
def pool_states(model: DecoderLM, prompt: list[int]) -> Tensor:
    """A checked prompt's embedding (C,) fp32: the mean of the model's final hidden states over its tokens (after the
    final norm), scaled to unit length, in one forward of the prompt alone. Mean pooling: a causal model's states
    each see a prefix, and their mean weighs the whole text where the last state alone leans on its end; models
    trained for embeddings usually pool one way, and this one works for any decoder llmkit loads."""
    tokens = torch.tensor([prompt], device=model.device)
    h = model.norm(model.run(tokens, model.step_for(tokens, None, None, None)))  # (1, T, C)
    return torch.nn.functional.normalize(h[0].float().mean(0), dim=0)


class Embedding:
    """One input's pooled embedding (pool_states's), computed a chunk at a time through a cache of its own. The
    engine loop takes a chunk of at most its step's token budget between two engine steps, as it takes a prompt's
    chunks, so a long input adds a step's worth of work between other requests' tokens instead of one forward
    that holds every stream up (an 8,192-token input stalled them 39 s on SmolLM2). The chunks' attention reads
    the keys cached before them: the same states as one forward, up to the products' rounding."""

    def __init__(self, model: DecoderLM, prompt: list[int]) -> None:
        check_input(model, prompt)
        self.model, self.prompt = model, prompt
        self.done = 0  # tokens computed
        self._cache: Any = None
        self._sum: Tensor | None = None  # of the final states computed so far, fp32

    @torch.inference_mode()
    def advance(self, tokens: int) -> Tensor | None:
        """Compute up to `tokens` more of the input: its embedding (C,) once the last is computed, else None."""
        model = self.model
        if self._cache is None:
            self._cache = model.new_cache(1, len(self.prompt))
        chunk = torch.tensor([self.prompt[self.done : self.done + tokens]], device=model.device)
        h = model.norm(model.run(chunk, model.step_for(chunk, None, None, self._cache.state), self._cache.layers))
        part = h[0].float().sum(0)
        self._sum = part if self._sum is None else self._sum + part
        self.done += chunk.shape[1]
        if self.done < len(self.prompt):
            return None
        self._cache = None  # (its memory goes at once, not when the job is dropped)
        return torch.nn.functional.normalize(self._sum / len(self.prompt), dim=0)


class OneForward:
    """An embedding computed in one call whatever the budget (a model split across ranks: the ranks run whole
    forwards in lockstep)."""

    def __init__(self, compute: Callable[[], Tensor]) -> None:
        self.compute = compute

    def advance(self, tokens: int) -> Tensor | None:
        return self.compute()
