"""One request can never hurt another: poisoned sampling settings among live streams, out-of-range integers, lone
surrogates, bodies too large or too slow, clients that go away, a request that outgrows the cache next to a small
one, and the keys in front of /metrics and /openapi.json.

Nothing here waits for time to pass: the engine is held between steps (Stepper) where the order of events
matters, and the timeouts under test are the server's own, waited for on a socket with a generous bound.
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
import urllib.error
import urllib.request

import pydantic
import pytest
import torch

import llmkit
from llmkit.generate import generate
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.paged import PagedCache
from llmkit.serve.protocol import MAX_MESSAGES, MAX_PROMPTS, CompletionRequest, EmbeddingRequest
from llmkit.serve.request import SamplingParams
from llmkit.serve.server import ServeOptions, Server

from .conftest import Stepper, post, wait_for

# settings that once made the batched sampler see NaN or infinite probabilities, ending every stream in flight
POISON = [
    {"temperature": 1, "top_p": 1e-300},
    {"temperature": 1e-300},
    {"temperature": 5e-324},
    {"temperature": 1, "repetition_penalty": 1e-300},
    {"temperature": 0.7, "repetition_penalty": 1e300},
    {"temperature": 1, "min_p": 1.0, "top_k": 1, "top_p": 1e-300},
]


def _server(model_tok, **options):
    model, tok = model_tok
    return Server(model, tok, ServeOptions("m", **options), EngineConfig(kv_memory=64 << 20))


def _greedy(model, ids, n):
    return generate(model, torch.tensor([ids]), max_new_tokens=n).tokens[0, len(ids) :].tolist()


def _stream(server, body, out, key):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    out[key] = conn.getresponse().read().decode()


def _events(sse: str) -> list[object]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in sse.split("\n\n") if line]


def test_poisoned_sampling_settings_end_no_other_stream(tiny):
    """Six requests whose settings once gave NaN probabilities are batched with three greedy streams (the engine
    is held until all nine are submitted, so they share steps): each gets a 200 and tokens, and every stream ends
    with exactly the text it has alone."""
    model, tok = tiny
    prompt = "Once upon a time"
    expected = tok.decode(_greedy(model, tok.encode(prompt), 40))
    with _server(tiny) as server:
        stepper = Stepper(server.engine)
        streams: dict[int, str] = {}
        answers: dict[int, tuple[int, object]] = {}
        body = {"model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        threads = [threading.Thread(target=_stream, args=(server, body, streams, i)) for i in range(3)]

        def poisoned(i: int) -> None:
            answers[i] = post(
                server.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 8, **POISON[i]}
            )

        threads += [threading.Thread(target=poisoned, args=(i,)) for i in range(len(POISON))]
        for t in threads:
            t.start()
        wait_for(lambda: server.loop.in_flight == 3 + len(POISON), what="all requests submitted")
        stepper.release()
        for t in threads:
            t.join(120)
        for i in range(3):
            events = _events(streams[i])
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), streams[i]
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
        for i, (code, answer) in answers.items():
            assert code == 200, (POISON[i], answer)
            assert answer["usage"]["completion_tokens"] == 8
        assert server.engine.stats.failed == 0


def test_a_row_whose_sampling_fails_ends_alone():
    """Below the API's checks: if a row's distribution is not a distribution after all, that sequence ends with
    "error" and the others in its batch are untouched."""
    from llmkit.serve import sampler

    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset("llama2-7b-tiny")).eval()
    engine = Engine(model, None, EngineConfig(kv_memory=8 << 20, block_size=4))
    good = [engine.add([1, 2, 3], SamplingParams(max_tokens=6, temperature=0)) for _ in range(2)]
    bad = engine.add([1, 2, 3], SamplingParams(max_tokens=6, temperature=0.5, seed=1))
    original = sampler._row_distribution

    def broken(x, seq):
        return torch.full_like(original(x, seq), float("nan")) if seq.request.id == bad else original(x, seq)

    sampler._row_distribution = broken
    try:
        finished = {}
        while engine.has_work:
            for d in engine.step():
                if d.finish_reason:
                    finished[d.request_id] = d.finish_reason
    finally:
        sampler._row_distribution = original
    assert finished == {good[0]: "length", good[1]: "length", bad: "error"}
    assert engine.pool.used == 0


def test_a_forward_that_fails_for_one_request_ends_that_request_alone():
    """A batch whose forward raises (out of memory, a kernel refusing a shape) is computed row by row; the row that
    fails ends with "error", the others give exactly their tokens."""
    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset("llama2-7b-tiny")).eval()
    engine = Engine(model, None, EngineConfig(kv_memory=8 << 20, block_size=4))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ids = [engine.add(p, SamplingParams(max_tokens=6, temperature=0)) for p in prompts]
    forward = engine.runner.forward

    def flaky(rows):
        if any(r.request == ids[1] and r.start >= len(prompts[1]) + 1 for r in rows):
            raise RuntimeError("simulated: the kernel refused this shape")
        return forward(rows)

    engine.runner.forward = flaky
    finished, tokens = {}, {}
    while engine.has_work:
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason:
                finished[d.request_id] = d.finish_reason
    assert finished == {ids[0]: "length", ids[1]: "error", ids[2]: "length"}
    for k in (0, 2):
        assert tokens[ids[k]] == _greedy(model, prompts[k], 6)
    assert engine.pool.used == 0 and not engine.requests


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -(2**70)),
        ("max_tokens", 2**40),
        ("top_k", 2**40),
        ("n", 17),
        ("logit_bias", {str(2**70): 1.0}),
        ("prompt", [2**70]),
        ("temperature", float("inf")),
    ],
)
def test_integer_and_number_fields_are_range_checked(tiny, field, value):
    with _server(tiny) as server:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, field: value}).encode()
        code, answer = post(server.url + "/v1/completions", body)
        assert code == 400, answer
        assert answer["error"]["param"] == field and field in answer["error"]["message"], answer


def test_lone_surrogates_are_refused_naming_the_field(tiny):
    with _server(tiny) as server:
        url = server.url
        for body, param in [
            ({"model": "m", "prompt": "abc\ud800def"}, "prompt"),
            ({"model": "m", "prompt": ["fine", "b\udc00"]}, "prompt.1"),
            ({"model": "m", "prompt": "x", "stop": ["\ud800"]}, "stop.0"),
        ]:
            code, answer = post(url + "/v1/completions", json.dumps(body).encode())
            assert (code, answer["error"]["param"]) == (400, param), answer
            assert "surrogate" in answer["error"]["message"]
        messages = [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]
        code, answer = post(url + "/v1/chat/completions", json.dumps({"model": "m", "messages": messages}).encode())
        assert (code, answer["error"]["param"]) == (400, "messages.0.content.0.text"), answer


def test_bodies_beyond_the_limits_are_refused_before_they_are_read(tiny):
    with _server(tiny, max_body_size=256 << 10) as server:
        big = json.dumps({"model": "m", "prompt": "x" * (300 << 10)}).encode()
        code, answer = post(server.url + "/v1/completions", big)
        assert code == 413 and "max-body-size" in answer["error"]["message"]
        # chunked, without a Content-Length: counted as it arrives (one chunk over the limit, then the client waits)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        assert _raw(server, head + b"%x\r\n" % len(big) + big + b"\r\n").startswith(b"HTTP/1.1 413")
        many = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}
        code, answer = post(server.url + "/v1/chat/completions", many)
        assert (code, answer["error"]["param"]) == (400, "messages"), answer
        prompts = {"model": "m", "prompt": ["hi"] * (MAX_PROMPTS + 1)}
        code, answer = post(server.url + "/v1/completions", prompts)
        assert (code, answer["error"]["param"]) == (400, "prompt"), answer
        assert post(server.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})[0] == 200


def _nested(depth: int) -> dict:
    """A JSON schema of objects `depth` deep (two levels of JSON each)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_many_small_strings_are_refused_by_their_count_before_each_is_checked(tiny):
    """`prompt: ["ab"] * 800000` (5 MB) was a 400 after 18-29 s, /health blocked meanwhile: each shape the field may
    take failed once per item. The count is checked first: one error, whatever the number of items."""
    for cls, field in ((CompletionRequest, "prompt"), (EmbeddingRequest, "input")):
        with pytest.raises(pydantic.ValidationError) as e:
            cls.model_validate({"model": "m", field: ["ab"] * 800_000})
        assert e.value.error_count() == 1 and "at most 256" in str(e.value), field
    CompletionRequest.model_validate({"model": "m", "prompt": list(range(2000))})  # one prompt of token ids
    with _server(tiny) as server:
        body = json.dumps({"model": "m", "prompt": ["ab"] * 800_000}).encode()
        code, answer = post(server.url + "/v1/completions", body)
        assert (code, answer["error"]["param"]) == (400, "prompt"), answer
        assert "at most 256 prompts in one request, got 800000" in answer["error"]["message"]


def test_schemas_nested_too_deep_say_the_limit_and_the_field(tiny):
    """A schema 500 deep was FastAPI's "There was an error parsing the body" (Python's JSON parser ran out of
    recursion), one 100 deep the grammar engine's "recursion limit exceeded": both name the limit now."""
    with _server(tiny) as server:
        url = server.url + "/v1/chat/completions"
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        schema = '{"type": "object", "properties": {"a": ' * 500 + '{"type": "integer"}' + "}}" * 500  # (json.dumps
        # cannot write it either)
        deep = json.dumps({**ask, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
        code, answer = post(url, deep[:-3].encode() + b', "schema": ' + schema.encode() + b"}}}")
        assert code == 400 and "nests deeper than 512 levels of JSON" in answer["error"]["message"], answer
        body = {**ask, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(100)}}}
        code, answer = post(url, json.dumps(body).encode())
        assert (code, answer["error"]["param"]) == (400, "response_format"), answer
        assert "nests 201 levels deep; the grammar engine takes at most 100" in answer["error"]["message"]
        body = {**ask, "structured_outputs": {"json": json.dumps(_nested(100))}}  # the schema as JSON text
        code, answer = post(url, json.dumps(body).encode())
        assert (code, answer["error"]["param"]) == (400, "structured_outputs"), answer
        tool = {"type": "function", "function": {"name": "f", "parameters": {**_nested(60), "type": "object"}}}
        code, answer = post(url, json.dumps({**ask, "tools": [tool]}).encode())
        assert (code, answer["error"]["param"]) == (400, "tools.0.function.parameters"), answer
        assert "nests 121 levels deep" in answer["error"]["message"]
        assert post(url, json.dumps(ask).encode())[0] == 200


def test_brackets_inside_strings_do_not_count_as_nesting():
    from llmkit.serve.limits import MAX_JSON_DEPTH, too_deep

    assert not too_deep(json.dumps({"prompt": "[" * 5000 + '\\"{' * 100}).encode())
    assert too_deep(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    assert not too_deep(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)


def _raw(server, data: bytes) -> bytes:
    """Send raw bytes and read until the server closes (bounded by the socket's 60 s timeout)."""
    with socket.create_connection((server.host, server.port), timeout=60) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_a_body_shorter_than_its_content_length_times_out(tiny):
    with _server(tiny, body_timeout=0.5) as server:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        answer = _raw(server, head + b'{"model": "m"')
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer


def test_headers_that_never_end_close_the_connection(tiny):
    with _server(tiny, header_timeout=0.5) as server:
        assert _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ") == b""
        assert _raw(server, b"") == b""  # a client that connects and says nothing
        code, _ = post(server.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
        assert code == 200


def test_tokenizing_and_chat_templates_run_off_the_event_loop(tiny):
    model, tok = tiny
    threads: list[str] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return tok.encode(*args, **kwargs)

    with Server(model, Recording(), ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as server:
        assert post(server.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})[0] == 200
        messages = [{"role": "user", "content": "hi"}]
        assert (
            post(server.url + "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 2})[0] == 200
        )
    assert len(threads) == 2 and all(name.startswith("llmkit-tokenize") for name in threads), threads


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(tiny):
    """The engine steps one at a time while the client is connected and gone; the request must be aborted long
    before it has generated what it asked for (the old server noticed only after a second without tokens)."""
    with _server(tiny) as server:
        stepper = Stepper(server.engine)
        budget = server.engine.max_len - 8
        body = {"model": "m", "prompt": "hi", "max_tokens": budget, "ignore_eos": True, "temperature": 0}
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        wait_for(lambda: len(server.engine.requests) == 1, what="the request queued")
        for _ in range(3):
            stepper.step()
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        steps = 0
        while server.loop.aborts == 0 and steps < budget:
            stepper.step(unless=lambda: server.loop.aborts > 0)
            steps += 1
        stepper.release()
        wait_for(lambda: not server.engine.has_work and server.engine.pool.used == 0, what="the engine idle")
        assert server.loop.aborts >= 1 and server.engine.stats.generated_tokens < budget
        metrics = server.loop.metrics.text().decode()
        assert 'finish_reason="length"' not in metrics


def test_a_small_request_is_not_starved_by_one_that_outgrows_the_cache():
    """One request of n=8 long completions needs three times the cache and preempts its own sequences every few
    steps; a 4-token request that comes after the preemptions began finishes within twice the 4 steps it takes
    alone (first come, first served kept it waiting 34 steps, behind the preempted sequences), and the large one
    still gives exactly the tokens it gives alone."""
    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset("llama2-7b-tiny")).eval()
    per_block = PagedCache.bytes_per_block(model, 4, torch.float32)
    engine = Engine(model, None, EngineConfig(kv_memory=per_block * 40, block_size=4, step_tokens=16))
    finished: dict[str, list[int]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    steps = 0

    def step() -> None:
        nonlocal steps
        steps += 1
        for d in engine.step():
            tokens.setdefault((d.request_id, d.index), []).extend(d.token_ids)
            if d.finish_reason:
                finished.setdefault(d.request_id, []).append(steps)

    big = engine.add([1, 2, 3, 4, 5], SamplingParams(max_tokens=60, temperature=0, n=8, ignore_eos=True))
    while engine.scheduler.preemptions == 0:
        step()
    small = engine.add([7, 8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    arrived = steps
    while engine.has_work:
        step()
    assert finished[small][0] - arrived <= 8 and finished[small][0] < min(finished[big]), (arrived, finished)
    assert engine.scheduler.preemptions > 8  # the large request really outgrew the cache
    reference = _greedy(model, [1, 2, 3, 4, 5], 60)
    assert all(tokens[(big, k)] == reference for k in range(8))
    assert tokens[(small, 0)] == _greedy(model, [7, 8, 9], 4)


def test_metrics_and_openapi_need_the_key(tiny):
    with _server(tiny, api_key="k", metrics_key="scrape") as server:

        def get(path, key=None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            try:
                with urllib.request.urlopen(urllib.request.Request(server.url + path, None, headers), timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert [get("/metrics"), get("/metrics", "nope"), get("/metrics", "k"), get("/metrics", "scrape")] == [
            401,
            401,
            200,
            200,
        ]
        assert [get("/openapi.json"), get("/openapi.json", "scrape"), get("/openapi.json", "k")] == [401, 401, 200]
        assert get("/health") == 200  # load balancers ask without a key


def test_a_long_embedding_input_takes_a_step_s_budget_between_steps(tiny, monkeypatch):
    """An 8,192-token embedding input stalled every stream for 39 s (one forward between two steps): its chunks now
    take turns with the engine's steps, at most one chunk of at most step_tokens tokens between two steps while
    requests run, and the embedding equals one forward's."""
    from llmkit.serve import embeddings

    model, tok = tiny
    config = EngineConfig(kv_memory=64 << 20, step_tokens=64)
    with Server(model, tok, ServeOptions("m"), config) as server:
        stepper = Stepper(server.engine)  # one step at a time: what runs between two steps is observable
        chunks: list[tuple[int, int]] = []  # per chunk: (tokens, engine steps taken before it)
        advance = embeddings.Embedding.advance

        def logged(job, tokens):
            before = job.done
            try:
                return advance(job, tokens)
            finally:
                chunks.append((job.done - before, server.engine.stats.steps))

        monkeypatch.setattr(embeddings.Embedding, "advance", logged)
        result: dict[str, object] = {}
        stream = {"model": "m", "prompt": "to be", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        ids = [
            int(t) for t in torch.randint(3, model.cfg.vocab_size, (1000,), generator=torch.Generator().manual_seed(0))
        ]
        threads = [
            threading.Thread(target=lambda: result.setdefault("stream", post(server.url + "/v1/completions", stream))),
            threading.Thread(
                target=lambda: result.setdefault(
                    "embedding", post(server.url + "/v1/embeddings", {"model": "m", "input": ids})
                )
            ),
        ]
        threads[0].start()
        wait_for(lambda: server.engine.has_work, what="the stream to be admitted")
        threads[1].start()
        while len(chunks) < 16:  # 1,000 tokens in chunks of 64
            assert stepper.step(), "the engine stopped while the embedding was computed"
        stepper.release()
        for thread in threads:
            thread.join(60)
    code, answer = result["embedding"]  # type: ignore[misc]
    assert code == 200, answer
    assert [n for n, _ in chunks] == [64] * 15 + [40]
    steps = [s for _, s in chunks]
    assert steps == sorted(set(steps)), steps  # never two chunks without a step between them
    whole = embeddings.pool_states(model, ids)
    torch.testing.assert_close(torch.tensor(answer["data"][0]["embedding"]), whole, atol=1e-5, rtol=0)
    assert result["stream"][0] == 200  # type: ignore[index]


def test_a_forced_call_among_many_tools_with_n_4_costs_the_others_no_step(tiny, monkeypatch):
    """100 tools, tool_choice "required", n = 4 once cost every stream 1.37 s a token, with gaps of 29 s: counted in
    engine steps, a stream running beside such a request gets a token at every step (its prompt's chunks and its
    four grammars' masks ride in the steps; none is taken without the stream)."""
    pytest.importorskip("llguidance")
    from llmkit.serve.engine_loop import EngineLoop

    model, tok = tiny
    city = {"city": {"type": "string", "maxLength": 4}}  # (short calls: a random model's arguments end soon)
    parameters = {"type": "object", "properties": city, "required": ["city"], "additionalProperties": False}
    # (as many tools as the tiny model's context of 1,024 holds with their definitions)
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters}} for i in range(12)]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    forced = {"model": "m", "messages": ask, "tools": tools, "tool_choice": "required", "n": 4, "max_tokens": 60}
    victim = {"model": "m", "prompt": "to be", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20, step_tokens=64)) as server:
        stepper = Stepper(server.engine)
        steps: dict[str, list[int]] = {}  # request id -> the engine step of each of its deltas with tokens
        deliver = EngineLoop._deliver

        def counted(loop, d):
            if d.token_ids:
                steps.setdefault(d.request_id, []).append(server.engine.stats.steps)
            deliver(loop, d)

        monkeypatch.setattr(EngineLoop, "_deliver", counted)
        result: dict[str, object] = {}

        def send(name: str, path: str, body: dict) -> threading.Thread:
            thread = threading.Thread(target=lambda: result.setdefault(name, post(server.url + path, body)))
            thread.start()
            return thread

        threads = [send("victim", "/v1/completions", victim)]
        wait_for(lambda: server.loop.in_flight == 1, what="the stream to be submitted")
        stepper.step()  # (the loop takes it in, then steps)
        threads.append(send("forced", "/v1/chat/completions", {**forced, "temperature": 1.0, "seed": 0}))
        wait_for(lambda: server.loop.in_flight == 2, what="the forced request to be submitted")
        while "forced" not in result:
            stepper.step(unless=lambda: "forced" in result)
        stepper.release()
        for thread in threads:
            thread.join(60)
    code, answer = result["forced"]  # type: ignore[misc]
    assert code == 200 and all(c["message"].get("tool_calls") for c in answer["choices"]), answer["choices"]
    victim_id, forced_id = sorted(steps, key=lambda r: int(r[1:]))  # (ids in the order of submission)
    during = [s for s in steps[victim_id] if s <= max(steps[forced_id])]
    assert len(during) > len(set(steps[forced_id])), (during, steps[forced_id])
    assert all(b - a == 1 for a, b in itertools.pairwise(during)), during
