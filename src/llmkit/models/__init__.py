"""Models: the decoder-only LM and the encoder-decoder Transformer, built from a ModelConfig."""

from __future__ import annotations

import contextlib

import torch

from llmkit.config import ModelConfig
from llmkit.models.common import LossOutput, shift_right
from llmkit.models.decoder import DecoderCache, DecoderLM
from llmkit.models.encoder_decoder import EncoderDecoder, EncoderDecoderCache

Model = DecoderLM | EncoderDecoder


def build_model(
    cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> DecoderLM | EncoderDecoder:
    """The model a config describes: EncoderDecoder when `cfg.encoder` is set, DecoderLM otherwise.

    Parameters are allocated directly on `device`; device="meta" allocates nothing, which is how even a 671B
    config can be built and counted on a laptop. `dtype` casts floating-point parameters (e.g. torch.bfloat16)."""
    cls = EncoderDecoder if cfg.is_encoder_decoder else DecoderLM
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = cls(cfg)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


__all__ = [
    "DecoderCache",
    "DecoderLM",
    "EncoderDecoder",
    "EncoderDecoderCache",
    "LossOutput",
    "Model",
    "build_model",
    "shift_right",
]
