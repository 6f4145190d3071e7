"""Reasoning output (llmkit.serve.reasoning): a reply's thinking block apart from its answer, whole and as it
streams, and through the server as `reasoning_content` for a chat template with thinking blocks."""

from __future__ import annotations

import pytest

from llmkit.serve.reasoning import THINK, Reasoning, ReasoningStream, tags_of

R = Reasoning(*THINK)


def test_a_reply_splits_into_its_block_and_its_answer():
    assert R.split("<think>w times h</think>\n\nThe area is 12.") == ("w times h", "The area is 12.")
    assert R.split("  <think>x</think>y") == ("x", "y")  # leading whitespace before the block
    assert R.split("No block here. <think>late</think>") == (None, "No block here. <think>late</think>")
    assert R.split("<think>never closed") == ("never closed", "")
    inside = Reasoning(*THINK, inside=True)  # the template opened the block: the reply starts in it
    assert inside.split("thinking</think>answer") == ("thinking", "answer")
    assert tags_of("{% if x %}<think>{% endif %}</think>") == THINK and tags_of("plain") is None


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_a_stream_split_anywhere_gives_the_whole_replys_parts(cut):
    text = "<think>a</think b < c</think>\n\nanswer <th"
    stream, reasoning, content = ReasoningStream(R), "", ""
    for i in range(0, len(text), cut):
        r, c = stream.push(text[i : i + cut])
        reasoning, content = reasoning + r, content + c
    r, c = stream.end()
    assert (reasoning + r, content + c) == ("a</think b < c", "answer <th")


def test_a_tag_cut_between_deltas_is_held_until_it_is_whole():
    stream = ReasoningStream(R)
    assert stream.push("<th") == ("", "")  # maybe the opening tag
    assert stream.push("ink>ab</th") == ("ab", "")  # the closing tag's start is held back
    assert stream.push("ink>\nc") == ("", "c")
    assert stream.end() == ("", "")


# a Qwen3-like template: the model opens its own <think> block, unless enable_thinking is false, when the template
# writes an empty one into the prompt
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny):
    import copy

    from llmkit.serve.engine import EngineConfig
    from llmkit.serve.server import ServeOptions, Server

    model, tok = tiny
    tok = copy.copy(tok)
    tok.chat_template = TEMPLATE
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as s:
        yield s


def test_the_openai_client_gets_reasoning_content_apart_whole_and_streamed(server):
    """The reply is held to a thinking block and an answer (a regex constraint, since the tiny model's own text is
    noise): `reasoning_content` is the block's inside, `content` the answer, the same streamed; with
    chat_template_kwargs {"enable_thinking": false} the template closes the block in the prompt and all is content."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    shape = {"structured_outputs": {"regex": "<think>[a-z]{3,8}</think>\\n\\n[a-z]{3,8}"}}
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0}
    reply = client.chat.completions.create(**ask, extra_body=shape).choices[0].message
    thought, answer = reply.reasoning_content, reply.content
    assert thought and answer and thought.isalpha() and answer.isalpha()
    stream = client.chat.completions.create(**ask, extra_body=shape, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    plain = {"structured_outputs": {"regex": "[a-z]{3,8}"}, "chat_template_kwargs": {"enable_thinking": False}}
    reply = client.chat.completions.create(**ask, extra_body=plain).choices[0].message
    assert reply.reasoning_content is None and reply.content.isalpha()


def test_reserved_template_variables_are_a_400(server):
    from .conftest import post

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}
    code, answer = post(f"{server.url}/v1/chat/completions", body)
    assert code == 400 and "set by the server" in answer["error"]["message"]
