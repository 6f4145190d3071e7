"""`llmkit serve` through the official openai client and raw HTTP, on 127.0.0.1 and a free port."""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import urllib.request

import pytest
import torch

from llmkit.generate import generate
from llmkit.serve.engine import EngineConfig
from llmkit.serve.server import ServeOptions, Server, parse_size
from llmkit.tokenizer import render_chat

from .conftest import Stepper, post, wait_for

openai = pytest.importorskip("openai")


def _server(model_tok, **config):
    model, tok = model_tok
    return Server(
        model, tok, ServeOptions("m", **config.pop("options", {})), EngineConfig(kv_memory=64 << 20, **config)
    )


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _greedy(model, ids, n):
    return generate(model, torch.tensor([ids]), max_new_tokens=n).tokens[0, len(ids) :].tolist()


def test_openai_client_completions_and_chat(tiny):
    model, tok = tiny
    with _server(tiny) as server:
        c = _client(server)
        assert [m.id for m in c.models.list()] == ["m"]
        r = c.completions.create(model="m", prompt="Once upon a time", max_tokens=7, temperature=0)
        ids = tok.encode("Once upon a time")
        assert r.choices[0].text == tok.decode(_greedy(model, ids, 7))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 7)
        assert r.choices[0].finish_reason == "length"
        streamed = c.completions.create(
            model="m",
            prompt="Once upon a time",
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(streamed)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
        assert chunks[-1].usage.completion_tokens == 7
        several = c.completions.create(model="m", prompt="Hello", max_tokens=5, temperature=0.9, n=3, seed=1)
        assert sorted(ch.index for ch in several.choices) == [0, 1, 2] and several.usage.completion_tokens == 15
        messages = [{"role": "user", "content": "Say something."}]
        chat = c.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
        chat_ids = tok.encode(render_chat(tok, messages), add_bos=False)
        assert chat.choices[0].message.content == tok.decode(_greedy(model, chat_ids, 6))
        assert chat.usage.prompt_tokens == len(chat_ids)
        parts = list(c.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0, stream=True))
        assert parts[0].choices[0].delta.role == "assistant"
        assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content


def test_stop_strings_end_the_text_before_them(tiny):
    with _server(tiny) as server:
        c = _client(server)
        full = c.completions.create(model="m", prompt="The", max_tokens=12, temperature=0).choices[0].text
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        cut = c.completions.create(model="m", prompt="The", max_tokens=12, temperature=0, stop=[stop]).choices[0]
        assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_smollm2_greedy_through_the_server_equals_generate(smollm2):
    model, tok = smollm2
    with _server(smollm2) as server:
        c = _client(server)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answer = c.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0).choices[0]
        ids = tok.encode(render_chat(tok, messages), add_bos=False)
        expected = generate(model, torch.tensor([ids]), max_new_tokens=24, eos_id=tok.eos_id).tokens[0, len(ids) :]
        expected = [t for t in expected.tolist() if t != tok.eos_id]
        assert answer.message.content == tok.decode(expected)
        assert "Paris" in answer.message.content and answer.finish_reason == "stop"
        text = c.completions.create(model="m", prompt="The capital of Germany is", max_tokens=8, temperature=0)
        assert text.choices[0].text == tok.decode(_greedy(model, tok.encode("The capital of Germany is"), 8))


def test_bad_requests_get_openai_style_errors(tiny):
    with _server(tiny, options={"api_key": "k"}) as server:
        url, auth = server.url + "/v1/completions", {"Authorization": "Bearer k"}
        good = {"model": "m", "prompt": "hi", "max_tokens": 2}
        assert post(url, good)[0] == 401
        assert post(url, good, {"Authorization": "Bearer nope"})[0] == 401
        assert post(url, good, auth)[0] == 200
        cases = [
            (b"{not json", 400, None),
            ({**good, "max_tokens": "many"}, 400, "max_tokens"),
            ({**good, "temperature": 9}, 400, "temperature"),
            ({**good, "frobnicate": 1}, 400, "frobnicate"),
            ({**good, "max_tokens": 10**6}, 400, "max_tokens"),
            ({**good, "prompt": ""}, 400, "prompt"),
            ({**good, "model": "gpt-9"}, 404, "model"),
            ({"prompt": "hi"}, 400, "model"),
        ]
        for body, status, param in cases:
            code, answer = post(url, body, auth)
            assert code == status, (body, answer)
            assert answer["error"]["message"] and answer["error"]["param"] == param, answer
        chat = server.url + "/v1/chat/completions"
        assert post(chat, {"model": "m", "messages": []}, auth)[0] == 400
        assert post(chat, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, auth)[0] == 400
        assert server.loop.alive


def test_full_queue_is_429_and_a_dropped_stream_frees_its_blocks(tiny):
    with _server(tiny, max_batch=1, max_queue=1) as server:
        stepper = Stepper(server.engine)  # the engine moves only when told: the stream cannot finish meanwhile
        budget = server.engine.max_len - 8
        long = {"model": "m", "prompt": "hi", "max_tokens": budget, "temperature": 0, "ignore_eos": True}
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request(
            "POST", "/v1/completions", json.dumps({**long, "stream": True}), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        wait_for(lambda: server.engine.requests, what="the stream queued")
        stepper.step()
        assert response.readline().startswith(b"data: ")  # running, holding blocks
        waiting = threading.Thread(target=post, args=(server.url + "/v1/completions", long))
        waiting.start()
        wait_for(lambda: server.loop.in_flight == 2, what="the second request submitted")
        code, answer = post(server.url + "/v1/completions", long)
        assert code == 429 and answer["error"]["type"] == "rate_limit_error"
        conn.close()  # the client goes away mid-stream: its request is aborted
        stepper.release()
        waiting.join(120)
        wait_for(lambda: not server.engine.has_work and server.engine.pool.used == 0, what="the engine idle")
        assert not any(server.engine.pool.refs)


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_soak_with_disconnects_and_malformed_requests(tiny):
    """240 requests from 8 threads, bounded in count: good ones (checked against their greedy
    output alone), malformed ones, and streams dropped part-way. Afterwards the server is healthy and every cache
    block is back in the pool."""
    model, tok = tiny
    prompts = [f"Request number {i}:" for i in range(6)]
    expected = {p: tok.decode(_greedy(model, tok.encode(p), 6)) for p in prompts}
    results: list[str] = []

    def client(k: int) -> None:
        import random

        rng = random.Random(k)
        for _ in range(30):
            prompt = rng.choice(prompts)
            kind = rng.choice(["good", "good", "malformed", "drop"])
            body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            if kind == "good":
                code, answer = post(server.url + "/v1/completions", body)
                ok = code == 200 and answer["choices"][0]["text"] == expected[prompt]
                results.append("good" if ok else f"wrong: {code} {answer}")
            elif kind == "malformed":
                code, _ = post(server.url + "/v1/completions", rng.choice([b"{", b"[]", b'{"model": 1}']))
                results.append("malformed" if code == 400 else f"wrong status {code}")
            else:
                conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
                long = {**body, "max_tokens": 500, "stream": True, "ignore_eos": True}
                conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.readline()
                conn.close()
                results.append("dropped")

    with _server(tiny, max_batch=8) as server:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert [r for r in results if r not in ("good", "malformed", "dropped")] == []
        assert len(results) == 8 * 30 and results.count("good") > 20
        assert post(server.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})[0] == 200
        with urllib.request.urlopen(server.url + "/health", timeout=60) as r:
            assert r.status == 200
        wait_for(lambda: not server.engine.has_work and server.engine.pool.used == 0, what="every block back")
        assert not any(server.engine.pool.refs)


def test_time_limit_and_metrics(tiny):
    """The request's time limit is checked by moving the engine's clock past it (held between steps), so no
    machine is too fast or too slow for it."""
    with _server(tiny, options={"request_timeout": 10}) as server:
        now = [0.0]
        server.engine.clock = lambda: now[0]
        stepper = Stepper(server.engine)
        body = {"model": "m", "prompt": "hi", "max_tokens": server.engine.max_len - 8, "ignore_eos": True}
        answer: dict[str, tuple[int, dict]] = {}
        client = threading.Thread(target=lambda: answer.setdefault("late", post(server.url + "/v1/completions", body)))
        client.start()
        wait_for(lambda: server.engine.requests, what="the request queued")
        stepper.step()
        stepper.step()
        now[0] = 10.5  # past its 10 s
        stepper.release()
        client.join(120)
        code, error = answer["late"]
        assert code == 504 and "time limit" in error["error"]["message"]
        assert post(server.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3})[0] == 200
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'llmkit_requests_finished_total{finish_reason="timeout"} 1.0' in text
        counts = [
            line.split()[-1]
            for line in text.splitlines()
            if line.startswith("llmkit_time_to_first_token_seconds_count")
        ]
        assert float(counts[0]) >= 1  # the answered request's first token, and the timed-out one's if it had one
        assert "llmkit_kv_blocks_total" in text and "llmkit_prefix_cache_hit_blocks" in text


def test_counters_histograms_and_one_log_line_per_request(tiny, caplog):
    """Totals are exported as counters; each request adds one end-to-end and one queue-time observation, and one
    line to the log with its tokens, time and finish reason."""
    with _server(tiny) as server, caplog.at_level(logging.INFO, logger="llmkit.serve"):
        for n in (3, 4):
            assert post(server.url + "/v1/completions", {"model": "m", "prompt": "hi there", "max_tokens": n})[0] == 200
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        prompt_tokens = server.engine.stats.prompt_tokens
    for name in ("llmkit_prompt_tokens", "llmkit_preemptions", "llmkit_prefix_cache_hit_blocks"):
        assert re.search(rf"# TYPE {name}(_total)? counter", text), name
    assert f"llmkit_prompt_tokens_total {float(prompt_tokens)}" in text
    assert "llmkit_request_latency_seconds_count 2.0" in text and "llmkit_request_queue_seconds_count 2.0" in text
    lines = [r.getMessage() for r in caplog.records if "generated" in r.getMessage()]
    assert len(lines) == 2 and "3 generated" in lines[0] and "4 generated" in lines[1]
    assert all("finish length" in line and "in queue" in line for line in lines)


def test_the_server_keeps_freed_buffers_in_the_heap(tiny, monkeypatch):
    """A server's process reuses its freed step buffers (perf.tune_allocator): with glibc's defaults its steps
    faulted fresh pages in for their activations all the time."""
    calls = []
    monkeypatch.setattr("llmkit.serve.server.tune_allocator", lambda: calls.append(1) or True)
    _server(tiny)
    assert calls == [1]


def test_while_shutting_down_new_requests_get_503_until_the_requests_in_flight_finish(tiny):
    """The drain keeps the listener open: a new request, /health and a new connection get 503 (they found the
    port closed before, where the docs promised 503); the request in flight still finishes, then the server exits."""
    with _server(tiny, options={"shutdown_timeout": 600.0}) as server:
        stepper = Stepper(server.loop.engine)
        result: dict[str, object] = {}

        def in_flight() -> None:
            body = {"model": "m", "prompt": "to be", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            result["answer"] = post(f"{server.url}/v1/completions", body)

        thread = threading.Thread(target=in_flight)
        thread.start()
        wait_for(lambda: server.loop.in_flight == 1, what="the request to be in flight")
        server.shut_down()  # the engine is held between steps: the request cannot finish yet
        assert not server._server.should_exit  # uvicorn is not told to stop listening while requests are in flight
        for path, body in (("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2}), ("/health", None)):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # a new connection
            connection.request("POST" if body else "GET", path, json.dumps(body) if body else None)
            answer = connection.getresponse()
            assert answer.status == 503 and b"shutting down" in answer.read(), path
            connection.close()
        stepper.release()
        thread.join(60)
        code, answer = result["answer"]  # type: ignore[misc]
        assert code == 200 and answer["choices"][0]["finish_reason"] == "length", answer
        assert server.wait(60)  # and then it stopped listening and exited
