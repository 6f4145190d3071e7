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

import torch
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import InputError
from llmkit.layers.attention import AttentionMask
from llmkit.layers.block import CrossAttentionBlock, TransformerBlock
from llmkit.layers.embedding import InputEmbedding, build_rope
from llmkit.layers.extras import Extras
from llmkit.layers.norm import build_norm
from llmkit.layers.tables import token_table
from llmkit.models.base import TokenModel
from llmkit.models.cache import Cache
from llmkit.models.init import init_weights
from llmkit.models.seq2seq import DecoderCall, Seq2SeqModel


class EncoderDecoder(TokenModel, Seq2SeqModel):
    """Sequence-to-sequence Transformer. source (B, S), target inputs (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.encoder is None:
            raise InputError("EncoderDecoder needs a config with an encoder; use DecoderLM (or build_model)")
        self.cfg = cfg
        self.embed = token_table(cfg.vocab_size, cfg.d_model)  # target (and shared source) embedding
        self.src_embed = token_table(cfg.encoder.vocab_size, cfg.d_model) if cfg.encoder.vocab_size else None
        self.inputs = InputEmbedding(cfg, cfg.position.max_seq_len)
        self.rope = build_rope(cfg)
        self.rope_local = build_rope(cfg, local=True)
        self.encoder = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.encoder.n_layers))
        self.decoder = nn.ModuleList(CrossAttentionBlock(cfg, i) for i in range(cfg.n_layers))
        pre = cfg.norm.placement != "post"  # pre-norm stacks end with a norm; post-norm blocks already end in one
        self.encoder_norm = build_norm(cfg.norm, cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = build_norm(cfg.norm, cfg.d_model) if pre else nn.Identity()
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.head_bias else None
        self.memory_width = cfg.d_model
        init_weights(self, cfg)

    def layer_stacks(self) -> dict[str, nn.ModuleList]:
        """The repeated layers, by stack name (what `llmkit compare` lines up with another implementation's)."""
        return {"encoder": self.encoder, "decoder": self.decoder}

    # ---- encoder

    def encode(self, source: Tensor, source_mask: Tensor | None = None, extras: Extras | None = None) -> Tensor:
        """source (B, S) int, source_mask (B, S) bool (True = real token) -> memory (B, S, C)."""
        valid = self.check_tokens(source, source_mask, "source", self.source_vocab_size)
        step = self.step_for(source, valid, None, None, causal=False)  # the encoder sees the whole source
        inputs = self.attention_inputs(step)
        x = self.inputs(self.source_embedding, source, step.positions)
        for block in self.encoder:
            x = block(x, inputs, None, extras)
        return self.encoder_norm(x)

    # ---- decoder

    def decoder_states(self, call: DecoderCall, cache: Cache | None = None, extras: Extras | None = None) -> Tensor:
        state = cache.state if cache is not None else None
        step = self.step_for(call.target, call.target_mask, None, state, name="target")
        inputs = self.attention_inputs(step)
        memory_mask = None if call.source_mask is None else AttentionMask(allowed=call.source_mask[:, None, None, :])
        x = self.inputs(self.embed, call.target, step.positions)
        for i, block in enumerate(self.decoder):
            layer_cache = cache.layers[i] if cache is not None else None
            cross_cache = cache.cross[i] if cache is not None and cache.cross is not None else None
            x = block(x, inputs, call.memory, memory_mask, layer_cache, cross_cache, extras)
        return self.decoder_norm(x)

    def decoding_blocks(self) -> nn.ModuleList:
        return self.decoder
