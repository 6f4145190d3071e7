"""Knowledge distillation (Hinton et al., 2015): a model learns a teacher's next-token distributions, not only the
data's next tokens. It is how a small draft model for speculative decoding is made to agree with its target: the
more often the draft's guess is the target's, the more tokens each verification accepts.

    loss = w * T^2 * KL( softmax(teacher / T) || softmax(student / T) ) + (1 - w) * cross-entropy(student, data)

averaged over the positions whose targets count. T > 1 softens both distributions so the student also learns how the
teacher ranks the unlikely tokens; T^2 keeps the gradient's scale independent of T. Shapes: B batch, T tokens,
V vocabulary. The KL itself is `llmkit.models.loss.distillation_kl` (also what a self-distilled MTP module learns).
"""

from __future__ import annotations

import torch

from llmkit.models.loss import distillation_kl

__all__ = ["distillation_kl", "load_teacher"]


def load_teacher(path: str, device: torch.device) -> torch.nn.Module:
    """A frozen teacher in eval mode on `device` (float weights; a GGUF file dequantized)."""
    from llmkit.interop.load import load_model
    from llmkit.runs import resolve_checkpoint

    model = load_model(resolve_checkpoint(path), dtype=torch.float32, quantized=False).model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
