"""Decoding for encoder-decoder models (the Transformer or the RNN): encode once, then the decoding loop of
decode.py over the decoder, from the start token until every row has produced its end token."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.decode import run_session
from llmkit.generate.sampling import Sampling
from llmkit.generate.sessions import Seq2SeqSession
from llmkit.generate.stops import StopRule
from llmkit.models import EncoderDecoder, RNNSeq2Seq


@torch.no_grad()
def generate_seq2seq(
    model: EncoderDecoder | RNNSeq2Seq,
    source: Tensor,
    *,
    start_id: int,
    eos_id: int | Sequence[int] | None,
    max_new_tokens: int = 64,
    source_mask: Tensor | None = None,
    suppress_ids: Sequence[int] = (),
    sampling: Sampling | None = None,
    seed: int | None = None,
) -> list[list[int]]:
    """source (B, S) -> per row the generated tokens, up to and including its end token (or max_new_tokens).
    Greedy unless `sampling` says otherwise; tokens in `suppress_ids` (e.g. padding) are never generated."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 1")
    session = Seq2SeqSession(model, source, source_mask, start_id, max_new_tokens, suppress_ids)
    return run_session(session, max_new_tokens, StopRule.of(eos_id), sampling, seed)
