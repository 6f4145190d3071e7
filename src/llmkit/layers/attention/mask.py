"""Attention masks: which key slots each query may attend to.

    causal (T = S = 4)          causal with a cache (T = 2 new queries    padding (key 3 is a pad)
                                 in slots 2 and 3 of S = 6)
        k0 k1 k2 k3                 k0 k1 k2 k3 k4 k5                          k0 k1 k2 k3
    q0   1  0  0  0             q2   1  1  1  0  0  0                      q*   1  1  1  0
    q1   1  1  0  0             q3   1  1  1  1  0  0
    q2   1  1  1  0
    q3   1  1  1  1

Without a cache the T queries are the T keys. With a cache of fixed size S the new queries sit in the slots
`query_slots` among the S key slots (the cache is preallocated, so slots after the newest are still empty and the
causal rule hides them). A sliding window (Mistral) further limits a query to the `window` most recent slots:
slot(q) - slot(k) < window. A mask stays symbolic (`causal=True`, no tensor) as long as possible so that SDPA can
take its fused causal path.

Rows of different lengths can also go through a layer as one packed row (a serving step: each decoding sequence's
newest token and each prompt chunk, N queries in all): `ragged` gives the rows' lengths, in the order their queries
are packed, `allowed` (R, 1, 1, S) and the keys (R, K, S, D) have one row each, and `query_slots` (1, N) gives each
query's slot in its own row. Attention then runs per run of rows of the same kind (`row_groups`): all the one-query
rows at once, and each longer row alone, so no query is ever scored against another row's keys.

Shapes: B batch, T queries, S key slots.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


def causal_tril(T: int, S: int, device: torch.device | None = None, query_slots: Tensor | None = None) -> Tensor:
    """(T, S) bool, or (B, T, S) with per-row query_slots (B, T): query t (in slot query_slots[.., t], or
    S - T + t) may see key s <= its own slot."""
    q_slot = _query_slots(T, S, device, query_slots).unsqueeze(-1)  # (T, 1) or (B, T, 1)
    return torch.arange(S, device=device) <= q_slot  # (T, S) or (B, T, S)


def _query_slots(T: int, S: int, device: torch.device | None, query_slots: Tensor | None) -> Tensor:
    return query_slots if query_slots is not None else torch.arange(S - T, S, device=device)


def _heads_axis(rule: Tensor) -> Tensor:
    """(T, S) -> (1, 1, T, S); (B, T, S) -> (B, 1, T, S)."""
    return rule[None, None] if rule.dim() == 2 else rule.unsqueeze(1)


@dataclass(frozen=True)
class AttentionMask:
    """allowed: (B | 1, 1, T | 1, S) bool, True where attention is allowed; None allows every key.
    causal: additionally restrict each query to keys up to its own slot.
    window: additionally restrict each query to the `window` most recent slots (itself included).
    query_slots: (T,) long, the queries' slots among the keys (a cache's write slots), or (B, T) when each row's
    queries sit elsewhere (a serving batch of sequences of different lengths); None: the last T.
    ragged: the lengths of packed rows (see the module docstring); None for an ordinary batch. ragged_first: which
    of them are `first` (a prompt's chunk from slot 0: its group attends by causality alone).
    first: the T queries are key slots 0 .. T - 1 of a cache that held nothing before them, all of them real (a
    prompt's prefill without padding): causality alone decides, over the first T keys (`trimmed`), so SDPA can take
    its fused causal path instead of a (T, S) mask of the whole preallocated cache."""

    allowed: Tensor | None = None
    causal: bool = False
    window: int | None = None
    query_slots: Tensor | None = None
    ragged: tuple[int, ...] | None = None
    ragged_first: tuple[bool, ...] | None = None
    first: bool = False

    def row_groups(self) -> list[tuple[slice, slice, AttentionMask]]:
        """A ragged mask's groups: (rows, their queries in the packed row, the mask of that batch of rows). Adjacent
        rows of one query form one group (a batch of (G, 1) queries), each longer row its own group."""
        assert self.ragged is not None and self.allowed is not None and self.query_slots is not None
        groups, row, start = [], 0, 0
        while row < len(self.ragged):
            end = row + 1
            if self.ragged[row] == 1:
                while end < len(self.ragged) and self.ragged[end] == 1:
                    end += 1
            n = sum(self.ragged[row:end])
            rows, queries = slice(row, end), slice(start, start + n)
            slots = self.query_slots[0, queries].view(end - row, -1)  # (G, T)
            first = end == row + 1 and self.ragged[row] > 1 and bool(self.ragged_first and self.ragged_first[row])
            sub = replace(self, allowed=self.allowed[rows], query_slots=slots, ragged=None, ragged_first=None)
            groups.append((rows, queries, replace(sub, first=first)))
            row, start = end, start + n
        return groups

    def trimmed(self, T: int) -> AttentionMask | None:
        """For `first` queries (and no sliding window shorter than them): the plain causal mask over the first T
        keys, which is all they can see; else None."""
        if not self.first or self.ragged is not None or (self.window is not None and self.window < T):
            return None
        return AttentionMask(causal=True)

    def causal_offset(self, T: int, S: int) -> int | None:
        """When T queries sit in consecutive slots o .. o + T - 1, the same in every row, and each sees every key up
        to its own slot and no other (a prompt's chunk over a cache filled up to it; o = 0 for `first` queries): o.
        Else None."""
        if not self.causal or self.ragged is not None or (self.window is not None and self.window < S):
            return None
        if self.first:
            return 0
        slots = torch.arange(S - T, S) if self.query_slots is None else self.query_slots.reshape(-1)
        if slots.numel() != T:
            return None  # several rows' slots
        offset = int(slots[0])
        if offset < 0 or offset + T > S or not torch.equal(slots.cpu(), torch.arange(offset, offset + T)):
            return None
        allowed = self.allowed  # (B | 1, 1, 1, S): every key up to the last query's slot
        if allowed is not None and (allowed.shape[1:] != (1, 1, S) or not bool(allowed[..., : offset + T].all())):
            return None
        return offset

    def with_window(self, window: int | None) -> AttentionMask:
        return self if window is None else replace(self, window=window)

    def dense(self, T: int, S: int, device: torch.device) -> Tensor | None:
        """The mask as a (B | 1, 1, T, S) bool tensor, or None when every key is allowed."""
        mask = self.allowed
        if self.causal:
            tril = _heads_axis(causal_tril(T, S, device, self.query_slots))  # (B | 1, 1, T, S)
            mask = tril if mask is None else mask & tril
        if self.window is not None:
            q_slot = _query_slots(T, S, device, self.query_slots).unsqueeze(-1)  # (T, 1) or (B, T, 1)
            band = _heads_axis(q_slot - torch.arange(S, device=device) < self.window)  # (B | 1, 1, T, S)
            mask = band if mask is None else mask & band
        return mask

    def for_sdpa(self, T: int, S: int, device: torch.device) -> tuple[Tensor | None, bool]:
        """(attn_mask, is_causal) for F.scaled_dot_product_attention."""
        symbolic = self.allowed is None and self.query_slots is None and (self.window is None or self.window >= S)
        if symbolic:
            if self.causal and T == S:
                return None, True  # the fused causal kernel
            if not self.causal or T == 1:
                return None, False  # one new query sees every key
        return self.dense(T, S, device), False


def padding_mask(key_valid: Tensor, causal: bool = False) -> AttentionMask:
    """Mask from key validity (B, S) bool (True = real token), optionally combined with causality."""
    return AttentionMask(allowed=key_valid[:, None, None, :], causal=causal)
