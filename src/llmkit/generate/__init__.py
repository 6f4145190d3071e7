"""Generation: sampling rules, stop rules, cached decoding (plain or compiled), streaming, beam search, speculative
decoding, all as loops over one decoding session (sessions.py)."""

from llmkit.generate.beam import BeamResult, beam_search, beam_search_seq2seq
from llmkit.generate.decode import Generation, generate, stream
from llmkit.generate.drafters import Drafter, ModelDrafter, MTPDrafter
from llmkit.generate.prompts import pad, pad_prompts
from llmkit.generate.sampling import Sampling, distribution, draw, filter_logits, next_token
from llmkit.generate.seq2seq import generate_seq2seq
from llmkit.generate.sessions import DecoderSession, Seq2SeqSession
from llmkit.generate.speculative import SpeculativeGeneration, accept, speculative_generate
from llmkit.generate.step import decode_step
from llmkit.generate.stops import StopRule

__all__ = [
    "BeamResult",
    "DecoderSession",
    "Drafter",
    "Generation",
    "MTPDrafter",
    "ModelDrafter",
    "Sampling",
    "Seq2SeqSession",
    "SpeculativeGeneration",
    "StopRule",
    "accept",
    "beam_search",
    "beam_search_seq2seq",
    "decode_step",
    "distribution",
    "draw",
    "filter_logits",
    "generate",
    "generate_seq2seq",
    "next_token",
    "pad",
    "pad_prompts",
    "speculative_generate",
    "stream",
]
