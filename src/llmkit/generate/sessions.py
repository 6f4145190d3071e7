"""Decoding sessions: a model with its cache for one batch, behind the two calls every generator makes.

    session.logits                 next-token logits (B, V) after everything fed so far
    session.feed(tokens)           append tokens (B, T); updates session.logits
    session.reorder(rows)          keep batch rows `rows` in that order (beam search)

A decoder-only session starts from the (left-padded) prompts; an encoder-decoder session encodes the sources once
and starts from the decoder's start token. Greedy and sampled decoding (decode.py), beam search (beam.py) and
speculative decoding (speculative.py) are loops over a session, the same loop for both kinds of model. `copies`
repeats every row (beam search keeps num_beams copies of each input). A decoder-only session's steps run on the
backend (step.py) chosen when it is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.step import DecodeStep, choose_step
from llmkit.models import DecoderLM, EncoderDecoder, RNNSeq2Seq


class DecoderSession:
    """A decoder-only model continuing a batch of prompts. tokens, mask (B, T): left-padded prompts; `room`: the
    most tokens that will be fed after them; `step`: the backend that runs its steps (choose_step's when None)."""

    def __init__(
        self, model: DecoderLM, tokens: Tensor, mask: Tensor, room: int, step: DecodeStep | None = None, copies: int = 1
    ) -> None:
        self.model = model
        self.step = step if step is not None else choose_step(model)
        tokens, mask = tokens.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
        self.cache = model.new_cache(tokens.shape[0], tokens.shape[1] + max(room, 1))
        self.logits = torch.empty(0)
        self.feed(tokens, mask, last=True, given=True)

    @property
    def device(self) -> torch.device:
        return self.cache.state.valid.device

    def feed(
        self, tokens: Tensor, valid: Tensor | None = None, last: bool = False, given: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Append tokens (B, T) (valid: False at padding; `given`: a prompt's or a scored text's, not generated);
        returns their logits (B, T, V) (with `last`, the last position's only) and hidden states (B, T, C)."""
        logits, hidden = self.step(tokens, self.cache, valid, last, given)
        self.logits = logits[:, -1]
        return logits, hidden

    def reorder(self, rows: Tensor) -> None:
        self.cache.reorder(rows)
        self.logits = self.logits.index_select(0, rows)


class Seq2SeqSession:
    """An encoder-decoder (the Transformer or the RNN) decoding from `start_id` after encoding the sources
    (B, S) once. Tokens in `suppress_ids` (e.g. padding) get no probability."""

    def __init__(
        self,
        model: EncoderDecoder | RNNSeq2Seq,
        source: Tensor,
        source_mask: Tensor | None,
        start_id: int,
        room: int,
        suppress_ids: Sequence[int] = (),
        copies: int = 1,
    ) -> None:
        if not 0 <= start_id < model.cfg.vocab_size:
            raise InputError(f"start_id={start_id} is outside the vocabulary [0, {model.cfg.vocab_size})")
        self.model = model
        self.memory = model.encode(source, source_mask).repeat_interleave(copies, dim=0)
        self.source_mask = None if source_mask is None else source_mask.bool().repeat_interleave(copies, dim=0)
        B = self.memory.shape[0]
        self.cache = model.new_cache(B, max(room, 1) + 1)
        self.banned = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=self.memory.device)
        self.logits = torch.empty(0)
        self.feed(torch.full((B, 1), start_id, dtype=torch.long, device=self.memory.device))

    @property
    def device(self) -> torch.device:
        return self.memory.device

    def feed(self, tokens: Tensor) -> None:
        logits = self.model.decode(tokens, self.memory, source_mask=self.source_mask, cache=self.cache)[:, -1]
        self.logits = logits.index_fill(-1, self.banned, float("-inf")) if len(self.banned) else logits

    def reorder(self, rows: Tensor) -> None:
        self.cache.reorder(rows)
        self.memory = self.memory.index_select(0, rows)
        if self.source_mask is not None:
            self.source_mask = self.source_mask.index_select(0, rows)
        self.logits = self.logits.index_select(0, rows)


Session = DecoderSession | Seq2SeqSession
