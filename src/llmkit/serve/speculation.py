"""Speculative decoding in the serving engine: every decoding sequence drafts up to k tokens with the model's own
multi-token-prediction module (DeepSeek-V3 §2.2, as `llmkit generate --mtp` does for one generation), and the target
checks all the sequences' drafts in the step's one forward (the C++ step's, or the GPU runner's).

    draft    the drafter over each sequence's slots `next` .. n: the ones it has not yet computed from true inputs,
             then `cur` (the newest token, in slot n) -> d1; chained at n + 1 .. -> d2 .. dk
    verify   the target over cur, d1 .. dk of every sequence, each token a row of the C++ step
             (NativeDecoder.run_tokens: the same arithmetic as a plain decoding row, so greedy output is the plain
             engine's token for token), with the head in row-invariant pieces; on a GPU, a row of 1 + k queries in the
             step's packed forward (kernel_runner.py)
    accept   greedy: the drafts while they are the target's argmax, then its token; sampled: the rule of Leviathan
             et al. (llmkit.generate.speculative.accept), which gives every token the target's distribution

The drafters (serve/drafters.py): models (ModelDrafting: the model's MTP module, MTPSpeculator, or a smaller model,
ModelSpeculator), or the sequence's own text (NgramSpeculator: prompt lookup).

How many drafts (0 .. k) is decided each step by Costs, which the speculator measures when it is made (the target's
verifying step with the head, and a chained draft, at 1 to 64 rows) and completes with the engine's per-step
overhead it learns,
and by the acceptance it keeps per draft depth: drafts where a step is bound by reading the weights, none where each
row costs its arithmetic (drafts_for).

Rejected drafts need no undoing: a sequence's computed length becomes cur plus the accepted drafts, and the slots after
it are rewritten before anything attends to them. Rows with penalties or a grammar decode plainly (their
distributions would depend on the drafts before them), and so do sampled requests with a seed, whose tokens then stay
those the seed gives without speculation. Shapes: R drafting rows, V vocabulary, C model dim.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.sampling import distribution, draw
from llmkit.generate.speculative import accept, accept_greedy
from llmkit.models.decoder import DecoderLM
from llmkit.serve.kv_manager import KVCacheManager
from llmkit.serve.request import Sequence, Top
from llmkit.serve.runner_base import TokenRunner
from llmkit.serve.sampler import logit_biased, top_logprobs
from llmkit.serve.scheduler import Work

log = logging.getLogger("llmkit.serve")


@dataclass
class _State:
    """What the drafter knows of one sequence."""

    start: int = 0  # the first new slot of its last step (a smaller one later: it was preempted and starts again)
    next: int = 1  # the first slot whose draft keys it has not computed from true inputs (Speculator.first_slot)


@dataclass(frozen=True)
class Drafts:
    """A sequence's drafts for one step: tokens (k,), and for a sampled row the distributions q (k, V) they were
    drawn from (None for greedy rows)."""

    tokens: Tensor
    q: Tensor | None


@dataclass
class Costs:
    """Seconds a verifying step and a chained draft take for a number of rows, interpolated (and extrapolated at a
    row's cost) from timings at ROWS; what the engine's own work adds to every step (`overhead`: scheduling,
    sampling, text) and how much longer a step's drafting takes than its chained drafts' timings say (`draft_scale`:
    the catch-up over accepted tokens and new prompts, the loop), both learnt from the steps that only decode
    (Speculator.timed)."""

    ROWS = (1, 2, 4, 8, 16, 32, 64)
    verifying: tuple[float, ...]
    drafting: tuple[float, ...]
    overhead: float = 0.0
    draft_scale: float = 1.0

    def step(self, rows: int, k: int) -> float:
        """Seconds a step of `rows` decoding rows with k drafts each takes."""
        return self.overhead + self.verify(rows * (k + 1)) + k * self.draft(rows) * self.draft_scale

    def verify(self, rows: int) -> float:
        return self._at(self.verifying, rows)

    def draft(self, rows: int) -> float:
        return self._at(self.drafting, rows)

    def _at(self, times: tuple[float, ...], rows: int) -> float:
        r = self.ROWS
        if rows >= r[-1]:
            return times[-1] + (rows - r[-1]) * (times[-1] - times[-2]) / (r[-1] - r[-2])
        i = next(i for i in range(1, len(r)) if rows <= r[i])
        return times[i - 1] + (rows - r[i - 1]) * (times[i] - times[i - 1]) / (r[i] - r[i - 1])

    @classmethod
    @torch.inference_mode()
    def measure(cls, speculator: Speculator) -> Costs:
        """Time the target's verifying step with its head and a chained draft (median of 3) over dummy tokens
        written into block 0 of the target's pools and of the drafter's (made before any sequence holds a block)."""
        sp = speculator
        dev = sp.model.device
        verifying, drafting = [], []
        for n in cls.ROWS:
            slots = torch.arange(n, device=dev) % sp.bs  # every row in block 0
            table = torch.zeros(n, 1, dtype=torch.long, device=dev)
            allowed = torch.arange(sp.bs, device=dev)[None] <= slots[:, None]
            tokens = torch.zeros(n, dtype=torch.long, device=dev)
            runs = 3 if n <= 8 else 1  # (a large model's many rows take long, and vary less)
            verifying.append(_seconds(sp.verify_rows, tokens, slots, table, runs=runs))
            drafting.append(sp.draft_seconds(slots, table, allowed, runs))
        return cls(tuple(verifying), tuple(drafting))


def _seconds(fn: Callable[..., object], *args: object, runs: int = 3) -> float:
    """The median of `runs` timings of fn(*args), after one to warm up (on a GPU, waiting for its work each time:
    its launches return before they run)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    fn(*args)
    times = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[runs // 2]


@dataclass(frozen=True)
class Verdict:
    """What a verified row yields: the accepted drafts, then the target's own token (1 to k + 1 tokens), with each
    one's log-probability under the model and the alternatives the request asked for."""

    tokens: list[int]
    logprobs: list[float]
    top: list[Top]
    accepted: int


class Speculator(ABC):
    """What every drafter shares: which rows draft and how many tokens (drafts_for, from Costs and the acceptance
    per depth), the choice of rows (propose), the verdicts (judge). A drafter gives _draft (the chosen rows' drafts),
    and may cap a row's drafts by what it has to offer (_available), keep what it reads of the target's states
    (_record) and say what a draft costs (draft_seconds). `target`: the engine's model runner, which verifies; `k`:
    the most drafts a sequence gets in a step."""

    first_slot = 1

    def __init__(self, model: DecoderLM, target: TokenRunner, kv: KVCacheManager, k: int) -> None:
        if not isinstance(k, int) or k < 1:
            raise InputError(f"draft tokens k={k!r} must be an int >= 1")
        self.model, self.target, self.kv, self.k, self.bs = model, target, kv, k, target.block_size
        self.states: dict[tuple[str, int], _State] = {}
        self.drafted = self.accepted = 0  # over all verified rows
        # the chance that the draft at each depth is kept, given the ones before it were (which sets k: drafts_for):
        # kept over tried, both decaying, from a prior of 7 in 10. A chained draft is kept less often than the first
        self._kept, self._tried = [7.0] * k, [10.0] * k
        # when the step only decodes: its verifying kernels' cost by `costs`, its drafting's time, what `costs` says
        # its drafts cost (Speculator.timed)
        self._kernels: tuple[float, float, float] | None = None
        self.costs = Costs((0.0,) * len(Costs.ROWS), (0.0,) * len(Costs.ROWS))  # measured by the drafter's __init__

    # ---- a drafter's part

    @abstractmethod
    def _draft(self, chosen: list[tuple[Work, int]]) -> list[Drafts]:
        """Drafts for each chosen row (its Work, how many drafts it gets: at least 1)."""

    def _available(self, w: Work, k: int) -> int:
        """How many of k drafts the drafter has for row w (a model always has k)."""
        return k

    def draft_seconds(self, slots: Tensor, table: Tensor, allowed: Tensor, runs: int) -> float:
        """Seconds a chained draft of dummy rows in slots (M,) through table (M, nb), seeing allowed (M, S), takes
        (Costs.measure); 0 for a drafter that runs no model."""
        return 0.0

    @abstractmethod
    def _record(self, rows: list[Work], hidden: list[Tensor], counts: list[int]) -> None:
        """Keep what the drafter reads of the target's last-block states (n_i, C) of a forward."""

    # ---- verifying

    def verify_rows(self, tokens: Tensor, slots: Tensor, table: Tensor) -> Tensor:
        """What a verifying step computes for tokens (N,), each a row (the target's token_states and token_logits:
        on the C++ step, the head in row-invariant pieces) -> logits (N, V)."""
        return self.target.token_logits(self.target.token_states(tokens, slots, table))

    def record(self, drafted: int, accepted: int, seq: Sequence | None = None) -> None:
        """A verified row (of `seq`) kept `accepted` of its `drafted` drafts: the acceptance per depth (which sets
        k) moves."""
        self.drafted += drafted
        self.accepted += accepted
        for depth in range(min(accepted + 1, drafted)):  # depths 1 .. a were kept, depth a + 1 (if drafted) was not
            self._tried[depth] = 0.99 * self._tried[depth] + 1
            self._kept[depth] = 0.99 * self._kept[depth] + (depth < accepted)

    # ---- bookkeeping

    @property
    def acceptance(self) -> list[float]:
        """Per depth d = 1 .. k: the chance the d-th draft is kept when the ones before it were."""
        return [kept / tried for kept, tried in zip(self._kept, self._tried, strict=True)]

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether a sequence can take drafts: its next token's distribution must not depend on the tokens before it
        beyond the model's logits (no penalties, no grammar), and a seeded sampled request must keep drawing what its
        seed draws without speculation (the drafts would consume its random stream differently, by how many each
        step gets)."""
        p = seq.request.params
        penalties = p.sampling.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
        seeded = p.seed is not None and not p.sampling.greedy
        return not penalties and not seeded and seq.matcher is None

    def forget(self, seq: Sequence) -> None:
        self.states.pop(seq.key, None)

    # ---- the target's states

    def observe(self, rows: list[Work], hidden: list[Tensor], counts: list[int] | None = None) -> None:
        """A forward computed the target's last-block states hidden[i] (n_i, C) for slots start .. start + n_i - 1
        of rows[i] (n_i = counts[i], default the row's count): notice restarts (preemption), let the drafter keep
        what it reads."""
        for w in rows:
            state = self.states.setdefault(w.seq.key, _State(next=self.first_slot))
            if w.start < state.start:  # computed again from its tokens (preempted): its draft keys may be gone
                state.next = self.first_slot
            state.start = w.start
        self._record(rows, hidden, counts if counts is not None else [w.count for w in rows])

    # ---- drafting

    def drafts_for(self, decoding: int) -> int:
        """How many drafts each of `decoding` rows gets this step: the k (up to self.k) with the most tokens per
        second, by the measured costs (`costs`) and acceptance. A row with k drafts yields 1 + a1 + a1 a2 + .. +
        a1 .. ak tokens on average (ad: the chance the d-th draft is kept when the ones before it were); a step of
        n rows with k drafts costs costs.step(n, k). With few rows a step is bound by reading the weights and
        drafts are nearly free; as rows grow it becomes bound by its arithmetic, and then every rejected draft
        costs as much as a token: k falls to 0."""
        best, best_rate = 0, decoding / self.costs.step(decoding, 0)
        tokens, reach = 1.0, 1.0
        for k, a in enumerate(self.acceptance, start=1):
            reach *= a
            tokens += reach
            rate = decoding * tokens / self.costs.step(decoding, k)
            if rate > best_rate * 1.02:  # a clear gain only
                best, best_rate = k, rate
        return best

    def timed(self, seconds: float) -> None:
        """The engine's step took `seconds`: where it only decoded (no prompt chunk), what it took beyond its
        verifying kernels' measured cost and its drafting's measured time updates the overhead, and the drafting's
        time against its chained drafts' timings the draft scale, which the choice of k counts with."""
        if self._kernels is not None:
            verifying, drafting, predicted = self._kernels
            spare = max(0.0, seconds - verifying - drafting)
            self.costs.overhead = 0.9 * self.costs.overhead + 0.1 * spare
            if predicted > 0:
                self.costs.draft_scale = 0.9 * self.costs.draft_scale + 0.1 * max(1.0, drafting / predicted)
        self._kernels = None

    def propose(
        self, rows: list[Work], room: Callable[[Sequence, int], bool], max_len: int, chunks: bool = False
    ) -> dict[int, Drafts]:
        """Drafts for the decoding rows that take them, by the row's index in `rows`. room(seq, length):
        make the sequence hold blocks for `length` tokens (False: it cannot, and gets no drafts); chunks: the step
        also computes prompt chunks (then its time says nothing about the engine's overhead: `timed`). Drafting
        only saves time: where it fails, the step decodes without drafts."""
        if not rows:
            return {}
        try:
            start = time.perf_counter()
            pending = self._propose(rows, room, max_len, chunks)
            if self._kernels is not None:  # (the drafting's own time, for `timed`)
                self._kernels = (self._kernels[0], time.perf_counter() - start, self._kernels[2])
            return pending
        except Exception as e:
            log.warning("drafting failed (%s: %s); this step decodes without drafts", type(e).__name__, e)
            for w in rows:  # their MTP keys may be half written: computed again from slot 1 next time
                self.forget(w.seq)
            return {}

    def _propose(
        self, rows: list[Work], room: Callable[[Sequence, int], bool], max_len: int, chunks: bool
    ) -> dict[int, Drafts]:
        k = self.drafts_for(len(rows))
        self._kernels = None if chunks else (self.costs.verify(len(rows)), 0.0, 0.0)
        if k == 0:
            return {}
        chosen: list[tuple[Work, int]] = []
        index: list[int] = []  # each chosen row's index in `rows`
        for i, w in enumerate(rows):
            seq = w.seq
            left = seq.request.params.max_tokens - len(seq.generated)  # tokens it may still get, cur's next included
            kw = min(k, left - 1, max_len - 1 - w.start)
            # (slot 0 has no MTP position: nothing comes before it)
            if kw > 0 and w.start > 0 and self.eligible(seq):
                kw = self._available(w, kw)
                if kw > 0 and room(seq, w.start + 1 + kw):
                    chosen.append((w, kw))
                    index.append(i)
        if not chosen:
            return {}
        drafts = dict(zip(index, self._draft(chosen), strict=True))
        if self._kernels is not None:  # the verifying rows, and what the chained drafts' timings say
            deepest = max(kw for _, kw in chosen)
            extra = sum(kw for _, kw in chosen)
            self._kernels = (self.costs.verify(len(rows) + extra), 0.0, deepest * self.costs.draft(len(chosen)))
        return drafts


class ModelDrafting(Speculator):
    """A drafter that runs a model (the MTP module, a draft model): its state at each row's cur from its true inputs
    (_catch_up), then chained drafts (_step), each drawn from its head's logits under the row's settings. It says
    where its drafting starts (first_slot) and gives head (state -> logits) and draft_scratch (a timed draft)."""

    @abstractmethod
    def _catch_up(self, rows: list[Work]) -> Tensor:
        """The drafter over every row's slots from its state's `next` to its cur (slot w.start), from true inputs;
        returns its state at each row's cur (R, C'), which `head` turns into logits."""

    @abstractmethod
    def _step(self, works: list[Work], slots: Tensor, ids: Tensor, out: Tensor) -> Tensor:
        """One chained draft: each work's token ids (M,) in slots (M,), after states out (M, C') -> states (M, C')."""

    @abstractmethod
    def head(self, out: Tensor) -> Tensor:
        """The drafter's states (M, C') -> logits (M, V)."""

    @abstractmethod
    def draft_scratch(self, slots: Tensor, table: Tensor, allowed: Tensor) -> Tensor:
        """A chained draft of dummy rows in slots (M,) through table (M, nb), seeing allowed (M, S) (Costs)."""

    def draft_seconds(self, slots: Tensor, table: Tensor, allowed: Tensor, runs: int) -> float:
        return _seconds(self.draft_scratch, slots, table, allowed, runs=runs)

    def _draft(self, chosen: list[tuple[Work, int]]) -> list[Drafts]:
        for w, _ in chosen:  # a sequence not seen yet, or computed again since (preempted): MTP keys from slot 1
            state = self.states.setdefault(w.seq.key, _State(w.start, self.first_slot))
            if w.start < state.start:
                state.next = self.first_slot
        out = self._catch_up([w for w, _ in chosen])  # (R, C): MTP's normed output at each row's cur
        tokens: list[list[Tensor]] = [[] for _ in chosen]
        qs: list[list[Tensor]] = [[] for _ in chosen]
        live = list(range(len(chosen)))
        for depth in range(max(kw for _, kw in chosen)):
            logits = self.head(out)  # (r, V)
            nxt = []
            for j, i in enumerate(live):
                seq = chosen[i][0].seq
                token, q = self._draw(logits[j], seq, depth)
                tokens[i].append(token)
                if q is not None:
                    qs[i].append(q)
                nxt.append(token)
            keep = [j for j, i in enumerate(live) if chosen[i][1] > depth + 1]
            if not keep:
                break
            live = [live[j] for j in keep]
            works = [chosen[i][0] for i in live]
            slots = torch.tensor([w.start + depth + 1 for w in works])
            ids = torch.stack([nxt[j] for j in keep])
            out = self._step(works, slots, ids, out[keep])
        return [Drafts(torch.stack(t), torch.stack(q) if q else None) for t, q in zip(tokens, qs, strict=True)]

    def _draw(self, logits: Tensor, seq: Sequence, depth: int) -> tuple[Tensor, Tensor | None]:
        """Draft `depth` (0: the token after cur) from the MTP head's logits (V,) under the sequence's settings, and
        q (V,) when sampled."""
        sampling = seq.request.params.sampling
        x = logit_biased(logits.float(), seq.request.params.logit_bias)
        if sampling.greedy:
            return x.argmax(), None
        q = distribution(x.unsqueeze(0), sampling)[0]
        return draw(q, False, seq.generator), q

    def _spans(self, rows: list[Work]) -> tuple[list[Work], list[int], list[int]]:
        """What _catch_up computes: every row's slots from its state's `next` to its cur, one entry per slot (the
        slot's Work, the slot), and where each row's cur is among them; the states move on past cur."""
        works: list[Work] = []
        slots: list[int] = []
        last: list[int] = []
        for w in rows:
            state = self.states[w.seq.key]
            span = range(state.next, w.start + 1)
            works += [w] * len(span)
            slots += span
            last.append(len(slots) - 1)
            state.next = w.start + 1
        return works, slots, last

    def _tables(self, works: list[Work], device: torch.device) -> Tensor:
        """The works' block tables, one row each, padded with a valid block (M, nb)."""
        tables = [self.kv.table(w.seq) for w in works]
        nb = max(len(t) for t in tables)
        return torch.tensor([t + t[:1] * (nb - len(t)) for t in tables], device=device)


class NoDrafts:
    """The drafter of an engine that does not speculate: no row gets drafts, so nothing is verified."""

    drafted = accepted = 0

    def propose(
        self, rows: list[Work], room: Callable[[Sequence, int], bool], max_len: int, chunks: bool = False
    ) -> dict[int, Drafts]:
        return {}

    def observe(self, rows: list[Work], hidden: list[Tensor], counts: list[int] | None = None) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass

    def timed(self, seconds: float) -> None:
        pass

    def record(self, drafted: int, accepted: int, seq: Sequence | None = None) -> None:
        raise AssertionError("an engine without speculation verified drafts")


Drafter = Speculator | NoDrafts


def judge(seq: Sequence, drafts: Drafts, logits: Tensor) -> Verdict:
    """The target's logits (k + 1, V) after `seq`'s token and after each of its k drafts -> what the row keeps."""
    p = seq.request.params
    d = drafts.tokens.to(logits.device)[None]  # (1, k)
    x = logit_biased(logits.float(), p.logit_bias)
    if p.sampling.greedy:
        n, extra = accept_greedy(d, x.argmax(dim=-1)[None])
    else:
        assert drafts.q is not None
        probs = distribution(x, p.sampling)  # (k + 1, V)
        n, extra = accept(d, drafts.q[None], probs[None], False, seq.generator)
    a = int(n[0])
    tokens = [*drafts.tokens[:a].tolist(), int(extra[0])]
    logprobs = torch.log_softmax(logits[: a + 1].float(), dim=-1)  # (a + 1, V): the model's own
    values = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    return Verdict(tokens, values, top_logprobs(logprobs, p.top_logprobs), a)
