"""Knowledge distillation (Hinton et al., 2015): a model learns a teacher's next-token distributions, not only the
data's next tokens. It is how a small draft model for speculative decoding is made to agree with its target: the
more often the draft's guess is the target's, the more tokens each verification accepts.

    loss = w * T^2 * KL( softmax(teacher / T) || softmax(student / T) ) + (1 - w) * cross-entropy(student, data)

averaged over the positions whose targets count. T > 1 softens both distributions so the student also learns how the
teacher ranks the unlikely tokens; T^2 keeps the gradient's scale independent of T. Shapes: B batch, T tokens,
V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def distillation_kl(student: Tensor, teacher: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """T^2 * KL(teacher || student) per counted position, averaged. student, teacher (B, T, V) logits; targets (B, T)
    with -100 where nothing counts (padding, a chat's prompt)."""
    keep = (targets != -100).flatten()  # (B*T,)
    s = F.log_softmax(student.flatten(0, 1)[keep].float() / temperature, dim=-1)  # (N, V)
    t = F.log_softmax(teacher.flatten(0, 1)[keep].float() / temperature, dim=-1)  # (N, V)
    kl = F.kl_div(s, t, log_target=True, reduction="sum")  # sum over positions and tokens
    return kl * temperature**2 / keep.sum().clamp(min=1)


def load_teacher(path: str, device: torch.device) -> torch.nn.Module:
    """A frozen teacher in eval mode on `device` (float weights; a GGUF file dequantized)."""
    from llmkit.interop.load import load_model
    from llmkit.runs import resolve_checkpoint

    model = load_model(resolve_checkpoint(path), dtype=torch.float32, quantized=False).model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
