"""Generation: sampling rules, stop rules, cached decoding (eager, compiled or C++ steps: step.py), streaming, beam
search, speculative decoding, all as loops over one decoding session (sessions.py)."""

from llmkit.generate.beam import BeamResult, beam_search, beam_search_seq2seq
from llmkit.generate.decode import Generation, generate, stream
from llmkit.generate.drafters import Drafter, ModelDrafter, MTPDraft, MTPDrafter
from llmkit.generate.prompts import pad, pad_prompts
from llmkit.generate.sampling import Sampling, distribution, draw, filter_logits, next_token
from llmkit.generate.seq2seq import generate_seq2seq
from llmkit.generate.sessions import DecoderSession, Seq2SeqSession
from llmkit.generate.speculative import SpeculativeGeneration, accept, speculative_generate
from llmkit.generate.step import CompiledStep, DecodeStep, NativeStep, choose_step
from llmkit.generate.stops import StopRule

__all__ = [
    "BeamResult",
    "CompiledStep",
    "DecodeStep",
    "DecoderSession",
    "Drafter",
    "Generation",
    "MTPDraft",
    "MTPDrafter",
    "ModelDrafter",
    "NativeStep",
    "Sampling",
    "Seq2SeqSession",
    "SpeculativeGeneration",
    "StopRule",
    "accept",
    "beam_search",
    "beam_search_seq2seq",
    "choose_step",
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
