"""Next tokens for a batch of sequences that each carry their own sampling settings.

Greedy rows without penalties take one argmax together; every other row goes through llmkit.generate.sampling with
its own settings and its own random generator, so a request's seed gives the same tokens whatever else is in the
batch. The log-probability reported for a token is the model's own (log-softmax of the raw logits), before
temperature and filters, which is what makes outputs comparable across settings.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.generate.sampling import distribution, draw
from llmkit.serve.request import Sequence


def penalize_presence(logits: Tensor, generated: list[int], presence: float, frequency: float) -> Tensor:
    """OpenAI's penalties: logits (V,) minus presence for every generated token, minus frequency per occurrence."""
    if not generated or (presence == 0.0 and frequency == 0.0):
        return logits
    ids, counts = torch.tensor(generated, device=logits.device).unique(return_counts=True)
    penalty = presence + frequency * counts.to(logits.dtype)
    return logits.index_add(0, ids, -penalty)


def sample(logits: Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """logits (B, V), one row per sequence -> the next token of each and its log-probability under the model."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    chosen = logits.argmax(dim=-1)  # (B,): right for greedy rows without penalties
    for row, seq in enumerate(seqs):
        p = seq.request.params
        s = p.sampling
        penalties = s.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
        if s.greedy and not penalties and not p.logit_bias:
            continue
        x = logits[row]
        if p.logit_bias:
            index = torch.tensor([t for t, _ in p.logit_bias], device=x.device)
            x = x.index_add(0, index, torch.tensor([b for _, b in p.logit_bias], device=x.device))
        x = penalize_presence(x, seq.generated, p.presence_penalty, p.frequency_penalty)
        history = torch.tensor([seq.tokens], device=logits.device) if s.repetition_penalty != 1.0 else None
        probs = distribution(x.unsqueeze(0), s, history)  # (1, V)
        chosen[row] = draw(probs, s.greedy, seq.generator)[0]
    ids = chosen.tolist()
    return ids, logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
