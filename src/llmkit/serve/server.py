"""Starting and stopping the HTTP server: in the foreground for `llmkit serve`, or in a background thread (tests,
benchmarks). Both bind to 127.0.0.1 unless told otherwise.

Stopping is the same in both, `Server.shut_down()` (what SIGTERM and SIGINT do in the foreground):

    1. the gate closes: new requests get 503 and /health says so (the listener stays open meanwhile, so that a
       client or a load balancer learns why instead of finding the port closed);
    2. the requests in flight get up to `shutdown_timeout` seconds to finish;
    3. whatever is still running then is ended: a stream gets an error event and `data: [DONE]`, a waiting client
       a 503; what was ended is logged; uvicorn stops listening and closes idle connections, and the process exits
       once the answers are sent.

A second signal skips the wait (step 3 at once). A request is never cut off mid-stream without its `[DONE]`.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import threading
import time
from types import FrameType, TracebackType

import uvicorn

from llmkit.errors import InputError
from llmkit.machine.perf import tune_allocator
from llmkit.models.decoder import DecoderLM
from llmkit.serve.api import Gate, build_app
from llmkit.serve.config import ServeOptions
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.engine_loop import EngineClient, EngineLoop
from llmkit.serve.limits import with_header_timeout
from llmkit.serve.lockstep import Lockstep
from llmkit.tokenizer import Tokenizer

__all__ = ["ServeOptions", "Server", "free_port", "parse_size"]

log = logging.getLogger("llmkit.serve")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
}

# once the in-flight requests have been ended, how long their answers get to reach the clients before the server
# closes anyway (a client that stopped reading must not hold the exit)
_FLUSH_SECONDS = 10.0


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise InputError(f"{text!r} is not a size: use a number of bytes or e.g. 512MiB, 2GiB, 1.5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Server:
    """An engine, its loop and the HTTP app on host:port (a context manager: in a background thread)."""

    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Tokenizer | None,
        options: ServeOptions,
        config: EngineConfig | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        draft: DecoderLM | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        self.options = options
        # freed step buffers stay in the heap: with glibc's default, the server's steps faulted fresh pages in for
        # their activations all the time (770,000 minor faults in a 7 s load, a quarter of its CPU time) where a
        # plain loop of Engine.step did not; tuned, concurrency 16 served 1.2-1.3x the output tokens/s
        tune_allocator()
        self.engine = Engine(model, tokenizer, config, draft, lockstep)
        self.loop = EngineLoop(self.engine)
        self.gate = Gate()
        self.app = build_app(EngineClient(self.loop), tokenizer, options, self.gate)
        self.host, self.port = host, port if port is not None else free_port(host)
        uvicorn_config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            http=with_header_timeout(options.header_timeout),
            lifespan="off",
        )
        # uvicorn runs off the main thread, where it installs no answer to SIGTERM / SIGINT of its own (it would wait
        # for every connection however long it takes, and cut streams on a second Ctrl-C): run_foreground installs ours
        self._server = uvicorn.Server(uvicorn_config)
        self._thread = threading.Thread(target=self._server.run, name="llmkit-http", daemon=True)
        self._drainer: threading.Thread | None = None
        self._drain_now = threading.Event()  # a second signal: stop waiting for the requests in flight
        self._lock = threading.RLock()  # re-entrant: a second signal can arrive while the first is handled

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def shutting_down(self) -> bool:
        return self.gate.closed

    def start(self, timeout: float = 30.0) -> Server:
        self.loop.start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def shut_down(self, now: bool = False, reason: str = "shutdown requested") -> None:
        """Stop taking requests, give those in flight `options.shutdown_timeout` seconds (none when `now`), end the
        rest, and let the HTTP server exit once their answers are out. Safe from a signal handler and any thread;
        a second call with `now` ends the wait."""
        with self._lock:
            first = not self.gate.closed
            self.gate.closed = True  # new requests: 503 (uvicorn keeps listening until the drain ends)
            if first:
                grace = 0.0 if now else self.options.shutdown_timeout
                log.warning(
                    "%s: not taking new requests; %d in flight get up to %g s to finish",
                    reason,
                    self.loop.in_flight,
                    grace,
                )
                self._drainer = threading.Thread(target=self._drain, args=(grace,), name="llmkit-drain", daemon=True)
                self._drainer.start()
            elif now:
                log.warning("%s again: ending the %d requests in flight now", reason, self.loop.in_flight)
                self._drain_now.set()

    def _drain(self, grace: float) -> None:
        """Wait up to `grace` seconds (or a second signal) for the requests in flight, then end the rest."""
        deadline, finished = time.monotonic() + grace, False
        while not finished and not self._drain_now.is_set() and time.monotonic() < deadline:
            finished = self.loop.wait_idle(min(0.1, max(deadline - time.monotonic(), 0.0)))
        self._server.should_exit = True  # uvicorn: stop listening, close idle connections, wait for the rest
        if finished:
            log.warning("shutting down: every request in flight finished")
            return
        if self.loop.in_flight:
            self.loop.shut_down()  # streams end with an error event and [DONE]; logged by the loop
        if not self.loop.wait_idle(_FLUSH_SECONDS):
            log.warning("shutting down: %d requests did not take their answers; closing", self.loop.in_flight)
        # the answers are handed to the event loop; give the connections a bounded time to send them
        flush = time.monotonic() + _FLUSH_SECONDS
        while self._server.server_state.connections and time.monotonic() < flush:
            time.sleep(0.05)
        self._server.force_exit = True

    def stop(self) -> None:
        """Stop at once (tests): end what is in flight and wait for the HTTP thread and the engine thread."""
        self.shut_down(now=True, reason="stop")
        self._thread.join(30)
        self.loop.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the HTTP server (after shut_down) to exit; True when it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def run_foreground(self) -> None:
        """Serve until SIGTERM or SIGINT (Ctrl-C), then shut down as the module docstring says. The engine steps in
        this thread, the one that loaded the model (see engine_loop.py for why), and HTTP in a thread of its own."""
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._thread.start()

            def stop_engine_after_http() -> None:
                self._thread.join()
                self.loop.stop()

            threading.Thread(target=stop_engine_after_http, name="llmkit-http-watch", daemon=True).start()
            self.loop.run()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if self._drainer is not None:
                self._drainer.join(_FLUSH_SECONDS)
            self.loop.stop()
            log.warning("stopped")

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.shut_down(now=self.shutting_down, reason=signal.Signals(sig).name)
