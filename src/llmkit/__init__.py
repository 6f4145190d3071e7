"""llmkit: the Transformer family, from "Attention Is All You Need" to LLaMA-2 and DeepSeek-V3.

import llmkit
cfg = llmkit.get_preset("llama2-7b-tiny")
model = llmkit.build_model(cfg)
logits = model(tokens)                          # (B, T) -> (B, T, V)
loss = model.loss(tokens, start_id=0).total     # teacher forcing
llmkit.analyze(llmkit.get_preset("deepseek-v3")).kv_cache_bytes_per_token
"""

from llmkit.analysis import Report, analyze, count_parameters
from llmkit.config import (
    AttentionConfig,
    EncoderConfig,
    FFNConfig,
    IndexerConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    PositionConfig,
    RopeScaling,
)
from llmkit.config.presets import PRESETS, get_preset, list_presets
from llmkit.errors import ConfigError, InputError, LLMKitError
from llmkit.models import DecoderLM, EncoderDecoder, LossOutput, build_model, shift_right

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "AttentionConfig",
    "ConfigError",
    "DecoderLM",
    "EncoderConfig",
    "EncoderDecoder",
    "FFNConfig",
    "IndexerConfig",
    "InputError",
    "LLMKitError",
    "LossOutput",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "NormConfig",
    "PositionConfig",
    "Report",
    "RopeScaling",
    "analyze",
    "build_model",
    "count_parameters",
    "get_preset",
    "list_presets",
    "shift_right",
]
