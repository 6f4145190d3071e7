"""The serving engine: requests join the running batch at the next step and leave it the step they finish.

    add(request) ─► Scheduler.plan() ─► model over paged cache ─► sampler ─► text / stops ─► Delta per sequence
                        ▲                                                                          │
                        └──────────────── finished sequences give their blocks back ◄──────────────┘

`step()` does one iteration: the scheduler picks the work (every decoding sequence's newest token, plus prompt
chunks up to the step's token budget), the model computes it through a view of the paged cache, and every sequence
that reached the end of its known tokens gets its next token. A step's rows go through the model in one forward:
decoding rows and prompt chunks of different lengths packed into one row (1, N), each attending within its own
sequence (AttentionMask.ragged); the decoding rows run in one C++ call instead where the model allows it
(llmkit's native step), which reads the paged pools in place: putting them into the chunks' PyTorch forward
instead made SmolLM2's steps with long contexts 1.6x slower (487 against 309 ms), since each layer then gathers every
row's keys. With a speculator (speculation.py) the decoding rows first draft tokens with the model's MTP module and
the step verifies them: a sequence can get several tokens a step. Nothing here is threaded: `llmkit.serve.runner`
drives an engine for the HTTP server, and `generate` drives it to completion for a Python caller.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from llmkit.errors import InputError, LLMKitError
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.models.decoder import DecoderLM
from llmkit.quant.native_step import NativeDecoder
from llmkit.serve.blocks import BlockPool
from llmkit.serve.config import EngineConfig, EngineStats
from llmkit.serve.drafters import speculator
from llmkit.serve.forward import prompt_count, prompt_logits, row_of
from llmkit.serve.lockstep import Lockstep, RanksLost, forward_step, make_cache
from llmkit.serve.paged import PagedCache
from llmkit.serve.request import (
    Completion,
    Delta,
    FinishReason,
    Refused,
    Request,
    SamplingParams,
    Sequence,
    Status,
    Top,
)
from llmkit.serve.sampler import record_prompt_logprobs, sample
from llmkit.serve.scheduler import Scheduler, Work
from llmkit.serve.structured import Grammars, allowed_tokens
from llmkit.serve.text import TextOutput
from llmkit.tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger("llmkit.serve")


class QueueFull(LLMKitError):
    """The engine's waiting queue is full; the request was not taken (HTTP 429)."""


class Engine:
    """A decoder-only model, its paged cache, the requests in flight, and a drafter with config.draft_tokens."""

    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        draft: DecoderLM | None = None,
        lockstep: Lockstep | None = None,
    ):
        if not isinstance(model, DecoderLM):
            raise InputError(f"the engine serves decoder-only models, got {type(model).__name__}")
        config = config or EngineConfig()
        if lockstep is not None and (config.draft_tokens or config.batch_invariant or draft is not None):
            raise InputError("a model split across ranks is served without speculation or the batch-invariant mode")
        self.lockstep = lockstep  # a tensor-parallel model: every rank runs each forward (lockstep.py)
        self._run_rows = forward_step if lockstep is None else functools.partial(lockstep.run, forward_step)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.device, self.dtype = model.device, model.dtype
        per_block = PagedCache.bytes_per_block(model, config.block_size, self.dtype)
        if draft is not None and config.draft_tokens:  # (its pools share the blocks and the memory)
            per_block += PagedCache.bytes_per_block(draft, config.block_size, draft.dtype)
        n_blocks = config.kv_memory // per_block
        if n_blocks < 1:
            raise InputError(f"kv_memory={config.kv_memory} bytes is less than one block ({per_block} bytes)")
        self.cache = PagedCache(model, n_blocks, config.block_size, self.device, self.dtype)
        if lockstep is not None:  # the other ranks' caches: the same blocks, their own heads
            lockstep.tell(make_cache, n_blocks, config.block_size, self.dtype)
        self.native = NativeDecoder.of(model) if lockstep is None else None  # decoding rows in C++ where it applies
        # whether rows of different lengths can go through the model as one packed row: grouped-query attention
        # takes them (AttentionMask.ragged); latent attention's paths size their work by the queries' batch
        self.packs = all(type(b.attn) is GroupedQueryAttention for b in model.blocks)
        self.invariant = config.batch_invariant
        kv = self.cache.grouped_query()
        with torch.no_grad():  # (how the engine's steps run)
            native_pools = self.native is not None and kv is not None and self.native.applies_paged(1, kv[0])
        for mode, wanted in (("the batch-invariant mode", self.invariant), ("speculation", config.draft_tokens)):
            if wanted and not native_pools:
                raise InputError(
                    f"{mode} runs tokens through llmkit's C++ decode step: it needs an x86 CPU with AVX2, fp32 or "
                    "int4/int8 weights, fp32 caches and a grouped-query decoder"
                )
        self.pool = BlockPool(n_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_batch, config.step_tokens)
        # drafts for the decoding rows (config.draft_tokens): `draft`'s, or the model's MTP module's (drafters.py)
        self.speculator = speculator(model, self.native, self.scheduler.kv, kv, config, draft)
        self.max_len = model.max_seq_len
        self.eos_ids = {tokenizer.eos_id} if tokenizer is not None and tokenizer.eos_id is not None else set()
        # structured outputs: constraints compiled against the tokenizer's vocabulary (needs the tokenizer)
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size) if tokenizer is not None else None
        self.requests: dict[str, list[Sequence]] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        # what deadlines and token times are read from: tests replace it, so that a time limit is checked by moving
        # this clock, not by hoping the machine is slow enough
        self.clock: Callable[[], float] = time.monotonic

    # ---- requests

    @property
    def capacity_sequences(self) -> float:
        """How many sequences of the model's full context the cache holds at once."""
        return self.pool.n_blocks * self.pool.block_size / self.max_len

    def add(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None, timeout: float | None = None
    ) -> str:
        """Queue a request (token ids); returns its id. Raises InputError for a request that can never run and
        QueueFull when too many are waiting."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InputError(f"request id {request_id!r} is already in flight")
        self.check(prompt, params)
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting; try again later")
        now = self.clock()
        request = Request(request_id, list(prompt), params, now, now + timeout if timeout is not None else None)
        seqs = [self._sequence(request, i) for i in range(params.n)]
        self.requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """A Refused error naming the field unless the request can run on this engine."""
        if not prompt:
            raise Refused("the prompt is empty", "prompt")
        if len(prompt) + params.max_tokens > self.max_len:  # first: it costs nothing, and refuses huge prompts
            raise Refused(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_len} tokens",
                "max_tokens",
            )
        V = self.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < V for t in prompt):
            raise Refused(f"prompt token ids must be integers in [0, {V})", "prompt")
        if any(not 0 <= t < V for t, _ in params.logit_bias):
            raise Refused(f"logit_bias: token ids must be in [0, {V})", "logit_bias")
        if params.constraint is not None:
            if self.grammars is None:
                raise Refused("structured outputs need the model's tokenizer, and this model has none", "constraint")
            try:
                self.grammars.compile(params.constraint)  # cached: the HTTP server compiled it off its event loop
            except InputError as e:
                raise Refused(str(e), "constraint") from e
        blocks = -(-(len(prompt) + params.max_tokens) // self.pool.block_size)
        if blocks > self.pool.n_blocks:
            raise Refused(
                f"the request needs {blocks} cache blocks and the cache has {self.pool.n_blocks}: "
                "give the server more kv memory or ask for fewer tokens",
                "max_tokens",
            )

    def _sequence(self, request: Request, index: int) -> Sequence:
        seed = request.params.seed
        generator = None
        if not request.params.sampling.greedy:
            generator = torch.Generator(device=self.device)
            # seed + index stays in manual_seed's range: seeds are int64 (SamplingParams), which it takes up to 2**64
            generator.manual_seed(seed + index if seed is not None else int(torch.randint(2**62, ()).item()))
        decoder = IncrementalDecoder(self.tokenizer, request.prompt) if self.tokenizer is not None else None
        seq = Sequence(request, index, list(request.prompt), generator, TextOutput(decoder, request.params.stop))
        if request.params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(request.prompt)  # the first token has none: nothing comes before it
        if request.params.constraint is not None and self.grammars is not None:
            seq.matcher = self.grammars.matcher(request.params.constraint)
        return seq

    def abort(self, request_id: str) -> None:
        """End a request now (a client went away); its blocks go back to the pool. Unknown ids are ignored."""
        for seq in self.requests.pop(request_id, []):
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                if self.speculator is not None:
                    self.speculator.forget(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- one step

    @torch.inference_mode()
    def step(self) -> list[Delta]:
        """Run one iteration; returns what it added to each sequence that got a token or finished."""
        start = time.perf_counter()
        deltas = self._step()
        if self.speculator is not None:  # (how it chooses the number of drafts)
            self.speculator.timed(time.perf_counter() - start)
        return deltas

    def _step(self) -> list[Delta]:
        deltas = self._expire()
        work = self.scheduler.plan()
        if not work:
            return deltas
        self.stats.steps += 1
        now = self.clock()
        for w in work:
            if w.seq.request.admitted is None:  # its first work: the end of its time in queue
                w.seq.request.admitted = now
        logits = self._logits(work)
        for w in [w for w in work if id(w) not in logits]:  # its forward failed even alone: it ends, alone
            self.stats.failed += 1
            self._finish(w.seq, "error")
            deltas.append(Delta.of(w.seq))
        work = [w for w in work if id(w) in logits]
        for w in work:
            self.scheduler.computed(w)
            if w.start < w.seq.prompt_len:
                self.stats.prompt_tokens += min(w.start + w.count, w.seq.prompt_len) - w.start
        ready = [w for w in work if w.samples]
        for w in [w for w in ready if w.seq.request.params.max_tokens == 0]:  # the prompt was all it asked for
            self._finish(w.seq, "length")
            deltas.append(Delta.of(w.seq, prompt_logprobs=w.seq.prompt_logprobs))
        ready = [w for w in ready if w.seq.request.params.max_tokens > 0]
        deltas += [self._judge(w, logits[id(w)]) for w in ready if logits[id(w)].dim() == 2]  # drafts verified
        ready = [w for w in ready if logits[id(w)].dim() == 1]
        if not ready:
            return deltas
        batch = torch.stack([logits[id(w)] for w in ready])  # (B, V)
        bad = (torch.isnan(batch) | torch.isposinf(batch)).any(dim=-1).tolist()  # -inf: a token masked on purpose
        if any(bad):  # damaged weights or an overflow: those sequences end with an error, the batch goes on
            for w in (w for w, b in zip(ready, bad, strict=True) if b):
                log.error("request %s: the model's logits are NaN or infinite; ending it", w.seq.request.id)
                self.stats.failed += 1
                self._finish(w.seq, "error")
                deltas.append(Delta.of(w.seq))
            keep = [i for i, b in enumerate(bad) if not b]
            ready, batch = [ready[i] for i in keep], batch[keep]
        if ready:
            matchers = [w.seq.matcher for w in ready]
            allowed = None
            if any(m is not None for m in matchers):  # structured outputs: each grammar's next tokens
                allowed = allowed_tokens(matchers, batch.shape[-1])
            sampled = sample(batch, [w.seq for w in ready], allowed)
            for w, token, logprob, top in zip(ready, sampled.tokens, sampled.logprobs, sampled.top, strict=True):
                if token is None or logprob is None:  # this row's settings failed: it ends alone
                    self.stats.failed += 1
                    self._finish(w.seq, "error")
                    deltas.append(Delta.of(w.seq))
                else:
                    deltas.append(self._append(w.seq, token, logprob, top))
        return deltas

    def _logits(self, work: list[Work]) -> dict[int, Tensor]:
        """The last-token logits (V,) of each work item, by id. All the rows go through the model in one forward
        (packed, see _forward); the decoding rows in C++ instead where it applies (self.native), and each row length
        on its own for models whose attention cannot take packed rows. When a forward raises (out of memory, a
        kernel refusing a shape), its rows are computed one by one, so that the failure is pinned on the rows that
        cause it; those are missing from the result."""
        decoding = [w for w in work if w.count == 1]
        chunks = [w for w in work if w.count > 1]
        if self.speculator is not None:  # drafts for the decoding rows that take them (speculator.pending)
            self.speculator.propose(decoding, self.scheduler.kv.allocate, self.max_len, chunks=bool(chunks))
        if self.invariant:
            groups = [work]
        elif self._native_applies(decoding):
            groups = [decoding, chunks]
        elif self.packs:
            groups = [decoding + chunks]
        else:
            groups = [decoding] + [[w] for w in chunks]
        logits: dict[int, Tensor] = {}
        for group in (g for g in groups if g):
            try:
                out = self._forward(group)  # (B, V)
            except RanksLost:
                raise  # the ranks are out of step: nothing is retried
            except Exception as e:
                if len(group) > 1:
                    log.warning(
                        "a batch of %d rows failed (%s: %s); computing them one by one", len(group), type(e).__name__, e
                    )
                    logits.update(self._logits_alone(group))
                else:
                    log.error("request %s failed: %s: %s; ending it", group[0].seq.request.id, type(e).__name__, e)
                continue
            logits.update({id(w): out[i] for i, w in enumerate(group)})
        return logits

    def _logits_alone(self, rows: list[Work]) -> dict[int, Tensor]:
        logits = {}
        for w in rows:
            try:
                logits[id(w)] = self._forward([w])[0]
            except Exception as e:
                log.error("request %s failed: %s: %s; ending it", w.seq.request.id, type(e).__name__, e)
        return logits

    def _native_applies(self, rows: list[Work]) -> bool:
        kv = self.cache.grouped_query()
        return bool(rows) and self.native is not None and kv is not None and self.native.applies_paged(1, kv[0])

    def _forward(self, rows: list[Work]) -> Tensor | list[Tensor]:
        """The model over the rows -> logits of each row's last token (B, V). Rows of one token each run in C++
        where it applies; the others through forward.run_rows (on every rank, for a model split across ranks);
        decoding rows with drafts (speculator.pending) token by token in C++ (_forward_tokens), their logits
        (1 + k, V)."""
        bs = self.pool.block_size
        dev = self.device
        counts = [w.count for w in rows]
        tables = [self.scheduler.kv.table(w.seq) for w in rows]
        drafts = self.speculator.pending if self.speculator is not None else {}
        extra = [len(drafts[id(w)].tokens) if id(w) in drafts else 0 for w in rows]
        in_cpp = self.invariant or any(extra) or (counts == [1] * len(rows) and self._native_applies(rows))
        if not in_cpp:  # the PyTorch forward, which builds its own slots and tables
            out = self._run_rows(self, bs, [row_of(w, t) for w, t in zip(rows, tables, strict=True)])
            record_prompt_logprobs(rows, out.prompt)
            if self.speculator is not None:
                self.speculator.observe(rows, out.hidden)
            return out.logits
        starts = torch.tensor([w.start for w in rows], device=dev)  # (B,) each row's first new slot
        nb = max(len(t) for t in tables)
        table = torch.tensor([t + t[:1] * (nb - len(t)) for t in tables], device=dev)  # (B, nb), padded
        ends = torch.tensor([w.start + n + e for w, n, e in zip(rows, counts, extra, strict=True)], device=dev)
        filled = torch.arange(nb * bs, device=dev) < ends[:, None]  # (B, nb * bs) the slots each row fills
        if self.invariant or any(extra):
            return self._forward_tokens(rows, table, filled)
        tokens = torch.tensor([w.seq.tokens[w.start] for w in rows], device=dev)[:, None]  # (B, 1)
        keys, values = self.cache.grouped_query() or ([], [])
        h = self.native.run_paged(  # type: ignore[union-attr]
            tokens, positions=starts[:, None], table=table, slots=starts, allowed=filled, keys=keys, values=values
        )  # (B, 1, C)
        self._states(rows, list(h))
        return self.model.logits(self.model.norm(h[:, -1]))  # (B, V)

    def _forward_tokens(self, rows: list[Work], table: Tensor, filled: Tensor) -> list[Tensor]:
        """Every token of the rows through the C++ step as a row of its own (table and filled (B, ...) repeated for
        each of a row's tokens), the head through row-invariant products: the batch-invariant mode's forward, and
        the verifying one of rows with drafts (speculator.pending), whose logits are (1 + k, V) at cur and each
        draft; the other rows' are (V,) at their last token."""
        assert self.native is not None
        dev = self.device
        drafts = self.speculator.pending if self.speculator is not None else {}
        ids = [w.seq.tokens[w.start : w.start + w.count] + (drafts[id(w)].tokens.tolist() if id(w) in drafts else [])
               for w in rows]  # fmt: skip
        counts = [len(t) for t in ids]
        tokens = torch.tensor([t for row in ids for t in row], device=dev)
        starts = [w.start for w in rows]
        positions = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, counts, strict=True)])
        row = torch.repeat_interleave(torch.arange(len(rows), device=dev), torch.tensor(counts, device=dev))
        keys, values = self.cache.grouped_query() or ([], [])
        h = self.native.run_tokens(
            tokens, positions=positions, table=table[row].contiguous(), allowed=filled[row], keys=keys, values=values
        )  # (N, C)
        states = list(h.split(counts))
        self._states(rows, states, counts)
        wanted = [s if id(w) in drafts else s[-1:] for w, s in zip(rows, states, strict=True)]
        logits = self.native.logits(self.model.norm(torch.cat(wanted)), invariant=True)  # (rows wanted, V)
        out = logits.split([len(s) for s in wanted])
        return [x if id(w) in drafts else x[0] for w, x in zip(rows, out, strict=True)]

    def _states(self, rows: list[Work], hidden: list[Tensor], counts: list[int] | None = None) -> None:
        """What a forward's last-block states (n, C) of each row feed: the prompt log-probabilities asked for, and
        the drafter's record of the target's states."""
        record_prompt_logprobs(rows, prompt_logits(self.model, hidden, [prompt_count(w) for w in rows]))
        if self.speculator is not None:
            self.speculator.observe(rows, hidden, counts)

    def _judge(self, w: Work, logits: Tensor) -> Delta:
        """A row whose drafts were verified: the target's logits (1 + k, V) -> the tokens it keeps, as one delta."""
        assert self.speculator is not None
        seq = w.seq
        if bool((torch.isnan(logits) | torch.isposinf(logits)).any()):
            log.error("request %s: the model's logits are NaN or infinite; ending it", seq.request.id)
            self.stats.failed += 1
            self._finish(seq, "error")
            return Delta.of(seq)
        verdict = self.speculator.judge(w, self.speculator.pending[id(w)], logits)
        parts = []
        for token, logprob, top in zip(verdict.tokens, verdict.logprobs, verdict.top, strict=True):
            parts.append(self._append(seq, token, logprob, top))
            if seq.finished:
                break
        if not seq.finished:  # cur and the accepted drafts are cached; the target's own token is the next cur
            seq.computed = w.start + 1 + verdict.accepted
            self.scheduler.kv.cache_full_blocks(seq, seq.computed)
        return Delta.joined(parts)

    def _append(self, seq: Sequence, token: int, logprob: float, top: Top) -> Delta:
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        p = seq.request.params
        complete = False  # the constraint's text is complete: nothing may follow
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):  # the mask allowed it, so only a grammar engine's fault
                log.error(
                    "request %s: its grammar refused token %d: %s", seq.request.id, token, seq.matcher.get_error()
                )
                self.stats.failed += 1
                self._finish(seq, "error")
                return Delta.of(seq)
            complete = seq.matcher.is_stopped()
        eos = token in self.eos_ids and not p.ignore_eos  # its text is never shown
        length = not eos and (len(seq.generated) >= p.max_tokens or len(seq.tokens) >= self.max_len)
        text, stopped = seq.output.push(None if eos else token, final=eos or length or complete)
        reason: FinishReason | None = "stop" if eos or stopped or complete else "length" if length else None
        if reason is not None:
            self._finish(seq, reason)
        prompt = seq.prompt_logprobs if len(seq.generated) == 1 else None  # with the first token
        return Delta.of(seq, [token], text, [logprob], [top], prompt)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.stats.finished += 1
        seqs = self.requests.get(seq.request.id, [])
        if all(s.finished for s in seqs):
            self.requests.pop(seq.request.id, None)

    def _expire(self) -> list[Delta]:
        """End the requests past their deadline."""
        now = self.clock()
        late = [seqs for seqs in self.requests.values() if (d := seqs[0].request.deadline) is not None and now > d]
        return self._end(late, "timeout")

    def fail(self) -> list[Delta]:
        """End every request in flight with finish reason "error" (a step failed; the engine stays usable)."""
        return self._end(list(self.requests.values()), "error")

    def shut_down(self) -> list[Delta]:
        """End every request in flight with finish reason "shutdown" (the server is stopping)."""
        return self._end(list(self.requests.values()), "shutdown")

    def _end(self, requests: list[list[Sequence]], reason: FinishReason) -> list[Delta]:
        deltas = []
        for seqs in requests:
            for seq in seqs:
                if not seq.finished:
                    self._finish(seq, reason)
                    deltas.append(Delta.of(seq))
        return deltas

    # ---- whole requests from Python

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams) -> list[Completion]:
        """Run the prompts to completion together (continuous batching inside); one Completion per sequence, in
        the order of the prompts (and of n within each)."""
        ids = [self.add(list(p), params) for p in prompts]
        keys = [(i, k) for i in ids for k in range(params.n)]
        deltas: dict[tuple[str, int], list[Delta]] = {key: [] for key in keys}
        pending = set(keys)
        while pending:
            for d in self.step():
                key = (d.request_id, d.index)
                if key in deltas:  # (not another caller's request)
                    deltas[key].append(d)
                    if d.finish_reason is not None:
                        pending.discard(key)
        return [Completion.of(deltas[key]) for key in keys]
