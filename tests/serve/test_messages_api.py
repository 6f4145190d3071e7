"""Anthropic's Messages API (/v1/messages) with the `anthropic` SDK against SmolLM2: the same tokens as the chat
endpoint for the same turns, whole and streamed, stop sequences, a tool round trip, count_tokens, the API key in
Anthropic's header and errors in Anthropic's shape."""

from __future__ import annotations

import json
import socket

import pytest

from .conftest import post

pytest.importorskip("llguidance")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from llmkit.serve.engine import EngineConfig  # noqa: E402
from llmkit.serve.server import ServeOptions, Server  # noqa: E402

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
SYSTEM = "You are a terse assistant."
GREEDY = {"extra_body": {"temperature": 0}}  # (the SDK's newest create() no longer takes sampling settings)
ASK = "Name three colours."


@pytest.fixture(scope="module")
def smol(smollm2):
    model, tok = smollm2
    with Server(model, tok, ServeOptions("m", api_key="sk-test"), EngineConfig(kv_memory=64 << 20)) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0)
        gpt = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
        yield server, claude, gpt


def _chat(gpt, messages, **extra):
    return gpt.chat.completions.create(model="m", messages=messages, temperature=0, **extra).choices[0]


def test_a_message_is_the_chat_endpoint_s_answer_whole_and_streamed(smol):
    _, claude, gpt = smol
    reply = claude.messages.create(
        model="m", system=SYSTEM, messages=[{"role": "user", "content": ASK}], max_tokens=24, **GREEDY
    )
    chat = _chat(gpt, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=24)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "m"
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == chat.message.content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.finish_reason]
    assert reply.usage.output_tokens == 24 if chat.finish_reason == "length" else reply.usage.output_tokens > 0
    prompt = gpt.chat.completions.create(
        model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=1
    ).usage.prompt_tokens
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == prompt
    counted = claude.messages.count_tokens(model="m", system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == prompt

    with claude.messages.stream(
        model="m", system=SYSTEM, messages=[{"role": "user", "content": ASK}], max_tokens=24, **GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == reply.content[0].text and len(pieces) > 1
    assert final.content[0].text == reply.content[0].text and final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt  # (message_delta has them all)
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: its blocks were cached


def test_a_stop_sequence_ends_the_text_and_is_named(smol):
    _, claude, _ = smol
    ask = {"model": "m", "messages": [{"role": "user", "content": ASK}], "max_tokens": 24, **GREEDY}
    whole = claude.messages.create(**ask).content[0].text
    word = next(w for w in whole.split()[1:] if w.isalpha())
    cut = claude.messages.create(**ask, stop_sequences=["never-there", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == whole[: whole.index(word)]
    events = list(claude.messages.create(**ask, stop_sequences=[word], stream=True))
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == word


def test_a_tool_round_trip(smol):
    """A forced call: a tool_use block valid for its schema (stop_reason tool_use); streamed, the same input in
    input_json_delta; its result sent back as a tool_result gives the chat endpoint's answer to the same turns."""
    _, claude, gpt = smol
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    common = {"model": "m", "messages": ask, "tools": [WEATHER], "tool_choice": forced, "max_tokens": 80}
    reply = claude.messages.create(**common, **GREEDY)
    assert reply.stop_reason == "tool_use"
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with claude.messages.stream(**common, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]

    turns = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees, sunny"}]},
    ]
    answer = claude.messages.create(model="m", messages=turns, tools=[WEATHER], max_tokens=30, **GREEDY)
    tool = {"type": "function", "function": {k if k != "input_schema" else "parameters": v for k, v in WEATHER.items()}}
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    chat = _chat(
        gpt,
        [*ask, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": use.id, "content": "18 degrees, sunny"}],
        tools=[tool],
        max_tokens=30,
    )  # fmt: skip
    texts = [b.text for b in answer.content if b.type == "text"]
    assert texts and texts[0] == (chat.message.content or "")


def test_structured_output_follows_the_schema(smol):
    _, claude, _ = smol
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    reply = claude.messages.create(
        model="m", messages=[{"role": "user", "content": ASK}], max_tokens=40,
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.content[0].text), schema)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' blocks"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Su"}]}, "prefill"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": 5, "frobnicate": 1}, "frobnicate"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "not a tool"),
        ({"output_config": {"effort": "high"}}, "effort"),
    ],
)
def test_bad_requests_are_400s_in_anthropic_s_shape(smol, change, says):
    server, _, _ = smol
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5} | change
    code, answer = post(server.url + "/v1/messages", body, {"x-api-key": "sk-test"})
    assert code == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert says in answer["error"]["message"]


def test_keys_models_and_limits_answer_in_anthropic_s_shape(smol):
    server, claude, _ = smol
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert e.value.body["error"]["type"] == "not_found_error"
    for path, shape in [("/v1/messages", "request_too_large"), ("/v1/chat/completions", "invalid_request_error")]:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nx-api-key: sk-test\r\nContent-Length: {9 << 20}\r\n\r\n"
        with socket.create_connection((server.host, server.port), timeout=60) as s:
            s.sendall(head.encode())  # refused on its declared length, before any of the body is read
            answer = b"".join(iter(lambda: s.recv(65536), b""))
        assert answer.startswith(b"HTTP/1.1 413")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == shape  # each API's own shape
