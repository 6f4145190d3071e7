"""Generation: sampling rules, cached decoding (plain or compiled), streaming, beam search, speculative decoding."""

from llmkit.generate.decode import Generation, generate, pad_prompts, stream
from llmkit.generate.sampling import Sampling, distribution, filter_logits, next_token
from llmkit.generate.step import decode_step

__all__ = [
    "Generation",
    "Sampling",
    "decode_step",
    "distribution",
    "filter_logits",
    "generate",
    "next_token",
    "pad_prompts",
    "stream",
]
