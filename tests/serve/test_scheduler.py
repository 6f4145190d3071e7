"""The scheduler alone, without a model: the step's token budget, the order of prompt chunks, admission, the
preemption victim and prefix hits, checked on its plans (the engine tests check the tokens that result)."""

from __future__ import annotations

from llmkit.serve.blocks import BlockPool
from llmkit.serve.request import Request, SamplingParams, Sequence, Status
from llmkit.serve.scheduler import Scheduler, Work


def seq(request: str, prompt: list[int], index: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(Request(request, prompt, SamplingParams(max_tokens=64), arrival), index, list(prompt))


def run(scheduler: Scheduler) -> list[Work]:
    """One step as the engine does it: the plan, then every item computed and a token for each that samples."""
    work = scheduler.plan()
    for w in work:
        scheduler.computed(w)
        if w.samples:
            w.seq.tokens.append(7)
    return work


def shape(work: list[Work]) -> list[tuple[str, int, int]]:
    return [(w.seq.request.id, w.start, w.count) for w in work]


def test_decoding_rows_come_first_and_prompts_fill_the_budget_in_chunks():
    s = Scheduler(BlockPool(64, 4), max_batch=8, step_tokens=10)
    a = seq("a", list(range(3)))
    s.add(a)
    assert shape(run(s)) == [("a", 0, 3)]  # the whole prompt, and a samples its first token
    b, c = seq("b", list(range(100, 115))), seq("c", list(range(200, 204)))
    s.add(b)
    s.add(c)
    # a decodes its one token first; the 9 left go to b's prompt (cut), c waits for budget
    assert shape(run(s)) == [("a", 3, 1), ("b", 0, 9)]
    # b's remaining 6 tokens before the newer c, then c's first 3 of 4
    assert shape(run(s)) == [("a", 4, 1), ("b", 9, 6), ("c", 0, 3)]
    assert shape(run(s)) == [("a", 5, 1), ("b", 15, 1), ("c", 3, 1)]
    assert all(x.status is Status.RUNNING for x in (a, b, c))


def test_the_batch_never_exceeds_max_batch():
    s = Scheduler(BlockPool(64, 4), max_batch=2, step_tokens=100)
    for k in range(3):
        s.add(seq(f"r{k}", [k, k + 1]))
    assert [w.seq.request.id for w in run(s)] == ["r0", "r1"]
    assert [x.request.id for x in s.waiting] == ["r2"]


def test_a_shared_prompt_prefix_is_taken_from_the_cache():
    pool = BlockPool(64, 4)
    s = Scheduler(pool, max_batch=8, step_tokens=100)
    prompt = list(range(10))  # two full blocks and a partial one
    first = seq("a", prompt)
    s.add(first)
    run(s)
    second = seq("b", [*prompt[:8], 50, 51])
    s.add(second)
    work = run(s)
    assert (work[-1].seq, work[-1].start, work[-1].count) == (second, 8, 2)  # only what differs is computed
    assert s.kv.table(second)[:2] == s.kv.table(first)[:2] and pool.refs[s.kv.table(first)[0]] == 2
    assert (s.prefix.queried, s.prefix.hit) == (2 + 2, 2)


def test_the_victim_is_the_newest_sequence_of_the_request_holding_most_blocks():
    pool = BlockPool(8, 2)
    s = Scheduler(pool, max_batch=8, step_tokens=100)
    big = [seq("big", [1, 2, 3], index=k) for k in range(3)]  # 3 sequences of one request
    small = seq("small", [9], arrival=1.0)
    for x in big:
        s.add(x)
    run(s)  # each big sequence: 3 prompt tokens + 1 -> 2 blocks; 6 of 8 blocks used
    s.add(small)
    run(s)  # small takes a block; every big sequence's 5th token fits its second block
    assert pool.free == 1 and small.status is Status.RUNNING
    work = run(s)  # big[0] takes the last free block for its 5th token; big[1] finds none
    # the victim is big[2] (the newest sequence of the request holding most), not small (the newest admitted)
    assert [x.status for x in big] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    assert small.status is Status.RUNNING and any(w.seq is small for w in work)
    assert list(s.waiting) == [big[2]] and s.preemptions == 1
    assert s.kv.table(big[2]) == [] and big[2].computed == 0  # its blocks went back; it will be recomputed


def test_among_requests_of_one_sequence_each_the_victim_is_the_newest_not_the_one_holding_most():
    pool = BlockPool(5, 2)
    s = Scheduler(pool, max_batch=8, step_tokens=100)
    old = seq("old", [1, 2, 3, 4, 5])
    s.add(old)
    run(s)  # 5 prompt tokens: 3 blocks
    new = seq("new", [9, 9, 9], arrival=1.0)
    s.add(new)
    run(s)  # old's 6th token fits its third block; new takes the last 2
    assert pool.free == 0
    work = run(s)  # old's 7th token needs a fourth block
    # preempting old (it holds the most) would throw away the most work, and stop the request nearest its end
    assert old.status is Status.RUNNING and new.status is Status.WAITING
    assert [(w.seq, w.start, w.count) for w in work] == [(old, 6, 1)] and s.preemptions == 1


def test_a_request_of_several_sequences_gives_way_only_when_it_holds_the_most():
    for mid_prompt, expected in (([7], "new"), ([7] * 9, "mid")):
        s = Scheduler(BlockPool(32, 2), max_batch=8, step_tokens=100)
        old = seq("old", list(range(8)))  # one sequence, 4 blocks
        mid = [seq("mid", mid_prompt, index=k, arrival=1.0) for k in range(2)]  # two sequences: 2 or 10 blocks
        new = seq("new", [9], arrival=2.0)  # one sequence, 1 block
        for x in (old, *mid, new):
            s.add(x)
        run(s)
        victim = s._victim()
        assert victim is not None
        # mid holding less than old: last in, first out (new); holding the most: its newest sequence
        assert victim is (new if expected == "new" else mid[1])


def test_a_request_holding_no_blocks_is_admitted_before_the_preempted_ones():
    pool = BlockPool(5, 2)
    s = Scheduler(pool, max_batch=8, step_tokens=100)
    big = [seq("big", [1, 2, 3], index=k) for k in range(2)]
    for x in big:
        s.add(x)
    run(s)  # 2 blocks each: 4 of 5
    small = seq("small", [9, 9, 9], arrival=1.0)
    s.add(small)
    run(s)  # small needs 2 blocks, 1 is free: it waits
    assert small.status is Status.WAITING
    work = run(s)  # big[0] takes the free block; big[1] finds none and is preempted, freeing 2
    assert big[1].status is Status.WAITING and small.status is Status.RUNNING
    assert (work[-1].seq, work[-1].start, work[-1].count) == (small, 0, 3)
    # first come, first served would have put big[1], first in line, back in those blocks (to be preempted again)
    assert list(s.waiting) == [big[1]]


def test_a_waiting_sequence_that_does_not_fit_keeps_its_place_and_holds_nothing():
    pool = BlockPool(4, 2)
    s = Scheduler(pool, max_batch=8, step_tokens=100)
    s.add(seq("a", [1, 2, 3, 4, 5]))
    run(s)  # 3 blocks for 6 tokens
    s.add(seq("b", [1, 9, 9, 9, 9, 9, 9]))  # needs 4 blocks: does not fit next to a
    s.add(seq("c", [8]))  # fits, but b came first and holds nothing: c waits behind it
    run(s)
    assert [x.request.id for x in s.waiting] == ["b", "c"]
    assert all(s.kv.table(x) == [] for x in s.waiting)


def prioritized(request: str, prompt: list[int], priority: int, arrival: float = 0.0) -> Sequence:
    params = SamplingParams(max_tokens=64, priority=priority)
    return Sequence(Request(request, prompt, params, arrival), 0, list(prompt))


def test_waiting_sequences_are_admitted_by_priority_then_as_before():
    s = Scheduler(BlockPool(64, 4), max_batch=1, step_tokens=100)
    for name, priority in [("a", 1), ("b", 0), ("c", -2), ("d", 0)]:
        s.add(prioritized(name, [1, 2], priority))
    order = []
    for _ in range(4):
        running = s.running[0] if s.running else None
        if running is not None:
            s.remove(running)
        order.append(shape(run(s))[0][0])
    assert order == ["c", "b", "d", "a"]  # lower first; equal priorities in arrival order


def test_a_higher_priority_sequence_preempts_a_lower_one_for_a_full_batch_never_an_equal_one():
    s = Scheduler(BlockPool(64, 4), max_batch=2, step_tokens=100)
    low, mid = prioritized("low", [1, 2, 3], 5), prioritized("mid", [4, 5], 0)
    s.add(low)
    s.add(mid)
    run(s)
    equal = prioritized("equal", [6], 5, arrival=1.0)
    s.add(equal)
    run(s)  # the batch is full and `equal` outranks no one running (low is its equal): it waits
    assert equal.status is Status.WAITING and low.status is Status.RUNNING
    high = prioritized("high", [7, 8], -1, arrival=2.0)
    s.add(high)
    work = run(s)
    # high takes low's place (low's decoding token is taken out of the step); `equal` still waits
    assert high.status is Status.RUNNING and low.status is Status.WAITING and equal.status is Status.WAITING
    assert [w.seq for w in work] == [mid, high] and s.kv.table(low) == [] and s.preemptions == 1


def test_a_higher_priority_sequence_preempts_lower_ones_until_its_prompt_fits():
    pool = BlockPool(6, 2)
    s = Scheduler(pool, max_batch=8, step_tokens=100)
    lows = [prioritized(f"low{k}", [k, k, k], 3, arrival=k) for k in range(3)]  # 2 blocks each: the pool is full
    for x in lows:
        s.add(x)
    run(s)
    assert pool.free == 0
    high = prioritized("high", [9] * 7, 0, arrival=9.0)  # 4 blocks: two of the lows must go
    s.add(high)
    run(s)
    assert high.status is Status.RUNNING and s.preemptions >= 2
    assert sum(x.status is Status.RUNNING for x in lows) <= 1
    assert all(s.kv.table(x) == [] for x in lows if x.status is Status.WAITING)
