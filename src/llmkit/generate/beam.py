"""Beam search: keep the `num_beams` best partial sequences instead of only the best next token.

At each step every beam is extended by every token; the 2 * num_beams highest cumulative log-probabilities are
candidates; candidates ending in an end token become finished hypotheses, the others the next beams (at most
num_beams). The caches follow their beams (rows are reordered). A finished hypothesis scores
sum(log p) / length ** length_penalty (length = generated tokens): a penalty above 0 favours longer outputs, 0 ranks
by raw log-probability. The search for one input stops when num_beams hypotheses are finished and no running beam can
still beat the worst of them (or after max_new_tokens). One beam is greedy decoding.

Works for decoder-only models (continuing prompts) and encoder-decoder models (decoding from a start token given the
encoded source), with the same loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.decode import prepare_prompts
from llmkit.models import DecoderLM, EncoderDecoder
from llmkit.models.rnn import RNNSeq2Seq


@dataclass
class BeamResult:
    """Per input: the best hypothesis (generated tokens, end token included) and its length-normalised score."""

    sequences: list[list[int]]
    scores: list[float]


class _Hypotheses:
    def __init__(self, num_beams: int, length_penalty: float) -> None:
        self.n, self.penalty = num_beams, length_penalty
        self.items: list[tuple[float, list[int]]] = []

    def score(self, logprob: float, length: int) -> float:
        return logprob / max(length, 1) ** self.penalty

    def add(self, tokens: list[int], logprob: float) -> None:
        self.items.append((self.score(logprob, len(tokens)), tokens))
        self.items.sort(key=lambda x: -x[0])
        del self.items[self.n :]

    def done(self, best_running: float, length: int) -> bool:
        return len(self.items) >= self.n and self.score(best_running, length) <= self.items[-1][0]


def _search(
    step: Callable[[Tensor], Tensor],
    reorder: Callable[[Tensor], None],
    first_logits: Tensor,
    batch: int,
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float,
    eos: set[int],
) -> BeamResult:
    """The beam loop. first_logits (B * num_beams, V) after the prompt; step(tokens (B * nb, 1)) -> logits."""
    nb = num_beams
    device = first_logits.device
    scores = torch.full((batch, nb), float("-inf"), device=device)
    scores[:, 0] = 0.0  # one live beam at first, so the beams do not start as copies of each other
    beams: list[list[list[int]]] = [[[] for _ in range(nb)] for _ in range(batch)]
    hyps = [_Hypotheses(nb, length_penalty) for _ in range(batch)]
    finished = [False] * batch
    logits = first_logits
    for step_index in range(max_new_tokens):
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B * nb, V)
        V = logprobs.shape[-1]
        total = (logprobs.view(batch, nb, V) + scores.unsqueeze(-1)).view(batch, nb * V)
        top, idx = total.topk(min(2 * nb, nb * V), dim=-1)  # candidates, best first
        next_scores = torch.full((batch, nb), float("-inf"), device=device)
        next_tokens = torch.zeros(batch, nb, dtype=torch.long, device=device)
        source = torch.zeros(batch, nb, dtype=torch.long, device=device)
        last = step_index == max_new_tokens - 1
        for b in range(batch):
            if finished[b]:
                source[b] = torch.arange(nb, device=device)
                continue
            filled = 0
            for rank, (s, i) in enumerate(zip(top[b].tolist(), idx[b].tolist(), strict=True)):
                beam, token = divmod(i, V)
                if s == float("-inf"):
                    break
                seq = [*beams[b][beam], token]
                if token in eos:
                    if rank < nb:  # an end token among the best num_beams candidates finishes a hypothesis
                        hyps[b].add(seq, s)
                    continue
                next_scores[b, filled], next_tokens[b, filled], source[b, filled] = s, token, beam
                filled += 1
                if filled == nb:
                    break
            new_beams = [[*beams[b][int(source[b, j])], int(next_tokens[b, j])] for j in range(nb)]
            beams[b] = new_beams
            if last:
                for j in range(nb):
                    if next_scores[b, j] > float("-inf"):
                        hyps[b].add(beams[b][j], float(next_scores[b, j]))
            finished[b] = hyps[b].done(float(next_scores[b].max()), step_index + 1) or last
        scores = next_scores
        if all(finished):
            break
        rows = (source + torch.arange(batch, device=device).unsqueeze(1) * nb).view(-1)
        reorder(rows)
        logits = step(next_tokens.view(-1, 1))
    out: list[list[int]] = []
    best: list[float] = []
    for b in range(batch):
        if not hyps[b].items:  # nothing finished and no steps taken
            out.append([])
            best.append(0.0)
            continue
        best.append(hyps[b].items[0][0])
        out.append(hyps[b].items[0][1])
    return BeamResult(out, best)


def _check(num_beams: int, length_penalty: float) -> None:
    if not isinstance(num_beams, int) or num_beams < 1:
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
    B, T = tokens.shape
    expanded = tokens.repeat_interleave(num_beams, dim=0)
    valid = mask.repeat_interleave(num_beams, dim=0)
    cache = model.new_cache(B * num_beams, T + max(max_new_tokens, 1))
    first = model(expanded, padding_mask=valid if not bool(valid.all()) else None, cache=cache)[:, -1]
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    return _search(
        lambda t: model(t, cache=cache)[:, -1], cache.reorder, first, B, num_beams, max_new_tokens, length_penalty, eos
    )


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
    if not 0 <= start_id < model.cfg.vocab_size:
        raise InputError(f"start_id={start_id} is outside the vocabulary [0, {model.cfg.vocab_size})")
    memory = model.encode(source, source_mask)
    B = source.shape[0]
    memory = memory.repeat_interleave(num_beams, dim=0)
    smask = None if source_mask is None else source_mask.bool().repeat_interleave(num_beams, dim=0)
    cache = model.new_cache(B * num_beams, max(max_new_tokens, 1) + 1)
    start = torch.full((B * num_beams, 1), start_id, dtype=torch.long, device=memory.device)
    banned = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=memory.device)

    def step(tokens: Tensor) -> Tensor:
        logits = model.decode(tokens, memory, source_mask=smask, cache=cache)[:, -1]  # type: ignore[arg-type]
        return logits.index_fill(-1, banned, float("-inf")) if len(banned) else logits

    first = step(start)
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    return _search(
        step,
        cache.reorder,
        first,
        B,
        num_beams,
        max_new_tokens,
        length_penalty,
        eos,
    )
