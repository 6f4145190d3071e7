"""Beam search: keep the `num_beams` best partial sequences instead of only the best next token.

At each step every beam is extended by every token; the 2 * num_beams highest cumulative log-probabilities are
candidates; candidates ending in an end token among the best num_beams become finished hypotheses, the others the
next beams (at most num_beams). The caches follow their beams (rows are reordered). A finished hypothesis scores
sum(log p) / length ** length_penalty (length = generated tokens): a penalty above 0 favours longer outputs, 0 ranks
by raw log-probability. The search for one input stops when num_beams hypotheses are finished and no running beam can
still beat the worst of them (or after max_new_tokens). One beam is greedy decoding.

Every input's beams and hypotheses are tensors ((B, num_beams) scores, (B, num_beams, L) tokens), so one step
updates the whole batch at once. The same loop serves decoder-only models (continuing prompts) and encoder-decoder
models (decoding from a start token given the encoded source): only the session differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.prompts import prepare_prompts
from llmkit.generate.sampling import check_finite
from llmkit.generate.sessions import DecoderSession, Seq2SeqSession, Session
from llmkit.generate.stops import eos_ids
from llmkit.models import DecoderLM, EncoderDecoder, RNNSeq2Seq

_NEG = float("-inf")


@dataclass
class BeamResult:
    """Per input: the best hypothesis (generated tokens, end token included) and its length-normalised score."""

    sequences: list[list[int]]
    scores: list[float]


@dataclass
class _Hypotheses:
    """Each input's best finished hypotheses, best first: scores (B, n) (-inf where none yet), tokens (B, n, L),
    lengths (B, n)."""

    scores: Tensor
    tokens: Tensor
    lengths: Tensor

    def add(self, scores: Tensor, tokens: Tensor, length: int) -> None:
        """Merge candidates (B, m) of `length` tokens (B, m, length) (score -inf: not a candidate), keeping the n
        best; on a tie the hypothesis found earlier stays ahead."""
        n, width = self.scores.shape[1], max(self.tokens.shape[2], length)
        old = torch.nn.functional.pad(self.tokens, (0, width - self.tokens.shape[2]))
        new = torch.nn.functional.pad(tokens, (0, width - length))
        all_scores = torch.cat([self.scores, scores], dim=1)
        order = all_scores.sort(dim=1, descending=True, stable=True).indices[:, :n]  # (B, n)
        self.scores = all_scores.gather(1, order)
        self.tokens = torch.cat([old, new], dim=1).gather(1, order.unsqueeze(-1).expand(-1, -1, width))
        lengths = torch.cat([self.lengths, torch.full_like(scores, length, dtype=torch.long)], dim=1)
        self.lengths = lengths.gather(1, order)

    def count(self) -> Tensor:
        return (self.scores > _NEG).sum(dim=1)


def _normalise(logprob: Tensor, length: int, penalty: float) -> Tensor:
    return logprob / max(length, 1) ** penalty


def search(
    session: Session, batch: int, nb: int, max_new_tokens: int, penalty: float, eos: frozenset[int]
) -> BeamResult:
    """The beam loop over a session holding batch * nb rows (the nb copies of each input next to each other, e.g.
    made with `copies=nb`)."""
    device = session.device
    scores = torch.full((batch, nb), _NEG, device=device)
    scores[:, 0] = 0.0  # one live beam at first, so the beams do not start as copies of each other
    beams = torch.zeros(batch, nb, 0, dtype=torch.long, device=device)
    hyps = _Hypotheses(scores.new_full((batch, nb), _NEG), beams.clone(), beams.new_zeros(batch, nb))
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    eos_list = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    rank = torch.arange(2 * nb, device=device)
    for t in range(max_new_tokens):
        length, last = t + 1, t == max_new_tokens - 1
        check_finite(session.logits, t)
        logprobs = torch.log_softmax(session.logits.float(), dim=-1)  # (B * nb, V)
        V = logprobs.shape[-1]
        total = (logprobs.view(batch, nb, V) + scores.unsqueeze(-1)).view(batch, nb * V)
        top, idx = total.topk(min(2 * nb, nb * V), dim=-1)  # candidates, best first: (B, m)
        m = top.shape[1]
        beam, token = idx // V, idx % V
        seqs = torch.cat([beams.gather(1, beam.unsqueeze(-1).expand(-1, -1, t)), token.unsqueeze(-1)], dim=-1)
        live = (top > _NEG) & ~finished.unsqueeze(1)  # (B, m)
        is_eos = torch.isin(token, eos_list) & live
        # an end token among the best nb candidates finishes a hypothesis; the best nb others run on
        ended = is_eos & (rank[:m] < nb)
        hyps.add(torch.where(ended, _normalise(top, length, penalty), _NEG), seqs, length)
        keep = (~is_eos & live).long()
        chosen = (rank[:m] + (1 - keep) * m).argsort(dim=1)[:, :nb]  # running candidates in rank order first
        filled = keep.gather(1, chosen).bool()  # (B, nb): False where fewer than nb candidates ran on
        next_scores = torch.where(filled, top.gather(1, chosen), _NEG)
        source = torch.where(filled, beam.gather(1, chosen), 0)
        next_tokens = torch.where(filled, token.gather(1, chosen), 0)
        # a finished input keeps its beams where they are
        source = torch.where(finished.unsqueeze(1), torch.arange(nb, device=device), source)
        beams = torch.cat([beams.gather(1, source.unsqueeze(-1).expand(-1, -1, t)), next_tokens.unsqueeze(-1)], -1)
        if last:  # the running beams become hypotheses too
            running = torch.where(finished.unsqueeze(1), _NEG, _normalise(next_scores, length, penalty))
            hyps.add(running, beams, length)
        best_running = _normalise(next_scores.max(dim=1).values, length, penalty)
        done = (hyps.count() >= nb) & (best_running <= hyps.scores[:, -1])
        finished = finished | done | last
        scores = next_scores
        if bool(finished.all()):
            break
        session.reorder((source + torch.arange(batch, device=device).unsqueeze(1) * nb).view(-1))
        session.feed(next_tokens.view(-1, 1))
    return _result(hyps)


def _result(hyps: _Hypotheses) -> BeamResult:
    sequences: list[list[int]] = []
    best: list[float] = []
    for scores, tokens, lengths in zip(hyps.scores.tolist(), hyps.tokens.tolist(), hyps.lengths.tolist(), strict=True):
        if scores[0] == _NEG:  # nothing finished and no steps taken
            sequences.append([])
            best.append(0.0)
        else:
            sequences.append(tokens[0][: lengths[0]])
            best.append(scores[0])
    return BeamResult(sequences, best)


def _check(num_beams: int, length_penalty: float) -> None:
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise InputError(f"num_beams={num_beams!r} must be an int >= 1")
    if length_penalty != length_penalty:  # NaN
        raise InputError("length_penalty must be a number")


@torch.no_grad()
def beam_search(
    model: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    *,
    num_beams: int = 4,
    max_new_tokens: int = 64,
    length_penalty: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    padding_mask: Tensor | None = None,
) -> BeamResult:
    """Beam search continuing each prompt of a decoder-only model."""
    _check(num_beams, length_penalty)
    tokens, mask = prepare_prompts(model, prompts, padding_mask, max_new_tokens)
    session = DecoderSession(model, tokens, mask, max_new_tokens, copies=num_beams)
    return search(session, tokens.shape[0], num_beams, max_new_tokens, length_penalty, eos_ids(eos_id))


@torch.no_grad()
def beam_search_seq2seq(
    model: EncoderDecoder | RNNSeq2Seq,
    source: Tensor,
    *,
    start_id: int,
    num_beams: int = 4,
    max_new_tokens: int = 64,
    length_penalty: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    source_mask: Tensor | None = None,
    suppress_ids: Sequence[int] = (),
) -> BeamResult:
    """Beam search decoding each source sentence (B, S) of an encoder-decoder (Transformer or RNN), from
    `start_id`. The encoder runs once; the cross-attention keys and values are computed once and reordered with the
    beams. Tokens in `suppress_ids` (e.g. padding) are never generated."""
    _check(num_beams, length_penalty)
    session = Seq2SeqSession(model, source, source_mask, start_id, max_new_tokens, suppress_ids, copies=num_beams)
    return search(session, source.shape[0], num_beams, max_new_tokens, length_penalty, eos_ids(eos_id))
