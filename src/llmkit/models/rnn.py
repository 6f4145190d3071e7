"""The model the Transformer replaced: an RNN encoder-decoder with attention (Bahdanau et al. 2015; Luong et al.
2015).

    source ─► embed ─► bidirectional LSTM/GRU ─► h_1 ... h_m  (B, S, H): one vector per source token
    target (shifted right) ─► embed ─► LSTM/GRU (initial state from the mean of h) ─► s_i   (B, T, H)
    alpha_ij = softmax_j(align(s_i, h_j))        align: dot s.h | general s.(W h) | additive v.tanh(W s + U h)
    c_i = sum_j alpha_ij h_j                     the "prescription" read from the source
    logits_i = W_o tanh(W_c [c_i; s_i])

The recurrence is what the Transformer removed: s_i needs s_{i-1}, so a sequence of T tokens takes T dependent
steps (the encoder, and the decoder in training, run them inside one cuDNN / MKL call; decoding runs them one at a
time). Attention is applied after the recurrent step (Luong's "global attention", without input feeding), so a
teacher-forced target runs through the decoder RNN in one call and through attention in parallel; `align` offers
the plain inner product, Luong's bilinear "general" score and Bahdanau's additive score.

The module has the encoder-decoder interface of `EncoderDecoder` (encode, decode with a cache, new_cache, loss), so
the trainer, greedy decoding and beam search treat both alike.
Shapes: B batch, S source tokens, T target tokens, E embedding, H hidden, V target vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from llmkit.config.base import ConfigBase
from llmkit.errors import InputError
from llmkit.layers.extras import Extras
from llmkit.models.checks import check_mask, check_tokens
from llmkit.models.seq2seq import DecoderCall, Seq2SeqModel

Cell = Literal["lstm", "gru"]
Align = Literal["dot", "general", "additive"]


@dataclass(frozen=True)
class RNNConfig(ConfigBase):
    """An RNN encoder-decoder with attention. src_vocab_size 0 shares the target vocabulary and embedding."""

    path: ClassVar[str] = "model"
    arch: Literal["rnn"] = "rnn"
    vocab_size: int = 8000
    src_vocab_size: int = 0
    d_embed: int = 256
    d_hidden: int = 512
    n_layers: int = 2
    cell: Cell = "lstm"
    align: Align = "general"
    bidirectional: bool = True
    dropout: float = 0.1
    max_seq_len: int = 1024

    def validate(self) -> None:
        self.at_least(1, "vocab_size")
        self.require(self.src_vocab_size >= 0, "src_vocab_size", "must be >= 0 (0 shares the target vocabulary)")
        self.at_least(1, "d_embed")
        self.at_least(2, "d_hidden")
        if self.bidirectional:
            self.require(self.d_hidden % 2 == 0, "d_hidden", "must be even with a bidirectional encoder")
        self.at_least(1, "n_layers")
        self.require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        self.at_least(1, "max_seq_len")

    @property
    def is_encoder_decoder(self) -> bool:
        return True

    def architecture(self) -> dict[str, Any]:
        """What must match for weights to be interchangeable (dropout is a training setting)."""
        return {k: v for k, v in self.to_dict().items() if k != "dropout"}


@dataclass
class RNNCache:
    """Decoder state between steps: the recurrent state (L, B, H) (and the LSTM cell), the attention keys of the
    memory (computed once per source), and how many target tokens were consumed."""

    hidden: Tensor | None = None
    cell: Tensor | None = None
    keys: Tensor | None = None
    length: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.cell, self.keys) if t is not None)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` in that order (beam search)."""
        if self.hidden is not None:
            self.hidden = self.hidden.index_select(1, index)
        if self.cell is not None:
            self.cell = self.cell.index_select(1, index)
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index)


class Attention(nn.Module):
    """align(s_i, h_j) -> weights over the source -> context. Keys depend only on the memory, so a decoder
    computes them once per source."""

    def __init__(self, align: Align, d: int) -> None:
        super().__init__()
        self.align = align
        self.key = nn.Linear(d, d, bias=False) if align != "dot" else None
        self.query = nn.Linear(d, d, bias=True) if align == "additive" else None
        self.v = nn.Linear(d, 1, bias=False) if align == "additive" else None

    def keys(self, memory: Tensor) -> Tensor:
        return memory if self.key is None else self.key(memory)  # (B, S, H)

    def forward(
        self, states: Tensor, memory: Tensor, keys: Tensor, source_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """states (B, T, H), memory and keys (B, S, H) -> (context (B, T, H), weights (B, T, S))."""
        if self.align == "additive":
            assert self.query is not None and self.v is not None
            scores = self.v(torch.tanh(self.query(states)[:, :, None, :] + keys[:, None, :, :])).squeeze(-1)
        else:
            scores = states @ keys.transpose(1, 2)  # (B, T, S)
        if source_mask is not None:
            scores = scores.masked_fill(~source_mask[:, None, :], float("-inf"))
        weights = scores.float().softmax(-1).to(states.dtype)
        return weights @ memory, weights


class RNNSeq2Seq(Seq2SeqModel):
    """RNN encoder-decoder with attention. source (B, S), target inputs (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: RNNConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E, H, L = cfg.d_embed, cfg.d_hidden, cfg.n_layers
        rnn = nn.LSTM if cfg.cell == "lstm" else nn.GRU
        between = cfg.dropout if L > 1 else 0.0
        self.embed = nn.Embedding(cfg.vocab_size, E)
        self.src_embed = nn.Embedding(cfg.src_vocab_size, E) if cfg.src_vocab_size else None
        enc_hidden = H // 2 if cfg.bidirectional else H
        self.encoder = rnn(E, enc_hidden, L, batch_first=True, dropout=between, bidirectional=cfg.bidirectional)
        self.bridge = nn.Linear(H, L * H)  # mean of the source states -> the decoder's initial state, every layer
        self.decoder = rnn(E, H, L, batch_first=True, dropout=between)
        self.attention = Attention(cfg.align, H)
        self.combine = nn.Linear(2 * H, H, bias=False)
        self.out = nn.Linear(H, cfg.vocab_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.memory_width = H
        nn.init.normal_(self.embed.weight, std=E**-0.5)
        if self.src_embed is not None:
            nn.init.normal_(self.src_embed.weight, std=E**-0.5)

    @property
    def max_seq_len(self) -> int:
        """The longest target the decoder produces."""
        return self.cfg.max_seq_len

    # ---- encoder

    def encode(self, source: Tensor, source_mask: Tensor | None = None, extras: Extras | None = None) -> Tensor:
        """source (B, S) int, source_mask (B, S) bool (True = real token, right padding) -> memory (B, S, H)."""
        check_tokens(source, self.source_vocab_size, "source")
        valid = check_mask(source_mask, source, "source_mask")
        x = self.drop(self.source_embedding(source))  # (B, S, E)
        if valid is None:
            memory, _ = self.encoder(x)
            return memory
        lengths = valid.sum(1)
        if bool((lengths == 0).any()):
            raise InputError("source_mask marks a source with no real tokens")
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.encoder(packed)
        memory, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=source.shape[1])
        return memory

    def initial_state(self, memory: Tensor, source_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(hidden (L, B, H), cell (L, B, H) or None for a GRU) from the mean of the real source states."""
        if source_mask is None:
            mean = memory.mean(1)
        else:
            m = source_mask.to(memory.dtype).unsqueeze(-1)
            mean = (memory * m).sum(1) / m.sum(1).clamp_min(1.0)
        B, L, H = memory.shape[0], self.cfg.n_layers, self.cfg.d_hidden
        hidden = torch.tanh(self.bridge(mean)).view(B, L, H).transpose(0, 1).contiguous()
        return hidden, (torch.zeros_like(hidden) if self.cfg.cell == "lstm" else None)

    # ---- decoder

    def decoder_states(self, call: DecoderCall, cache: RNNCache | None = None, extras: Extras | None = None) -> Tensor:
        """The decoder's states after attention (B, T, H). With a cache the recurrent state carries over between
        calls (the first call starts it from the memory). Target padding must be on the right: the recurrence runs
        left to right, so padded positions never affect real ones. With `extras.attention_weights`, the attention
        weights (B, T, S) go to `extras.cross_attention`."""
        target, memory, valid = call.target, call.memory, call.source_mask
        B = target.shape[0]
        if cache is not None and cache.hidden is not None:
            if cache.hidden.shape[1] != B:
                raise InputError(f"the cache holds batch {cache.hidden.shape[1]}, target has batch {B}")
            hidden, cell, keys = cache.hidden, cache.cell, cache.keys
            assert keys is not None
        else:
            hidden, cell = self.initial_state(memory, valid)
            keys = self.attention.keys(memory)
        if cache is not None and cache.length + target.shape[1] > self.cfg.max_seq_len:
            raise InputError(f"the target would exceed max_seq_len={self.cfg.max_seq_len}")
        x = self.drop(self.embed(target))  # (B, T, E)
        state = (hidden, cell) if self.cfg.cell == "lstm" else hidden
        states, new_state = self.decoder(x, state)  # (B, T, H)
        context, weights = self.attention(states, memory, keys, valid)
        if extras is not None and extras.attention_weights:
            extras.cross_attention.append(weights)
        if cache is not None:
            if self.cfg.cell == "lstm":
                cache.hidden, cache.cell = new_state
            else:
                cache.hidden, cache.cell = new_state, None
            cache.keys = keys
            cache.length += target.shape[1]
        return torch.tanh(self.combine(torch.cat([context, states], dim=-1)))

    def logits(self, h: Tensor) -> Tensor:
        return self.out(self.drop(h))

    def new_cache(
        self, batch: int, max_len: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> RNNCache:
        """An empty decoder state (the recurrent state has a fixed size: max_len only bounds the target)."""
        if batch < 1 or max_len < 1:
            raise InputError(f"batch={batch} and max_len={max_len} must be >= 1")
        if max_len > self.cfg.max_seq_len:
            raise InputError(f"max_len={max_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        return RNNCache()


def build_rnn(
    cfg: RNNConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> RNNSeq2Seq:
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = RNNSeq2Seq(cfg)
    return model.to(dtype=dtype) if dtype is not None else model


__all__ = ["RNNCache", "RNNConfig", "RNNSeq2Seq", "build_rnn"]
