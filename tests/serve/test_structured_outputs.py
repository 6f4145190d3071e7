"""Structured outputs: JSON schemas, regexes, choices and grammars enforced while decoding (llguidance), through the
engine (beside unconstrained rows, on the C++ decode step) and through the server with real clients (the `openai`
SDK, LangChain), every output parsed and validated with `jsonschema`; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import pytest

from .conftest import Person, langchain_chat, post, wait_for

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from llmkit.errors import InputError  # noqa: E402
from llmkit.serve.engine import Engine, EngineConfig  # noqa: E402
from llmkit.serve.model_runner import NativeRunner  # noqa: E402
from llmkit.serve.request import SamplingParams  # noqa: E402
from llmkit.serve.server import ServeOptions, Server  # noqa: E402
from llmkit.serve.structured import Constraint, Grammars  # noqa: E402
from llmkit.tokenizer import render_chat  # noqa: E402

# schemas whose every valid text is short: a random model finishes them well inside its budget
BOUNDED = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {
                "type": "object",
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "ok": {"type": "boolean"}},
                "required": ["zip", "ok"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue"]},
}

# what a user asks of a real model
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
RECIPE = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "ingredients": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"item": {"type": "string"}, "grams": {"type": "number"}},
                "required": ["item", "grams"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 4,
        },
        "vegetarian": {"type": "boolean"},
    },
    "required": ["title", "ingredients", "vegetarian"],
    "additionalProperties": False,
}
ASK = "Describe a person called Alice, aged 30, who lives in Paris, as JSON."
ASK_KEYS = 'Reply with a JSON object with the keys "name" and "age" for Alice, who is 30.'  # for schema-free JSON


def _chat_ids(tok, text: str) -> list[int]:
    return tok.encode(render_chat(tok, [{"role": "user", "content": text}]), add_bos=False)


def test_constrained_rows_validate_beside_free_rows_that_are_unchanged(tiny):
    """One batch: rows under a schema, a regex and a choice next to unconstrained rows. Each constrained text is
    valid and complete (finish reason stop); the free rows give exactly the tokens they give alone."""
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(kv_memory=32 << 20))
    prompts = [_chat_ids(tok, "Give me JSON."), _chat_ids(tok, "A number?"), _chat_ids(tok, "Colour?")]
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [c.token_ids for c in engine.generate(prompts, free)]
    constraints = [Constraint.json_schema(s) for s in BOUNDED.values()]
    constraints += [Constraint("regex", r"[0-9]{3}-[0-9]{2}"), Constraint.choice(["yes", "no", "maybe"])]
    free_ids = [engine.add(p, free) for p in prompts]
    bound_ids = [
        engine.add(prompts[i % len(prompts)], SamplingParams(max_tokens=200, temperature=0.0, constraint=c))
        for i, c in enumerate(constraints)
    ]
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_work:
        for d in engine.step():
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                reasons[d.request_id] = d.finish_reason
    assert [tokens[i] for i in free_ids] == alone
    for request_id, c in zip(bound_ids, constraints, strict=True):
        assert reasons[request_id] == "stop", (c, texts[request_id])
        text = texts[request_id]
        if c.kind == "json":
            jsonschema.validate(json.loads(text), json.loads(c.text))
        elif c.kind == "regex":
            assert re.fullmatch(c.text, text), text
        else:
            assert text in ("yes", "no", "maybe")


def test_the_c_plus_plus_decode_step_is_used_with_constraints(tiny, monkeypatch):
    """Constraints act on the logits, after the model: the C++ step still computes the decoding rows."""
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(kv_memory=32 << 20))
    if not isinstance(engine.runner, NativeRunner):
        pytest.skip("the native kernels are not available here")
    calls = []
    native = engine.runner.native
    for entry in ("run_paged", "run_tokens"):  # (the batch-invariant runner takes every row through run_tokens)
        run = getattr(native, entry)
        monkeypatch.setattr(native, entry, lambda *a, run=run, **k: calls.append(1) or run(*a, **k))
    params = SamplingParams(max_tokens=200, temperature=0.0, constraint=Constraint.json_schema(BOUNDED["nested"]))
    [out] = engine.generate([_chat_ids(tok, "JSON please.")], params)
    jsonschema.validate(json.loads(out.text), BOUNDED["nested"])
    assert len(calls) >= len(out.token_ids) - 1


def test_sampled_rows_stay_inside_the_grammar(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(kv_memory=32 << 20))
    params = SamplingParams(
        max_tokens=200, temperature=1.5, seed=3, n=4, constraint=Constraint("regex", r"[a-c]{2,5}!")
    )
    for out in engine.generate([_chat_ids(tok, "Letters.")], params):
        assert re.fullmatch(r"[a-c]{2,5}!", out.text), out.text
        assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    "constraint, message",
    [
        (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
        (lambda: Constraint.json_schema({"type": "strin"}), "json"),
        (lambda: Constraint("regex", "(unclosed"), "regex"),
        (lambda: Constraint("grammar", "start: ((("), "grammar"),
        (lambda: Constraint.choice([]), "non-empty"),
    ],
)
def test_bad_constraints_are_input_errors(tiny, constraint, message):
    grammars = Grammars(tiny[1], tiny[0].cfg.vocab_size)
    with pytest.raises(InputError, match=message):
        grammars.compile(constraint())


# constraints the grammar engine accepts but cannot decode: their first token meets a limit (llguidance's row of
# 2,000 items, 50,000 items for the tokens a rule forces), or no text satisfies them at all
ENDLESS_SCHEMA = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}
ALTERNATIVES = "start: " + " | ".join(f'"w{i}x"' for i in range(5000))
UNDECODABLE = [
    (Constraint.json_schema(ENDLESS_SCHEMA), "does every text of it end"),
    (Constraint("grammar", 'start: "a" start'), "does every text of it end"),
    (Constraint("grammar", 'root ::= "a" root'), "does every text of it end"),  # GBNF
    (Constraint("grammar", ALTERNATIVES), "Current row has 5001 items; max is 2000"),
    (Constraint("regex", r"[^\s\S]"), "no text satisfies the regex"),
    (Constraint("regex", "[a&&b]"), "no text satisfies the regex"),
]


@pytest.mark.parametrize("constraint, message", UNDECODABLE)
def test_constraints_that_cannot_be_decoded_are_refused_when_compiled(tiny, constraint, message):
    """Each of these compiled, then failed at the first token while decoding (a 500), or gave "" for a regex that
    matches nothing: the first step is taken when the constraint is compiled."""
    grammars = Grammars(tiny[1], tiny[0].cfg.vocab_size)
    with pytest.raises(InputError, match=re.escape(message)) as e:
        grammars.compile(constraint)
    assert "\n" not in str(e.value) and "w4999x" not in str(e.value) and len(str(e.value)) < 600  # not the grammar


def test_the_documented_maximum_of_choices_decodes(tiny):
    """4,096 choices (the documented maximum) were one grammar rule past the parser's row limit of 2,000."""
    model, tok = tiny
    options = [f"option {i}" for i in range(4096)]
    engine = Engine(model, tok, EngineConfig(kv_memory=32 << 20))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, constraint=Constraint.choice(options))
    for out in engine.generate([_chat_ids(tok, "Pick one.")], params):
        assert out.text in options and out.finish_reason == "stop", out


def test_a_constraint_is_compiled_once(tiny):
    grammars = Grammars(tiny[1], tiny[0].cfg.vocab_size)
    for _ in range(3):
        grammars.matcher(Constraint.json_schema(BOUNDED["array"]))
    assert grammars.compiled.cache_info().misses == 1


@pytest.fixture(scope="module")
def smol_server(smollm2):
    model, tok = smollm2
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("schema", [PERSON, RECIPE, BOUNDED["array"]], ids=["person", "recipe", "array"])
def test_json_schema_output_validates(smol_server, schema):
    _, client = smol_server
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": ASK}],
        max_tokens=300,
        temperature=0,
        response_format=response_format,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


def test_json_object_streamed_and_not(smol_server):
    _, client = smol_server
    common = {"model": "m", "messages": [{"role": "user", "content": ASK_KEYS}], "max_tokens": 300, "temperature": 0}
    whole = client.chat.completions.create(**common, response_format={"type": "json_object"})  # type: ignore[call-overload]
    assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)
    chunks = client.chat.completions.create(**common, response_format={"type": "json_object"}, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_vllm_structured_outputs_on_both_endpoints(smol_server):
    _, client = smol_server
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert chat.choices[0].message.content in ("yes", "no")
    done = client.completions.create(
        model="m",
        prompt="The phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", done.choices[0].text)
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    g = client.completions.create(
        model="m", prompt="Q: Is water wet?\nA:", max_tokens=20, extra_body={"structured_outputs": {"grammar": grammar}}
    )
    assert g.choices[0].text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: )"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"grammar": 'start: "a" start'}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= "a" root'}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": ALTERNATIVES}}, "structured_outputs"),
        ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": ENDLESS_SCHEMA}}},
            "response_format",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            None,
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(smol_server, extra, param):
    server, _ = smol_server
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    code, answer = post(f"{server.url}/v1/chat/completions", body)
    assert code == 400, answer
    assert answer["error"]["param"] == param, answer


def test_a_slow_compilation_stalls_no_one(tiny):
    """While one request's grammar compiles (held here on an event), the server answers /health and serves other
    requests: compiling runs off the event loop and outside the engine's steps."""
    model, tok = tiny
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=32 << 20)) as server:
        grammars = server.loop.engine.grammars
        entered, release = threading.Event(), threading.Event()
        compile_for_real = grammars.compiled

        def held(constraint):
            if constraint.kind == "regex":
                entered.set()
                assert release.wait(60)
            return compile_for_real(constraint)

        grammars.compiled = held
        result: dict[str, object] = {}

        def slow() -> None:
            body = {"model": "m", "prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "[ab]{3}"}}
            result["answer"] = post(f"{server.url}/v1/completions", body)

        thread = threading.Thread(target=slow)
        thread.start()
        assert entered.wait(60)
        with urllib.request.urlopen(server.url + "/health", timeout=60) as r:
            assert r.status == 200
        code, other = post(f"{server.url}/v1/completions", {"model": "m", "prompt": "y", "max_tokens": 3})
        assert code == 200 and other["choices"][0]["finish_reason"] == "length"
        assert "answer" not in result
        release.set()
        thread.join(60)
        code, answer = result["answer"]  # type: ignore[misc]
        assert code == 200 and re.fullmatch("[ab]{3}", answer["choices"][0]["text"]), answer
        wait_for(lambda: not server.loop.engine.has_work, what="the engine to go idle")


def test_langchain_with_structured_output(smol_server):
    llm = langchain_chat(smol_server[0].url, max_tokens=200)
    for method in ("json_schema", "json_mode"):
        person = llm.with_structured_output(Person, method=method).invoke(ASK_KEYS)
        assert isinstance(person, Person), (method, person)


class _FailsAtSecondToken:
    """A grammar engine's matcher that meets a limit at the second token (as a grammar can, deep inside: an
    alternation past llguidance's row limit behind the first tokens), for what the client is told."""

    def __init__(self, matcher) -> None:
        self.matcher, self.taken = matcher, 0

    def consume_token(self, token: int) -> bool:
        self.taken += 1
        return self.taken < 2 and self.matcher.consume_token(token)

    def get_error(self) -> str:
        return "Parser Error: Current row has 2001 items; max is 2000\n<non-verbose/>"

    def __getattr__(self, name: str):
        return getattr(self.matcher, name)


def test_a_grammar_that_fails_while_decoding_is_an_error_that_names_it(tiny):
    """A 400 naming the grammar engine's limit, or an error event in a stream; before, a 500 "the engine failed"
    (or finish_reason "stop" with text outside the grammar, had the row gone on)."""
    model, tok = tiny
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=32 << 20)) as server:
        grammars = server.loop.engine.grammars
        real = grammars.matcher
        grammars.matcher = lambda constraint: _FailsAtSecondToken(real(constraint))
        body = {"model": "m", "prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "[ab]{5}"}}
        code, answer = post(f"{server.url}/v1/completions", body)
        assert code == 400, answer
        message = answer["error"]["message"]
        assert "grammar failed at token" in message and "max is 2000" in message and "\n" not in message, message
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        events = client.completions.create(
            model="m", prompt="x", max_tokens=8, stream=True, extra_body={"structured_outputs": {"regex": "[ab]{5}"}}
        )
        with pytest.raises(openai.APIError, match="max is 2000"):
            list(events)
        code, plain = post(f"{server.url}/v1/completions", {"model": "m", "prompt": "y", "max_tokens": 3})
        assert code == 200 and plain["choices"][0]["finish_reason"] == "length"
