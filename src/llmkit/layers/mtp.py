"""Multi-token prediction modules (DeepSeek-V3 §2.2).

Besides the next token, the model learns to predict tokens further ahead with D sequential modules. Module k
(k = 1..D) at position i combines the previous depth's representation of token i with the embedding of token i + k
and predicts token i + k + 1:

    h'_i^k = M_k [ norm(Emb(t_(i+k))) ; norm(h_i^(k-1)) ]        M_k: (2C -> C) projection
    h_i^k  = norm(Block_k(h'_(1..T-k)^k))                        a causal Transformer block of its own
    P^k    = Head(h_i^k)                                         embedding and output head shared with the model

h^0 is the main model's final (normed) hidden state, and each depth passes its normed output to the next, as the
DeepSeek-V3 implementations in vLLM and Megatron-Core do.

The sequential chain keeps the causal order of predictions. At inference the modules can be dropped, or used to
draft tokens for self-speculative decoding. Shapes: h (B, T, C), emb (B, T, C) -> (B, T, C).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.layers.attention import AttentionInputs
from llmkit.layers.block import TransformerBlock
from llmkit.layers.extras import Extras
from llmkit.layers.norm import build_norm


class MTPModule(nn.Module):
    """One prediction depth. h_prev (B, T, C), emb of the tokens k ahead (B, T, C) -> normed h (B, T, C)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.emb_norm = build_norm(cfg.norm, cfg.d_model)
        self.h_norm = build_norm(cfg.norm, cfg.d_model)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = TransformerBlock(cfg, layer)
        self.norm = build_norm(cfg.norm, cfg.d_model)  # before the shared output head and the next depth

    def forward(
        self, h_prev: Tensor, emb: Tensor, inputs: AttentionInputs, cache: Any = None, extras: Extras | None = None
    ) -> Tensor:
        return self.norm(self.block(self.combine(h_prev, emb), inputs, cache, extras))

    def combine(self, h_prev: Tensor, emb: Tensor) -> Tensor:
        """The block's input: M_k [norm(emb) ; norm(h_prev)] (B, T, C)."""
        return self.proj(torch.cat((self.emb_norm(emb), self.h_norm(h_prev)), dim=-1))
