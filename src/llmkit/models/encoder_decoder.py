"""Encoder-decoder Transformer, as in "Attention Is All You Need" (Vaswani et al. 2017, Figure 1).

    source ─► embed * sqrt(C) + sinusoids ─► N x [self-attention, FFN] ──────────────► memory (B, S, C)
                                                                                          │
    target (shifted right) ─► embed * sqrt(C) + sinusoids ─► N x [masked self-attention,  ▼
                                                                  cross-attention over memory,
                                                                  FFN] ─► linear (tied to the embedding) ─► logits

The encoder reads the whole source at once; the decoder is causal over the target and reads the source through
cross-attention. In the paper every sub-layer is post-norm, LayerNorm(x + Sublayer(x)), the FFN uses ReLU, and one
embedding matrix is shared by the source, the target and the output projection (a joint BPE vocabulary).
Shapes: B batch, S source tokens, T target tokens, C model dim, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import InputError
from llmkit.layers.attention import AttentionInputs, AttentionMask
from llmkit.layers.attention.cross import CrossCache
from llmkit.layers.attention.mask import padding_mask as make_padding_mask
from llmkit.layers.block import CrossAttentionBlock, TransformerBlock
from llmkit.layers.norm import build_norm
from llmkit.models.common import (
    InputEmbedding,
    LossOutput,
    SequenceState,
    build_rope,
    check_cache_args,
    check_mask,
    check_positions,
    check_tokens,
    init_weights,
    moe_aux_loss,
    positions_from_mask,
    seq2seq_teacher_forcing,
)


@dataclass
class EncoderDecoderCache:
    """Decoder state between decoding steps: self-attention caches, the cross-attention keys/values of the memory
    (computed once per source), and the slot bookkeeping."""

    layers: list[object]
    cross: list[CrossCache]
    state: SequenceState

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(c, "nbytes", 0)) for c in self.layers) + sum(c.nbytes for c in self.cross)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` in that order, in every layer and cross-attention cache (beam search)."""
        for c in self.layers:
            c.reorder(index)  # type: ignore[attr-defined]
        for x in self.cross:
            x.reorder(index)
        self.state.reorder(index)


class EncoderDecoder(nn.Module):
    """Sequence-to-sequence Transformer. source (B, S), target inputs (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.encoder is None:
            raise InputError("EncoderDecoder needs a config with an encoder; use DecoderLM (or build_model)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)  # target (and shared source) embedding
        self.src_embed = nn.Embedding(cfg.encoder.vocab_size, cfg.d_model) if cfg.encoder.vocab_size else None
        self.inputs = InputEmbedding(cfg, cfg.position.max_seq_len)
        self.rope = build_rope(cfg)
        self.encoder = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.encoder.n_layers))
        self.decoder = nn.ModuleList(CrossAttentionBlock(cfg, i) for i in range(cfg.n_layers))
        pre = cfg.norm.placement == "pre"  # pre-norm stacks end with a norm; post-norm blocks already end in one
        self.encoder_norm = build_norm(cfg.norm, cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = build_norm(cfg.norm, cfg.d_model) if pre else nn.Identity()
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.head_bias else None
        init_weights(self, cfg)

    @property
    def source_embedding(self) -> nn.Embedding:
        return self.src_embed if self.src_embed is not None else self.embed

    @property
    def source_vocab_size(self) -> int:
        return self.source_embedding.num_embeddings

    def logits(self, h: Tensor) -> Tensor:
        weight = self.embed.weight if self.head is None else self.head.weight
        return F.linear(h, weight, self.head_bias)

    # ---- encoder

    def encode(self, source: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """source (B, S) int, source_mask (B, S) bool (True = real token) -> memory (B, S, C)."""
        check_tokens(source, self.source_vocab_size, "source")
        valid = check_mask(source_mask, source, "source_mask")
        S = source.shape[1]
        positions = torch.arange(S, device=source.device).unsqueeze(0) if valid is None else positions_from_mask(valid)
        check_positions(positions, self.cfg)
        mask = AttentionMask() if valid is None else make_padding_mask(valid)  # the encoder sees the whole source
        inputs = AttentionInputs(mask=mask, rope=self.rope(positions) if self.rope is not None else None)
        x = self.inputs(self.source_embedding, source, positions)
        for block in self.encoder:
            x = block(x, inputs)
        return self.encoder_norm(x)

    # ---- decoder

    def decode(
        self,
        target: Tensor,
        memory: Tensor,
        *,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
    ) -> Tensor:
        """Decoder inputs target (B, T) int and memory (B, S, C) -> logits (B, T, V). With a cache, the target tokens
        are appended to it and the memory's keys/values are computed only on the first call."""
        return self.logits(
            self.decode_hidden(target, memory, source_mask=source_mask, target_mask=target_mask, cache=cache)
        )

    def decode_hidden(
        self,
        target: Tensor,
        memory: Tensor,
        *,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
    ) -> Tensor:
        """Like `decode` but returns the final hidden states (B, T, C)."""
        check_tokens(target, self.cfg.vocab_size, "target")
        valid = check_mask(target_mask, target, "target_mask")
        if memory.dim() != 3 or memory.shape[0] != target.shape[0] or memory.shape[2] != self.cfg.d_model:
            raise InputError(
                f"memory must be (batch={target.shape[0]}, source_len, d_model={self.cfg.d_model}), "
                f"got {tuple(memory.shape)}"
            )
        if source_mask is not None and tuple(source_mask.shape) != tuple(memory.shape[:2]):
            raise InputError(f"source_mask {tuple(source_mask.shape)} does not match memory {tuple(memory.shape[:2])}")
        T = target.shape[1]
        start = 0
        if cache is not None:
            if cache.state.valid.shape[0] != target.shape[0]:
                raise InputError(
                    f"the cache was made for batch {cache.state.valid.shape[0]}, target has batch {target.shape[0]}"
                )
            start, positions, mask = cache.state.advance(T, valid)
        else:
            mask = AttentionMask(causal=True) if valid is None else make_padding_mask(valid, causal=True)
            positions = (
                torch.arange(T, device=target.device).unsqueeze(0) if valid is None else positions_from_mask(valid)
            )
        check_positions(positions, self.cfg)
        inputs = AttentionInputs(
            mask=mask, rope=self.rope(positions) if self.rope is not None else None, cache_start=start
        )
        memory_mask = None if source_mask is None else AttentionMask(allowed=source_mask.bool()[:, None, None, :])
        x = self.inputs(self.embed, target, positions)
        for i, block in enumerate(self.decoder):
            layer_cache = cache.layers[i] if cache is not None else None
            cross_cache = cache.cross[i] if cache is not None else None
            x = block(x, inputs, memory, memory_mask, layer_cache, cross_cache)
        return self.decoder_norm(x)

    def forward(
        self,
        source: Tensor,
        target: Tensor,
        *,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
    ) -> Tensor:
        """source (B, S), decoder inputs target (B, T) -> logits (B, T, V). Masks are True at real tokens."""
        memory = self.encode(source, source_mask)
        return self.decode(target, memory, source_mask=source_mask, target_mask=target_mask)

    def new_cache(
        self,
        batch: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> EncoderDecoderCache:
        """A preallocated decoder cache for `batch` targets of up to `max_len` tokens."""
        dtype = check_cache_args(self, batch, max_len, dtype)
        device = torch.device(device) if device is not None else self.embed.weight.device
        layers: list[object] = [
            cast(CrossAttentionBlock, b).attn.new_cache(batch, max_len, device, dtype) for b in self.decoder
        ]
        return EncoderDecoderCache(
            layers, [CrossCache() for _ in self.decoder], SequenceState.new(batch, max_len, device)
        )

    # ---- training

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
        token in parallel. target_mask (B, T) marks real target tokens; pads do not count."""
        _, labels, ce = seq2seq_teacher_forcing(
            self, source, targets, start_id, source_mask, target_mask, ignore_index, label_smoothing
        )
        aux = moe_aux_loss(self, self.cfg, ce)
        zero = ce.new_zeros(())
        return LossOutput(total=ce + aux, ce=ce, aux=aux, mtp=zero, n_tokens=int((labels != ignore_index).sum()))
