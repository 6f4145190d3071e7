"""What the decoder-only and the encoder-decoder Transformer share: turning new tokens into embeddings plus attention
inputs (through a cache's SequenceState, or for a whole sequence), and turning final hidden states into logits.

Both models build their own modules (so that each reads top to bottom, and parameter names and initialisation order
stay where they are); this base class only holds the steps they take the same way.
"""

from __future__ import annotations

import abc
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import InputError
from llmkit.layers.attention import AttentionInputs, SelfAttention
from llmkit.layers.attention.cross import CrossCache
from llmkit.layers.embedding import InputEmbedding
from llmkit.layers.rope import RotaryEmbedding
from llmkit.layers.softcap import soft_cap
from llmkit.models.cache import Cache, SequenceState, Step, whole_sequence
from llmkit.models.checks import check_cache_args, check_mask, check_positions, check_tokens


class TokenModel(nn.Module, abc.ABC):
    """Base of the Transformer models: embedding table `embed`, additive positions `inputs`, `rope`, output head."""

    cfg: ModelConfig
    embed: nn.Embedding
    inputs: InputEmbedding
    rope: RotaryEmbedding | None
    rope_local: RotaryEmbedding | None  # the sliding-window layers' own RoPE base (Gemma 3)
    head: nn.Module | None  # nn.Linear, or a quantized linear (llmkit.quant) applied from outside
    head_bias: nn.Parameter | None

    @property
    def device(self) -> torch.device:
        """Where the model computes: its token embedding's device."""
        return self._placement().device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's states: its token embedding's."""
        return self._placement().dtype

    def _placement(self) -> Tensor:
        # a quantized embedding (llmkit.quant.embedding) holds no table: it says where its rows come out
        probe = getattr(self.embed, "placement", None)
        return probe if isinstance(probe, Tensor) else self.embed.weight

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model reads (its positions' range)."""
        return self.cfg.position.max_seq_len

    def logits(self, h: Tensor) -> Tensor:
        """Final hidden states after the norm (B, T, C) -> logits (B, T, V). A tied head reuses the embedding. With
        cfg.logit_softcap (Gemma 2), logits become cap * tanh(logits / cap): smooth, bounded to (-cap, cap)."""
        if self.head is None:
            logits = F.linear(h, self.embed.weight, self.head_bias)
        else:
            logits = self.head(h)
            logits = logits + self.head_bias if self.head_bias is not None else logits
        return soft_cap(logits, self.cfg.logit_softcap)

    def attention_inputs(self, step: Step) -> AttentionInputs:
        """The attention inputs of a step: its mask and slots, and the RoPE tables of its positions."""
        rope = self.rope(step.positions) if self.rope is not None else None
        local = self.rope_local(step.positions) if self.rope_local is not None else None
        return AttentionInputs(step.mask, rope, step.slots, local)

    def check_tokens(
        self, tokens: Tensor, padding_mask: Tensor | None, name: str = "tokens", vocab_size: int | None = None
    ) -> Tensor | None:
        """Check a public call's tokens and padding mask; returns the mask as bool (or None)."""
        check_tokens(tokens, self.cfg.vocab_size if vocab_size is None else vocab_size, name)
        return check_mask(padding_mask, tokens, "padding_mask" if name == "tokens" else f"{name}_mask")

    def step_for(
        self,
        tokens: Tensor,
        valid: Tensor | None,
        positions: Tensor | None,
        state: SequenceState | None,
        causal: bool = True,
        name: str = "tokens",
    ) -> Step:
        """Give checked tokens their step: the next slots of a cache's `state`, or the whole sequence without one.
        positions (T,) or (B, T) override the ones counted from the padding."""
        B, T = tokens.shape
        if state is not None:
            if state.batch != B:
                verb = "have" if name.endswith("s") else "has"
                raise InputError(f"the cache was made for batch {state.batch}, {name} {verb} batch {B}")
            step = state.advance(T, valid)
        else:
            step = whole_sequence(T, valid, tokens.device, causal)
        if positions is not None:
            if tuple(positions.shape) not in ((T,), (B, T), (1, T)):
                raise InputError(
                    f"positions must have shape (seq_len,) or (batch, seq_len), got {tuple(positions.shape)}"
                )
            step = step.with_positions(positions if positions.dim() == 2 else positions.unsqueeze(0))
        check_positions(step.positions, self.cfg)
        return step

    @abc.abstractmethod
    def decoding_blocks(self) -> nn.ModuleList:
        """The blocks whose self-attention a cache serves (the decoder's)."""

    def new_cache(
        self, batch: int, max_len: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Cache:
        """A preallocated cache for `batch` sequences of up to `max_len` tokens, on the model's device and dtype
        unless given: one cache per decoder layer in its attention variant's layout (and, for an encoder-decoder,
        one for the memory's cross-attention keys and values)."""
        dtype = check_cache_args(self, batch, max_len, dtype)
        dev = torch.device(device) if device is not None else self.device
        blocks = self.decoding_blocks()
        layers: list[object] = [
            cast(SelfAttention, block.attn).new_cache(batch, max_len, dev, dtype) for block in blocks
        ]
        cross = [CrossCache() for _ in blocks] if self.cfg.is_encoder_decoder else None
        return Cache(layers, SequenceState.new(batch, max_len, dev), cross)
