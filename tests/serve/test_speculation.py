"""Speculative serving (serve/speculation.py): greedy output is the plain engine's token for token whatever the MTP
module drafts, sampled output keeps the model's distribution, the drafter reads what the training-time MTP forward
reads, and its state survives prompt chunks, preemption and shared prefixes."""

from __future__ import annotations

import dataclasses
import threading
import urllib.request

import pytest
import torch

import llmkit
from llmkit.errors import InputError
from llmkit.layers.attention import AttentionInputs, AttentionMask
from llmkit.models.cache import whole_sequence
from llmkit.quant.native_step import NativeDecoder
from llmkit.serve.drafters import ModelSpeculator, MTPSpeculator
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.kernel_runner import KernelRunner
from llmkit.serve.paged import LatentPool, PagedCache
from llmkit.serve.request import SamplingParams
from llmkit.serve.speculation import Costs

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _model(seed: int = 0, **changes: object) -> llmkit.DecoderLM:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(llmkit.get_preset("llama2-7b-tiny"), **{"mtp_depth": 1, **changes})
    model = llmkit.build_model(cfg).eval()
    if NativeDecoder.of(model) is None:
        pytest.skip("speculative serving runs in llmkit's C++ step, which this machine does not build")
    return model


def _prompts(lengths: list[int], prefix: int = 0, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (prefix,), generator=g).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(model: llmkit.DecoderLM, k: int = 0, blocks: int = 400, drafts: int | None = None, **kw: object) -> Engine:
    """An engine with small blocks and steps; with k, speculating (through the module's own weights unless
    draft_head_bits says otherwise); drafts: force that many drafts a step."""
    per_block = PagedCache.bytes_per_block(model, 4, torch.float32)
    kw.setdefault("draft_head_bits", None)
    config = EngineConfig(kv_memory=per_block * blocks, block_size=4, step_tokens=16, draft_tokens=k, **kw)
    engine = Engine(model, None, config)
    if drafts is not None:
        assert engine.drafter is not None
        engine.drafter.drafts_for = lambda rows: drafts  # type: ignore[method-assign]
    return engine


def _oracle(monkeypatch: pytest.MonkeyPatch, expected: dict[tuple[int, ...], list[int]], wrong_at: int = -1) -> None:
    """Make the drafter propose the plain engine's own next tokens (expected[prompt]), wrong at depth `wrong_at`;
    for other prompts, its own drafts."""
    own = MTPSpeculator._draw

    def draw(self: MTPSpeculator, logits: torch.Tensor, seq, depth: int):
        out = expected.get(tuple(seq.request.prompt))
        if out is None:
            return own(self, logits, seq, depth)
        token = out[len(seq.generated) + depth]
        return torch.tensor((token + 1) % 256 if depth == wrong_at else token), None

    monkeypatch.setattr(MTPSpeculator, "_draw", draw)


@pytest.mark.parametrize(("k", "bits", "invariant"), [(1, None, False), (3, None, False), (3, 4, False), (2, 4, True)])
def test_greedy_speculative_serving_equals_plain_serving(k, bits, invariant):
    """Whatever the untrained module drafts (almost always wrong), through its own weights or int4 copies, the
    tokens and their log-probabilities are the plain engine's, for one-token prompts, prompts cut into chunks and
    everything between; in the batch-invariant mode too."""
    model = _model()
    prompts = _prompts([1, 3, 9, 17, 30])
    plain = _engine(model, batch_invariant=invariant).generate(prompts, GREEDY)
    engine = _engine(model, k, drafts=k, draft_head_bits=bits, batch_invariant=invariant)
    spec = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain, strict=True):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)
        assert s.finish_reason == "length"
    assert engine.drafter is not None and engine.drafter.drafted > 0
    assert engine.pool.used == 0 and not engine.drafter.states  # everything given back


@pytest.mark.parametrize(("wrong_at", "per_round"), [(-1, 4), (2, 3), (0, 1)])
def test_drafts_the_model_would_choose_are_kept(monkeypatch, wrong_at, per_round):
    """Drafts equal to the model's choices are all accepted (k + 1 tokens a step); a wrong one ends the round there,
    and the model's own token replaces it: the output never changes, only the number of steps."""
    model = _model()
    prompts = _prompts([5, 11])
    params = SamplingParams(max_tokens=13, temperature=0.0)
    plain = _engine(model).generate(prompts, params)
    _oracle(monkeypatch, {tuple(p): o.token_ids for p, o in zip(prompts, plain, strict=True)}, wrong_at)
    engine = _engine(model, 3, drafts=3)
    steps = []
    engine.add(prompts[0], params)
    engine.add(prompts[1], params)
    while engine.has_work:
        steps.append(sum(len(d.token_ids) for d in engine.step() if d.request_id == "req-0"))
    got = [o.token_ids for o in plain]
    assert sum(steps) == 13
    # after the prompt's step (1 token), rounds of per_round tokens while at least 4 are left
    decoding = [n for n in steps if n][1:]
    assert decoding[: (12 - 3) // per_round] == [per_round] * ((12 - 3) // per_round), decoding
    assert engine.drafter is not None
    if wrong_at == 2:  # what the choice of k learns: depths 1 and 2 always kept, depth 3 never
        a = engine.drafter.acceptance
        assert a[0] > 0.8 and a[1] > 0.8 and a[2] < 0.5, a
    again = _engine(model, 3, drafts=3).generate(prompts, params)
    assert [o.token_ids for o in again] == got


def _spy(monkeypatch: pytest.MonkeyPatch, kind: type = MTPSpeculator) -> list[tuple[list[int], int, torch.Tensor]]:
    """Record the drafter's state at every drafting row's cur: (prompt, slot of cur, state (C,))."""
    seen: list[tuple[list[int], int, torch.Tensor]] = []
    catch_up = kind._catch_up

    def spy(self, rows):
        out = catch_up(self, rows)
        seen.extend((w.seq.request.prompt, w.start, o) for w, o in zip(rows, out, strict=True))
        return out

    monkeypatch.setattr(kind, "_catch_up", spy)
    return seen


def _training_mtp(model: llmkit.DecoderLM, ids: list[int]) -> torch.Tensor:
    """The training-time MTP forward over a whole text: row j reads h_j and token j + 1 (T - 1, C)."""
    tokens = torch.tensor([ids])
    T = tokens.shape[1]
    with torch.no_grad():
        h = model.run(tokens, whole_sequence(T, None, tokens.device))
        emb = model.inputs(model.embed, tokens[:, 1:], torch.arange(1, T)[None])
        rope = model.rope(torch.arange(T - 1)[None])
        return model.mtp[0](model.norm(h[:, :-1]), emb, AttentionInputs(AttentionMask(causal=True), rope))[0]


def test_drafts_read_what_the_training_time_mtp_forward_reads(monkeypatch):
    """The module's output at each step's cur, from its paged keys (caught up over prompt chunks and accepted
    drafts), equals the training-time MTP forward over the whole text at that position."""
    model = _model()
    prompt = _prompts([23])[0]  # two chunks of a 16-token step
    seen = _spy(monkeypatch)
    out = _engine(model, 2, drafts=2).generate([prompt], GREEDY)[0]
    full = _training_mtp(model, prompt + out.token_ids)
    assert len(seen) >= 3
    for _, slot, o in seen:  # slot n holds MTP position n - 1 (h_(n-1), token n)
        torch.testing.assert_close(o, full[slot - 1], atol=1e-4, rtol=1e-4)


def test_sampled_speculation_keeps_the_models_distribution():
    """The second token of 1,200 samples (drawn through a verified draft) against its exact distribution: the sum
    over the first token's choices of p(first) p(second | first), top-3 sampling at temperature 1.5. (No seed in the
    requests, which would keep them from drafting: the global generator, seeded here, seeds their streams.)"""
    model = _model()
    prompt = _prompts([6])[0]
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=3, n=40)
    engine = _engine(model, 1, drafts=1, max_batch=64)
    torch.manual_seed(5)
    outs = [o for _ in range(30) for o in engine.generate([prompt], params)]
    assert engine.drafter is not None and engine.drafter.drafted >= 1000
    from llmkit.generate.sampling import Sampling, distribution

    rule = Sampling(temperature=1.5, top_k=3)
    with torch.no_grad():
        first = distribution(model(torch.tensor([prompt]))[:, -1], rule)[0]  # (V,)
        choices = first.nonzero()[:, 0]
        rows = torch.tensor([[*prompt, int(t)] for t in choices])
        second = distribution(model(rows)[:, -1], rule)  # (3, V)
    expected = (first[choices, None] * second).sum(0)  # (V,)
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=256).float()
    tv = 0.5 * (counts / counts.sum() - expected).abs().sum()
    assert tv < 0.07, tv


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=1.5),
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11),
    ],
)
def test_rows_with_penalties_or_seeds_decode_plainly(params):
    """Penalties make a token's distribution depend on the drafts before it; a seed must give the tokens it gives
    without speculation: such rows take no drafts, and their output is the plain engine's."""
    model = _model()
    prompts = _prompts([4, 9])
    engine = _engine(model, 2, drafts=2)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [
        o.token_ids for o in _engine(model).generate(prompts, params)
    ]
    assert engine.drafter is not None and engine.drafter.drafted == 0


def test_logit_bias_applies_to_drafts_and_checks():
    """A bias that bans the model's favourite tokens changes the greedy output the same way with drafts as without."""
    model = _model()
    prompts = _prompts([5, 12])
    plain = _engine(model).generate(prompts, GREEDY)
    banned = tuple((t, -100.0) for t in {o.token_ids[2] for o in plain})
    params = dataclasses.replace(GREEDY, logit_bias=banned)
    expected = [o.token_ids for o in _engine(model).generate(prompts, params)]
    assert expected != [o.token_ids for o in plain]
    engine = _engine(model, 3, drafts=3)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.drafter is not None and engine.drafter.drafted > 0


def test_speculation_survives_preemption_and_shared_prefixes(monkeypatch):
    """A cache too small for every request: sequences are preempted and computed again (their MTP keys with them),
    prompts share cached blocks whose MTP keys other sequences wrote; the output is still the plain engine's."""
    model = _model()
    prompts = _prompts([5, 17, 3, 33, 8, 9, 10, 2], prefix=12)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = _engine(model).generate(prompts, params)
    outputs = {tuple(p): o.token_ids for p, o in zip(prompts, plain, strict=True)}
    _oracle(monkeypatch, outputs, wrong_at=2)
    seen = _spy(monkeypatch)
    engine = _engine(model, 3, blocks=30, drafts=3)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert engine.scheduler.preemptions > 0 and engine.scheduler.prefix.hit > 0
    assert engine.drafter is not None and engine.drafter.accepted > 0
    assert engine.pool.used == 0
    full = {p: _training_mtp(model, [*p, *out]) for p, out in outputs.items()}
    for prompt, slot, o in seen:  # the drafts themselves were the oracle's: the module's state is checked here
        torch.testing.assert_close(o, full[tuple(prompt)][slot - 1], atol=1e-4, rtol=1e-4)


def test_drafts_per_step_follow_the_measured_costs():
    """Where extra rows cost nearly nothing (a step bound by reading the weights) every sequence gets k drafts;
    where each row costs its arithmetic, none, unless the engine's own work per step outweighs it; and fewer as
    acceptance falls. The overhead is learnt from the steps that only decode."""
    model = _model()
    engine = _engine(model, 4)
    sp = engine.drafter
    assert sp is not None and sp.costs is not None and len(sp.costs.verifying) == len(Costs.ROWS)
    sp.costs = Costs(verifying=(1.0,) * 7, drafting=(0.01,) * 7)
    assert sp.drafts_for(1) == 4 and sp.drafts_for(16) == 4
    sp.costs = Costs(verifying=tuple(float(n) for n in Costs.ROWS), drafting=(0.0,) * 7)
    assert sp.drafts_for(16) == 0
    sp.costs.overhead = 40.0  # the engine's own work dwarfs the kernels: drafts pay again
    assert sp.drafts_for(16) >= 1
    sp.costs = Costs(verifying=tuple(1.0 + n / 8 for n in Costs.ROWS), drafting=(0.1,) * 7)
    many = sp.drafts_for(1)
    sp._kept = [1.0] * 4  # drafts mostly rejected lately
    sp._tried = [9.0] * 4
    assert many >= 2 and sp.drafts_for(1) < many
    assert Costs((1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0), (0.0,) * 7).verify(96) == 96.0  # extrapolated per row
    costs = sp.costs = Costs(verifying=(1.0,) * 7, drafting=(0.0,) * 7)
    rows = _prompts([3, 4])
    engine.drafter.drafts_for = lambda n: 0  # type: ignore[method-assign]
    for p in rows:
        engine.add(p, GREEDY)
    engine.step()  # the prompts (chunks): nothing learnt
    assert costs.overhead == 0.0
    sp.timed(0.0)
    sp.propose([], engine.scheduler.kv.allocate, 100)
    # as propose leaves a step whose verifying rows cost 1 s by `costs`, whose drafting took 0.5 s where its
    # chained drafts' timings say 0.25 s
    sp._kernels = (1.0, 0.5, 0.25)
    sp.timed(3.0)
    assert costs.overhead == pytest.approx(0.15)  # 0.9 * 0 + 0.1 * (3 - 1 - 0.5)
    assert costs.draft_scale == pytest.approx(1.1)  # 0.9 * 1 + 0.1 * (0.5 / 0.25)
    assert costs.step(4, 2) == pytest.approx(0.15 + 1.0 + 2 * 0.0 * 1.1)


def test_speculation_needs_an_mtp_module_and_the_cpp_step():
    torch.manual_seed(0)
    plain = llmkit.build_model(llmkit.get_preset("llama2-7b-tiny")).eval()
    with pytest.raises(InputError, match="multi-token-prediction"):
        Engine(plain, None, EngineConfig(kv_memory=1 << 22, draft_tokens=2))
    half = _model().to(torch.bfloat16)
    with pytest.raises(InputError, match="C\\+\\+ decode step"):
        Engine(half, None, EngineConfig(kv_memory=1 << 22, draft_tokens=2))
    with pytest.raises(InputError, match="draft_tokens"):
        EngineConfig(draft_tokens=-1)


def test_openai_client_gets_the_plain_servers_text(monkeypatch, smollm2):
    """Through the openai client: completions (streamed, several tokens an event when drafts are kept) and chat give
    the plain server's greedy text; usage counts every token."""
    openai = pytest.importorskip("openai")
    from llmkit.serve.server import ServeOptions, Server

    model = _model(vocab_size=smollm2[0].cfg.vocab_size)
    tok = smollm2[1]
    ids = tok.encode("Once upon a time there was")
    params = SamplingParams(max_tokens=14, temperature=0.0)
    expected = Engine(model, tok, EngineConfig(kv_memory=64 << 20)).generate([ids], params)[0].token_ids
    _oracle(monkeypatch, {tuple(ids): expected}, wrong_at=2)
    texts = []
    for k in (0, 3):
        with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20, draft_tokens=k)) as server:
            if k:
                server.engine.drafter.drafts_for = lambda rows: 3  # type: ignore[union-attr]
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            chunks = list(
                c.completions.create(
                    model="m",
                    prompt=ids,
                    max_tokens=14,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            events = [ch for ch in chunks if ch.choices and ch.choices[0].text]
            assert chunks[-1].usage.completion_tokens == 14
            chat = c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0
            )
            texts.append(("".join(ch.choices[0].text for ch in events), chat.choices[0].message.content))
            if k:
                assert len(events) < 14  # rounds of several tokens arrived as one event each
                speculator = server.engine.drafter
                assert speculator is not None and speculator.accepted > 0
                with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
                    metrics = r.read().decode()
                assert f"llmkit_spec_accepted_tokens_total {float(speculator.accepted)}" in metrics
                assert f"llmkit_spec_draft_tokens_total {float(speculator.drafted)}" in metrics
    assert texts[0] == texts[1]
    assert texts[0][0] == tok.decode(expected)


def test_a_failing_draft_only_costs_its_step_the_drafts(monkeypatch, caplog):
    """Drafting is an optimisation: when it raises (a kernel refusing a shape, memory), the step decodes without
    drafts, every request still gets the plain engine's tokens, and the next steps draft again."""
    model = _model()
    prompts = _prompts([4, 9, 13])
    plain = _engine(model).generate(prompts, GREEDY)
    catch_up, calls = MTPSpeculator._catch_up, []

    def flaky(self, rows):
        calls.append(len(rows))
        if len(calls) % 3 == 1:
            raise RuntimeError("no room for the draft")
        return catch_up(self, rows)

    monkeypatch.setattr(MTPSpeculator, "_catch_up", flaky)
    engine = _engine(model, 2, drafts=2)
    with caplog.at_level("WARNING", logger="llmkit.serve"):
        out = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert "drafting failed (RuntimeError: no room for the draft)" in caplog.text
    assert engine.drafter is not None and engine.drafter.drafted > 0 and len(calls) > 3


def test_poisoned_sampling_settings_end_no_speculating_stream(smollm2):
    """The reliability suite's settings that once gave NaN probabilities (top_p 1e-300, temperature 5e-324, ...),
    batched with greedy streams on a server that drafts every step: each gets its tokens, the streams keep the plain
    engine's text, nothing fails."""
    from llmkit.serve.server import ServeOptions, Server

    from .conftest import Stepper, post, wait_for
    from .test_reliability import POISON, _events, _stream

    model, tok = _model(vocab_size=smollm2[0].cfg.vocab_size), smollm2[1]
    ids = tok.encode("Once upon a time")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = tok.decode(Engine(model, tok, EngineConfig(kv_memory=64 << 20)).generate([ids], params)[0].token_ids)
    with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=64 << 20, draft_tokens=2)) as server:
        speculator = server.engine.drafter
        assert speculator is not None
        speculator.drafts_for = lambda rows: 2  # type: ignore[method-assign]
        stepper = Stepper(server.engine)
        streams: dict[int, str] = {}
        answers: dict[int, tuple[int, object]] = {}
        body = {"model": "m", "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        threads = [threading.Thread(target=_stream, args=(server, body, streams, i)) for i in range(2)]

        def poisoned(i: int) -> None:
            request = {"model": "m", "prompt": "hi", "max_tokens": 8, **POISON[i]}
            answers[i] = post(server.url + "/v1/completions", request)

        threads += [threading.Thread(target=poisoned, args=(i,)) for i in range(len(POISON))]
        for t in threads:
            t.start()
        wait_for(lambda: server.loop.in_flight == 2 + len(POISON), what="all requests submitted")
        stepper.release()
        for t in threads:
            t.join(120)
        for i in range(2):
            events = _events(streams[i])
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), streams[i]
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
        for i, (code, answer) in answers.items():
            assert code == 200, (POISON[i], answer)
            assert answer["usage"]["completion_tokens"] == 8
        assert server.engine.stats.failed == 0 and speculator.drafted > 0


# ---- a smaller model as the drafter (drafters.ModelSpeculator)


def _drafted_engine(model: llmkit.DecoderLM, draft: llmkit.DecoderLM, k: int, blocks: int = 400) -> Engine:
    per_block = PagedCache.bytes_per_block(model, 4, torch.float32) + PagedCache.bytes_per_block(
        draft, 4, torch.float32
    )
    config = EngineConfig(kv_memory=per_block * blocks, block_size=4, step_tokens=16, draft_tokens=k)
    engine = Engine(model, None, config, draft=draft)
    assert isinstance(engine.drafter, ModelSpeculator) and engine.pool.n_blocks == blocks
    engine.drafter.drafts_for = lambda rows: k  # type: ignore[method-assign]
    return engine


def test_a_draft_model_gives_the_plain_servers_greedy_output():
    """A weak draft (one layer, other weights) and the model itself as its own draft: the output is the plain
    engine's; the model drafting for itself is always right, so every step yields k + 1 tokens."""
    model = _model()
    prompts = _prompts([1, 3, 9, 17, 30])
    plain = [o.token_ids for o in _engine(model).generate(prompts, GREEDY)]
    weak = _model(seed=1, n_layers=1, mtp_depth=0)
    engine = _drafted_engine(model, weak, 3)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain
    assert engine.drafter is not None and engine.drafter.drafted > 0
    itself = _drafted_engine(model, _model(), 3)
    assert [o.token_ids for o in itself.generate(prompts, GREEDY)] == plain
    sp = itself.drafter
    assert sp is not None and sp.drafted > 0 and sp.accepted == sp.drafted
    assert itself.pool.used == 0 and not sp.states


def test_a_draft_models_state_survives_preemption_and_shared_prefixes(monkeypatch):
    """Preempted and prefix-sharing sequences: the draft's state at each cur equals its own forward over the whole
    text, and the output is the plain engine's."""
    model = _model()
    draft = _model(seed=2, n_layers=2, mtp_depth=0)
    prompts = _prompts([5, 17, 3, 33, 8, 9, 10, 2], prefix=12)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = {tuple(p): o.token_ids for p, o in zip(prompts, _engine(model).generate(prompts, params), strict=True)}
    seen = _spy(monkeypatch, ModelSpeculator)
    engine = _drafted_engine(model, draft, 3, blocks=30)
    assert [o.token_ids for o in engine.generate(prompts, params)] == list(plain.values())
    assert engine.scheduler.preemptions > 0 and engine.scheduler.prefix.hit > 0
    for prompt, slot, out in seen:
        tokens = torch.tensor([[*prompt, *plain[tuple(prompt)]]])
        with torch.no_grad():
            full = draft.run(tokens, whole_sequence(tokens.shape[1], None, tokens.device))[0]  # last-block states
        torch.testing.assert_close(out, full[slot], atol=1e-4, rtol=1e-4)


def test_a_draft_model_must_share_the_vocabulary():
    model = _model()
    with pytest.raises(InputError, match="vocabulary"):
        Engine(model, None, EngineConfig(kv_memory=1 << 22, draft_tokens=2), draft=_model(vocab_size=300))


def test_a_draft_model_on_the_gpu_runner_gives_the_plain_output(monkeypatch):
    """The GPU's runner as the engine's and as the draft's: drafts verified as rows of 1 + k queries in the step's
    packed forward; the greedy output is the plain engine's on the same runner, and the model drafting for itself
    keeps every draft. (Its attention here is the kernel's reference, which tests/kernel_tests and test_model_runner
    check the kernel against: interpreted, the speculator's cost measurements take minutes.)"""
    import llmkit.serve.engine as engine_module

    monkeypatch.setattr(engine_module, "model_runner", lambda m, c, bs, *_: KernelRunner(m, c, bs, kernel=False))
    model = _model()
    prompts = _prompts([1, 3, 9, 17])
    plain = [o.token_ids for o in _engine(model).generate(prompts, GREEDY)]
    engine = _drafted_engine(model, _model(seed=1, n_layers=1, mtp_depth=0), 3)
    assert isinstance(engine.runner, KernelRunner) and isinstance(engine.drafter, ModelSpeculator)
    assert isinstance(engine.drafter.runner, KernelRunner)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain
    itself = _drafted_engine(model, _model(), 3)
    assert [o.token_ids for o in itself.generate(prompts, GREEDY)] == plain
    assert itself.drafter is not None and itself.drafter.accepted == itself.drafter.drafted > 0


@pytest.mark.parametrize("k", [1, 3])
def test_the_mtp_module_on_the_gpu_runner_gives_the_plain_output(monkeypatch, k):
    """The MTP module drafting beside the GPU's runner (its block as one-query rows of the paged-attention kernel
    over its own pool, its keys from slot 1), drafts verified in the step's packed forward: greedy tokens and their
    log-probabilities are the plain engine's on the same runner, with preemption and shared prefixes."""
    import llmkit.serve.engine as engine_module

    monkeypatch.setattr(engine_module, "model_runner", lambda m, c, bs, *_: KernelRunner(m, c, bs, kernel=False))
    model = _model()
    prompts = _prompts([1, 3, 9, 17, 30], prefix=8)
    plain = _engine(model, blocks=24).generate(prompts, GREEDY)
    engine = _engine(model, k, blocks=24, drafts=k)
    assert isinstance(engine.drafter, MTPSpeculator) and engine.drafter.native is None
    spec = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain, strict=True):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)
    assert engine.drafter.drafted > 0 and engine.scheduler.preemptions > 0


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "deepseek-v3.2-tiny"])
def test_a_latent_attention_mtp_module_on_the_gpu_runner_gives_the_plain_output(monkeypatch, preset):
    """DeepSeek's own MTP module (its block with latent attention, and with sparse attention's top-k keys) drafting
    beside the GPU's runner over a latent pool of its own (keys from slot 1): the plain engine's greedy tokens, and
    the module's state at each drafting step equals the training-time MTP forward over the whole text."""
    import llmkit.serve.engine as engine_module

    monkeypatch.setattr(engine_module, "model_runner", lambda m, c, bs, *_: KernelRunner(m, c, bs, kernel=False))
    cfg = llmkit.get_preset(preset)
    moe = dataclasses.replace(cfg.moe, capacity_factor=None)  # capacity would couple a step's tokens
    torch.manual_seed(0)
    model = llmkit.build_model(dataclasses.replace(cfg, mtp_depth=1, moe=moe)).eval()
    prompts = _prompts([1, 3, 9, 17], prefix=8)
    plain = _engine(model).generate(prompts, GREEDY)
    engine = _engine(model, 2, drafts=2)
    assert isinstance(engine.drafter, MTPSpeculator) and isinstance(engine.drafter.pool, LatentPool)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert engine.drafter.drafted > 0
    seen = _spy(monkeypatch)
    out = _engine(model, 2, drafts=2).generate([prompts[3]], GREEDY)[0]  # 25 tokens: past the top-k of 8
    full = _training_mtp(model, prompts[3] + out.token_ids)
    assert len(seen) >= 3
    for _, slot, o in seen:
        torch.testing.assert_close(o, full[slot - 1], atol=1e-4, rtol=1e-4)


def test_mtp_states_on_the_gpu_runner_equal_the_cpp_steps():
    """The module's block as kernel rows computes what its C++ step computes: the same drafts' logits at each
    step, from the same keys (one engine of each, the same requests)."""
    model = _model()
    prompts = _prompts([5, 12])
    outs = {}
    for name in ("cpp", "kernel"):
        engine = _engine(model, 2, drafts=2)
        if name == "kernel":
            engine.runner = KernelRunner(model, engine.cache, 4, kernel=False)
            engine.drafter = MTPSpeculator(model, engine.runner, engine.scheduler.kv, 2)
            engine.drafter.drafts_for = lambda rows: 2  # type: ignore[method-assign]
            engine.processor.drafter = engine.drafter
        heads = []
        real = engine.drafter.head
        engine.drafter.head = lambda out, real=real, heads=heads: heads.append(real(out)) or heads[-1]  # type: ignore[method-assign]
        engine.generate(prompts, GREEDY)
        outs[name] = heads
    assert len(outs["cpp"]) == len(outs["kernel"]) > 0
    for a, b in zip(outs["cpp"], outs["kernel"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
