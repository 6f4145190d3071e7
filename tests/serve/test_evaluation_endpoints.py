"""Log-probabilities and embeddings through the server, in OpenAI's shapes, checked against one uncached forward of
the model (fp32), and the tokenizer endpoints an evaluation harness uses."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from .conftest import post

openai = pytest.importorskip("openai")

from llmkit.generate import generate  # noqa: E402
from llmkit.serve.engine import EngineConfig  # noqa: E402
from llmkit.serve.server import ServeOptions, Server  # noqa: E402
from llmkit.tokenizer import render_chat  # noqa: E402

PROMPT = "Once upon a time, there was"


@pytest.fixture(scope="module")
def served(tiny):
    model, tok = tiny
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as server:
        yield server, model, tok, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _forward(model, ids: list[int]) -> torch.Tensor:
    """log-softmax over the vocabulary at each position (L, V): row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)


def test_echo_gives_the_prompts_own_logprobs(served):
    """What lm-evaluation-harness asks for a log-likelihood: echo, max_tokens 0, logprobs 1."""
    _, model, tok, c = served
    ids = tok.encode(PROMPT)
    r = c.completions.create(model="m", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids, skip_special=False) and choice.finish_reason == "length"
    lp = _forward(model, ids)
    got = choice.logprobs
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.tokens == [tok.decode([t], skip_special=False) for t in ids]
    expected = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert got.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for i, top in enumerate(got.top_logprobs[1:], start=1):  # the best token and the prompt's own
        best = lp[i - 1].argmax().item()
        assert top[tok.decode([best], skip_special=False)] == pytest.approx(lp[i - 1, best].item(), abs=1e-4)
        assert len(top) <= 2
    assert got.text_offset == sorted(got.text_offset) and got.text_offset[0] == 0
    assert r.usage.completion_tokens == 0


def test_completion_logprobs_streamed_and_not(served):
    _, model, tok, c = served
    ids = tok.encode(PROMPT)
    greedy = generate(model, torch.tensor([ids]), max_new_tokens=6).tokens[0, len(ids) :].tolist()
    r = c.completions.create(model="m", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0)
    got = r.choices[0].logprobs
    assert got.tokens == [tok.decode([t], skip_special=False) for t in greedy]
    lp = _forward(model, ids + greedy)
    expected = [lp[len(ids) - 1 + j, t].item() for j, t in enumerate(greedy)]
    assert got.token_logprobs == pytest.approx(expected, abs=1e-4)
    for value, top in zip(got.token_logprobs, got.top_logprobs, strict=True):  # greedy: the best of the three
        assert value == max(top.values()) and len(top) == 3
    assert got.text_offset[0] == len(PROMPT) and got.text_offset == sorted(got.text_offset)
    parts = list(c.completions.create(model="m", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0, stream=True))
    streamed = [p.choices[0].logprobs for p in parts if p.choices and p.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == got.tokens
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(got.token_logprobs)
    assert [o for s in streamed for o in s.text_offset] == got.text_offset
    echoed = list(
        c.completions.create(model="m", prompt=PROMPT, max_tokens=2, logprobs=0, echo=True, temperature=0, stream=True)
    )
    assert "".join(p.choices[0].text for p in echoed if p.choices).startswith(PROMPT)
    first = next(p.choices[0].logprobs for p in echoed if p.choices and p.choices[0].logprobs)
    assert first.tokens[: len(ids)] == [tok.decode([t], skip_special=False) for t in ids]


def test_chat_logprobs_are_the_models(served):
    _, model, tok, c = served
    messages = [{"role": "user", "content": "Say something."}]
    r = c.chat.completions.create(
        model="m", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    prompt = tok.encode(render_chat(tok, messages), add_bos=False)
    generated = [tok.encode(e.token, add_bos=False) for e in content]
    assert all(len(g) == 1 for g in generated)  # each named token encodes back to itself here
    ids = [g[0] for g in generated]
    lp = _forward(model, prompt + ids)
    for j, entry in enumerate(content):
        row = lp[len(prompt) - 1 + j]
        assert entry.logprob == pytest.approx(row[ids[j]].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    parts = list(
        c.chat.completions.create(
            model="m", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    streamed = [e for p in parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = c.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize(
    "endpoint, extra, param",
    [
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_logprob_settings_are_400s_naming_the_field(served, endpoint, extra, param):
    server = served[0]
    body = {"model": "m", "max_tokens": 2}
    body |= {"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    code, answer = post(f"{server.url}/v1/{endpoint}", body | extra)
    assert code == 400 and answer["error"]["param"] == param, answer


def test_tokenizer_endpoints_and_model_cards(served):
    server, model, tok, c = served
    code, t = post(server.url + "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert code == 200 and t["tokens"] == tok.encode(PROMPT, add_bos=False) and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == model.max_seq_len
    messages = [{"role": "user", "content": "hi"}]
    code, t = post(server.url + "/tokenize", {"messages": messages})
    assert t["tokens"] == tok.encode(render_chat(tok, messages), add_bos=False)
    code, d = post(server.url + "/detokenize", {"tokens": tok.encode(PROMPT, add_bos=False)})
    assert code == 200 and d["prompt"] == PROMPT
    assert post(server.url + "/detokenize", {"tokens": [10**9]})[0] == 400
    assert post(server.url + "/tokenize", {"prompt": "a", "messages": messages})[0] == 400
    with urllib.request.urlopen(server.url + "/tokenizer_info") as r:
        info = json.loads(r.read())
    assert info["eos_token"] == tok.backend.id_to_token(tok.eos_id) and info["chat_template"] == tok.chat_template
    assert [m.max_model_len for m in c.models.list()] == [model.max_seq_len]  # type: ignore[attr-defined]
    assert c.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")


def test_embeddings_are_the_models_pooled_states(served):
    """/v1/embeddings: the mean of the final hidden states (after the final norm), unit length; through the SDK
    (which asks for base64) and as floats, for strings and token ids."""
    server, model, tok, c = served
    texts = ["The cat sat on the mat.", "Bonjour"]
    r = c.embeddings.create(model="m", input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    for text, d in zip(texts, r.data, strict=True):
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            h = model.norm(model.run(ids, model.step_for(ids, None, None, None)))[0].float().mean(0)
        expected = torch.nn.functional.normalize(h, dim=0)
        torch.testing.assert_close(torch.tensor(d.embedding), expected, atol=1e-5, rtol=0)
    code, floats = post(server.url + "/v1/embeddings", {"model": "m", "input": tok.encode(texts[0])})
    assert code == 200 and floats["data"][0]["embedding"] == pytest.approx(r.data[0].embedding, abs=1e-6)
    for body, param in [({"input": ""}, "input"), ({"input": "x", "dimensions": 8}, "dimensions")]:
        code, answer = post(server.url + "/v1/embeddings", {"model": "m"} | body)
        assert code == 400 and answer["error"]["param"] == param, answer
