"""Starting the HTTP server: in the foreground for `llmkit serve`, or in a background thread (tests, benchmarks).

Both bind to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass
from types import TracebackType

import uvicorn

from llmkit.errors import InputError
from llmkit.models.decoder import DecoderLM
from llmkit.serve.api import build_app
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.runner import EngineRunner
from llmkit.tokenizer import Tokenizer

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


@dataclass(frozen=True)
class ServeOptions:
    """model_name: the name clients ask for; api_key: required as a Bearer token when given; request_timeout:
    seconds a request may take before it is ended."""

    model_name: str
    api_key: str | None = None
    request_timeout: float = 600.0


class Server:
    """An engine, its runner and the HTTP app on host:port, in a background thread (a context manager)."""

    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Tokenizer | None,
        options: ServeOptions,
        config: EngineConfig | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.engine = Engine(model, tokenizer, config)
        self.runner = EngineRunner(self.engine)
        self.app = build_app(self.runner, tokenizer, options.model_name, options.api_key, options.request_timeout)
        self.host, self.port = host, port if port is not None else free_port(host)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="llmkit-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Server:
        self.runner.start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self.runner.stop()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def run_foreground(self) -> None:
        """Serve until interrupted (Ctrl-C), in this thread."""
        self.runner.start()
        try:
            self._server.run()
        finally:
            self.runner.stop()
