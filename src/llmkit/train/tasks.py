"""Training tasks: how a batch is drawn and what loss it gives. The loop is the same for every task.

    LanguageModelTask   next-token prediction on a token stream (decoder-only models), with every extra term
                        the architecture needs: MoE balance and z losses, the MTP loss, and the sparse-attention
                        indexer's KL loss (dense warm-up, then sparse)

The model is wrapped in a `TrainingModule` whose forward returns the loss terms, so that DDP and FSDP see one forward
call per micro-batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from llmkit.layers.attention.sparse import DeepSeekSparseAttention
from llmkit.models import DecoderLM
from llmkit.train.config import TrainConfig
from llmkit.train.data import TokenData, train_batch
from llmkit.train.parallel import Runtime

TERMS = ("loss", "ce", "aux", "mtp", "indexer")


def sparse_attention_layers(model: nn.Module) -> list[DeepSeekSparseAttention]:
    return [m for m in model.modules() if isinstance(m, DeepSeekSparseAttention)]


class TrainingModule(nn.Module):
    """model + loss settings -> forward(inputs, targets) returns (total, ce, aux, mtp, indexer) scalars."""

    def __init__(self, model: DecoderLM, cfg: TrainConfig) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.sparse = sparse_attention_layers(model)
        self.indexer_only = False  # the indexer's warm-up: only its loss trains

    def set_indexer_phase(self, phase: Literal["off", "dense", "sparse"]) -> None:
        for layer in self.sparse:
            layer.indexer_training = phase
        self.indexer_only = phase == "dense"

    def forward(self, inputs: Tensor, targets: Tensor, evaluate: bool = False) -> tuple[Tensor, ...]:
        if evaluate:  # summed next-token loss and the token count (through the wrapper, so FSDP gathers weights)
            logits = self.model(inputs)
            nll = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            return nll, torch.tensor(float(targets.numel()), device=nll.device)
        c = self.cfg.loss
        out = self.model.loss(targets, inputs=inputs, label_smoothing=c.label_smoothing, mtp_weight=c.mtp_weight)
        losses = [layer.last_indexer_loss for layer in self.sparse if layer.last_indexer_loss is not None]
        indexer = torch.stack(losses).mean() if losses else out.ce.new_zeros(())
        total = out.total + c.indexer_weight * indexer
        if self.indexer_only:  # the rest of the model gets zero gradients (and a zero learning rate)
            total = out.total * 0.0 + c.indexer_weight * indexer
        return total, out.ce.detach(), out.aux.detach(), out.mtp.detach(), indexer.detach()


class LanguageModelTask:
    """Random windows of the training stream; inputs and targets shifted by one token."""

    def __init__(self, data: TokenData, cfg: TrainConfig, rt: Runtime) -> None:
        self.data, self.cfg, self.rt = data, cfg, rt
        data.check_window(cfg.data.seq_len)

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one micro-step consumes across all processes."""
        return self.cfg.data.batch_size * self.cfg.data.seq_len * self.rt.world

    def batch(self, step: int, micro: int) -> tuple[Tensor, Tensor]:
        d = self.cfg.data
        x, y = train_batch(
            self.data, d.seq_len, d.batch_size, self.cfg.train.seed, step, micro, self.rt.rank, self.rt.world
        )
        return x.to(self.rt.device, non_blocking=True), y.to(self.rt.device, non_blocking=True)
