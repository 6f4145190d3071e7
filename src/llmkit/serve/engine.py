"""The serving engine: requests join the running batch at the next step and leave it the step they finish.

    add(request) ─► Scheduler.plan() ─► StepPlan ─► ModelRunner.execute ─► OutputProcessor.process ─► Delta per row
                        ▲                 (+ drafts)   (model_runner.py)      (output_processor.py)        │
                        └──────────────── finished sequences give their blocks back ◄──────────────────────┘

`step()` does one iteration, in vLLM v1's three parts: the scheduler picks the work (every decoding sequence's
newest token, plus prompt chunks up to the step's token budget) and the engine freezes it into a plan (each row's
tokens, slots and cache blocks, and the drafts the drafter proposes for decoding rows: speculation.py); the model
runner, whose backend was chosen once when the engine was made (the C++ paged step, PyTorch rows, or either on
every rank of a split model), computes the plan's logits; the output processor turns them into tokens, judges the
drafts, applies stops and detokenizes. Nothing here is threaded: `llmkit.serve.engine_loop` drives an engine for the
HTTP server, and `generate` drives it to completion for a Python caller.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable

import torch

from llmkit.errors import InputError, LLMKitError
from llmkit.models.decoder import DecoderLM
from llmkit.serve.adapters import Adapters
from llmkit.serve.blocks import BlockPool
from llmkit.serve.config import EngineConfig, EngineStats
from llmkit.serve.drafters import speculator
from llmkit.serve.embeddings import Embedding, OneForward, check_input
from llmkit.serve.forward import row_of
from llmkit.serve.lockstep import Lockstep, embed_step, make_cache
from llmkit.serve.model_runner import StepPlan, model_runner
from llmkit.serve.output_processor import OutputProcessor
from llmkit.serve.paged import PagedCache
from llmkit.serve.reasoning import ThinkingBudget
from llmkit.serve.request import Completion, Delta, FinishReason, Refused, Request, SamplingParams, Sequence, Status
from llmkit.serve.sampler import record_prompt_logprobs
from llmkit.serve.scheduler import Scheduler, Work
from llmkit.serve.speculation import Drafter, Drafts, NoDrafts
from llmkit.serve.structured import Grammars
from llmkit.serve.telemetry import StepCosts, StepLog, Telemetry
from llmkit.serve.text import TextOutput
from llmkit.serve.tiers import BlockStore, cache_key
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
        if config.tiered and (lockstep is not None or (config.draft_tokens and not config.ngram)):
            raise InputError(
                "prefix-cache tiers keep the model's own cache blocks: not with a model split across ranks, nor "
                "with --mtp or --draft (whose caches share the blocks); --ngram drafts are fine"
            )
        self.lockstep = lockstep  # a tensor-parallel model: every rank runs each forward (lockstep.py)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.device, self.dtype = model.device, model.dtype
        if config.kv_dtype is not None and lockstep is not None:
            raise InputError("a model split across ranks keeps its cache in the model's dtype (no --kv-dtype)")
        per_block = PagedCache.bytes_per_block(model, config.block_size, self.dtype, config.kv_dtype)
        if draft is not None and config.draft_tokens:  # (its pools share the blocks and the memory)
            per_block += PagedCache.bytes_per_block(draft, config.block_size, draft.dtype)
        n_blocks = config.kv_memory // per_block
        if n_blocks < 1:
            raise InputError(f"kv_memory={config.kv_memory} bytes is less than one block ({per_block} bytes)")
        # on a GPU, a scratch block for the spare rows of captured decoding steps (kernel_runner.DecodeGraphs)
        self.cache = PagedCache(
            model, n_blocks, config.block_size, self.device, self.dtype, self.device.type == "cuda", config.kv_dtype
        )
        if lockstep is not None:  # the other ranks' caches: the same blocks, their own heads
            lockstep.tell(make_cache, n_blocks, config.block_size, self.dtype)
        if config.max_adapters and lockstep is not None:
            raise InputError("served adapters run on one process (not with a model split across ranks)")
        self.runner = model_runner(model, self.cache, config.block_size, config.batch_invariant, lockstep)
        self.adapters: Adapters | None = None  # per-request LoRA adapters (adapters.py)
        if config.max_adapters:
            self.adapters = self.runner.adapters = Adapters(model, config.max_adapters, self._adapters_in_use)
        self.pool = BlockPool(n_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_batch, config.step_tokens, self.runner.shares_generated)
        self.store: BlockStore | None = None  # the prefix-cache tiers (tiers.py)
        if config.tiered:
            key = cache_key(model, self.dtype, config.block_size, self.cache.layout)
            self.store = BlockStore(key, config.host_cache, config.cache_dir, config.disk_cache)
            self.scheduler.kv.use_tiers(self.store, self.cache)
        # drafts for the decoding rows (config.draft_tokens): `draft`'s, or the model's MTP module's (drafters.py)
        self.drafter: Drafter = NoDrafts()
        if config.draft_tokens:
            self.drafter = speculator(model, self.runner, self.scheduler.kv, config, draft)
        self.max_len = model.max_seq_len
        self.eos_ids = {tokenizer.eos_id} if tokenizer is not None and tokenizer.eos_id is not None else set()
        # structured outputs: constraints compiled against the tokenizer's vocabulary (needs the tokenizer)
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size) if tokenizer is not None else None
        self.requests: dict[str, list[Sequence]] = {}
        self.stats = EngineStats()
        # each step's bytes read and FLOPs (telemetry.py); the server measures the machine's limits at start-up
        steps_log = StepLog(config.log_steps) if config.log_steps is not None else None
        self.telemetry = Telemetry(StepCosts(model, self.cache) if lockstep is None else None, log=steps_log)
        self.processor = OutputProcessor(self.drafter, self.eos_ids, self.max_len, self.stats, self._finish)
        self._ids = itertools.count()
        # what deadlines and token times are read from: tests replace it, so that a time limit is checked by moving
        # this clock, not by hoping the machine is slow enough
        self.clock: Callable[[], float] = time.monotonic

    # ---- requests

    @property
    def capacity_sequences(self) -> float:
        """How many sequences of the model's full context the cache holds at once."""
        return self.pool.n_blocks * self.pool.block_size / self.max_len

    def sequences_of(self, tokens: int) -> int:
        """How many sequences of `tokens` tokens (prompt and output) the cache holds at once."""
        return self.pool.n_blocks // -(-tokens // self.pool.block_size)

    def add(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None, timeout: float | None = None
    ) -> str:
        """Queue a request (token ids); returns its id. Raises InputError for a request that can never run and
        QueueFull when too many are waiting."""
        self.check(prompt, params)
        return self.admit(prompt, params, request_id, timeout)

    def admit(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None, timeout: float | None = None
    ) -> str:
        """`add` for a request that `check` has already passed (the engine loop checks in the caller's thread)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InputError(f"request id {request_id!r} is already in flight")
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
        if params.adapter is not None and (self.adapters is None or params.adapter not in self.adapters.known):
            served = ", ".join(self.adapters.known) if self.adapters is not None else "none"
            raise Refused(f"no adapter is named {params.adapter!r} (this server's: {served})", "model")
        if params.reasoning_budget is not None:
            if params.reasoning is None or self.tokenizer is None:
                raise Refused("a thinking budget needs a chat template with thinking blocks", "reasoning_budget")
            if params.constraint is not None:
                raise Refused("a thinking budget and a structured output cannot both hold", "reasoning_budget")
        if params.tempered_logprobs and self.config.draft_tokens:
            raise Refused("tempered log-probabilities are not computed for verified drafts", "tempered_logprobs")
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
        p = request.params
        if p.adapter is not None and self.adapters is not None:
            seq.root = self.adapters.get(p.adapter).root  # (loaded again here if it was unloaded to make room)
        if p.reasoning_budget is not None and p.reasoning is not None and self.tokenizer is not None:
            close = self.tokenizer.encode("\n" + p.reasoning.end, add_bos=False)
            seq.budget = ThinkingBudget(p.reasoning, p.reasoning_budget, close)
        return seq

    def abort(self, request_id: str) -> None:
        """End a request now (a client went away); its blocks go back to the pool. Unknown ids are ignored."""
        for seq in self.requests.pop(request_id, []):
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                self.drafter.forget(seq)

    def weights_changed(self) -> None:
        """The model's weights were changed in place (a training step, llmkit.train.grpo): the cached prefixes were
        computed with the old ones and are dropped. Between requests only: a sequence in flight would mix the two."""
        if self.has_work:
            raise InputError("the weights cannot change while requests are in flight")
        if self.store is not None:
            raise InputError("an engine with prefix-cache tiers keeps its blocks: its weights cannot change")
        self.pool.forget_cached()

    def embedding(self, prompt: list[int]) -> Embedding | OneForward:
        """The prompt's pooled embedding (embeddings.py) as work to advance a chunk at a time (Refused for a bad
        prompt, at once); on every rank of a model split across ranks, in one forward."""
        if self.lockstep is None:
            return Embedding(self.model, prompt)
        check_input(self.model, prompt)  # a refusal before any rank starts the forward
        lockstep = self.lockstep
        return OneForward(lambda: lockstep.run(embed_step, self.runner, prompt))

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- one step

    @torch.inference_mode()
    def step(self) -> list[Delta]:
        """Run one iteration; returns what it added to each sequence that got a token or finished."""
        start = time.perf_counter()
        self.telemetry.begin()
        deltas = self._step()
        seconds = time.perf_counter() - start
        self.drafter.timed(seconds)  # (how a speculator chooses the number of drafts)
        self.telemetry.finished(seconds, time.time())
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
        plan, drafts = self._plan(work)
        self.telemetry.planned(plan.rows)
        output = self.runner.execute(plan)
        done = []
        for i, w in enumerate(work):
            if output.failed(i):  # its forward failed even alone: it ends, alone
                self.stats.failed += 1
                self._finish(w.seq, "error")
                deltas.append(Delta.of(w.seq))
            else:
                done.append(i)
        # what the rows' states feed: the prompt log-probabilities asked for, and the drafter's record of them
        record_prompt_logprobs([work[i] for i in done], [output.prompt[i] for i in done])
        self.drafter.observe([work[i] for i in done], [output.hidden[i] for i in done],
                             [len(output.hidden[i]) for i in done])  # fmt: skip
        for w in (work[i] for i in done):
            self.scheduler.computed(w)
            if w.start < w.seq.prompt_len:
                self.stats.prompt_tokens += min(w.start + w.count, w.seq.prompt_len) - w.start
        processed = self.processor.process(work, output, drafts)
        for seq, computed in processed.computed:  # verified rows: their token and the drafts they kept
            seq.computed = computed
            self.scheduler.kv.cache_full_blocks(seq, computed)
        return deltas + processed.deltas

    def _plan(self, work: list[Work]) -> tuple[StepPlan, dict[int, Drafts]]:
        """The step's plan, and the drafts of its decoding rows by row index (the drafter's proposal, for which it
        may take more blocks: the tables are read after it)."""
        # rows that compute their newest token and sample the next (a prompt's 1-token chunk short of its end does
        # not); a reply that may be in a thinking block with a budget takes one token a step (the budget may force it)
        decoding = [
            i for i, w in enumerate(work) if w.count == 1 and w.samples and not (w.seq.budget and w.seq.budget.thinking)
        ]
        proposed = self.drafter.propose(
            [work[i] for i in decoding], self.scheduler.kv.allocate, self.max_len, chunks=len(decoding) < len(work)
        )
        drafts = {decoding[j]: d for j, d in proposed.items()}
        rows = []
        for i, w in enumerate(work):
            extra = tuple(drafts[i].tokens.tolist()) if i in drafts else ()
            rows.append(row_of(w, self.scheduler.kv.table(w.seq), extra))
        return StepPlan(tuple(rows)), drafts

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        self.drafter.forget(seq)
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

    def _adapters_in_use(self) -> set[str]:
        return {a for seqs in self.requests.values() if (a := seqs[0].request.params.adapter) is not None}

    def close(self) -> None:
        """The engine stops for good: with a disk tier, its cached prefix blocks are written there for the next
        start (from the thread that steps it)."""
        self.telemetry.close()
        if self.store is not None and self.store.dir is not None:
            start = time.perf_counter()
            self.scheduler.kv.save()
            log.info("prefix cache: %d blocks on disk in %s (%.1f s)", len(self.store.disk), self.store.dir,
                     time.perf_counter() - start)  # fmt: skip

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
        the order of the prompts (and of n within each). Every prompt is checked first; they join the queue as it
        has room (a Python caller may pass more than config.max_queue)."""
        todo = [list(p) for p in prompts]
        for prompt in todo:
            self.check(prompt, params)
        ids: list[str] = []
        deltas: dict[tuple[str, int], list[Delta]] = {}
        pending: set[tuple[str, int]] = set()
        while len(ids) < len(todo) or pending:
            while len(ids) < len(todo) and (
                not pending or len(self.scheduler.waiting) + params.n <= self.config.max_queue
            ):
                ids.append(self.admit(todo[len(ids)], params))
                keys = [(ids[-1], k) for k in range(params.n)]
                deltas.update({key: [] for key in keys})
                pending.update(keys)
            for d in self.step():
                key = (d.request_id, d.index)
                if key in deltas:  # (not another caller's request)
                    deltas[key].append(d)
                    if d.finish_reason is not None:
                        pending.discard(key)
        return [Completion.of(deltas[(i, k)]) for i in ids for k in range(params.n)]
