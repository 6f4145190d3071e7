"""The paged KV cache's bookkeeping: which fixed-size blocks of the pool are free, which belong to which sequences,
and which hold a known prefix that a later request may reuse (Kwon et al. 2023, PagedAttention, for the pages;
prefix caching as in vLLM and SGLang's RadixAttention).

    pool       [0][1][2][3][4][5][6][7] ...        every layer's cache tensors are cut into the same N blocks
    sequence A  table [3, 0, 5]                    of `block_size` token slots; a sequence's block table maps its
    sequence B  table [3, 0, 6, 1]                 logical block i to a physical block. A and B share blocks 3 and 0:
                                                   the same first 2 * block_size prompt tokens.

A full block is identified by a digest of its tokens and of the digest of the block before it, so equal digests
mean equal whole prefixes. When a block fills, its digest is registered; a new sequence looks its prompt's full
blocks up one by one and takes the chain it finds (reference counted) instead of computing it again. A block whose
last user leaves keeps its contents: if it has a digest it waits, least recently used first, until either a new
prompt reuses it or the pool needs the room. Nothing here touches a tensor: it is host-side accounting.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The identity of a full block: its tokens and (through the parent's digest) every token before them."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class PrefixStats:
    """Prefix-cache lookups of admitted sequences: full blocks of their tokens looked up, and found."""

    queried: int = 0
    hit: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0


class BlockPool:
    """Allocation, sharing and reuse of `n_blocks` blocks of `block_size` token slots."""

    def __init__(
        self,
        n_blocks: int,
        block_size: int,
        prefix_caching: bool = True,
        evicted: Callable[[int, bytes], None] | None = None,
    ) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one slot, got {n_blocks} x {block_size}")
        self.n_blocks, self.block_size, self.prefix_caching = n_blocks, block_size, prefix_caching
        self.refs = [0] * n_blocks
        self.digest_of: list[bytes | None] = [None] * n_blocks
        self.fresh = list(range(n_blocks - 1, -1, -1))  # never used, or used without a digest: pop from the end
        self.idle: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks with a digest, oldest first
        self.by_digest: dict[bytes, int] = {}
        # told (block, digest) when a cached block is about to be reused, while it still holds its contents (the
        # prefix-cache tiers keep them: tiers.py)
        self.evicted = evicted

    @property
    def free(self) -> int:
        """Blocks that can be handed out now (fresh ones and idle cached ones)."""
        return len(self.fresh) + len(self.idle)

    @property
    def used(self) -> int:
        return self.n_blocks - self.free

    @property
    def idle_cached(self) -> int:
        """Free blocks that still hold a cached prefix (handed out only when no fresh block is left)."""
        return len(self.idle)

    def allocate(self) -> int | None:
        """A block for one sequence's use (reference count 1), or None when the pool is exhausted. A fresh block is
        preferred; otherwise the least recently used idle block loses its cached prefix."""
        if self.fresh:
            block = self.fresh.pop()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)
            digest = self.digest_of[block]
            assert digest is not None
            del self.by_digest[digest]
            self.digest_of[block] = None
            if self.evicted is not None:
                self.evicted(block, digest)
        else:
            return None
        self.refs[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence is done with its blocks: each loses one reference; unreferenced ones become free (kept as
        cached prefixes when they have a digest)."""
        for block in blocks:
            assert self.refs[block] > 0, f"block {block} released more often than taken"
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.digest_of[block] is not None:
                    self.idle[block] = None
                else:
                    self.fresh.append(block)

    def register(self, block: int, digest: bytes) -> None:
        """`block` is full and holds the prefix with this digest (the first block with a digest keeps it)."""
        if self.prefix_caching and digest not in self.by_digest and self.digest_of[block] is None:
            self.by_digest[digest] = block
            self.digest_of[block] = digest

    def forget_cached(self) -> None:
        """Drop every cached prefix (the weights that computed them changed): idle cached blocks become fresh ones,
        blocks in use keep their contents but are found by no digest."""
        for block in self.idle:
            self.fresh.append(block)
        self.idle.clear()
        self.by_digest.clear()
        self.digest_of = [None] * self.n_blocks

    def cached(self) -> list[tuple[int, bytes]]:
        """Every block that holds a cached prefix, with its digest."""
        return [(block, digest) for digest, block in self.by_digest.items()]

    def match(self, tokens: Sequence[int], limit: int, root: bytes = b"") -> tuple[list[int], bytes]:
        """Take the cached blocks holding the longest prefix of `tokens` made of whole blocks and at most `limit`
        tokens long (each taken block gains a reference), the chain's digests starting from `root` (a served
        adapter's: its blocks are its own). Returns the blocks and the digest of the last one (`root` for none)."""
        found: list[int] = []
        parent = root
        if not self.prefix_caching:
            return found, parent
        bs = self.block_size
        for start in range(0, min(limit, len(tokens)) - bs + 1, bs):
            digest = block_digest(parent, tokens[start : start + bs])
            block = self.by_digest.get(digest)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.idle[block]
            self.refs[block] += 1
            found.append(block)
            parent = digest
        return found, parent
