"""What loading a checkpoint gives, whatever its format: the model and what came with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmkit.models import DecoderLM, EncoderDecoder, RNNSeq2Seq
from llmkit.tokenizer import Tokenizer

Format = Literal["hf", "gguf", "llmkit"]


@dataclass
class Loaded:
    """A model and what came with it, from a Hugging Face directory, a GGUF file or an llmkit checkpoint."""

    model: DecoderLM | EncoderDecoder | RNNSeq2Seq
    tokenizer: Tokenizer | None
    source: Format
    path: Path
    hf_model_type: str | None = None
    hf_config: dict[str, Any] | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    source_tokenizer: Tokenizer | None = None  # a translation model's, when it differs from `tokenizer`
    notes: list[str] = field(default_factory=list)  # what loading changed (e.g. GGUF tensors dequantized)
