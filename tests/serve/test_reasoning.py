"""Reasoning output (llmkit.serve.reasoning): a reply's thinking block apart from its answer, whole and as it
streams, and through the server as `reasoning_content` for a chat template with thinking blocks."""

from __future__ import annotations

import pytest

from llmkit.serve.reasoning import THINK, Reasoning, ReasoningStream, ThinkingBudget, tags_of

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
# writes an empty one into the prompt; with enable_thinking true it opens the block itself (as DeepSeek-R1's does)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
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


# ---- the thinking budget


def test_a_budget_forces_the_closing_tokens_once_the_block_has_taken_its_tokens():
    budget = ThinkingBudget(Reasoning(*THINK, inside=True), budget=3, close=[90, 91])
    for token, text in [(1, "a"), (2, "b")]:
        budget.push(token, text)
        assert budget.next_token() is None
    budget.push(3, "c")
    assert budget.next_token() == 90
    budget.push(90, "\n</thi")
    assert budget.next_token() == 91 and budget.thinking
    budget.push(91, "nk>")
    assert budget.next_token() is None and not budget.thinking
    budget.push(4, "answer")  # after the block: never limited again
    assert budget.next_token() is None and budget.used == 5

    closes_itself = ThinkingBudget(Reasoning(*THINK), budget=3, close=[90])
    for token, text in [(1, "<think>"), (2, "ok"), (3, "</think>"), (4, "x"), (5, "y")]:
        closes_itself.push(token, text)
    assert closes_itself.next_token() is None and not closes_itself.thinking
    no_block = ThinkingBudget(Reasoning(*THINK), budget=1, close=[90])
    for token, text in [(1, "plain"), (2, " text")]:
        no_block.push(token, text)
    assert no_block.next_token() is None and not no_block.thinking


def test_the_engine_keeps_the_reply_and_forces_the_close_at_the_budget(tiny):
    """The budgeted reply is the plain one up to the budget, then the closing tag's tokens, each with the model's
    own log-probability; a budget is refused where it cannot work."""
    from dataclasses import replace

    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.request import Refused, SamplingParams
    from llmkit.serve.structured import Constraint

    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(kv_memory=16 << 20))
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", add_bos=False)
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    budgeted = replace(plain, reasoning_budget=4, reasoning=Reasoning(*THINK, inside=True))
    [free], [held] = engine.generate([prompt], plain), engine.generate([prompt], budgeted)
    close = tok.encode("\n</think>", add_bos=False)
    assert "</think>" not in free.text  # (the tiny model never closes its block by itself)
    assert held.token_ids[:4] == free.token_ids[:4]
    assert held.token_ids[4 : 4 + len(close)] == close
    assert all(lp <= 0.0 for lp in held.logprobs) and len(held.token_ids) == 12
    with pytest.raises(Refused, match="thinking blocks"):
        engine.add(prompt, replace(plain, reasoning_budget=4))
    with pytest.raises(Refused, match="structured output"):
        engine.add(prompt, replace(budgeted, constraint=Constraint("regex", "[a-z]+")))


def test_the_three_apis_split_a_budgeted_reply_alike(server):
    """The chat endpoint's reasoning_content / content, Anthropic's thinking / text blocks and the Responses API's
    reasoning / message items hold the same two texts for the same budgeted request, whole and streamed."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    gpt = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    budget = {"thinking_token_budget": 4, "chat_template_kwargs": {"enable_thinking": True}}
    chat = gpt.chat.completions.create(model="m", messages=hi, max_tokens=16, temperature=0, extra_body=budget)
    thought, answer = chat.choices[0].message.reasoning_content, chat.choices[0].message.content
    assert thought and answer is not None and "</think>" not in thought + answer

    thinking = {"type": "enabled", "budget_tokens": 4}
    ask = {"model": "m", "messages": hi, "max_tokens": 16, "thinking": thinking, "extra_body": {"temperature": 0}}
    message = claude.messages.create(**ask)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (thought, answer)
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert (final.content[0].thinking, final.content[1].text) == (thought, answer)

    r = gpt.responses.create(model="m", input="hi", max_output_tokens=16, temperature=0, extra_body=budget)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == (thought, answer)
    events = list(gpt.responses.create(model="m", input="hi", max_output_tokens=16, temperature=0,
                                       extra_body=budget, stream=True))  # fmt: skip
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought and events[-1].response.output[0].content[0].text == thought

    from .conftest import post

    with_regex = {"model": "m", "messages": hi, "thinking_token_budget": 4, "structured_outputs": {"regex": "[a-z]+"}}
    code, body = post(server.url + "/v1/chat/completions", with_regex)
    assert code == 400 and body["error"]["param"] == "thinking_token_budget"
