"""Attention masks: which key slots each query may attend to.

    causal (T = S = 4)          causal with a cache (T = 2 new queries, S = 4 keys)    padding (key 3 is a pad)
        k0 k1 k2 k3                 k0 k1 k2 k3                                          k0 k1 k2 k3
    q0   1  0  0  0             q2   1  1  1  0                                     q*   1  1  1  0
    q1   1  1  0  0             q3   1  1  1  1
    q2   1  1  1  0
    q3   1  1  1  1

The new queries are always the last T of the S key slots, so "causal" needs no offset argument. A sliding window
(Mistral) further limits query t to the `window` most recent keys: slot(q) - slot(k) < window. A mask is kept
symbolic (`causal=True`, no tensor) as long as possible so that SDPA can take its fused causal path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def causal_tril(T: int, S: int, device: torch.device | None = None) -> Tensor:
    """(T, S) bool: query t (key slot S - T + t) may see key s <= its own slot."""
    q_slot = torch.arange(S - T, S, device=device).unsqueeze(1)  # (T, 1)
    return torch.arange(S, device=device).unsqueeze(0) <= q_slot  # (T, S)


@dataclass(frozen=True)
class AttentionMask:
    """allowed: (B | 1, 1, T | 1, S) bool, True where attention is allowed; None allows every key.
    causal: additionally restrict query t to keys up to its own slot.
    window: additionally restrict query t to the `window` most recent slots (itself included)."""

    allowed: Tensor | None = None
    causal: bool = False
    window: int | None = None

    def with_window(self, window: int | None) -> AttentionMask:
        return self if window is None else AttentionMask(self.allowed, self.causal, window)

    def dense(self, T: int, S: int, device: torch.device) -> Tensor | None:
        """The mask as a (B | 1, 1, T, S) bool tensor, or None when every key is allowed."""
        mask = self.allowed
        if self.causal:
            tril = causal_tril(T, S, device)[None, None]  # (1, 1, T, S)
            mask = tril if mask is None else mask & tril
        if self.window is not None:
            q_slot = torch.arange(S - T, S, device=device).unsqueeze(1)  # (T, 1)
            band = (q_slot - torch.arange(S, device=device).unsqueeze(0) < self.window)[None, None]  # (1, 1, T, S)
            mask = band if mask is None else mask & band
        return mask

    def for_sdpa(self, T: int, S: int, device: torch.device) -> tuple[Tensor | None, bool]:
        """(attn_mask, is_causal) for F.scaled_dot_product_attention."""
        if self.window is not None and self.window < S:  # the window cuts off some keys
            return self.dense(T, S, device), False
        if self.allowed is None:
            if self.causal and T == S:
                return None, True  # the fused causal kernel
            if not self.causal or T == 1:
                return None, False  # one new query sees every cached key
        return self.dense(T, S, device), False


def padding_mask(key_valid: Tensor, causal: bool = False) -> AttentionMask:
    """Mask from key validity (B, S) bool (True = real token), optionally combined with causality."""
    return AttentionMask(allowed=key_valid[:, None, None, :], causal=causal)
