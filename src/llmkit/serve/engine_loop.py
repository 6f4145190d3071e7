"""An engine driven by a loop of its own, for callers that must not block (the HTTP server's event loop), and the
client the HTTP layer talks to instead of the engine.

The loop's thread owns the engine: new requests and aborts reach it through a queue of commands, applied between
steps, so a caller never waits for a step to end. The loop runs in a thread of its own (`start`), or in the calling
thread (`run`): `llmkit serve` runs it in the thread that loaded the model, because OpenMP's worker threads belong
to the thread that first ran a parallel region, and another thread's regions then ran 3x slower on a 2-core VM
(21-27 ms a SmolLM2 token against 7 ms). A request's deltas go to the callback given with it (the server
passes one that hands them to its event loop). Validation happens in the caller's thread, so a bad request fails
at once with the engine's message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from torch import Tensor

from llmkit.errors import InputError
from llmkit.serve.adapters import Adapters
from llmkit.serve.embeddings import Embedding, OneForward
from llmkit.serve.engine import Engine, QueueFull
from llmkit.serve.lockstep import RanksLost
from llmkit.serve.metrics import Metrics
from llmkit.serve.request import Delta, Request, SamplingParams
from llmkit.serve.structured import Constraint

log = logging.getLogger("llmkit.serve")

OnDelta = Callable[[Delta], None]


@dataclass
class _Flight:
    on_delta: OnDelta
    n: int
    arrival: float = field(default_factory=time.monotonic)
    last: dict[int, float] = field(default_factory=dict)  # per sequence: when its previous tokens came
    done: set[int] = field(default_factory=set)
    request: Request | None = None  # the engine's, once it took it
    generated: int = 0


class EngineLoop:
    """Runs `engine.step()` while there is work (`start`: in a thread of its own; `run`: in this one); `submit`
    and `abort` from any thread."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None, idle_wait: float = 0.05) -> None:
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.idle_wait = idle_wait
        self._commands: deque[Callable[[], None]] = deque()
        self._embeddings: deque[tuple[Embedding | OneForward, Future[Tensor]]] = deque()  # a chunk between steps
        self._flights: dict[str, _Flight] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = 0
        self._id_lock = threading.Lock()
        self._pending = 0  # submitted requests the loop has not taken yet (counted against the queue)
        self._idle = threading.Condition()  # notified when the last request in flight is done
        self.aborts = 0  # abort() calls (clients that went away), for /metrics and tests
        self.thread = threading.Thread(target=self.run, name="llmkit-engine", daemon=True)
        self._running = threading.Event()  # the loop is running, in whichever thread

    def start(self) -> EngineLoop:
        """Run the loop in a thread of its own."""
        self.thread.start()
        return self

    def run(self) -> None:
        """Run the loop in this thread until `stop`."""
        self._running.set()
        try:
            self._loop()
        finally:
            try:
                self.engine.close()
            finally:
                self._running.clear()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._running.is_set()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._flights) + self._pending

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight (True) or `timeout` seconds pass (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: self.in_flight == 0, timeout)

    def shut_down(self) -> None:
        """End every request in flight with finish reason "shutdown" (their streams get an error event), at the
        start of the loop's next iteration."""

        def end_all() -> None:
            deltas = self.engine.shut_down()
            ended = sorted({d.request_id for d in deltas})
            if ended:
                log.warning("shutting down: ended %d requests in flight (%s)", len(ended), ", ".join(ended))
            for delta in deltas:
                self._deliver(delta)

        self._commands.append(end_all)
        self._wake.set()

    def submit(self, prompt: list[int], params: SamplingParams, on_delta: OnDelta, timeout: float | None) -> str:
        """Queue a request; returns its id. Raises InputError (bad request) or QueueFull at once: the request is
        checked here, once, and the loop admits it as it is."""
        self.engine.check(prompt, params)
        with self._id_lock:
            if len(self.engine.scheduler.waiting) + self._pending >= self.engine.config.max_queue:
                raise QueueFull("the server's queue is full; try again later")
            self._ids += 1
            self._pending += 1
            request_id = f"r{self._ids}"

        def add() -> None:
            with self._id_lock:
                self._pending -= 1
            flight = self._flights[request_id] = _Flight(on_delta, params.n)
            try:
                self.engine.admit(prompt, params, request_id, timeout)
                flight.request = self.engine.requests[request_id][0].request
            except Exception as e:  # anything the engine refuses ends this request only
                log.warning("request %s refused: %s", request_id, e)
                self._flights.pop(request_id, None)
                why = str(e) if isinstance(e, InputError) else None  # the client's to read (e.g. adapters all busy)
                for i in range(params.n):
                    on_delta(Delta(request_id, i, [], "", [], "error", len(prompt), 0, error=why))

        self._commands.append(add)
        self._wake.set()
        return request_id

    def call(self, fn: Callable[[Adapters], None]) -> Future[None]:
        """Run fn(the engine's adapters) in the loop between two steps; its exception goes to the future."""
        future: Future[None] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                assert self.engine.adapters is not None, "the engine serves no adapters"
                fn(self.engine.adapters)
                future.set_result(None)
            except Exception as e:
                future.set_exception(e)

        self._commands.append(run)
        self._wake.set()
        return future

    def embed(self, prompt: list[int]) -> Future[Tensor]:
        """The prompt's pooled embedding, computed in the loop at most a step's token budget at a time, one chunk
        between two engine steps (Refused for a bad prompt, at once, in the caller's thread). Cancelling the future
        drops the rest of the work."""
        job = self.engine.embedding(prompt)
        future: Future[Tensor] = Future()
        self._commands.append(lambda: self._embeddings.append((job, future)))
        self._wake.set()
        return future

    def _embed_chunk(self) -> bool:
        """One chunk of the oldest embedding still wanted (its future resolved once it is whole); whether one ran."""
        while self._embeddings and self._embeddings[0][1].cancelled():
            self._embeddings.popleft()
        if not self._embeddings:
            return False
        job, future = self._embeddings[0]
        try:
            vector = job.advance(self.engine.config.step_tokens)
        except Exception as e:  # the caller's to report
            self._embeddings.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(e)
            return True
        if vector is not None:
            self._embeddings.popleft()
            if future.set_running_or_notify_cancel():
                future.set_result(vector)
        return True

    def abort(self, request_id: str) -> None:
        """End a request (its client went away); its cache blocks go back to the pool."""

        def cancel() -> None:
            self._flights.pop(request_id, None)
            self.engine.abort(request_id)

        self.aborts += 1
        self._commands.append(cancel)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            while self._commands:
                self._commands.popleft()()
            if not self._flights and not self._pending:
                with self._idle:
                    self._idle.notify_all()
            embedded = self._embed_chunk()  # at most one chunk of a step's budget between two steps
            if not self.engine.has_work:
                self.metrics.observe_engine(self.engine)
                if not embedded:
                    self._wake.wait(self.idle_wait)
                    self._wake.clear()
                continue
            try:
                deltas = self.engine.step()
            except RanksLost:  # a model split across ranks whose ranks are out of step: the server ends
                for delta in self.engine.fail():
                    self._deliver(delta)
                raise
            except Exception:  # a failed step must not take the server down
                log.exception("engine step failed; ending the requests in flight")
                deltas = self.engine.fail()
            self.metrics.observe_engine(self.engine)
            for delta in deltas:
                self._deliver(delta)

    def _finished(self, d: Delta, flight: _Flight, seconds: float) -> None:
        """A request's last sequence ended: its metrics, and its line in the log."""
        request = flight.request
        queued = None
        if request is not None and request.admitted is not None:
            queued = request.admitted - request.arrival
            self.metrics.queue.observe(queued)
        self.metrics.e2e.observe(seconds)
        self.metrics.requests.labels(d.finish_reason).inc()
        log.info(
            "%s: %d prompt tokens, %d generated, %.3f s (%s in queue), finish %s",
            d.request_id,
            d.prompt_tokens,
            flight.generated,
            seconds,
            "-" if queued is None else f"{queued:.3f} s",
            d.finish_reason,
        )

    def _deliver(self, d: Delta) -> None:
        flight = self._flights.get(d.request_id)
        if flight is None:
            return
        now = time.monotonic()
        if d.token_ids:
            previous = flight.last.get(d.index)
            if previous is None:
                self.metrics.ttft.observe(now - flight.arrival)
            else:
                self.metrics.itl.observe((now - previous) / len(d.token_ids))
            flight.last[d.index] = now
            flight.generated += len(d.token_ids)
            self.metrics.generated.inc(len(d.token_ids))
        if d.finish_reason is not None:
            flight.done.add(d.index)
            if len(flight.done) == flight.n:
                self._flights.pop(d.request_id, None)
                self._finished(d, flight, now - flight.arrival)
        try:
            flight.on_delta(d)
        except Exception:  # a consumer's failure ends its own request only
            log.exception("delivering to request %s failed", d.request_id)
            self.abort(d.request_id)


class EngineClient:
    """What the HTTP layer may ask of an engine in a loop, from any thread: submit a request (its deltas come to a
    callback), cancel it, embed a prompt, compile a constraint, and read the engine's limits and metrics. The
    engine behind it (its scheduler, grammars, a split model's ranks) is the loop's alone."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        engine = loop.engine
        self.max_len = engine.max_len  # the model's context, in tokens
        self.vocab_size = engine.model.cfg.vocab_size
        self.structured = engine.grammars is not None  # whether constraints can be compiled (needs a tokenizer)
        self._grammars = engine.grammars  # (compiling is thread-safe and cached: the engine finds the result)

    @property
    def alive(self) -> bool:
        return self._loop.alive

    @property
    def metrics(self) -> Metrics:
        return self._loop.metrics

    def submit(self, prompt: list[int], params: SamplingParams, on_delta: OnDelta, timeout: float | None) -> str:
        """Queue a request; returns its id. Raises InputError (Refused: naming the field) or QueueFull at once."""
        return self._loop.submit(prompt, params, on_delta, timeout)

    def cancel(self, request_id: str) -> None:
        """End a request (its client went away); its cache blocks go back to the pool."""
        self._loop.abort(request_id)

    def embed(self, prompt: list[int]) -> Future[Tensor]:
        """The prompt's pooled embedding, computed between two engine steps (Refused for a bad prompt)."""
        return self._loop.embed(prompt)

    @property
    def serves_adapters(self) -> bool:
        return self._loop.engine.adapters is not None

    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter the server knows (a copy: read from any thread)."""
        adapters = self._loop.engine.adapters
        return list(adapters.known.items()) if adapters is not None else []

    def adapter_names(self) -> list[str]:
        return [name for name, _ in self.adapters()]

    def load_adapter(self, name: str, path: str) -> Future[None]:
        """Load (or replace) the adapter `name` from `path`, in the loop between two steps (InputError: cannot)."""

        def load(adapters: Adapters) -> None:
            adapters.register(name, path)

        return self._loop.call(load)

    def unload_adapter(self, name: str) -> Future[None]:
        return self._loop.call(lambda adapters: adapters.unregister(name))

    def compile(self, constraint: Constraint) -> None:
        """Compile a structured-output constraint now, in this thread (a large grammar can take a second), so that the
        engine finds it compiled; InputError when it cannot be used or there is no tokenizer to compile against."""
        if self._grammars is None:
            raise InputError("structured outputs need a tokenizer, and this model has none")
        self._grammars.compile(constraint)
