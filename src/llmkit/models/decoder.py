"""Decoder-only language model: GPT-2/GPT-3, LLaMA-2, Mixtral, DeepSeek-V3/V3.2 by configuration.

    tokens ─► embedding (+ learned / sinusoidal positions) ─► N x TransformerBlock ─► final norm ─► head ─► logits
                                                                     │                  (pre-norm only)
                              RoPE tables (rotary positions) ────────┘
    with mtp_depth > 0:   normed hidden ─► MTP module 1 ─► MTP module 2 ─► ...   (each: shared embedding, head)

Every block is causal: position t sees tokens 0..t only, which is what lets training score all T next-token
predictions of a sequence in one parallel pass (teacher forcing), while generation proceeds token by token with a
cache of keys and values. Shapes: B batch, T tokens, C model dim, V vocabulary.
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
from llmkit.layers.attention.mask import padding_mask as make_padding_mask
from llmkit.layers.block import TransformerBlock
from llmkit.layers.mtp import MTPModule
from llmkit.layers.norm import build_norm
from llmkit.models.common import (
    InputEmbedding,
    LossOutput,
    SequenceState,
    build_rope,
    check_cache_args,
    check_label_smoothing,
    check_mask,
    check_positions,
    check_tokens,
    cross_entropy,
    init_weights,
    moe_aux_loss,
    positions_from_mask,
    reset_moe_stats,
    teacher_forcing,
)


@dataclass
class DecoderCache:
    """A decoder-only model's state between calls: one cache per layer, in its attention variant's layout, and the
    slot/position bookkeeping shared by all layers."""

    layers: list[object]
    state: SequenceState

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(c, "nbytes", 0)) for c in self.layers)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` in that order, in every layer (beam search)."""
        for c in self.layers:
            c.reorder(index)  # type: ignore[attr-defined]
        self.state.reorder(index)


class DecoderLM(nn.Module):
    """Causal language model. tokens (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.is_encoder_decoder:
            raise InputError("DecoderLM needs a config with encoder=None; use EncoderDecoder (or build_model)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.inputs = InputEmbedding(cfg, cfg.position.max_seq_len)
        self.rope = build_rope(cfg)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = build_norm(cfg.norm, cfg.d_model) if cfg.norm.placement == "pre" else nn.Identity()
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.head_bias else None
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.n_layers + k) for k in range(cfg.mtp_depth))
        init_weights(self, cfg)

    # ---- pieces

    def logits(self, h: Tensor) -> Tensor:
        """Final hidden states after the norm (B, T, C) -> logits (B, T, V). A tied head reuses the embedding."""
        weight = self.embed.weight if self.head is None else self.head.weight
        return F.linear(h, weight, self.head_bias)

    def _prepare(
        self,
        tokens: Tensor,
        padding_mask: Tensor | None,
        positions: Tensor | None,
        cache: DecoderCache | None,
    ) -> tuple[Tensor, AttentionInputs]:
        check_tokens(tokens, self.cfg.vocab_size)
        valid = check_mask(padding_mask, tokens)
        B, T = tokens.shape
        start = 0
        if cache is not None:
            if cache.state.valid.shape[0] != B:
                raise InputError(f"the cache was made for batch {cache.state.valid.shape[0]}, tokens have batch {B}")
            start, auto_positions, mask = cache.state.advance(T, valid)
        else:
            mask = AttentionMask(causal=True) if valid is None else make_padding_mask(valid, causal=True)
            auto_positions = (
                torch.arange(T, device=tokens.device).unsqueeze(0) if valid is None else positions_from_mask(valid)
            )
        if positions is None:
            positions = auto_positions
        elif tuple(positions.shape) not in ((T,), (B, T), (1, T)):
            raise InputError(f"positions must have shape (seq_len,) or (batch, seq_len), got {tuple(positions.shape)}")
        positions = positions if positions.dim() == 2 else positions.unsqueeze(0)
        check_positions(positions, self.cfg)
        rope = self.rope(positions) if self.rope is not None else None
        x = self.inputs(self.embed, tokens, positions)
        return x, AttentionInputs(mask=mask, rope=rope, cache_start=start)

    def forward_hidden(
        self,
        tokens: Tensor,
        *,
        padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> tuple[Tensor, AttentionInputs]:
        """Run the blocks. Returns the last block's output (B, T, C), before the final norm, and the attention
        inputs that were used (the MTP modules reuse them)."""
        x, inputs = self._prepare(tokens, padding_mask, positions, cache)
        for i, block in enumerate(self.blocks):
            x = block(x, inputs, cache.layers[i] if cache is not None else None)
        return x, inputs

    def forward(
        self,
        tokens: Tensor,
        *,
        padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """tokens (B, T) int -> logits (B, T, V).

        padding_mask (B, T) bool, True at real tokens (pad on the left to batch prompts of different lengths).
        positions (T,) or (B, T): defaults to 0.. counted over real tokens, continuing from the cache.
        cache: from `new_cache`; the tokens are appended to it (decoding step by step)."""
        h, _ = self.forward_hidden(tokens, padding_mask=padding_mask, positions=positions, cache=cache)
        return self.logits(self.norm(h))

    def new_cache(
        self,
        batch: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> DecoderCache:
        """A preallocated cache for `batch` sequences of up to `max_len` tokens, on the model's device and dtype
        unless given."""
        dtype = check_cache_args(self, batch, max_len, dtype)
        device = torch.device(device) if device is not None else self.embed.weight.device
        layers: list[object] = [
            cast(TransformerBlock, b).attn.new_cache(batch, max_len, device, dtype) for b in self.blocks
        ]
        return DecoderCache(layers, SequenceState.new(batch, max_len, device))

    # ---- training

    def loss(
        self,
        targets: Tensor,
        *,
        start_id: int | None = None,
        inputs: Tensor | None = None,
        padding_mask: Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        mtp_weight: float = 0.3,
    ) -> LossOutput:
        """Teacher-forcing loss. targets (B, T): the tokens to predict.

        Give `start_id` to build the inputs by shifting the targets right behind a start token (the seeds'
        convention: inputs "<s> I love", targets "I love you"), or give the `inputs` (B, T) directly (then targets
        equal to `ignore_index` do not count). padding_mask (B, T) marks real tokens; pads do not count. The total
        adds the MoE losses (weighted by moe.aux_loss_coef / z_loss_coef) and mtp_weight times the MTP loss."""
        check_label_smoothing(label_smoothing)
        if (start_id is None) == (inputs is None):
            raise InputError("give exactly one of start_id (teacher forcing by shifting right) or inputs")
        if not isinstance(targets, Tensor):
            raise InputError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
        valid = check_mask(padding_mask, targets)
        if start_id is not None:
            inputs, labels = teacher_forcing(targets, start_id, valid, ignore_index, self.cfg.vocab_size)
        else:
            assert inputs is not None
            if not isinstance(inputs, Tensor) or inputs.shape != targets.shape:
                shape = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
                raise InputError(f"inputs {shape} and targets {tuple(targets.shape)} must have the same shape")
            check_tokens(targets.masked_fill(targets == ignore_index, 0), self.cfg.vocab_size, "targets")
            labels = targets if valid is None else targets.masked_fill(~valid, ignore_index)
        reset_moe_stats(self)
        h, _ = self.forward_hidden(inputs, padding_mask=valid)
        h = self.norm(h)
        ce = cross_entropy(self.logits(h), labels, ignore_index, label_smoothing)
        mtp = self._mtp_loss(h, inputs, labels, valid, ignore_index) if len(self.mtp) else ce.new_zeros(())
        aux = moe_aux_loss(self, self.cfg, ce)  # after the MTP modules, whose MoE layers count too
        total = ce + aux + (mtp_weight * mtp if len(self.mtp) else 0.0)
        return LossOutput(total=total, ce=ce, aux=aux, mtp=mtp, n_tokens=int((labels != ignore_index).sum()))

    def _mtp_loss(self, h: Tensor, inputs: Tensor, labels: Tensor, valid: Tensor | None, ignore_index: int) -> Tensor:
        """Mean over depths k of the cross-entropy of MTP module k. h (B, T, C) is the main model's final (normed)
        hidden state; module k at position i sees depth k-1's state and the embedding of inputs[i + k], and predicts
        labels[i + k] (with inputs = labels shifted right: the token k + 1 ahead). Predictions made at padded
        positions do not count."""
        T = inputs.shape[1]
        positions = torch.arange(T, device=inputs.device).unsqueeze(0) if valid is None else positions_from_mask(valid)
        losses = []
        for k, module in enumerate(cast(list[MTPModule], self.mtp), start=1):
            n = T - k  # positions that still have a target k tokens ahead
            if n < 1:
                break
            mask = AttentionMask(causal=True) if valid is None else make_padding_mask(valid[:, :n], causal=True)
            rope = self.rope(positions[:, :n]) if self.rope is not None else None
            emb = self.inputs(self.embed, inputs[:, k:], positions[:, k:])  # (B, n, C): tokens i + k
            h = module(h[:, :n], emb, AttentionInputs(mask=mask, rope=rope))  # (B, n, C), normed
            target = labels[:, k:] if valid is None else labels[:, k:].masked_fill(~valid[:, :n], ignore_index)
            losses.append(cross_entropy(self.logits(h), target, ignore_index))
        return torch.stack(losses).mean() if losses else h.new_zeros((), dtype=torch.float32)
