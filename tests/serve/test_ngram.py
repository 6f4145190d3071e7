"""Drafts without a draft model (llmkit.serve.ngram): the lookup finds what followed the text's last n-gram where it
occurred before, and in the engine the drafts are verified like a model's: greedy output is the plain engine's,
and a text that repeats itself keeps drafts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import llmkit
from llmkit.errors import InputError
from llmkit.generate import generate
from llmkit.quant.native_step import NativeDecoder
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.ngram import NgramIndex, NgramSpeculator
from llmkit.serve.paged import PagedCache
from llmkit.serve.request import SamplingParams
from llmkit.serve.server import ServeOptions, Server

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def test_the_longest_ngram_ending_the_text_gives_what_followed_its_latest_occurrence():
    index = NgramIndex()
    text = [7, 1, 2, 3, 4, 9, 8, 1, 2, 3, 5, 6, 0, 2, 3]
    # (6, 0, 2, 3) and (0, 2, 3) never occurred before; (2, 3) did twice, latest followed by 5, 6, 0
    assert index.continuation(text, 3) == [5, 6, 0]
    # the text grows: (1, 2, 3) now ends it, latest seen at 7 .. 9, followed by 5, 6
    assert index.continuation([*text, 5, 6, 0, 1, 2, 3], 2) == [5, 6]
    # the 4-gram (4, 1, 2, 3) before the 3-gram, its continuation running into the text's own end
    assert NgramIndex().continuation([4, 4, 1, 2, 3, 4, 1, 2, 3], 9) == [4, 1, 2, 3]
    assert NgramIndex().continuation([1, 2, 3, 4], 3) == []  # nothing repeats
    assert NgramIndex().continuation([5, 5], 3) == []  # one token is not an n-gram (MIN_N = 2)


def test_the_index_grows_with_the_text_as_a_fresh_one_would_see_it():
    torch.manual_seed(0)
    text = torch.randint(0, 6, (200,)).tolist()
    grown = NgramIndex()
    for end in range(2, 200):
        assert grown.continuation(text[:end], 4) == NgramIndex().continuation(text[:end], 4)


def _model(**changes: object) -> llmkit.DecoderLM:
    torch.manual_seed(0)
    model = llmkit.build_model(dataclasses.replace(llmkit.get_preset("llama2-7b-tiny"), **changes)).eval()
    if NativeDecoder.of(model) is None:
        pytest.skip("speculative serving runs in llmkit's C++ step, which this machine does not build")
    return model


def _engine(model: llmkit.DecoderLM, ngram: bool) -> Engine:
    per_block = PagedCache.bytes_per_block(model, 4, torch.float32)
    config = EngineConfig(kv_memory=per_block * 400, block_size=4, step_tokens=16, draft_tokens=4 if ngram else 0,
                          ngram=ngram)  # fmt: skip
    return Engine(model, None, config)


def test_ngram_drafting_gives_the_plain_engines_tokens_and_keeps_drafts_on_a_text_that_repeats():
    """Prompts that quote a passage twice (what a copying answer looks like) and random ones: every request's greedy
    tokens and log-probabilities are the plain engine's, and the drafts the lookup proposed were kept often."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    passage = torch.randint(0, 256, (12,), generator=g).tolist()
    prompts = [
        [*passage, 9, *passage],
        [*passage, 1, 2, *passage[:5]],
        torch.randint(0, 256, (9,), generator=g).tolist(),
    ]
    plain = _engine(model, ngram=False).generate(prompts, GREEDY)
    engine = _engine(model, ngram=True)
    assert isinstance(engine.drafter, NgramSpeculator)
    engine.drafter.drafts_for = lambda rows: 4  # type: ignore[method-assign]
    spec = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain, strict=True):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)
    assert engine.drafter.accepted > 0 and engine.drafter.drafted > 0
    assert not engine.drafter.indexes  # forgotten as the requests ended


def test_sampled_ngram_speculation_keeps_the_models_distribution():
    """A sampled row's drafts are proposals with all their mass on one token (q one-hot in Leviathan et al.'s rule):
    the second token of 600 samples, drafted and verified, against its exact distribution (the sum over the first
    token of p(first) p(second | first)). An 8-token vocabulary and a prompt holding every pair of tokens: the
    lookup always has a draft."""
    model = _model(vocab_size=8)
    prompt = [t for a in range(8) for b in range(8) for t in (a, b)]
    engine = _engine(model, ngram=True)
    assert isinstance(engine.drafter, NgramSpeculator)
    engine.drafter.drafts_for = lambda rows: 2  # type: ignore[method-assign]
    torch.manual_seed(5)
    params = SamplingParams(max_tokens=3, temperature=1.0, n=40)
    outs = [o for _ in range(15) for o in engine.generate([prompt], params)]
    assert engine.drafter.drafted >= 300 and engine.drafter.accepted > 0
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt]))[0, -1], -1)  # (8,)
        second = torch.softmax(model(torch.tensor([[*prompt, t] for t in range(8)]))[:, -1], -1)  # (8, 8)
    expected = (first[:, None] * second).sum(0)
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=8).float()
    tv = 0.5 * (counts / counts.sum() - expected).abs().sum()
    assert tv < 0.1, tv


def test_ngram_drafting_needs_drafts_to_make():
    with pytest.raises(InputError, match="draft_tokens"):
        EngineConfig(ngram=True)


def test_a_server_drafting_by_prompt_lookup_answers_the_openai_client_as_plain_decoding(tiny):
    """`llmkit serve --ngram` as the openai SDK sees it: a completion that restates its prompt, plain and streamed,
    gives `generate`'s greedy text."""
    openai = pytest.importorskip("openai")
    model, tok = tiny
    if NativeDecoder.of(model) is None:
        pytest.skip("speculative serving runs in llmkit's C++ step, which this machine does not build")
    text = "def area(self):\n    return self.width * self.height\n\n# again:\ndef area(self):\n    return"
    ids = tok.encode(text)
    want = tok.decode(generate(model, torch.tensor([ids]), max_new_tokens=12).tokens[0, len(ids) :].tolist())
    config = EngineConfig(kv_memory=64 << 20, draft_tokens=3, ngram=True)
    with Server(model, tok, ServeOptions("m"), config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="m", prompt=text, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        stream = client.completions.create(model="m", prompt=text, max_tokens=12, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want
        assert isinstance(server.engine.drafter, NgramSpeculator)


def test_only_rows_that_sample_are_offered_drafts(monkeypatch):
    """Four completions of one prompt: the later ones find its first blocks cached and compute the rest, at times
    as a 1-token chunk short of the prompt's end. Such a row samples nothing, so it must not carry drafts (they
    would sit between prompt tokens); every row the drafter is offered samples its next token."""
    model = _model()
    g = torch.Generator().manual_seed(4)
    passage = torch.randint(0, 256, (10,), generator=g).tolist()
    engine = _engine(model, ngram=True)
    offered = []
    propose = NgramSpeculator.propose

    def spy(self, rows, *args, **kwargs):
        offered.extend(w.samples for w in rows)  # (as the row stands when it is offered)
        return propose(self, rows, *args, **kwargs)

    monkeypatch.setattr(NgramSpeculator, "propose", spy)
    engine.generate([[*passage, 5, *passage]], SamplingParams(max_tokens=6, temperature=0.3, n=4))
    assert offered and all(offered)


def test_a_sequence_whose_drafts_are_rejected_drafts_less():
    """k per sequence from its own acceptance: a sequence that keeps its drafts gets the step's k, one that does not
    falls to a single draft (still measured), and its record goes with it."""
    from llmkit.serve.request import Request, Sequence

    engine = _engine(_model(), ngram=True)
    drafter = engine.drafter
    assert isinstance(drafter, NgramSpeculator)
    copying, wandering = (Sequence(Request(r, [1, 2], GREEDY, 0.0), 0, [1, 2]) for r in ("copying", "wandering"))
    for _ in range(4):
        drafter.record(4, 4, copying)
        drafter.record(4, 0, wandering)
    assert drafter._depth(copying, 4) == 4 and drafter._depth(wandering, 4) == 1
    drafter.forget(wandering)
    assert drafter._depth(wandering, 4) == 4  # a sequence not seen yet drafts in full
