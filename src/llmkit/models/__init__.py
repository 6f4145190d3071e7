"""Models: the decoder-only LM and the encoder-decoder Transformer, built from a ModelConfig; and the RNN
encoder-decoder with attention they replaced, built from an RNNConfig."""

from __future__ import annotations

import contextlib

import torch

from llmkit.config import ModelConfig
from llmkit.models.cache import Cache, SequenceState, Step
from llmkit.models.decoder import DecoderLM
from llmkit.models.encoder_decoder import EncoderDecoder
from llmkit.models.loss import LossOutput, shift_right
from llmkit.models.rnn import RNNCache, RNNConfig, RNNSeq2Seq, build_rnn

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


def build_any(
    cfg: ModelConfig | RNNConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> DecoderLM | EncoderDecoder | RNNSeq2Seq:
    """build_model for a ModelConfig, build_rnn for an RNNConfig."""
    if isinstance(cfg, RNNConfig):
        return build_rnn(cfg, device=device, dtype=dtype)
    return build_model(cfg, device=device, dtype=dtype)


__all__ = [
    "Cache",
    "DecoderLM",
    "EncoderDecoder",
    "LossOutput",
    "Model",
    "RNNCache",
    "RNNConfig",
    "RNNSeq2Seq",
    "SequenceState",
    "Step",
    "build_any",
    "build_model",
    "build_rnn",
    "shift_right",
]
