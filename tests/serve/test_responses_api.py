"""OpenAI's Responses API (/v1/responses) with the `openai` SDK against SmolLM2: the chat endpoint's tokens for the
same turns, whole and streamed (raw events and the SDK's stream helper), a forced function call and its result,
previous_response_id, structured text, retrieval and deletion, and the store's bounds."""

from __future__ import annotations

import json

import pytest

from .conftest import post

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from llmkit.serve.engine import EngineConfig  # noqa: E402
from llmkit.serve.responses_api import ResponseStore  # noqa: E402
from llmkit.serve.server import ServeOptions, Server  # noqa: E402

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
INSTRUCTIONS = "You are a terse assistant."
ASK = "Name three colours."


@pytest.fixture(scope="module")
def smol(smollm2):
    model, tok = smollm2
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat(client, messages, **extra):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **extra).choices[0]


def test_a_response_is_the_chat_endpoint_s_answer_whole_and_streamed(smol):
    _, client = smol
    ask = {"model": "m", "instructions": INSTRUCTIONS, "input": ASK, "max_output_tokens": 24, "temperature": 0}
    r = client.responses.create(**ask)
    chat = _chat(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}], max_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == chat.message.content
    if chat.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 24
    else:
        assert r.status == "completed"
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == ("response.incomplete" if r.status == "incomplete" else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text and len(deltas) > 1
    assert events[-1].response.output_text == r.output_text


def test_a_forced_function_call_and_its_result(smol):
    """The call is an item valid for its schema; its output, sent with previous_response_id, gives the chat
    endpoint's answer to the same conversation."""
    _, client = smol
    ask = "What is 2 plus 3?"
    r = client.responses.create(
        model="m", input=ask, tools=[ADD], tool_choice={"type": "function", "name": "add"}, temperature=0,
        max_output_tokens=60,
    )  # fmt: skip
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    events = list(
        client.responses.create(
            model="m", input=ask, tools=[ADD], tool_choice="required", temperature=0, max_output_tokens=60, stream=True
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments) == json.loads(call.arguments)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    answer = client.responses.create(
        model="m", previous_response_id=r.id, input=[result], tools=[ADD], temperature=0, max_output_tokens=20
    )
    tool = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
    openai_call = {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}
    chat = _chat(
        client,
        [{"role": "user", "content": ask}, {"role": "assistant", "content": None, "tool_calls": [openai_call]},
         {"role": "tool", "tool_call_id": call.call_id, "content": "5"}],
        tools=[tool],
        max_tokens=20,
    )  # fmt: skip
    assert answer.output_text == (chat.message.content or "")


def test_previous_response_id_continues_the_conversation(smol):
    _, client = smol
    first = client.responses.create(model="m", input="Say a colour.", temperature=0, max_output_tokens=12)
    second = client.responses.create(
        model="m", previous_response_id=first.id, input="And another?", temperature=0, max_output_tokens=12
    )
    chat = _chat(
        client,
        [{"role": "user", "content": "Say a colour."}, {"role": "assistant", "content": first.output_text},
         {"role": "user", "content": "And another?"}],
        max_tokens=12,
    )  # fmt: skip
    assert second.output_text == chat.message.content
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", previous_response_id=first.id, input="More?", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id" and first.id in e.value.body["message"]
    unstored = client.responses.create(model="m", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema_is_followed_whole_and_through_the_stream_helper(smol):
    """(The SDK's stream helper takes only a response that completes: a schema that ends well within the limit.)"""
    _, client = smol
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
    ask = {"model": "m", "input": ASK, "temperature": 0, "max_output_tokens": 40,
           "text": {"format": {"type": "json_schema", "name": "colour", "schema": schema}}}  # fmt: skip
    r = client.responses.create(**ask)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    with client.responses.stream(**ask) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text and final.id != r.id


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [ADD]}, None),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"frobnicate": True}, "frobnicate"),
    ],
)
def test_bad_requests_are_400s_in_openai_s_shape(smol, change, param):
    server, _ = smol
    code, answer = post(server.url + "/v1/responses", {"model": "m", "input": "hi"} | change)
    assert code == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert param is None or (answer["error"]["param"] or "").startswith(param), answer


def test_the_store_drops_the_least_recently_used_past_its_bounds():
    store = ResponseStore(most=2, most_chars=10)
    turns = [{"role": "user", "content": "abc"}]
    for name in ("a", "b"):
        store.put({"id": name}, turns)
    assert store.get("a") is not None  # a is now the most recently used
    store.put({"id": "c"}, turns)
    assert [k for k in ("a", "b", "c") if store.get(k)] == ["a", "c"]
    store.put({"id": "d"}, [{"role": "user", "content": "x" * 9}])  # 3 + 9 characters: over the bound
    assert store.get("a") is None and store.get("c") is None and store.get("d") is not None
    assert store.chars == 9 and store.drop("d") and store.chars == 0 and not store.drop("d")
