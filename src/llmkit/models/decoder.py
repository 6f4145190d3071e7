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

from typing import cast

import torch
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import InputError
from llmkit.layers.block import TransformerBlock
from llmkit.layers.embedding import InputEmbedding, build_rope
from llmkit.layers.extras import Extras
from llmkit.layers.mtp import MTPModule
from llmkit.layers.norm import build_norm
from llmkit.layers.tables import token_table
from llmkit.models.base import TokenModel
from llmkit.models.cache import Cache, Step, packed_sequence, whole_sequence
from llmkit.models.checks import check_label_smoothing, check_mask, check_segments, check_tokens
from llmkit.models.init import init_weights
from llmkit.models.loss import LossOutput, cross_entropy, distillation_kl, moe_loss, teacher_forcing


class DecoderLM(TokenModel):
    """Causal language model. tokens (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.is_encoder_decoder:
            raise InputError("DecoderLM needs a config with encoder=None; use EncoderDecoder (or build_model)")
        self.cfg = cfg
        self.embed = token_table(cfg.vocab_size, cfg.d_model)
        self.inputs = InputEmbedding(cfg, cfg.position.max_seq_len)
        self.rope = build_rope(cfg)
        self.rope_local = build_rope(cfg, local=True)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = build_norm(cfg.norm, cfg.d_model) if cfg.norm.placement != "post" else nn.Identity()
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.head_bias else None
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.n_layers + k) for k in range(cfg.mtp_depth))
        init_weights(self, cfg)

    def layer_stacks(self) -> dict[str, nn.ModuleList]:
        """The repeated layers, by stack name (what `llmkit compare` lines up with another implementation's)."""
        return {"layer": self.blocks}

    # ---- forward

    def run(
        self, tokens: Tensor, step: Step, layers: list[object] | None = None, extras: Extras | None = None
    ) -> Tensor:
        """The blocks over tokens (B, T) at `step`, writing each layer's keys into `layers` (caches) when given.
        Returns the last block's output (B, T, C), before the final norm. Checks nothing and reads nothing back
        from the device: this is what a decode step runs."""
        inputs = self.attention_inputs(step)
        x = self.inputs(self.embed, tokens, step.positions)
        for i, block in enumerate(self.blocks):
            x = block(x, inputs, layers[i] if layers is not None else None, extras)
        return x

    def forward(
        self,
        tokens: Tensor,
        *,
        padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        extras: Extras | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """tokens (B, T) int -> logits (B, T, V).

        padding_mask (B, T) bool, True at real tokens (pad on the left to batch prompts of different lengths).
        positions (T,) or (B, T): defaults to 0.. counted over real tokens, continuing from the cache.
        cache: from `new_cache`; the tokens are appended to it (decoding step by step).
        extras: side outputs to collect (attention weights, MoE statistics; see llmkit.layers.extras).
        segments (B, T) int: packed examples (see `packed_sequence`): each attends only within itself, and its
        positions start at 0; not with a cache, padding_mask or positions."""
        valid = self.check_tokens(tokens, padding_mask)
        if segments is not None:
            if cache is not None or valid is not None or positions is not None:
                raise InputError("segments (packed examples) go without a cache, padding_mask or positions")
            step = packed_sequence(check_segments(segments, tokens))
        else:
            step = self.step_for(tokens, valid, positions, cache.state if cache is not None else None)
        h = self.run(tokens, step, cache.layers if cache is not None else None, extras)
        return self.logits(self.norm(h))

    def decoding_blocks(self) -> nn.ModuleList:
        return self.blocks

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
        extras: Extras | None = None,
        segments: Tensor | None = None,
        mtp_target: str = "data",
    ) -> LossOutput:
        """Teacher-forcing loss. targets (B, T): the tokens to predict.

        Give `start_id` to build the inputs by shifting the targets right behind a start token (inputs
        "<s> I love", targets "I love you"), or give the `inputs` (B, T) directly (then targets equal to
        `ignore_index` do not count). padding_mask (B, T) marks real tokens; pads do not count. The total adds the
        MoE losses (weighted by moe.aux_loss_coef / z_loss_coef) and mtp_weight times the MTP loss. `extras`
        receives what the layers report (a fresh one is used when not given). segments (B, T) int packs several
        examples into a row (with `inputs`): none attends to another, and a prediction of a token of another example
        (an MTP module's near a boundary) does not count. mtp_target "model": the MTP modules learn the model's own
        distribution of the token they predict instead of the data's token (see _mtp_loss)."""
        if mtp_target not in ("data", "model"):
            raise InputError(f"mtp_target={mtp_target!r} must be 'data' or 'model'")
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
        if segments is not None:
            if start_id is not None or valid is not None:
                raise InputError("segments (packed examples) go with inputs and without a padding_mask")
            segments = check_segments(segments, targets)
        extras = extras if extras is not None else Extras()
        step = (
            packed_sequence(segments) if segments is not None else whole_sequence(inputs.shape[1], valid, inputs.device)
        )
        h = self.norm(self.run(inputs, step, None, extras))
        logits = self.logits(h)  # (B, T, V)
        ce = cross_entropy(logits, labels, ignore_index, label_smoothing)
        teacher = logits.detach() if mtp_target == "model" else None
        mtp = (
            self._mtp_loss(h, inputs, labels, valid, ignore_index, extras, segments, teacher)
            if len(self.mtp)
            else ce.new_zeros(())
        )
        aux = moe_loss(extras, self.cfg.moe, ce)  # after the MTP modules, whose MoE layers count too
        total = ce + aux + (mtp_weight * mtp if len(self.mtp) else 0.0)
        return LossOutput(total=total, ce=ce, aux=aux, mtp=mtp, n_tokens=int((labels != ignore_index).sum()))

    def _mtp_loss(
        self,
        h: Tensor,
        inputs: Tensor,
        labels: Tensor,
        valid: Tensor | None,
        ignore_index: int,
        extras: Extras,
        segments: Tensor | None = None,
        teacher: Tensor | None = None,
    ) -> Tensor:
        """Mean over depths k of the cross-entropy of MTP module k. h (B, T, C) is the main model's final (normed)
        hidden state; module k at position i sees depth k-1's state and the embedding of inputs[i + k], and predicts
        labels[i + k] (with inputs = labels shifted right: the token k + 1 ahead). Predictions made at padded
        positions do not count.

        With `teacher` (B, T, V), the main model's own logits, module k learns instead the model's distribution of
        that same token: KL(teacher[i + k] || module k at i), self-distillation. A module drafting for
        self-speculative decoding is right when it guesses what the model will say, not what the text says, and the
        model's distribution is also the easier one to learn (lower entropy, no noise of the data)."""
        T = inputs.shape[1]
        whole = packed_sequence(segments) if segments is not None else whole_sequence(T, valid, inputs.device)
        positions = whole.positions
        losses = []
        for k, module in enumerate(cast(list[MTPModule], self.mtp), start=1):
            n = T - k  # positions that still have a target k tokens ahead
            if n < 1:
                break
            if segments is not None:  # module k's tokens i + k sit where the trunk's i did, in i's example
                step = packed_sequence(segments[:, :n])
            else:
                step = whole_sequence(n, None if valid is None else valid[:, :n], inputs.device)  # positions 0..n-1
            emb = self.inputs(self.embed, inputs[:, k:], positions[:, k:])  # (B, n, C): tokens i + k
            h = module(h[:, :n], emb, self.attention_inputs(step), None, extras)  # (B, n, C), normed
            target = labels[:, k:] if valid is None else labels[:, k:].masked_fill(~valid[:, :n], ignore_index)
            if segments is not None:  # the token k ahead belongs to the next example: nothing to predict
                target = target.masked_fill(segments[:, k:] != segments[:, :n], ignore_index)
            if teacher is None:
                losses.append(cross_entropy(self.logits(h), target, ignore_index))
            else:
                losses.append(distillation_kl(self.logits(h), teacher[:, k:], target, ignore_index=ignore_index))
        return torch.stack(losses).mean() if losses else h.new_zeros((), dtype=torch.float32)
