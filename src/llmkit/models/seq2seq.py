"""What every encoder-decoder offers (the Transformer and the RNN it replaced), so that decoding, translation and
training treat them alike:

    memory = model.encode(source, source_mask)                       (B, S) -> (B, S, width)
    logits = model.decode(target, memory, source_mask=, target_mask=, cache=, extras=)   (B, T) -> (B, T, V)
    logits = model(source, target, ...)                              encode, then decode
    out    = model.loss(source, targets, start_id=...)               teacher forcing behind the start token

A model implements `encode`, `decoder_states` (the decoder's final states for checked inputs) and `logits`; the
input checks, `forward` and the loss are here, once.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.layers.extras import Extras
from llmkit.models.checks import check_mask, check_tokens
from llmkit.models.loss import LossOutput, seq2seq_loss


@dataclass(frozen=True)
class DecoderCall:
    """Checked decoder inputs: target (B, T) ids, memory (B, S, width), source_mask (B, S) and target_mask (B, T)
    bool (True at real tokens) or None."""

    target: Tensor
    memory: Tensor
    source_mask: Tensor | None
    target_mask: Tensor | None


class Seq2SeqModel(nn.Module, abc.ABC):
    """Base of the encoder-decoder models."""

    cfg: Any
    memory_width: int  # the encoder output's last dimension
    embed: nn.Embedding  # the target embedding (and the source's, unless src_embed is set)
    src_embed: nn.Embedding | None  # a source embedding of its own (separate vocabularies)

    @property
    def source_embedding(self) -> nn.Embedding:
        return self.src_embed if self.src_embed is not None else self.embed

    @property
    def source_vocab_size(self) -> int:
        return self.source_embedding.num_embeddings

    @abc.abstractmethod
    def encode(self, source: Tensor, source_mask: Tensor | None = None, extras: Extras | None = None) -> Tensor:
        """source (B, S) int, source_mask (B, S) bool (True = real token) -> memory (B, S, width)."""

    @abc.abstractmethod
    def decoder_states(self, call: DecoderCall, cache: Any = None, extras: Extras | None = None) -> Tensor:
        """The decoder's final states (B, T, H) for checked inputs; a cache carries state between calls."""

    @abc.abstractmethod
    def logits(self, h: Tensor) -> Tensor:
        """Final decoder states (B, T, H) -> logits (B, T, V)."""

    def decode(
        self,
        target: Tensor,
        memory: Tensor,
        *,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        cache: Any = None,
        extras: Extras | None = None,
    ) -> Tensor:
        """Decoder inputs target (B, T) int and memory (B, S, width) -> logits (B, T, V). With a cache the target
        tokens are appended to it (decoding step by step), and what depends on the memory alone is computed on the
        first call only."""
        check_tokens(target, self.cfg.vocab_size, "target")
        valid = check_mask(target_mask, target, "target_mask")
        B = target.shape[0]
        if memory.dim() != 3 or memory.shape[0] != B or memory.shape[2] != self.memory_width:
            raise InputError(
                f"memory must be (batch={B}, source_len, width={self.memory_width}), got {tuple(memory.shape)}"
            )
        if source_mask is not None and tuple(source_mask.shape) != tuple(memory.shape[:2]):
            raise InputError(f"source_mask {tuple(source_mask.shape)} does not match memory {tuple(memory.shape[:2])}")
        source_valid = None if source_mask is None else source_mask.bool()
        return self.logits(self.decoder_states(DecoderCall(target, memory, source_valid, valid), cache, extras))

    def forward(
        self,
        source: Tensor,
        target: Tensor,
        *,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        extras: Extras | None = None,
    ) -> Tensor:
        """source (B, S), decoder inputs target (B, T) -> logits (B, T, V). Masks are True at real tokens."""
        memory = self.encode(source, source_mask, extras)
        return self.decode(target, memory, source_mask=source_mask, target_mask=target_mask, extras=extras)

    def loss(
        self,
        source: Tensor,
        targets: Tensor,
        *,
        start_id: int,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> LossOutput:
        """Teacher forcing: the decoder reads the targets shifted right behind `start_id` and predicts every target
        token in parallel. target_mask (B, T) marks real target tokens; pads do not count. The total adds the MoE
        losses of a Transformer with MoE layers."""
        return seq2seq_loss(
            self,
            source,
            targets,
            start_id=start_id,
            source_mask=source_mask,
            target_mask=target_mask,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            moe=getattr(self.cfg, "moe", None),
        )
