"""Embeddings for /v1/embeddings: any decoder llmkit loads, pooled."""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.models.decoder import DecoderLM
from llmkit.serve.request import Refused


def pooled_embedding(model: DecoderLM, prompt: list[int]) -> Tensor:
    """The prompt's embedding (C,) fp32: the mean of the model's final hidden states over its tokens (after the final
    norm), scaled to unit length. Mean pooling: a causal model's states each see a prefix, and their mean weighs the
    whole text where the last state alone leans on its end; models trained for embeddings usually pool one way, and
    this one works for any decoder llmkit loads. No cache: one forward of the prompt alone."""
    check_input(model, prompt)
    return pool_states(model, prompt)


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
    """pooled_embedding's computation, on a prompt already checked."""
    tokens = torch.tensor([prompt], device=model.device)
    h = model.norm(model.run(tokens, model.step_for(tokens, None, None, None)))  # (1, T, C)
    return torch.nn.functional.normalize(h[0].float().mean(0), dim=0)
