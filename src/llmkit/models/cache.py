"""A model's state between calls while generating: per-layer caches plus one `SequenceState`, the single place
where new tokens get their cache slots, their positions and their attention mask.

    slots     0   1   2   3   4   5   6   7        every row of a batch shares one slot layout: new tokens take
    row 0     a   b   c   d   .   .   .   .        slots [length, length + T) in all rows, so prompts are padded on
    row 1     -   -   x   y   .   .   .   .        the left ('-'), and a row's positions count its real tokens only
                                                    (row 1: x at position 0, y at 1)

The caches are preallocated to `max_len` slots and attention always runs over all of them; the state's `valid`
flags and the causal rule (a query sees slots up to its own) hide the pads and the empty slots. Nothing here reads a
value back from the device, and every tensor shape is fixed by (batch, max_len), so a decode step built on it can
be compiled once. Shapes: B batch, T new tokens, S_max slots.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.layers.attention.cross import CrossCache
from llmkit.layers.attention.mask import AttentionMask, padding_mask


@dataclass(frozen=True)
class Step:
    """Where the tokens of one forward call sit: their positions (B | 1, T), the mask over key slots, and the cache
    slots (T,) they are written to (None without a cache)."""

    positions: Tensor
    mask: AttentionMask
    slots: Tensor | None = None

    def with_positions(self, positions: Tensor) -> Step:
        return replace(self, positions=positions)


def positions_from_mask(valid: Tensor) -> Tensor:
    """Positions of real tokens counted from each row's first real token: (B, T) bool -> (B, T) long."""
    return (valid.long().cumsum(dim=1) - 1).clamp(min=0)


def whole_sequence(T: int, valid: Tensor | None, device: torch.device, causal: bool = True) -> Step:
    """A call without a cache: T tokens at positions 0.. (counted over real tokens when `valid` (B, T) marks
    padding), each seeing the earlier ones (causal) or all of them."""
    if valid is None:
        return Step(torch.arange(T, device=device).unsqueeze(0), AttentionMask(causal=causal))
    return Step(positions_from_mask(valid), padding_mask(valid, causal=causal))


def packed_sequence(segments: Tensor) -> Step:
    """Several examples packed into each row, without a cache. segments (B, T) int: which example each token belongs
    to (each example one consecutive run). Positions restart at 0 with every example, and a token sees only the
    earlier tokens of its own example:

        segments   0  0  0  1  1  2          allowed (causal, within an example)
        positions  0  1  2  0  1  0              q3 sees k3; q4 sees k3 k4; q5 sees k5
    """
    B, T = segments.shape
    index = torch.arange(T, device=segments.device).expand(B, T)  # (B, T)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]  # the first token of each example
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # (B, T): its example's start
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    return Step(index - first, AttentionMask(allowed=same[:, None], causal=True))


@dataclass
class SequenceState:
    """Slot bookkeeping shared by all layers of a cache: which slots hold real tokens, each row's next position,
    and how many slots are used (a host-side count, never read from the device)."""

    valid: Tensor  # (B, S_max) bool
    next_position: Tensor  # (B,) long
    length: int = 0

    @classmethod
    def new(cls, batch: int, max_len: int, device: torch.device | None) -> SequenceState:
        return cls(
            valid=torch.zeros(batch, max_len, dtype=torch.bool, device=device),
            next_position=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def advance(self, T: int, valid: Tensor | None = None) -> Step:
        """Claim the next T slots for new tokens (valid (B, T): False at padding) and return where they sit."""
        start = self.length
        if start + T > self.max_len:
            raise InputError(
                f"the cache holds max_len={self.max_len} tokens and {start} are used; {T} more do not fit. "
                "Create the cache with a larger max_len"
            )
        slots = torch.arange(start, start + T, device=self.valid.device)  # (T,)
        if valid is None:  # every new token is real (each decoding step): fewer small operations per step
            self.valid[:, start : start + T] = True
            positions = self.next_position[:, None] + slots.sub(start)  # (B, T)
            self.next_position = self.next_position + T
        else:
            self.valid[:, start : start + T] = valid
            positions = (self.next_position[:, None] + valid.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
            self.next_position = self.next_position + valid.long().sum(dim=1)
        self.length = start + T
        first = start == 0 and valid is None  # a fresh cache's unpadded prefill: causality alone decides
        mask = AttentionMask(allowed=self.valid[:, None, None, :], causal=True, query_slots=slots, first=first)
        return Step(positions, mask, slots)

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` (B',) in that order (beam search)."""
        self.valid = self.valid.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)

    def discard(self, counts: Tensor, span: int) -> None:
        """Forget the last counts[b] (<= span) filled slots of each row b (rejected speculative tokens): they stop
        being attended to and the row's next position moves back. Their slots stay used; new tokens go after them."""
        if span == 0:
            return
        counts = counts.to(self.valid.device)
        slots = torch.arange(self.length - span, self.length, device=self.valid.device)  # (span,)
        drop = slots.unsqueeze(0) >= (self.length - counts).unsqueeze(1)  # (B, span)
        self.valid[:, self.length - span : self.length] &= ~drop
        self.next_position = self.next_position - counts


class Cache:
    """Per-layer caches in their attention variant's layout and the slot bookkeeping shared by all layers; for an
    encoder-decoder also the cross-attention keys and values of the memory (computed once per source)."""

    def __init__(self, layers: list[object], state: SequenceState, cross: list[CrossCache] | None = None) -> None:
        self.layers = layers
        self.state = state
        self.cross = cross

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(c, "nbytes", 0)) for c in [*self.layers, *(self.cross or [])])

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` in that order, in every layer (beam search)."""
        for c in [*self.layers, *(self.cross or [])]:
            c.reorder(index)  # type: ignore[attr-defined]
        self.state.reorder(index)
