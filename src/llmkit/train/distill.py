"""Knowledge distillation (Hinton et al., 2015): a model learns a teacher's next-token distributions, not only the
data's next tokens. It is how a draft for speculative decoding is made to agree with its target: the more often the
draft's guess is the target's, the more tokens each verification accepts. Two forms:

    a live teacher (loss.distill_from), the whole vocabulary:
        loss = w * T^2 * KL( softmax(teacher / T) || softmax(student / T) ) + (1 - w) * cross-entropy(student, data)
    a recorded teacher (the model's own text: own_text.py), its top-k logits only:
        loss = - sum_j  softmax(top_logits)_j * log softmax_{c in candidates}(student_c)[top_ids_j]

The first is averaged over the positions whose targets count; T > 1 softens both distributions so the student also
learns how the teacher ranks the unlikely tokens, and T^2 keeps the gradient's scale independent of T (the KL itself
is `llmkit.models.loss.distillation_kl`, also what a self-distilled MTP module learns). The second is the
cross-entropy against the teacher's distribution renormalised over its top k, with the student's normalised over the
candidates: the union of every position's top-k in the batch, so that a head of 49,152 rows costs ~2,000 of them.
It differs from KL(teacher_k || student) by the teacher's entropy, a constant: the same gradient.
Shapes: B batch, T tokens, V vocabulary, V' candidates, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.models.loss import distillation_kl

__all__ = ["candidates", "distillation_kl", "top_k_cross_entropy"]


def candidates(top_ids: Tensor) -> tuple[Tensor, Tensor]:
    """The batch's candidate tokens (V',) (every position's top-k, each once) and where each position's top-k sits
    among them (B, T, K)."""
    ids, index = torch.unique(top_ids.long(), return_inverse=True)
    return ids, index


def top_k_cross_entropy(logits: Tensor, index: Tensor, top_logits: Tensor) -> Tensor:
    """The student's cross-entropy against a teacher's top-k distributions, per position, averaged. logits (B, T, V'):
    the student's over the candidates; index (B, T, K): the teacher's top-k among them; top_logits (B, T, K)."""
    teacher = torch.softmax(top_logits.float(), dim=-1)  # (B, T, K), renormalised over the top k
    student = F.log_softmax(logits.float(), dim=-1).gather(-1, index)  # (B, T, K)
    return -(teacher * student).sum(-1).mean()
