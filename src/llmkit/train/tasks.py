"""Training tasks: how a batch is drawn and what loss it gives. The loop is the same for every task.

    LanguageModelTask   next-token prediction on a token stream (decoder-only models), with every extra term
                        the architecture needs: MoE balance and z losses, the MTP loss, and the sparse-attention
                        indexer's KL loss (dense warm-up, then sparse)
    TranslationTask     sentence pairs (encoder-decoder models: the Transformer or the RNN), batched by token
                        count from length buckets; teacher forcing behind the start token <s>

The model is wrapped in a module whose forward returns the loss terms, so that DDP and FSDP see one forward call per
micro-batch. A task gives the loop its batches (with their token counts) and its evaluation batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from llmkit.data.parallel import ParallelData
from llmkit.layers.attention.sparse import DeepSeekSparseAttention
from llmkit.models import DecoderLM, EncoderDecoder, RNNSeq2Seq
from llmkit.train.buckets import BucketedPairs, length_batches
from llmkit.train.config import TrainConfig
from llmkit.train.data import TokenData, eval_offsets, train_batch, window_batch
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

    def __init__(self, data: TokenData, cfg: TrainConfig, rt: Runtime, model: DecoderLM) -> None:
        self.data, self.cfg, self.rt = data, cfg, rt
        data.check_window(cfg.data.seq_len)
        self.module = TrainingModule(model, cfg)

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """(inputs, targets) of this process for (step, micro-step), and how many tokens they hold."""
        d = self.cfg.data
        x, y = train_batch(
            self.data, d.seq_len, d.batch_size, self.cfg.train.seed, step, micro, self.rt.rank, self.rt.world
        )
        tensors = (x.to(self.rt.device, non_blocking=True), y.to(self.rt.device, non_blocking=True))
        return tensors, d.batch_size * d.seq_len

    @property
    def eval_split(self) -> str:
        return "val" if "val" in self.data.splits else "train"

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """Evenly spaced windows of the validation split (all of it when `full`), this process's share."""
        split = self.data.split(self.eval_split)
        T, B = self.cfg.data.seq_len, self.cfg.data.batch_size
        budget = len(split.tokens) if full else self.cfg.train.eval_tokens
        offsets = eval_offsets(len(split.tokens), T, budget)[self.rt.rank :: self.rt.world]
        for i in range(0, len(offsets), B):
            x, y = window_batch(split.tokens, offsets[i : i + B], T)
            yield x.to(self.rt.device), y.to(self.rt.device)

    @property
    def chars_per_token(self) -> float:
        return self.data.split(self.eval_split).chars_per_token


class Seq2SeqModule(nn.Module):
    """encoder-decoder + loss settings -> forward(source, source_mask, target, target_mask) returns the loss terms
    (total, ce, aux, mtp, indexer), or with evaluate=True the summed target-token NLL and the token count."""

    def __init__(self, model: EncoderDecoder | RNNSeq2Seq, cfg: TrainConfig, start_id: int) -> None:
        super().__init__()
        self.model, self.cfg, self.start_id = model, cfg, start_id

    def forward(
        self, source: Tensor, source_mask: Tensor, target: Tensor, target_mask: Tensor, evaluate: bool = False
    ) -> tuple[Tensor, ...]:
        smoothing = 0.0 if evaluate else self.cfg.loss.label_smoothing
        out = self.model.loss(source, target, start_id=self.start_id, source_mask=source_mask,
                              target_mask=target_mask, label_smoothing=smoothing)  # fmt: skip
        if evaluate:
            count = torch.tensor(float(out.n_tokens), device=out.ce.device)
            return out.ce.float() * count, count
        zero = out.ce.new_zeros(())
        return out.total, out.ce.detach(), out.aux.detach(), out.mtp.detach(), zero


class TranslationTask:
    """Sentence pairs batched by token count (see buckets.py); validation in fixed length-sorted batches."""

    def __init__(self, data: ParallelData, cfg: TrainConfig, rt: Runtime, model: EncoderDecoder | RNNSeq2Seq) -> None:
        self.data, self.cfg, self.rt = data, cfg, rt
        d = cfg.data
        self.train = BucketedPairs(data.side("train", "src"), data.side("train", "tgt"), d.batch_tokens, d.seq_len,
                                   cfg.train.seed, data.pad_id)  # fmt: skip
        self.module = Seq2SeqModule(model, cfg, data.bos_id)
        self.eval_split = "val" if len(data.side("val", "src")) else "train"
        self.val = BucketedPairs(data.side(self.eval_split, "src"), data.side(self.eval_split, "tgt"), d.batch_tokens,
                                 d.seq_len, 0, data.pad_id)  # fmt: skip

    def batch(self, step: int, micro: int) -> tuple[tuple[Tensor, ...], int]:
        """This process's batch for (step, micro-step), and its real tokens (source + target)."""
        g = (step * self.cfg.train.grad_accum + micro) * self.rt.world + self.rt.rank
        b = self.train.batch(g).to(self.rt.device)
        return (b.source, b.source_mask, b.target, b.target_mask), b.tokens

    def eval_batches(self, full: bool) -> Iterator[tuple[Tensor, ...]]:
        """The validation pairs in length-sorted batches (a spread-out subset of about train.eval_tokens target
        tokens unless `full`), this process's share."""
        batches = self.val.batches  # shortest to longest
        if not full:
            total = int(self.val.tgt.lengths[np.concatenate(batches)].sum())
            if total > self.cfg.train.eval_tokens:
                keep = max(1, round(len(batches) * self.cfg.train.eval_tokens / total))
                batches = [batches[int(i)] for i in np.linspace(0, len(batches) - 1, keep).astype(np.int64)]
        for rows in batches[self.rt.rank :: self.rt.world]:
            b = self.val.make(rows).to(self.rt.device)
            yield b.source, b.source_mask, b.target, b.target_mask

    @property
    def chars_per_token(self) -> float:
        return self.data.chars_per_token(self.eval_split)


__all__ = ["LanguageModelTask", "Seq2SeqModule", "TrainingModule", "TranslationTask", "length_batches"]
