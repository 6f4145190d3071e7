"""What a drafter learns from its model's own text (own_text.py), as modules the training loop calls, and how well
it drafts afterwards.

    MTPDrafting      a grafted MTP module (graft.graft_mtp; it alone trains: train.trainable [mtp]). Position i
                     reads the model's state h_i and token i + 1 and predicts token i + 2: the top-k cross-entropy
                     against the model's own distribution of that token (distill.top_k_cross_entropy), plus smooth-L1
                     from the module's normed output to the model's normed state at i + 1, which that output stands in
                     for when the drafter chains (the feature regression of EAGLE, Li et al. 2024). The module is
                     applied again to its own outputs (depths 2 .. loss.unroll) so that chained drafts stay on course.
    DraftDistilling  a separate draft model (e.g. graft.prune's): its next-token distribution against the model's,
                     the same top-k cross-entropy.

    evaluate_drafter, agreement   held-out estimates: how often a draft is the model's token, and the drafts a round
                                  of k accepts (teacher-forced on the model's text, which is what an accepted chain
                                  reads)

Each module's forward(tokens, hidden, top_logits, top_ids) returns the loss terms "loss", "teacher" and "feature";
with evaluate=True the summed teacher cross-entropy of the first draft "nll" and the position "count".
Shapes: N sequences of T tokens, C model width, K top-k, V' candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.layers.mtp import MTPModule
from llmkit.layers.softcap import soft_cap
from llmkit.models import DecoderLM
from llmkit.models.cache import whole_sequence
from llmkit.train.distill import candidates, top_k_cross_entropy
from llmkit.train.own_text import OwnText

TERMS = ("loss", "teacher", "feature")


@dataclass
class DrafterReport:
    """What training reached: steps, sequences seen, seconds; on held-out text, how often depth d's draft is the
    model's token (`agreement`, d = 1 .. len) and the mean number of drafts a round of k would accept."""

    steps: int
    sequences: int
    seconds: float
    agreement: list[float]
    accepted_per_round: float


def candidate_logits(model: DecoderLM, h: Tensor, ids: Tensor) -> Tensor:
    """The model's head on normed states h (N, T, C), over the candidate tokens `ids` (V',) only: (N, T, V')."""
    head = cast(Tensor, model.embed.weight if model.head is None else model.head.weight)  # (V, C)
    bias = None if model.head_bias is None else model.head_bias[ids]
    return soft_cap(F.linear(h, head[ids], bias), model.cfg.logit_softcap)


def mtp_depths(model: DecoderLM, text: OwnText, depths: int) -> list[Tensor]:
    """The MTP module's normed outputs (N, T - 1, C) at depths 1 .. `depths`: depth 1 at position i reads the model's
    state h_i and token i + 1; depth d reads depth d - 1's output at i - 1 instead of h_i (what a chain of drafts
    reads). Position i of every depth predicts the model's token at i + 1 (token i + 2)."""
    module = model.mtp[0]
    assert isinstance(module, MTPModule)
    T = text.tokens.shape[1]
    step = whole_sequence(T - 1, None, text.tokens.device)
    inputs = model.attention_inputs(step)
    emb = model.inputs(model.embed, text.tokens[:, 1:], step.positions)  # (N, T - 1, C): tokens i + 1
    first = model.norm(text.hidden[:, :-1].float())  # (N, T - 1, C)
    h, outs = first, []
    for _ in range(depths):
        out = module(h, emb, inputs)
        outs.append(out)
        h = torch.cat([first[:, :1], out[:, :-1]], dim=1)  # position 0 has no earlier output: the model's state
    return outs


class MTPDrafting(nn.Module):
    """A model with a grafted MTP module learning to draft for it (see the module docstring)."""

    def __init__(self, model: DecoderLM, unroll: int, feature_weight: float) -> None:
        super().__init__()
        self.model, self.unroll, self.feature_weight = model, unroll, feature_weight

    def forward(
        self, tokens: Tensor, hidden: Tensor, top_logits: Tensor, top_ids: Tensor, evaluate: bool = False
    ) -> dict[str, Tensor]:
        m = self.model
        text = OwnText(tokens, hidden, top_logits, top_ids)
        ids, index = candidates(top_ids[:, 1:])  # position i's target: the model's top-k at i + 1
        outs = mtp_depths(m, text, 1 if evaluate else self.unroll)
        teacher = [top_k_cross_entropy(candidate_logits(m, out, ids), index, top_logits[:, 1:]) for out in outs]
        if evaluate:
            count = torch.tensor(float(index[..., 0].numel()), device=tokens.device)
            return {"nll": teacher[0] * count, "count": count}
        target = m.norm(hidden[:, 1:].float()).detach()  # (N, T - 1, C): the model's normed state at i + 1
        feature = torch.stack([F.smooth_l1_loss(out, target) for out in outs]).mean()
        ce = torch.stack(teacher).mean()
        return {"loss": ce + self.feature_weight * feature, "teacher": ce, "feature": feature}


class DraftDistilling(nn.Module):
    """A draft model learning its target's next-token distributions on the target's own text."""

    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, tokens: Tensor, hidden: Tensor, top_logits: Tensor, top_ids: Tensor, evaluate: bool = False
    ) -> dict[str, Tensor]:
        m = self.model
        h = m.norm(m.run(tokens, whole_sequence(tokens.shape[1], None, tokens.device)))  # (N, T, C): predicts i + 1
        ids, index = candidates(top_ids)
        ce = top_k_cross_entropy(candidate_logits(m, h, ids), index, top_logits)
        if evaluate:
            count = torch.tensor(float(index[..., 0].numel()), device=tokens.device)
            return {"nll": ce * count, "count": count}
        return {"loss": ce, "teacher": ce, "feature": ce.new_zeros(())}


def _accepted(hits: list[Tensor], start: int, k: int) -> float:
    """The mean drafts a round of k accepts from each position >= start, given hits[d] (N, L): whether depth d + 1's
    draft at a position is the model's token (a chain from position s: depth d + 1's draft sits at s + d)."""
    end = hits[0].shape[1] - k + 1
    run = torch.ones_like(hits[0][:, start:end])
    accepted = torch.zeros(run.shape, device=run.device)
    for d in range(k):
        run = run & hits[d][:, start + d : end + d]
        accepted += run.float()
    return float(accepted.mean())


@torch.no_grad()
def evaluate_drafter(model: DecoderLM, text: OwnText, depths: int, skip: int = 0) -> tuple[list[float], float]:
    """(agreement per depth, mean drafts accepted per round of k = depths) of model.mtp[0] on `text`, from position
    `skip` on (past the openings, which are the corpus's text rather than the model's)."""
    text = text.to(model.device)
    want = text.top_ids[:, 1:, 0].long()  # (N, T - 1): the model's token at i + 1
    hits = [model.logits(o).argmax(-1) == want for o in mtp_depths(model, text, depths)]  # (N, T - 1) each
    return [float(h[:, skip:].float().mean()) for h in hits], _accepted(hits, skip, depths)


@torch.no_grad()
def agreement(draft: DecoderLM, text: OwnText, k: int, skip: int = 0) -> tuple[float, float]:
    """(how often the draft's next token is the target's, the mean drafts a round of k accepts) on `text`, from
    position `skip` on."""
    text = text.to(draft.device)
    T = text.tokens.shape[1]
    logits = draft.logits(draft.norm(draft.run(text.tokens, whole_sequence(T, None, text.tokens.device))))
    hits = logits.argmax(-1) == text.top_ids[..., 0].long()  # (N, T)
    return float(hits[:, skip:].float().mean()), _accepted([hits] * k, skip, k)  # every draft reads the model's text
