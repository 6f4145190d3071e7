"""The serving engine against the plain decoding path: paged cache = contiguous cache, prefix hits = misses,
preemption loses nothing, a request's output does not depend on what else is in the batch."""

from __future__ import annotations

import pytest
import torch

import llmkit
from llmkit.config.presets import PRESETS
from llmkit.errors import InputError
from llmkit.generate import generate
from llmkit.kernels import triton_usable
from llmkit.serve.blocks import BlockPool
from llmkit.serve.engine import Engine, EngineConfig, QueueFull
from llmkit.serve.kernel_runner import KernelRunner
from llmkit.serve.model_runner import TorchRunner
from llmkit.serve.paged import PagedCache
from llmkit.serve.request import Completion, SamplingParams
from llmkit.serve.text import TextStops

DECODERS = [n for n, p in PRESETS.items() if n.endswith("-tiny") and p.config.encoder is None]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def _model(name: str) -> llmkit.DecoderLM:
    torch.manual_seed(0)
    return llmkit.build_model(llmkit.get_preset(name)).eval()


def _prompts(model: llmkit.DecoderLM, lengths: list[int], prefix: int = 0, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    shared = torch.randint(0, V, (prefix,), generator=g).tolist()
    return [shared + torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def _completions(engine: Engine, ids: list[str]) -> list[Completion]:
    """Step the engine until it has no work; each request's completion."""
    deltas: dict[str, list] = {i: [] for i in ids}
    while engine.has_work:
        for d in engine.step():
            deltas[d.request_id].append(d)
    return [Completion.of(deltas[i]) for i in ids]


def _engine(model: llmkit.DecoderLM, blocks: int = 400, **kw: object) -> Engine:
    per_block = PagedCache.bytes_per_block(model, 4, torch.float32)
    return Engine(model, None, EngineConfig(kv_memory=per_block * blocks, block_size=4, step_tokens=16, **kw))


def _reference(model: llmkit.DecoderLM, prompt: list[int], n: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), max_new_tokens=n).tokens[0, len(prompt) :].tolist()


def _assert_pool_empty(engine: Engine) -> None:
    assert engine.pool.used == 0 and not any(engine.pool.refs)
    assert not engine.has_work and not engine.requests


@pytest.mark.parametrize("name", DECODERS)
def test_paged_cache_gives_the_logits_of_the_contiguous_cache(name):
    """Every attention variant (MHA/GQA/MQA, sliding window, MLA, sparse attention, MoE): the engine's greedy tokens
    are the ones `generate` picks with its contiguous cache, and the log-probabilities it reports are those of
    one uncached forward over the whole sequence."""
    model = _model(name)
    prompts = _prompts(model, [5, 17, 30, 3, 9])
    outs = _engine(model).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _reference(model, prompt, 10)
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(full)[0, len(prompt) - 1 : -1].float(), -1)
        expected = lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)
        assert out.finish_reason == "length"


# learned positions and MHA; GQA; windows and soft caps; latent attention; sparse attention; mixture of experts
@pytest.mark.parametrize(
    "name",
    ["gpt2-tiny", "llama2-70b-tiny", "gemma2-2b-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny", "mixtral-8x7b-tiny"],
)
def test_the_gpu_runner_gives_the_tokens_of_generate(name):
    """The GPU's runner (every row in one forward, attention by the Triton kernel: interpreted here) in the engine,
    with prefix-cache hits and preemption: each request's greedy tokens are `generate`'s."""
    model = _model(name)
    if not triton_usable(model.device):
        pytest.skip("Triton is not installed")
    prompts = _prompts(model, [5, 17, 30, 3, 9], prefix=8)
    engine = _engine(model, blocks=24)
    engine.runner = KernelRunner(model, engine.cache, engine.pool.block_size)
    expected = [_reference(model, p, 10) for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert engine.scheduler.preemptions > 0  # 24 blocks of 4 slots for five rows of up to 48 tokens
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected  # prefix hits now
    assert engine.scheduler.prefix.hit > 0
    _assert_pool_empty(engine)


def test_a_high_priority_request_is_admitted_while_low_priority_ones_wait():
    """Two low-priority requests fill a batch of 2 and a third waits; a high-priority one arrives and runs at once
    (one of the low ones gives it its place); every request's greedy tokens are still `generate`'s."""
    model = _model("llama2-7b-tiny")
    prompts = _prompts(model, [5, 9, 7, 6])
    engine = _engine(model, max_batch=2)
    low = [engine.add(p, SamplingParams(max_tokens=12, temperature=0.0, priority=1)) for p in prompts[:3]]
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)

    step()
    step()
    high = engine.add(prompts[3], SamplingParams(max_tokens=12, temperature=0.0, priority=-1))
    step()
    running = {seq.request.id for seq in engine.scheduler.running}
    assert high in running and tokens.get(high) and len(running) == 2  # admitted in the step after it arrived
    assert {seq.request.id for seq in engine.scheduler.waiting} & set(low)  # while low-priority ones wait
    while engine.has_work:
        step()
    for prompt, request in zip(prompts, [*low, high], strict=True):
        assert tokens[request] == _reference(model, prompt, 12)
    _assert_pool_empty(engine)


def test_the_batch_invariant_gpu_runner_answers_each_request_as_alone():
    """The GPU runner in its batch-invariant mode (interpreted here), in the engine: six sampled requests run
    together, their prompts cut into chunks beside each other's decoding rows, each get the tokens and
    log-probabilities they get alone, bit for bit."""
    model = _model("llama2-70b-tiny")
    if not triton_usable(model.device):
        pytest.skip("Triton is not installed")
    prompts = _prompts(model, [5, 23, 30, 3, 9, 14])
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3)

    def engine() -> Engine:
        e = _engine(model)
        e.runner = KernelRunner(model, e.cache, e.pool.block_size, invariant=True)
        return e

    together, one_by_one = engine().generate(prompts, params), engine()
    for prompt, out in zip(prompts, together, strict=True):
        alone = one_by_one.generate([prompt], params)[0]  # (its own batch: generate runs it to the end)
        assert (alone.token_ids, alone.logprobs) == (out.token_ids, out.logprobs)


@pytest.mark.parametrize("name", ["llama2-70b-tiny", "deepseek-v3.2-tiny"])
def test_prefix_cache_hits_give_the_output_of_misses(name):
    model = _model(name)
    prompts = _prompts(model, [5, 17, 3, 9, 12], prefix=24)
    cold = _engine(model, prefix_caching=False).generate(prompts, GREEDY)
    engine = _engine(model)
    engine.generate(prompts[:1], GREEDY)  # the shared prefix is cached now
    warm = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert engine.scheduler.prefix.hit >= 5 * (24 // 4)  # every prompt found the whole shared prefix
    _assert_pool_empty(engine)


def test_tiny_memory_preempts_and_still_completes_every_request():
    model = _model("llama2-70b-tiny")
    prompts = _prompts(model, [5, 17, 40, 3, 33, 8, 9, 10], prefix=12)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    engine = _engine(model, blocks=25)  # one request needs up to 21 blocks
    outs = engine.generate(prompts, params)
    assert engine.scheduler.preemptions > 0
    assert [o.token_ids for o in outs] == [_reference(model, p, 30) for p in prompts]
    _assert_pool_empty(engine)


def test_requests_joining_at_different_steps_equal_their_single_outputs():
    """16 requests of mixed lengths and settings, added while others run: each equals its run alone (greedy and
    seeded sampling; fp32 batched rows round like single rows here, so tokens are compared exactly)."""
    model = _model("llama2-7b-tiny")
    prompts = _prompts(model, [3 + (7 * i) % 29 for i in range(16)])
    settings = [
        SamplingParams(max_tokens=4 + i % 9, temperature=0.0 if i % 2 else 0.8, top_k=20, seed=i) for i in range(16)
    ]
    alone = [_engine(model).generate([p], s)[0].token_ids for p, s in zip(prompts, settings, strict=True)]
    engine = _engine(model)
    got: dict[str, list[int]] = {}
    ids: list[str] = []
    for i, (p, s) in enumerate(zip(prompts, settings, strict=True)):
        ids.append(engine.add(p, s))
        for _ in range(i % 3):  # later requests join a batch that is already decoding
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
    while engine.has_work:
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    assert [got[i] for i in ids] == alone
    _assert_pool_empty(engine)


def test_n_choices_and_seeds():
    model = _model("llama2-7b-tiny")
    prompt = _prompts(model, [6])[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3)
    a = _engine(model).generate([prompt], params)
    b = _engine(model).generate([prompt], params)
    assert [o.index for o in a] == [0, 1, 2]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # a seed makes sampling repeatable
    assert len({tuple(o.token_ids) for o in a}) > 1  # the n choices are seeded apart


def test_abort_and_bad_requests():
    model = _model("llama2-7b-tiny")
    engine = _engine(model, max_queue=2, max_batch=1)
    with pytest.raises(InputError, match="empty"):
        engine.add([], GREEDY)
    with pytest.raises(InputError, match="context"):
        engine.add([1, 2], SamplingParams(max_tokens=model.max_seq_len))
    with pytest.raises(InputError, match=r"\[0, "):
        engine.add([model.cfg.vocab_size], GREEDY)
    first = engine.add([1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    engine.add([4, 5], GREEDY)
    engine.add([6, 7], GREEDY)
    with pytest.raises(QueueFull):
        engine.add([8, 9], GREEDY)
    engine.abort(first)
    while engine.has_work:
        engine.step()
    _assert_pool_empty(engine)


def test_stop_strings_across_pieces():
    stops = TextStops(["\n\n", "END"])
    out, held, stopped = stops.release("hello\n")
    assert (out, held, stopped) == ("hello", "\n", None)  # may be the start of "\n\n": held back
    assert stops.release(held + "\nworld") == ("", "", "\n\n")  # the caller passes what it held plus the new piece
    assert stops.release("the EN") == ("the ", "EN", None)
    assert stops.release("ENDING") == ("", "", "END")
    assert stops.release("a END b\n\n") == ("a ", "", "END")  # the stop string that occurs first, not first given
    assert stops.release("the EN", final=True) == ("the EN", "", None)
    assert TextStops([]).release("a\n") == ("a\n", "", None)


def test_block_pool_shares_and_evicts_least_recently_used():
    pool = BlockPool(n_blocks=3, block_size=2)
    a, b = pool.allocate(), pool.allocate()
    assert a is not None and b is not None
    from llmkit.serve.blocks import block_digest

    d1 = block_digest(b"", [1, 2])
    d2 = block_digest(d1, [3, 4])
    pool.register(a, d1)
    pool.register(b, d2)
    pool.release([a, b])  # both idle, still cached
    assert pool.free == 3
    found, digest = pool.match([1, 2, 3, 4, 5], limit=4)
    assert found == [a, b] and digest == d2 and pool.refs[a] == pool.refs[b] == 1
    assert pool.match([1, 2, 9, 9], limit=3)[0] == [a]  # a second user of the first block
    pool.release([a, b, a])
    c, d, e = pool.allocate(), pool.allocate(), pool.allocate()  # the fresh block first, then the oldest idle
    assert {c, d, e} == {0, 1, 2} and pool.allocate() is None
    assert pool.match([1, 2, 3, 4], limit=4)[0] == []  # evicted blocks no longer match


def test_logit_bias_and_penalties():
    model = _model("llama2-7b-tiny")
    prompt = _prompts(model, [6])[0]
    forced = _engine(model).generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, logit_bias=((42, 100.0),)))
    assert forced[0].token_ids == [42] * 5
    free = _engine(model).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids
    banned = (
        _engine(model)
        .generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((free[0], -100.0),)))[0]
        .token_ids
    )
    assert free[0] not in banned
    fresh = _engine(model).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=2.0))
    assert len(set(fresh[0].token_ids)) >= len(set(free))  # penalised repeats: at least as many distinct tokens
    with pytest.raises(InputError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 500.0),))


def test_fail_ends_every_request_and_frees_the_pool():
    model = _model("llama2-7b-tiny")
    engine = _engine(model)
    for p in _prompts(model, [5, 9, 30]):
        engine.add(p, SamplingParams(max_tokens=20, temperature=0.0, n=2))
    engine.step()
    deltas = engine.fail()
    assert len(deltas) == 6 and {d.finish_reason for d in deltas} == {"error"}
    _assert_pool_empty(engine)
    assert engine.generate(_prompts(model, [4]), GREEDY)[0].finish_reason == "length"  # still usable


def test_non_finite_logits_end_only_that_sequence():
    """NaN (or +inf) logits end their sequence with finish reason "error"; the rest of the batch is untouched, and a
    -inf logit (a token masked on purpose) is not an error."""
    model = _model("llama2-7b-tiny")
    engine = _engine(model)
    real = engine.runner.forward
    prompts = [[7, 1, 2, 9], [8, 1, 2, 9]]
    bad_id, good_id = (engine.add(p, GREEDY) for p in prompts)

    def forward(rows):
        out = real(rows)
        for r, x in zip(rows, out.logits, strict=True):
            x[3] = float("nan") if r.request == bad_id else float("-inf")
        return out

    engine.runner.forward = forward
    bad, good = _completions(engine, [bad_id, good_id])
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert good.finish_reason == "length" and len(good.token_ids) == 10 and 3 not in good.token_ids
    assert engine.stats.failed == 1
    _assert_pool_empty(engine)


# learned positions and MHA; GQA; soft-capped scores and sliding windows; qk-norm; mixture of experts
@pytest.mark.parametrize(
    "name", ["gpt2-tiny", "llama2-70b-tiny", "gemma2-2b-tiny", "qwen3-0.6b-tiny", "mixtral-8x7b-tiny"]
)
def test_one_forward_per_step_over_rows_of_every_length(name, monkeypatch):
    """Decoding rows and prompt chunks of different lengths go through the model as one packed row per step, and
    give what a forward per row length gives: the same greedy tokens and log-probabilities."""
    model = _model(name)
    prompts = _prompts(model, [5, 17, 30, 3, 9])
    real_run = model.run
    assert Engine(model, None, EngineConfig(kv_memory=1 << 22)).runner.packs

    def run(packs: bool) -> tuple[list, int, int]:
        engine = _engine(model)
        engine.runner = TorchRunner(model, engine.cache, engine.pool.block_size)  # every row through PyTorch
        engine.runner.packs = packs
        calls = {"n": 0}

        def counting(*args, **kwargs):
            calls["n"] += 1
            return real_run(*args, **kwargs)

        monkeypatch.setattr(model, "run", counting)
        outs = engine.generate(prompts, GREEDY)
        monkeypatch.setattr(model, "run", real_run)
        return outs, calls["n"], engine.stats.steps

    packed, packed_calls, steps = run(True)
    grouped, grouped_calls, _ = run(False)
    assert packed_calls == steps < grouped_calls
    for a, b in zip(packed, grouped, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama2-70b-tiny", "deepseek-v3-tiny"])
def test_prompt_and_token_logprobs_are_the_models_own(name):
    """Each prompt token's log-probability (and its top alternatives) is what one uncached forward gives, whatever
    the chunking, the batch and the prefix cache (a shared prefix is computed again, not reused); the generated
    tokens' alternatives are the model's too, best first, and greedy picks the best. max_tokens 0 gives only the
    prompt's."""
    model = _model(name)
    prompts = _prompts(model, [5, 17, 30, 1], prefix=8)
    asked = SamplingParams(max_tokens=4, temperature=0.0, top_logprobs=3, prompt_logprobs=2)
    engine = _engine(model)
    engine.generate(prompts[:1], GREEDY)  # puts the shared prefix in the cache
    outs = engine.generate(prompts, asked)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt + out.token_ids]))[0].float(), -1)  # (L, V)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry is not None
            value, top = entry
            assert value == pytest.approx(lp[i - 1, prompt[i]].item(), abs=1e-4)
            best = lp[i - 1].topk(2)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4)
        for j, (token, top) in enumerate(zip(out.token_ids, out.top_logprobs, strict=True)):
            row = lp[len(prompt) - 1 + j]
            assert len(top) == 3 and top[0][0] == token == row.argmax().item()
            assert [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    only_prompt = engine.generate(prompts[1:2], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert only_prompt.token_ids == [] and only_prompt.finish_reason == "length"
    assert only_prompt.prompt_logprobs is not None
    assert (
        [e[0] for e in only_prompt.prompt_logprobs[1:]]
        == pytest.approx(  # type: ignore[index]
            [e[0] for e in outs[1].prompt_logprobs[1:]],
            abs=1e-5,  # type: ignore[index, union-attr]
        )
    )
    _assert_pool_empty(engine)


def test_in_the_batch_invariant_mode_a_text_scored_as_a_prompt_has_the_bits_it_was_generated_with():
    """Sampled completions of prompts of different lengths, then the whole texts scored together as prompts
    (prompt_logprobs, max_tokens 0): every generated token's log-probability is the same float. This is what makes
    a rollout's log-probabilities the trainer's (llmkit.train.grpo)."""
    from llmkit.serve.model_runner import InvariantRunner

    model = _model("llama2-7b-tiny")
    engine = _engine(model, batch_invariant=True)
    if not isinstance(engine.runner, InvariantRunner):
        pytest.skip("llmkit's C++ step is not available here")
    prompts = _prompts(model, [3, 9, 20], prefix=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, n=2, seed=3))
    texts = [prompts[k // 2] + out.token_ids for k, out in enumerate(outs)]
    scored = engine.generate(texts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    for k, (out, score) in enumerate(zip(outs, scored, strict=True)):
        assert score.prompt_logprobs is not None
        start = len(prompts[k // 2])
        again = [entry[0] for entry in score.prompt_logprobs[start:] if entry is not None]
        assert again == out.logprobs, k


def test_tempered_logprobs_are_those_of_the_distribution_sampled_from():
    """With tempered_logprobs a sampled token's log-probability, and a prompt token's, is log-softmax of the logits
    over the temperature (the model's own without it); settings that change the distribution otherwise are refused."""
    model = _model("llama2-7b-tiny")
    engine = _engine(model)
    prompt = _prompts(model, [7])[0]
    asked = SamplingParams(max_tokens=5, temperature=0.5, seed=2, prompt_logprobs=0, tempered_logprobs=True)
    out = engine.generate([prompt], asked)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids]))[0].float()  # (L, V)
    tempered, raw = torch.log_softmax(logits / 0.5, -1), torch.log_softmax(logits, -1)
    for j, (token, value) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert value == pytest.approx(tempered[len(prompt) - 1 + j, token].item(), abs=1e-4)
        assert abs(value - raw[len(prompt) - 1 + j, token].item()) > 1e-3
    assert out.prompt_logprobs is not None
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and entry[0] == pytest.approx(tempered[i - 1, prompt[i]].item(), abs=1e-4)
    for bad in ({"temperature": 0.0}, {"top_p": 0.9}, {"top_k": 5}, {"presence_penalty": 0.5}):
        with pytest.raises(InputError, match="tempered_logprobs"):
            SamplingParams(tempered_logprobs=True, **bad)


def test_generate_takes_more_prompts_than_the_queue_holds():
    """Engine.generate admits prompts as the queue has room (it raised QueueFull past max_queue sequences): ten
    prompts of two greedy completions each through a queue of four, in order, each what it gets alone."""
    model = _model("llama2-7b-tiny")
    prompts = _prompts(model, [3, 5, 8, 4, 6, 9, 2, 7, 5, 3])
    engine = _engine(model, max_queue=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, n=2))
    assert [o.token_ids for o in outs] == [_reference(model, p, 4) for p in prompts for _ in range(2)]
    _assert_pool_empty(engine)
