"""`llmkit serve` stopped by SIGTERM and SIGINT with streams in flight, as a process manager stops it: new requests
get 503, in-flight requests get --shutdown-timeout seconds, then end with an error event and [DONE]; a second
signal ends them at once; the process logs what it did and exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from llmkit.interop.checkpoint import save_llmkit
from llmkit.serve.server import free_port

from .conftest import wait_for

pytestmark = pytest.mark.slow  # each test starts `llmkit serve` in a process of its own


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    model, tok = tiny
    return save_llmkit(model, tmp_path_factory.mktemp("serve") / "tiny", tokenizer=tok)


class _Serve:
    """`llmkit serve CHECKPOINT` in a child process on a free port, its stderr read line by line."""

    def __init__(self, checkpoint, *flags: str) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "llmkit", "serve", str(checkpoint), "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        try:
            wait_for(self._healthy, timeout=300, what="the server to answer /health")
        except BaseException:  # never leave a server behind
            self.proc.kill()
            self.proc.wait()
            raise

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"llmkit serve exited: {self.proc.stderr.read()}"  # type: ignore[union-attr]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def read_log_until(self, text: str) -> None:
        while not any(text in line for line in self.log):
            line = self.proc.stderr.readline()  # type: ignore[union-attr]
            assert line, f"the server exited without logging {text!r}: {self.log}"
            self.log.append(line)

    def stream(self) -> http.client.HTTPResponse:
        """A long greedy stream, read until its first token has come (so it is in flight)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = {"model": "m", "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        return response

    def finish(self) -> str:
        self.proc.wait(timeout=120)
        rest = self.proc.stderr.read()  # type: ignore[union-attr]
        return "".join(self.log) + rest


def _ended_cleanly(response: http.client.HTTPResponse) -> str:
    """How a stream ended: "finished" (every choice has a finish reason) or "shut down" (an error event); either
    way its last line is [DONE]."""
    events = [e.strip() for e in response.read().decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", events[-3:]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    if "error" in payloads[-1]:
        assert "shut down" in payloads[-1]["error"]["message"], payloads[-1]
        return "shut down"
    assert payloads[-1]["choices"][0]["finish_reason"] == "length", payloads[-1]
    return "finished"


def test_sigterm_lets_streams_finish_or_ends_them_with_done_then_exits_0(checkpoint):
    server = _Serve(checkpoint, "--model-name", "m", "--shutdown-timeout", "1")
    streams = [server.stream() for _ in range(4)]
    server.proc.send_signal(signal.SIGTERM)
    server.read_log_until("not taking new requests")
    try:  # the gate answers 503 while streams run; the listener closes once they end
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        status = None
    assert status in (None, 503)
    endings = [_ended_cleanly(s) for s in streams]
    log = server.finish()
    assert server.proc.returncode == 0, log
    assert "SIGTERM: not taking new requests; 4 in flight get up to 1 s to finish" in log
    if "shut down" in endings:
        assert f"ended {endings.count('shut down')} requests in flight" in log
    assert "Traceback" not in log


def test_a_second_signal_ends_the_streams_at_once(checkpoint):
    server = _Serve(checkpoint, "--model-name", "m", "--shutdown-timeout", "600")
    streams = [server.stream() for _ in range(3)]
    server.proc.send_signal(signal.SIGTERM)
    server.read_log_until("not taking new requests")
    server.proc.send_signal(signal.SIGINT)
    endings = [_ended_cleanly(s) for s in streams]  # within the sockets' 120 s, not the 600 s of grace
    log = server.finish()
    assert server.proc.returncode == 0, log
    assert "SIGINT again: ending the" in log and "Traceback" not in log
    assert "shut down" in endings or endings == ["finished"] * 3
