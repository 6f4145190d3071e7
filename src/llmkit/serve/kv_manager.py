"""Which blocks of the pool hold each sequence's keys and values (vLLM v1's KV-cache manager, over blocks.py's pool).

The scheduler decides which tokens are computed; this decides where their keys go:

    find_computed(seq)          at admission: take the cached blocks that already hold a prefix of its tokens (from
                                the pool, then from the prefix-cache tiers, copied into new blocks); returns how
                                many tokens they cover (the sequence computes only the rest)
    allocate(seq, length)       blocks enough for `length` tokens (added at the end of its table), or False with
                                nothing changed when the pool cannot give them
    cache_full_blocks(seq, n)   after a step that computed its tokens up to n: register the digests of the blocks
                                that are now full, so that later prompts with the same prefix find them
    free(seq)                   give every block back (finished, aborted, preempted)
    table(seq)                  its block table: logical block i of the sequence -> physical block in the pool

A sequence holds nothing here until it is admitted, and nothing again once freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmkit.serve.blocks import BlockPool, block_digest
from llmkit.serve.paged import PagedCache
from llmkit.serve.request import Sequence
from llmkit.serve.tiers import BlockStore


@dataclass
class _Held:
    """One sequence's blocks, and how far its full blocks have been registered in the prefix cache."""

    blocks: list[int] = field(default_factory=list)
    digest: bytes = b""  # the digest of the prefix held by the last registered full block
    registered: int = 0  # full blocks whose digest is registered


class KVCacheManager:
    """The block tables of the sequences that hold blocks of `pool`; with `tiers`, the blocks the pool evicts are
    kept there (host memory, disk) and come back on a hit."""

    def __init__(self, pool: BlockPool, share_generated: bool = True) -> None:
        self.pool, self.share_generated = pool, share_generated
        self._held: dict[tuple[str, int], _Held] = {}
        self.tiers: Tiers | None = None

    def use_tiers(self, store: BlockStore, cache: PagedCache) -> None:
        """Keep evicted blocks of `cache` in `store`, and look prompts up there after the pool."""
        self.tiers = Tiers(store, cache)
        self.pool.evicted = self.tiers.evicted

    def table(self, seq: Sequence) -> list[int]:
        held = self._held.get(seq.key)
        return held.blocks if held is not None else []

    def held(self, seq: Sequence) -> int:
        """Blocks `seq` holds (shared ones count for each holder)."""
        return len(self.table(seq))

    def find_computed(self, seq: Sequence) -> int:
        """Take the cached blocks holding the longest prefix of `seq`'s tokens (whole blocks, at least one token
        left to compute, so that the step that finishes the prompt has a token to sample from); returns the
        number of tokens they hold."""
        assert seq.key not in self._held, f"sequence {seq.key} already holds blocks"
        limit = len(seq.tokens) - 1
        blocks, digest = self.pool.match(seq.tokens, limit, seq.root)
        if self.tiers is not None and self.pool.prefix_caching:
            digest = self.tiers.restore(self.pool, seq.tokens, limit, blocks, digest)
        self._held[seq.key] = _Held(blocks, digest, len(blocks))
        return len(blocks) * self.pool.block_size

    def allocate(self, seq: Sequence, length: int) -> bool:
        """Make `seq` hold blocks enough for `length` tokens; on failure it keeps what it had."""
        held = self._held.setdefault(seq.key, _Held(digest=seq.root))
        need = -(-length // self.pool.block_size) - len(held.blocks)
        if need > self.pool.free:
            return False
        for _ in range(need):
            block = self.pool.allocate()
            assert block is not None
            held.blocks.append(block)
        return True

    def cache_full_blocks(self, seq: Sequence, computed: int) -> None:
        """Register the digests of `seq`'s blocks that its first `computed` tokens fill (each digest covers the
        whole prefix up to its block, through the digest of the block before); without `share_generated`, only
        the blocks its prompt fills (the model runner multiplies generated tokens otherwise)."""
        held = self._held[seq.key]
        bs = self.pool.block_size
        if not self.share_generated:
            computed = min(computed, seq.prompt_len)
        while (held.registered + 1) * bs <= computed:
            k = held.registered
            held.digest = block_digest(held.digest, seq.tokens[k * bs : (k + 1) * bs])
            self.pool.register(held.blocks[k], held.digest)
            held.registered += 1

    def save(self) -> None:
        """Write every cached block to the disk tier (at shutdown)."""
        if self.tiers is not None:
            self.tiers.save(self.pool)

    def free(self, seq: Sequence) -> None:
        """Give back every block of `seq` (cached prefixes stay findable until the pool needs the room). The last
        block goes back first, so it is reused first: a prefix is found from its first block on, and losing the
        first would lose them all (vLLM frees in the same order, for the same reason)."""
        held = self._held.pop(seq.key, None)
        if held is not None:
            self.pool.release(held.blocks[::-1])


@dataclass
class Tiers:
    """The pool's link to a BlockStore (tiers.py): evicted blocks' bytes go there; prompts' blocks come back."""

    store: BlockStore
    cache: PagedCache

    def evicted(self, block: int, digest: bytes) -> None:
        self.store.put(digest, self.cache.read_block(block))

    def restore(self, pool: BlockPool, tokens: list[int], limit: int, blocks: list[int], parent: bytes) -> bytes:
        """Continue the chain of `blocks` (the pool's match, ending at digest `parent`) with the blocks the store
        holds: each copied into a newly allocated block and registered. Returns the chain's last digest."""
        bs = pool.block_size
        for start in range(len(blocks) * bs, min(limit, len(tokens)) - bs + 1, bs):
            digest = block_digest(parent, tokens[start : start + bs])
            if digest not in self.store:
                break
            block = pool.allocate()
            if block is None:
                break
            data = self.store.take(digest)
            if data is None:  # its file failed a check (logged): computed instead
                pool.release([block])
                break
            self.cache.write_block(block, data)
            pool.register(block, digest)
            blocks.append(block)
            parent = digest
        return parent

    def save(self, pool: BlockPool) -> None:
        for block, digest in pool.cached():
            self.store.save(digest, self.cache.read_block(block))
        self.store.flush()
