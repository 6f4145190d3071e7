"""Which sequences run in the next step, and on which tokens (iteration-level scheduling: Yu et al. 2022, Orca;
continuous batching with a paged cache: Kwon et al. 2023, vLLM).

Every step:
  1. each running sequence that is decoding computes its one newest token; if it needs a new block and the pool is
     empty, a running sequence is preempted (its blocks go back; it waits, first in line, to be computed again from
     its tokens), so memory never runs out with an error;
  2. the rest of the step's token budget goes to prompts: first those already being prefilled, then new sequences
     from the queue, while the batch has room. A long prompt is cut into chunks across steps, so sequences that are
     decoding are never stalled for more than one budget's worth of prefill.
A new sequence first takes whatever cached blocks hold its prompt's prefix, and computes only the rest.

Fairness: a request that holds the most memory with several sequences gives way first, and requests that hold
none are admitted first. Plain first-come-first-served (vLLM's policy)
lets one request that outgrows the cache shut everyone else out: with a small cache, one request of n=16 long
completions preempted its own sequences 23 times, every step preempted one, and a 4-token request that came
later waited 90 s behind the preempted ones. Here
  - the victim of a preemption: where the request holding the most blocks runs several sequences, its newest one,
    so a small request is not pushed out to make room for a large one's growth (which gives up one of its sequences
    and keeps the others going); where it runs one, the newest request's (plain last-in-first-out, as vLLM): it has
    computed the least, so it costs the least to compute again, and the oldest finish first. (Preempting a request
    of one sequence for holding the most would stop the one that has come furthest: sixteen requests of 1,000 + 128
    tokens in a cache of 1,000 blocks preempted 26 times and computed 43,560 prompt tokens for 16,000;
    last-in-first-out, 5 times and 19,685.)
  - admission takes first the waiting sequences of requests that hold no blocks, in arrival order (a preempted
    sequence keeps its place ahead of newer requests), then sequences of requests that already run some, in queue
    order; in a step that had to preempt, only the first kind is admitted (taking back memory for the request
    that just gave it up would only preempt again).
Nothing starves: a request holding no blocks is admitted in arrival order, and a request that runs keeps its
oldest sequences running while others take their turn.

Priorities (a request's `priority`, lower first: vLLM's semantics) come before both rules, which order requests of
the same priority: admission takes the waiting sequences by priority first; a victim is taken from the lowest
priority that runs; and a waiting sequence that finds the batch full or the pool empty preempts running sequences
of a strictly lower priority until it fits (a request never preempts its equals to get in). With every request at
the default 0, as without priorities.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmkit.serve.blocks import BlockPool, PrefixStats
from llmkit.serve.kv_manager import KVCacheManager
from llmkit.serve.request import Sequence, Status


@dataclass(frozen=True)
class Work:
    """Compute tokens[start : start + count] of `seq` in this step."""

    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        """Whether this reaches the end of the known tokens, so the step samples the sequence's next token."""
        return self.start + self.count == len(self.seq.tokens)


class Scheduler:
    """The waiting queue and the running batch; `kv` (kv_manager.py) holds their blocks of the pool."""

    def __init__(self, pool: BlockPool, max_batch: int, step_tokens: int, share_generated: bool = True) -> None:
        self.pool, self.max_batch, self.step_tokens = pool, max_batch, step_tokens
        self.kv = KVCacheManager(pool, share_generated)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefix = PrefixStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def plan(self) -> list[Work]:
        """The work of the next step (possibly none)."""
        work: list[Work] = []
        preempted = False
        i = 0
        while i < len(self.running):  # 1. decoding: one token each, oldest first
            seq = self.running[i]
            if len(seq.tokens) - seq.computed != 1:
                i += 1
                continue
            if self.kv.allocate(seq, seq.computed + 1):
                work.append(Work(seq, seq.computed, 1))
                i += 1
                continue
            victim = self._victim()  # possibly seq itself, or one given work already this step
            assert victim is not None  # (seq itself runs)
            if self.running.index(victim) < i:
                i -= 1
                work = [w for w in work if w.seq is not victim]
            self._preempt(victim)
            preempted = True
        budget = self.step_tokens - len(work)
        for seq in self.running:  # 2a. prompts already being prefilled
            need = len(seq.tokens) - seq.computed
            if need > 1 and budget > 0:
                count = min(need, budget)
                if not self.kv.allocate(seq, seq.computed + count):
                    break
                work.append(Work(seq, seq.computed, count))
                budget -= count
        holding = {seq.request.id for seq in self.running}
        for seq in self._admission_order(holding):  # 2b. new ones, by priority, then fewest blocks held first
            if budget <= 0 or (preempted and seq.request.id in holding):
                break
            while len(self.running) >= self.max_batch and (freed := self._make_room(seq, work)) is not None:
                budget, preempted = budget + freed, True
            if len(self.running) >= self.max_batch:
                break
            # a request for the prompt's log-probabilities computes the whole prompt: no prefix-cache hits
            seq.computed = self.kv.find_computed(seq) if seq.request.params.prompt_logprobs is None else 0
            count = min(len(seq.tokens) - seq.computed, budget)
            while not (fits := self.kv.allocate(seq, seq.computed + count)):
                if (freed := self._make_room(seq, work)) is None:
                    break
                budget, preempted = budget + freed, True
            if not fits:
                self._unadmit(seq)  # no room yet: it keeps its place and holds nothing while it waits
                break
            self.waiting.remove(seq)
            self.prefix.queried += (len(seq.tokens) - 1) // self.pool.block_size
            self.prefix.hit += seq.computed // self.pool.block_size  # the blocks its prefix lookup found
            if seq.cached is None:  # what its first admission found (a preempted one finds its own blocks again)
                seq.cached = seq.computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            work.append(Work(seq, seq.computed, count))
            budget -= count
        return work

    def _victim(self, below: int | None = None) -> Sequence | None:
        """Among the running sequences of the lowest priority (of a priority below `below`, when given: None if
        none runs): where the request holding the most blocks (ties: the newer) runs several sequences, its newest;
        otherwise the newest request's."""
        candidates = [s for s in self.running if below is None or _priority(s) > below]
        if not candidates:
            return None
        lowest = max(_priority(s) for s in candidates)
        candidates = [s for s in candidates if _priority(s) == lowest]  # in admission order: a request's last is newest
        held: dict[str, int] = {}
        running: dict[str, int] = {}
        for seq in candidates:
            held[seq.request.id] = held.get(seq.request.id, 0) + self.kv.held(seq)
            running[seq.request.id] = running.get(seq.request.id, 0) + 1
        arrival = {seq.request.id: seq.request.arrival for seq in candidates}
        hog = max(held, key=lambda r: (held[r], arrival[r]))
        chosen = hog if running[hog] > 1 else max(held, key=lambda r: arrival[r])
        return next(seq for seq in reversed(candidates) if seq.request.id == chosen)

    def _make_room(self, seq: Sequence, work: list[Work]) -> int | None:
        """Preempt a running sequence of a lower priority than waiting `seq` (the victim of that class), taking its
        work out of this step's: the tokens of the budget it frees, or None where no such sequence runs."""
        victim = self._victim(below=_priority(seq))
        if victim is None:
            return None
        freed = sum(w.count for w in work if w.seq is victim)
        work[:] = [w for w in work if w.seq is not victim]
        self._preempt(victim)
        return freed

    def _admission_order(self, holding: set[str]) -> list[Sequence]:
        """By priority; within one, waiting sequences of requests that hold no blocks (queue order), then the
        others (queue order)."""
        order = [s for s in self.waiting if s.request.id not in holding] + [
            s for s in self.waiting if s.request.id in holding
        ]
        return sorted(order, key=_priority)  # (stable: the order above within a priority)

    def computed(self, work: Work) -> None:
        """After the model ran `work`: its tokens are cached, and the blocks it filled can be shared."""
        work.seq.computed = work.start + work.count
        self.kv.cache_full_blocks(work.seq, work.seq.computed)

    def _unadmit(self, seq: Sequence) -> None:
        """Give back all of `seq`'s blocks: a waiting sequence holds none, so whatever waits can never keep the
        running ones from the memory they need. It will be computed again from its tokens (what was cached of
        them is found again through the prefix cache unless the pool needed those blocks meanwhile)."""
        self.kv.free(seq)
        seq.computed = 0
        seq.status = Status.WAITING

    def _preempt(self, seq: Sequence) -> None:
        """Stop running `seq`, give back its blocks and put it first in line."""
        self.running.remove(seq)
        self._unadmit(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1


def _priority(seq: Sequence) -> int:
    return seq.request.params.priority
