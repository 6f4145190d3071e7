"""Next tokens for a batch of sequences that each carry their own sampling settings.

Greedy rows without penalties take one argmax together; every other row goes through llmkit.generate.sampling with
its own settings and its own random generator, so a request's seed gives the same tokens whatever else is in the
batch. A row with a structured-output constraint (serve/structured.py) chooses among the tokens its grammar allows:
the others' logits are -inf before penalties, temperature and filters. The log-probability reported for a token is
the model's own (log-softmax of the raw logits), before the grammar, temperature and filters, which is what makes
outputs comparable across settings; a request with tempered_logprobs gets those of the logits over its temperature
(the distribution it samples from, for reinforcement learning).

Rows are isolated: a row whose settings leave no valid distribution (which llmkit.generate.sampling is written
never to produce, but a sampler is the one place where one client's numbers meet the batch) is reported as failed
and ends that sequence alone; the other rows get their tokens as if it had not been there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from llmkit.generate.sampling import distribution, draw
from llmkit.serve.request import SamplingParams, Sequence, Top
from llmkit.serve.scheduler import Work
from llmkit.serve.structured import mask_logits


@dataclass(frozen=True)
class Sampled:
    """The tokens of a batch: tokens[i] and logprobs[i] for row i, or failed[i] saying why row i has none; top[i]:
    the alternatives row i asked for (top_logprobs)."""

    tokens: list[int | None]
    logprobs: list[float | None]
    failed: dict[int, str]
    top: list[Top]


def top_logprobs(logprobs: Tensor, k: int) -> list[Top]:
    """logprobs (N, V) -> the k most likely tokens of each row and their log-probabilities, best first."""
    if k == 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def record_prompt_logprobs(rows: list[Work], logits: list[Tensor | None]) -> None:
    """Record the log-probabilities of the prompt tokens that each row's first n states predict, from their logits
    (n, V) (None: the row's request asked for none here): the state at position i gives token i + 1."""
    for w, x in zip(rows, logits, strict=True):
        record, k = w.seq.prompt_logprobs, w.seq.request.params.prompt_logprobs
        if record is None or k is None or x is None:
            continue
        n = x.shape[0]
        logprobs = torch.log_softmax(tempered(x.float(), w.seq.request.params), dim=-1)  # (n, V)
        targets = torch.tensor(w.seq.tokens[w.start + 1 : w.start + 1 + n], device=logprobs.device)
        values = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        for i, (value, top) in enumerate(zip(values, top_logprobs(logprobs, k), strict=True)):
            record[w.start + 1 + i] = (value, top)


def tempered(logits: Tensor, params: SamplingParams) -> Tensor:
    """A request's logits over its temperature when it asked for the log-probabilities of the distribution it samples
    from (tempered_logprobs), else as they are: one division, the same for a token generated and scored."""
    return logits / params.temperature if params.tempered_logprobs else logits


def penalize_presence(logits: Tensor, generated: list[int], presence: float, frequency: float) -> Tensor:
    """OpenAI's penalties: logits (V,) minus presence for every generated token, minus frequency per occurrence."""
    if not generated or (presence == 0.0 and frequency == 0.0):
        return logits
    ids, counts = torch.tensor(generated, device=logits.device).unique(return_counts=True)
    penalty = presence + frequency * counts.to(logits.dtype)
    return logits.index_add(0, ids, -penalty)


def logit_biased(logits: Tensor, bias: tuple[tuple[int, float], ...]) -> Tensor:
    """logits (..., V) plus a request's logit_bias ((token, bias) pairs), the same sum for every row."""
    if not bias:
        return logits
    index = torch.tensor([t for t, _ in bias], device=logits.device)
    values = torch.tensor([b for _, b in bias], device=logits.device, dtype=logits.dtype)
    return logits + logits.new_zeros(logits.shape[-1]).index_add(0, index, values)


def _row_distribution(x: Tensor, seq: Sequence) -> Tensor:
    """One row's logits (V,) -> the probabilities (1, V) its settings draw from."""
    p = seq.request.params
    s = p.sampling
    x = logit_biased(x, p.logit_bias)
    x = penalize_presence(x, seq.generated, p.presence_penalty, p.frequency_penalty)
    history = torch.tensor([seq.tokens], device=x.device) if s.repetition_penalty != 1.0 else None
    return distribution(x.unsqueeze(0), s, history)


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.request.params
    s = p.sampling
    penalties = s.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
    return s.greedy and not penalties and not p.logit_bias


def sample(logits: Tensor, seqs: list[Sequence], allowed: np.ndarray | None = None) -> Sampled:
    """logits (B, V), one row per sequence -> the next token of each and its log-probability under the model.
    allowed (B, V) bool: the tokens each row may take (its grammar's, serve/structured.py), or None for all."""
    logits = logits.float()
    scaled = logits  # what the reported log-probabilities are of: rows with tempered_logprobs over their temperature
    if any(seq.request.params.tempered_logprobs for seq in seqs):
        scaled = torch.stack([tempered(x, seq.request.params) for x, seq in zip(logits, seqs, strict=True)])
    logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V)
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    chosen = logits.argmax(dim=-1)  # (B,): right for greedy rows without penalties
    failed: dict[int, str] = {}
    nothing: list[bool] = [not row.any() for row in allowed] if allowed is not None else [False] * len(seqs)
    for row, seq in enumerate(seqs):
        if nothing[row]:  # a grammar in an error state (its matcher is llguidance's): this row ends alone
            failed[row] = "the structured-output grammar allows no next token"
            continue
        if _plain_greedy(seq):
            continue
        try:
            probs = _row_distribution(logits[row], seq)  # (1, V)
            if not bool(probs.isfinite().all()) or not float(probs.sum()) > 0.0:
                raise ValueError("its sampling settings leave no token with a finite, positive probability")
            chosen[row] = draw(probs, seq.request.params.sampling.greedy, seq.generator)[0]
        except (RuntimeError, ValueError) as e:  # this row only: the batch goes on without it
            failed[row] = f"sampling failed: {e}"
    ids = chosen.tolist()
    lps = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top = [top_logprobs(logprobs[row : row + 1], seq.request.params.top_logprobs)[0] for row, seq in enumerate(seqs)]
    return Sampled(
        [None if i in failed else t for i, t in enumerate(ids)],
        [None if i in failed else lp for i, lp in enumerate(lps)],
        failed,
        top,
    )
