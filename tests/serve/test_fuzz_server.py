"""The server fuzzed as the checkpoint files are (tests/test_fuzz.py): Hypothesis posts random and mutated OpenAI
bodies (extreme and non-finite numbers, huge integers, wrong types, lone surrogates, junk JSON, damaged bytes)
while two clients stream greedy completions. The properties:

- the fuzzed request gets a 4xx that names what was wrong, or a well-formed correct answer (never a 5xx);
- every stream completes with exactly its greedy text;
- /health answers 200 throughout, and afterwards every cache block is back in the pool.

Bounded like the file fuzzing (helpers.fuzz_settings): 40 examples (LLMKIT_FUZZ_EXAMPLES=N for more), the same
examples every run unless LLMKIT_FUZZ_RANDOM=1.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.request
from typing import Any

import pytest
import torch
from helpers import fuzz_settings

from llmkit.generate import generate
from llmkit.serve.engine import EngineConfig
from llmkit.serve.server import ServeOptions, Server

from .conftest import post, wait_for

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = fuzz_settings()

EXTREME = st.sampled_from([0, -0.0, 1e-300, 5e-324, 1e300, 2, 0.5, 1, -1, 2**63, -(2**63), 2**64, -(2**70)])
NUMBER = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70) | EXTREME
TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "", "\x00", "😀" * 5, "\n\n"])
JUNK = st.recursive(
    st.none() | st.booleans() | NUMBER | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=5,
)
TINY = [1e-300, 5e-324, 1e-45, 1e-38]
# each field in its range, extremes included (what must give a correct answer)
PLAUSIBLE: dict[str, Any] = {
    "temperature": st.floats(0, 2) | st.sampled_from([0, 2, *TINY]),
    "top_p": st.floats(0, 1, exclude_min=True) | st.sampled_from([1, *TINY]),
    "top_k": st.integers(-1, 60) | st.just(2**31 - 1),
    "min_p": st.floats(0, 1) | st.sampled_from([1, *TINY]),
    "repetition_penalty": st.floats(0.01, 3) | st.sampled_from([1e300, 1e30, *TINY]),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 4),
    "max_tokens": st.integers(1, 12),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
# each field: a value of its own kind (in or out of range) or anything at all
FIELDS: dict[str, Any] = {
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": NUMBER,
    "min_p": NUMBER,
    "repetition_penalty": NUMBER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "seed": NUMBER,
    "n": st.integers(-2, 20) | NUMBER,
    "max_tokens": st.integers(-2, 12) | NUMBER,
    "stop": TEXT | st.lists(TEXT, max_size=5),
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str) | TEXT, NUMBER, max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stream_options": JUNK,
    "user": TEXT,
}
PROMPT = st.text(min_size=1, max_size=12) | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3)
ANY_PROMPT = PROMPT | TEXT | st.lists(TEXT, max_size=3) | st.lists(st.integers(-3, 60000), max_size=8) | JUNK
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()})
ANY_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", ""]), "content": TEXT | JUNK}
)
PATH = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
DAMAGE = st.one_of(st.none(), st.tuples(st.integers(0, 2**31), st.integers(1, 255)))  # a byte changed
REQUEST = st.one_of(
    st.tuples(  # well-formed, every setting in range: must be answered, correctly
        st.just(True),
        PATH,
        st.just("m"),
        PROMPT,
        st.lists(MESSAGE, min_size=1, max_size=3),
        st.fixed_dictionaries({}, optional=PLAUSIBLE),
        st.none(),
    ),
    st.tuples(  # anything: must be answered or refused with a 4xx naming the problem
        st.just(False),
        PATH,
        st.sampled_from(["m", "m", "other"]),
        ANY_PROMPT,
        st.lists(ANY_MESSAGE, max_size=3),
        st.fixed_dictionaries({}, optional={k: v | JUNK for k, v in FIELDS.items()}),
        DAMAGE,
    ),
)


def _greedy_text(model: Any, tok: Any, prompt: str, n: int) -> str:
    ids = tok.encode(prompt)
    return str(tok.decode(generate(model, torch.tensor([ids]), max_new_tokens=n).tokens[0, len(ids) :].tolist()))


def _stream(server: Server, body: dict[str, Any]) -> str:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    events = [e.strip() for e in conn.getresponse().read().decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", events[-2:]
    return "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])


def _check_answer(path: str, sent: dict[str, Any] | None, code: int, answer: Any, raw: bytes) -> None:
    assert code < 500, (sent, code, answer)
    if code >= 400:
        assert isinstance(answer, dict) and answer["error"]["message"], answer
        return
    assert code == 200 and sent is not None, (sent, answer)
    if sent.get("stream") is True:
        events = [e.strip() for e in raw.decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events[-3:]
        return
    n = sent.get("n", 1)
    prompts = sent["prompt"] if path == "/v1/completions" else ["chat"]
    count = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    assert len(answer["choices"]) == count * n
    assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"]), answer


def _send(server: Server, path: str, data: bytes) -> tuple[int, Any, bytes]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    return response.status, answer, raw


def test_fuzzed_requests_get_4xx_or_answers_while_others_stream(tiny):
    model, tok = tiny
    good = {"model": "m", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    expected = _greedy_text(model, tok, good["prompt"], 12)
    options = ServeOptions("m", max_body_size=64 << 10)
    with Server(model, tok, options, EngineConfig(kv_memory=16 << 20, max_batch=8)) as server:
        stop, problems, streamed = threading.Event(), [], [0]

        def streamer() -> None:
            while not stop.is_set():
                try:
                    text = _stream(server, good)
                except Exception as e:  # recorded: the main thread asserts there were none
                    problems.append(repr(e))
                    return
                if text != expected:
                    problems.append(f"stream gave {text!r}, alone it gives {expected!r}")
                streamed[0] += 1

        streamers = [threading.Thread(target=streamer) for _ in range(2)]
        for t in streamers:
            t.start()

        @FUZZ
        @given(request=REQUEST)
        def check(request: tuple[Any, ...]) -> None:
            plausible, path, model_name, prompt, messages, fields, damage = request
            body: dict[str, Any] = {"model": model_name, **fields}
            if path == "/v1/completions":
                body["prompt"] = prompt
            else:
                body["messages"] = messages
            body.setdefault("max_tokens", 8)  # keep examples cheap: chat's default is the rest of the context
            if isinstance(body["max_tokens"], int) and body["max_tokens"] > 12:
                body["max_tokens"] = 12
            data = json.dumps(body, allow_nan=True).encode()
            sent: dict[str, Any] | None = body
            if damage is not None:
                at, value = damage
                mutated = bytearray(data)
                mutated[at % len(mutated)] ^= value
                sent = None if bytes(mutated) != data else body
                data = bytes(mutated)
            code, answer, raw = _send(server, path, data)
            if sent is None and code == 200:  # a damaged body that still parses: check it as what it became
                sent = json.loads(data)
            _check_answer(path, sent, code, answer, raw)
            if plausible:  # well-formed and in range: refusing it would be a bug too
                assert code == 200, (body, answer)
            with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
                assert r.status == 200

        try:
            check()
        finally:
            stop.set()
            for t in streamers:
                t.join(120)
        assert problems == [] and streamed[0] >= 2
        assert post(server.url + "/v1/completions", good)[1]["choices"][0]["text"] == expected
        engine = server.engine
        wait_for(lambda: not engine.has_work and engine.pool.used == 0, what="every block back in the pool")
        assert not any(engine.pool.refs)
