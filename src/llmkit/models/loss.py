"""Teacher forcing and the loss record: how a sequence model is trained to predict every next token at once.

    targets  I    love you  </s>
    inputs   <s>  I    love you        the model predicts targets[t] from inputs[: t + 1]

Shapes: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.config import MoEConfig
from llmkit.errors import InputError
from llmkit.layers.extras import Extras
from llmkit.models.checks import check_label_smoothing, check_mask, check_tokens


def shift_right(tokens: Tensor, start_id: int, valid: Tensor | None = None) -> Tensor:
    """Teacher forcing inputs: prepend the start token and drop the last token. (B, T) -> (B, T).

    targets  I    love you  </s>
    inputs   <s>  I    love you        the model predicts targets[t] from inputs[: t + 1]

    With `valid` (B, T) (True = real target), the start token goes to each row's first real slot, so left-padded rows
    read  pad pad <s> I love  for targets  pad pad I love you."""
    shifted = torch.cat((torch.full_like(tokens[:, :1], start_id), tokens[:, :-1]), dim=1)
    if valid is None:
        return shifted
    first = valid & ~torch.cat((torch.zeros_like(valid[:, :1]), valid[:, :-1]), dim=1)  # first real slot
    return torch.where(first, torch.full_like(tokens, start_id), shifted)


def teacher_forcing(
    targets: Tensor, start_id: int, valid: Tensor | None, ignore_index: int, vocab_size: int
) -> tuple[Tensor, Tensor]:
    """(inputs, labels) for teacher forcing: inputs are the targets shifted right behind `start_id`; labels are the
    targets with padding replaced by `ignore_index`. The inputs' padding is `valid` itself."""
    if not 0 <= start_id < vocab_size:
        raise InputError(f"start_id={start_id} is outside the vocabulary [0, {vocab_size})")
    if bool((targets == ignore_index).any()):
        raise InputError(
            f"targets contain ignore_index={ignore_index}: with start_id the inputs are built from the targets, so "
            "every target must be a token id. Mark padding with padding_mask, or pass the inputs explicitly"
        )
    check_tokens(targets, vocab_size, "targets")
    labels = targets if valid is None else targets.masked_fill(~valid, ignore_index)
    return shift_right(targets, start_id, valid), labels


@dataclass(frozen=True)
class LossOutput:
    """The terms of a training loss. `total` is what to backpropagate."""

    total: Tensor
    ce: Tensor  # next-token cross-entropy (nats per token)
    aux: Tensor  # MoE balance + z losses, already weighted by their coefficients
    mtp: Tensor  # multi-token-prediction cross-entropy, mean over depths (unweighted; 0 without MTP)
    n_tokens: int  # target tokens that counted


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, label_smoothing: float = 0.0) -> Tensor:
    """Mean token cross-entropy in fp32 over the targets that count. logits (B, T, V), targets (B, T). A batch whose
    targets are all `ignore_index` (a chat example cut before the assistant speaks) gives 0, not 0 / 0."""
    flat = targets.flatten()
    total = F.cross_entropy(
        logits.flatten(0, 1).float(),
        flat,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    return total / (flat != ignore_index).sum().clamp(min=1)


def answer_logps(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's summed log-probability of its target tokens (targets -100 do not count), in fp32, and how many
    there are: logits (B, T, V), targets (B, T) -> (B,), (B,)."""
    counted = targets != -100
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * counted).sum(dim=-1), counted.sum(dim=-1)


def distillation_kl(
    student: Tensor, teacher: Tensor, targets: Tensor, temperature: float = 1.0, ignore_index: int = -100
) -> Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)) per counted position, averaged (Hinton et al., 2015):
    how far a model's next-token distributions are from a teacher's. student, teacher (B, T, V) logits; targets
    (B, T): `ignore_index` where nothing counts (padding, a chat's prompt). T^2 keeps the gradient's scale
    independent of T. 0 when nothing counts."""
    keep = (targets != ignore_index).flatten()  # (B*T,)
    s = F.log_softmax(student.flatten(0, 1)[keep].float() / temperature, dim=-1)  # (N, V)
    t = F.log_softmax(teacher.flatten(0, 1)[keep].float() / temperature, dim=-1)  # (N, V)
    kl = F.kl_div(s, t, log_target=True, reduction="sum")  # sum over positions and tokens
    return kl * temperature**2 / keep.sum().clamp(min=1)


def moe_loss(extras: Extras, moe: MoEConfig | None, like: Tensor) -> Tensor:
    """The MoE layers' balance and z losses recorded in `extras`, weighted by the config's coefficients."""
    if moe is None:
        return like.new_zeros((), dtype=torch.float32)
    return extras.moe_loss(moe.aux_loss_coef, moe.z_loss_coef, like)


def seq2seq_loss(
    model: Any,
    source: Tensor,
    targets: Tensor,
    *,
    start_id: int,
    source_mask: Tensor | None,
    target_mask: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    moe: MoEConfig | None = None,
) -> LossOutput:
    """An encoder-decoder's teacher-forced loss (the Transformer's or the RNN's): the decoder reads the targets
    shifted right behind `start_id` and predicts every target token in parallel; target_mask (B, T) marks real
    target tokens, and pads do not count. The total adds the MoE losses when `moe` is given."""
    check_label_smoothing(label_smoothing)
    if not isinstance(targets, Tensor):
        raise InputError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
    valid = check_mask(target_mask, targets, "target_mask")
    inputs, labels = teacher_forcing(targets, start_id, valid, ignore_index, model.cfg.vocab_size)
    extras = Extras()
    logits = model(source, inputs, source_mask=source_mask, target_mask=valid, extras=extras)
    ce = cross_entropy(logits, labels, ignore_index, label_smoothing)
    aux = moe_loss(extras, moe, ce)
    zero = ce.new_zeros(())
    return LossOutput(total=ce + aux, ce=ce, aux=aux, mtp=zero, n_tokens=int((labels != ignore_index).sum()))
