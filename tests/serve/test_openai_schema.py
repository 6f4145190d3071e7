"""OpenAI's request schema as OpenAI defines it: every field of the completions and chat-completions specs is
accepted at its default or null (real clients send them), a field llmkit does not implement is a 400 naming it when
it is given another value, and a misspelt field is still a 400."""

from __future__ import annotations

import pytest

from .conftest import post

openai = pytest.importorskip("openai")

from llmkit.serve.engine import EngineConfig  # noqa: E402
from llmkit.serve.server import ServeOptions, Server  # noqa: E402

MESSAGES = [{"role": "user", "content": "Say something."}]

# each field OpenAI's completions spec defines beyond the ones llmkit implements, at its default
COMPLETION_DEFAULTS = {"logprobs": None, "echo": False, "best_of": 1, "suffix": None, "user": "u-1", "seed": None}
CHAT_DEFAULTS = {
    "logprobs": False,
    "top_logprobs": None,
    "response_format": {"type": "text"},
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": True,
    "functions": None,
    "function_call": None,
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "verbosity": None,
    "web_search_options": None,
    "store": False,
    "metadata": {"purpose": "test"},
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "stream_options": None,
}


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as s:
        yield s


def test_every_field_at_its_default_is_served_as_if_left_out(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    plain = c.completions.create(model="m", prompt="Once upon a time", max_tokens=6, temperature=0)
    full = c.completions.create(
        model="m", prompt="Once upon a time", max_tokens=6, temperature=0, **COMPLETION_DEFAULTS
    )
    assert full.choices[0].text == plain.choices[0].text
    chat = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, temperature=0)
    everything = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, temperature=0, **CHAT_DEFAULTS)
    assert everything.choices[0].message.content == chat.choices[0].message.content
    # what a client gets back from OpenAI goes back in the next turn as it came
    turn = [*MESSAGES, {"role": "assistant", "content": "Hi.", "refusal": None, "tool_calls": []}]
    assert c.chat.completions.create(model="m", messages=[*turn, *MESSAGES], max_tokens=2).choices


def test_developer_messages_are_system_messages(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    def answer(role: str) -> str | None:
        messages = [{"role": role, "content": "Answer in French."}, *MESSAGES]
        r = c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        return r.choices[0].message.content

    assert answer("developer") == answer("system")


@pytest.mark.parametrize(
    "endpoint, field, value, param",
    [
        ("completions", "best_of", 3, "best_of"),
        ("completions", "suffix", "end", "suffix"),
        ("chat/completions", "reasoning_effort", "high", "reasoning_effort"),
        ("chat/completions", "store", True, "store"),
        ("chat/completions", "messages", [{"role": "function", "content": "1"}], "messages.0.role"),
        ("chat/completions", "service_tier", "flex", "service_tier"),
        ("chat/completions", "modalities", ["text", "audio"], "modalities"),
        (
            "chat/completions",
            "messages",
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages.0.content.0",
        ),
        ("completions", "logprobz", 1, "logprobz"),  # a typo stays an unknown field
    ],
)
def test_a_field_llmkit_does_not_implement_is_a_400_naming_it(server, endpoint, field, value, param):
    body = {"model": "m", "max_tokens": 2}
    body.update({"prompt": "hi"} if endpoint == "completions" else {"messages": MESSAGES})
    code, answer = post(f"{server.url}/v1/{endpoint}", {**body, field: value})
    assert code == 400, answer
    assert answer["error"]["param"] == param
    expected = "Extra inputs are not permitted" if field == "logprobz" else "not supported by llmkit serve"
    assert expected in answer["error"]["message"]


def test_langchain_completions_class_answers(server):
    """langchain_openai.OpenAI sends `"logprobs": null` (and more nulls) on every call."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", model="m", max_tokens=5, temperature=0, max_retries=0
    )
    direct = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    expected = direct.completions.create(model="m", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert llm.invoke("Once upon a time") == expected.choices[0].text


def test_priority_is_vllms_extension_field(server):
    """`priority` (lower runs first) reaches the engine through the SDK's extra_body; out of its range, a 400."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    seen = []
    admit = server.engine.admit
    server.engine.admit = lambda prompt, params, *a, **k: seen.append(params.priority) or admit(prompt, params, *a, **k)
    try:
        plain = client.completions.create(model="m", prompt="hi", max_tokens=3, temperature=0)
        first = client.completions.create(
            model="m", prompt="hi", max_tokens=3, temperature=0, extra_body={"priority": -5}
        )
    finally:
        server.engine.admit = admit
    assert first.choices[0].text == plain.choices[0].text and seen == [0, -5]
    code, answer = post(f"{server.url}/v1/completions", {"model": "m", "prompt": "hi", "priority": 2**40})
    assert code == 400 and answer["error"]["param"] == "priority"
