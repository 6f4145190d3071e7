"""Tool calling: definitions rendered into the prompt (by a template that takes `tools`, or as a system message we
write), calls parsed out of the reply (hermes blocks, Llama 3 JSON), whole and streamed, and forced calls whose
arguments validate against their schema; with the `openai` SDK and LangChain against SmolLM2."""

from __future__ import annotations

import copy
import json

import pytest

from .conftest import Person, langchain_chat, post

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from llmkit.serve.engine import EngineConfig  # noqa: E402
from llmkit.serve.routes import render_prompt  # noqa: E402
from llmkit.serve.server import ServeOptions, Server  # noqa: E402
from llmkit.serve.tools import Function, ToolCall, ToolText, conversation, parse, template_format  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
CALLED = {"name": "add", "arguments": "{}"}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- parsing and rendering


def test_hermes_blocks_are_parsed_and_the_rest_is_prose():
    text = (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n'  # not a function offered: stays text
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
    )
    content, calls = parse(text, "hermes", {"add", "get_weather"})
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Rome", "unit": "celsius"}),
    ]
    assert content == 'Let me check.\n\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parse("no calls here", "hermes", {"add"}) == ("no calls here", [])
    assert parse('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', "hermes", {"add"})[1] == []


def test_llama3_json_is_parsed():
    for text in ('{"name": "add", "parameters": {"a": 1, "b": 2}}', '<|python_tag|>{"name": "add", "parameters": {}}'):
        content, calls = parse(text, "llama3", {"add"})
        assert content is None and [c.name for c in calls] == ["add"]
    assert parse('{"answer": 1}', "llama3", {"add"}) == ('{"answer": 1}', [])


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_streamed_text_gives_the_same_prose_and_calls(fmt):
    names = {"add"}
    if fmt == "hermes":
        texts = ['Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "a <tool plain"]
    else:
        texts = ['{"name": "add", "parameters": {"a": 1, "b": 2}}', "Plain {text}"]
    for text in texts:
        for size in (1, 3, 7):
            stream = ToolText(fmt, names)  # type: ignore[arg-type]
            given = "".join(stream.push(text[i : i + size]) for i in range(0, len(text), size))
            rest, calls = stream.finish()
            content, expected = parse(text, fmt, names)  # type: ignore[arg-type]
            assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
            assert (given + rest).strip() == (content or "").strip()


def test_generic_format_writes_the_definitions_calls_and_results_into_the_conversation():
    f = Function("add", "Add two integers", ADD["function"]["parameters"])
    turns = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [ToolCall("add", '{"a": 1, "b": 2}', "call_1")]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    messages, context = conversation(turns, [f], takes_tools=False)
    assert context == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(f.definition()) in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}


TEMPLATE = (  # a template that takes tools, in the manner of Qwen2.5's
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def test_a_template_that_takes_tools_renders_them_itself(smollm2):
    tok = copy.copy(smollm2[1])
    tok.chat_template = TEMPLATE
    assert template_format(TEMPLATE) == (True, "hermes")
    assert template_format(smollm2[1].chat_template) == (False, "hermes")
    f = Function("add", "Add two integers", ADD["function"]["parameters"])
    turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": [ToolCall("add", '{"a": 1, "b": 2}', "c")]}]
    text = tok.decode(render_prompt(tok, turns, [f]), skip_special=False)
    assert json.dumps(f.definition()) in text  # tojson as transformers renders it: no HTML escapes
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text


# ---- through the server


@pytest.fixture(scope="module")
def smol(smollm2):
    model, tok = smollm2
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_parse_and_validate_streamed_and_not(smol, choice):
    _, client = smol
    common = {"model": "m", "messages": ASK, "tools": [WEATHER, ADD], "tool_choice": choice, "max_tokens": 120}
    r = client.chat.completions.create(**common, temperature=0)  # type: ignore[call-overload]
    message = r.choices[0].message
    assert message.tool_calls and message.content is None
    for call in message.tool_calls:
        _valid(call)
    if isinstance(choice, dict):
        assert {c.function.name for c in message.tool_calls} == {"add"}
        assert r.choices[0].finish_reason == "stop"  # OpenAI's reason for a call forced by name
    else:
        assert r.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**common, temperature=0, stream=True))  # type: ignore[call-overload]
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_a_schema_s_references_move_with_it_and_its_data_does_not():
    from llmkit.serve.tools import _moved

    schema = {
        "type": "object",
        "properties": {
            "enum": {"$ref": "#/$defs/x"},
            "c": {"const": {"$ref": "#/data"}},
            "d": {"enum": [{"$ref": "#"}]},
        },
        "$defs": {"x": {"type": "array", "items": {"$ref": "#"}}},
        "$id": "https://example.com/s",  # (other keys as they are)
        "additionalProperties": {"$ref": "https://example.com/other.json"},  # not document-local: as it is
    }
    moved = _moved(schema, "/$defs/f3")
    assert moved["properties"]["enum"] == {"$ref": "#/$defs/f3/$defs/x"}  # a property named like a keyword
    assert moved["$defs"]["x"]["items"] == {"$ref": "#/$defs/f3"}
    assert (
        moved["properties"]["c"] == schema["properties"]["c"] and moved["properties"]["d"] == schema["properties"]["d"]
    )
    assert moved["additionalProperties"] == schema["additionalProperties"] and moved["$id"] == schema["$id"]


# a schema with its own definitions, one of them recursive (refused before: "Pointer '/$defs/n' does not exist",
# the call's schema holding it under "arguments")
NESTED = {
    "type": "function",
    "function": {
        "name": "outline",
        "parameters": {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "title": {"type": "string", "maxLength": 8},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
                    },
                    "required": ["title"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"root": {"$ref": "#/$defs/node"}},
            "required": ["root"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("tools", [[NESTED], [WEATHER, NESTED]])
def test_a_tool_whose_schema_has_its_own_definitions_is_called(smol, tools):
    _, client = smol
    ask = [{"role": "user", "content": "Outline a book."}]
    name = {"type": "function", "function": {"name": "outline"}}
    r = client.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice=name, max_tokens=120)  # type: ignore[arg-type]
    [call] = r.choices[0].message.tool_calls or []
    assert call.function.name == "outline"
    jsonschema.validate(json.loads(call.function.arguments), NESTED["function"]["parameters"])


def test_parallel_tool_calls_false_gives_one_call(smol):
    _, client = smol
    r = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, ADD],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    assert len(r.choices[0].message.tool_calls or []) == 1


def test_auto_reads_the_calls_the_model_writes(smol):
    """With tool_choice auto the model decides; a grammar (structured_outputs) makes it write a call here, so that
    the parsing of a free reply is what is tested."""
    _, client = smol
    reply = 'Checking. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    grammar = f"start: {json.dumps(reply)}"  # a JSON string is a Lark literal
    common = {"model": "m", "messages": ASK, "tools": [WEATHER, ADD], "max_tokens": 60}
    extra = {"structured_outputs": {"grammar": grammar}}
    r = client.chat.completions.create(**common, extra_body=extra)  # type: ignore[call-overload]
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Checking."
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    chunks = list(client.chat.completions.create(**common, extra_body=extra, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "Checking."
    [streamed] = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert streamed.function.arguments == call.function.arguments


def test_a_conversation_with_calls_and_results_goes_on(smol):
    _, client = smol
    first = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=100,
        temperature=0,  # type: ignore[list-item]
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(model="m", messages=turns, tools=[WEATHER], max_tokens=20)  # type: ignore[arg-type, list-item]
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]}, "tools"),
        (  # a forced call whose arguments are a string came back as text with finish_reason "stop"
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": ["array", "null"]}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages.0"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": CALLED}]}]},
            "messages.0",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(smol, extra, param):
    server, _ = smol
    body = {"model": "m", "messages": ASK, "max_tokens": 4, **extra}
    code, answer = post(f"{server.url}/v1/chat/completions", body)
    assert code == 400, answer
    assert answer["error"]["param"] == param, answer


def test_langchain_bind_tools_and_structured_output_by_function_calling(smol):
    llm = langchain_chat(smol[0].url, max_tokens=120)
    message = llm.bind_tools([WEATHER, ADD], tool_choice="required").invoke("What is 2 plus 3?")
    assert message.tool_calls and message.tool_calls[0]["name"] in SCHEMAS
    jsonschema.validate(message.tool_calls[0]["args"], SCHEMAS[message.tool_calls[0]["name"]])
    person = llm.with_structured_output(Person, method="function_calling").invoke("Alice is 30.")
    assert isinstance(person, Person)
