"""Generation: sampling rules, cached decoding (plain or compiled), streaming, beam search, speculative decoding."""

from llmkit.generate.beam import BeamResult, beam_search, beam_search_seq2seq
from llmkit.generate.decode import Generation, generate, pad_prompts, stream
from llmkit.generate.sampling import Sampling, distribution, filter_logits, next_token
from llmkit.generate.speculative import SpeculativeGeneration, speculative_generate
from llmkit.generate.step import decode_step

__all__ = [
    "BeamResult",
    "Generation",
    "Sampling",
    "SpeculativeGeneration",
    "beam_search",
    "beam_search_seq2seq",
    "decode_step",
    "distribution",
    "filter_logits",
    "generate",
    "next_token",
    "pad_prompts",
    "speculative_generate",
    "stream",
]
