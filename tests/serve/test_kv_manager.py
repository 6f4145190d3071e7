"""The KV-cache manager over a block pool: tables grow by whole blocks, a failed allocation changes nothing, full
blocks are found again by a later sequence with the same prefix, and freeing returns every reference."""

from __future__ import annotations

from llmkit.serve.blocks import BlockPool
from llmkit.serve.kv_manager import KVCacheManager
from llmkit.serve.request import Request, SamplingParams, Sequence


def seq(request: str, tokens: list[int]) -> Sequence:
    return Sequence(Request(request, tokens, SamplingParams(), 0.0), 0, list(tokens))


def test_tables_grow_by_whole_blocks_and_a_failed_allocation_changes_nothing():
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool)
    a, b = seq("a", list(range(10))), seq("b", [1])
    assert kv.allocate(a, 10) and len(kv.table(a)) == 3 and pool.free == 1
    assert kv.allocate(a, 12) and len(kv.table(a)) == 3  # 12 slots fit the same 3 blocks
    before = list(kv.table(b))
    assert not kv.allocate(b, 8)  # needs 2, 1 is free
    assert kv.table(b) == before and pool.free == 1
    kv.free(a)
    kv.free(b)
    assert pool.free == 4 and not any(pool.refs)


def test_full_blocks_are_found_by_a_later_sequence_with_the_same_prefix():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool)
    first = seq("a", list(range(11)))
    assert kv.find_computed(first) == 0  # nothing cached yet
    assert kv.allocate(first, 11)
    kv.cache_full_blocks(first, 11)  # two full blocks registered, the third (3 tokens) not
    second = seq("b", [*range(8), 99, 98])
    assert kv.find_computed(second) == 8 and kv.table(second) == kv.table(first)[:2]
    assert pool.refs[kv.table(first)[0]] == 2
    same = seq("c", list(range(8)))  # a prompt of exactly two blocks: one token is always left to compute
    assert kv.find_computed(same) == 4
    for s in (first, second, same):
        kv.free(s)
    assert not any(pool.refs) and pool.free == 8  # the cached blocks wait, idle, to be found or reused


def test_a_freed_sequence_loses_the_tail_of_its_cached_prefix_first_not_the_head():
    """A preempted or finished sequence's blocks wait, cached, in the order they will be reused; the pool reuses
    the oldest first. Were its first block reused first, every later one would be unreachable (a lookup follows
    the chain from the first block), so one block taken by another sequence would cost the whole prefix."""
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool)
    a = seq("a", list(range(16)))
    assert kv.allocate(a, 16)
    kv.cache_full_blocks(a, 16)  # four full blocks, registered
    kv.free(a)
    other = seq("b", [50])
    assert kv.allocate(other, 1)  # takes one idle block: a's last
    again = seq("a2", list(range(16)))
    assert kv.find_computed(again) == 12  # the first three blocks are still found (one token is always computed)
