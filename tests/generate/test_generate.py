import pytest
import torch

from llmkit import InputError, build_model, get_preset
from llmkit.generate import CompiledStep, filter_logits, generate, next_token, pad_prompts, stream


@pytest.fixture(scope="module")
def model():
    return build_model(get_preset("llama2-7b-tiny")).eval()


def test_greedy_equals_argmax_of_full_forward(model):
    prompt = [3, 14, 15, 92, 65]
    out = generate(model, [prompt], max_new_tokens=8)
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.tokens.tolist() == seq.tolist()
    assert out.new_tokens[0] == seq[0, 5:].tolist()


def test_prompts_of_different_lengths_are_left_padded(model):
    tokens, mask = pad_prompts([[1, 2, 3], [4]])
    assert tokens.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[True] * 3, [False, False, True]]
    batched = generate(model, [[1, 2, 3], [4]], max_new_tokens=5)
    assert batched.new_tokens[1] == generate(model, [[4]], max_new_tokens=5).new_tokens[0]


def test_eos_stops_each_row(model):
    first = generate(model, [[7, 8, 9]], max_new_tokens=6).new_tokens[0]
    eos = first[2]
    out = generate(model, [[7, 8, 9]], max_new_tokens=6, eos_id=eos)
    assert out.new_tokens[0] == first[: first.index(eos) + 1]


def test_sampling_is_reproducible_with_a_seed(model):
    a = generate(model, [[1, 2]], max_new_tokens=10, temperature=1.0, seed=3).tokens
    b = generate(model, [[1, 2]], max_new_tokens=10, temperature=1.0, seed=3).tokens
    c = generate(model, [[1, 2]], max_new_tokens=10, temperature=1.0, seed=4).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_generating_keeps_freed_buffers_in_the_heap(model, monkeypatch):
    """generate and stream reuse a prompt's freed activations (perf.tune_allocator), as training and the server do:
    with glibc's defaults a 512-token prefill of a 1.5B model faulted 2.3 GiB of fresh pages in."""
    calls = []
    monkeypatch.setattr("llmkit.generate.decode.tune_allocator", lambda: calls.append(1) or True)
    generate(model, [[1, 2]], max_new_tokens=2)
    list(stream(model, [[1, 2]], max_new_tokens=2))
    assert calls == [1, 1]


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    # top-p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token is still needed; the rest are cut
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).tolist() == [[True, False, False, False, False]]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(logits, 1.0, top_k=2, generator=g) for _ in range(200)])
    assert set(draws.flatten().tolist()) == {0, 1}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(prompts=[[]], max_new_tokens=3), "a prompt is empty"),
        (dict(prompts=[[1]], max_new_tokens=-1), "max_new_tokens=-1 must be an int >= 0"),
        (dict(prompts=[[1]], max_new_tokens=3, temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (dict(prompts=[[1]], max_new_tokens=3, top_k=0), "top_k=0 must be >= 1"),
        (dict(prompts=[[1]], max_new_tokens=3, top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        (dict(prompts=[[1] * 250], max_new_tokens=10), "exceeds the model's context position.max_seq_len=256"),
        (dict(prompts=[[999]], max_new_tokens=1), "contains id 999, outside the vocabulary"),
    ],
)
def test_bad_arguments(model, kwargs, fragment):
    with pytest.raises(InputError) as e:
        generate(model, **kwargs)
    assert fragment in str(e.value)


def test_min_p_and_repetition_penalty():
    from llmkit.generate.sampling import Sampling, distribution, penalize_repetition

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, min_p=0.4)  # keep tokens with p >= 0.4 * 0.5 = 0.2
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    raw = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    out = penalize_repetition(raw, torch.tensor([[0, 1, -1]]), 2.0)  # tokens 0 and 1 seen; -1 is padding
    assert out.tolist() == [[1.0, -2.0, 3.0, 0.5]]
    probs = distribution(raw, Sampling(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))
    assert (probs[0, [1, 3]] == 0).all()


def test_repetition_penalty_changes_greedy_output(model):
    """A strong penalty leaves only unseen tokens attractive: nothing repeats, nothing of the prompt comes back, and
    whenever plain greedy decoding repeated a token the output differs. (Not pinned to this random model's plain
    output repeating: float rounding in a kernel can change whether it does.)"""
    prompt = [3, 4, 5]
    plain = generate(model, [prompt], max_new_tokens=20).new_tokens[0]
    penalized = generate(model, [prompt], max_new_tokens=20, repetition_penalty=1e4).new_tokens[0]
    assert len(set(penalized)) == len(penalized) and not set(penalized) & set(prompt)
    if len(set(prompt + plain)) < len(prompt + plain):
        assert penalized != plain
    mild = generate(model, [prompt], max_new_tokens=20, repetition_penalty=5.0).new_tokens[0]
    assert len(set(mild)) >= len(set(plain))


def test_stop_sequences_and_strings(model):
    from helpers import tiny_tokenizer

    full = generate(model, [[7, 8, 9]], max_new_tokens=12).new_tokens[0]
    stop = full[4:6]
    cut = generate(model, [[7, 8, 9]], max_new_tokens=12, stop_sequences=[stop]).new_tokens[0]
    assert cut == full[: full.index(stop[0], 4) + 2] or cut[-2:] == stop
    tok = tiny_tokenizer()
    text = tok.decode(full)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    out = generate(model, [[7, 8, 9]], max_new_tokens=12, stop_strings=[needle], tokenizer=tok).new_tokens[0]
    assert needle not in tok.decode(out) and text.startswith(tok.decode(out)[:1] if out else "")
    with pytest.raises(InputError, match="stop_strings need a tokenizer"):
        generate(model, [[1]], max_new_tokens=2, stop_strings=["x"])


def test_stream_yields_what_generate_returns(model):
    from llmkit.generate import stream

    steps = list(stream(model, [[1, 2, 3], [4]], max_new_tokens=6))
    assert len(steps) == 6 and all(len(s) == 2 for s in steps)
    rows = [[s[b] for s in steps] for b in range(2)]
    assert rows == generate(model, [[1, 2, 3], [4]], max_new_tokens=6).new_tokens


@pytest.mark.slow
def test_compiled_decoding_gives_the_same_tokens():
    torch.manual_seed(0)
    m = build_model(get_preset("llama2-7b-tiny")).eval()
    prompts = [[3, 14, 15, 92], [65, 35]]
    eager = generate(m, prompts, max_new_tokens=10)
    compiled = generate(m, prompts, max_new_tokens=10, step=CompiledStep(m))
    assert compiled.new_tokens == eager.new_tokens


# mixtral: softmax routing; deepseek-v3.2: grouped sigmoid routing with shared experts over MLA with sparse attention
# (deepseek-v2-lite's MLA with softmax routing adds nothing these two do not cover, and took 70 s to compile)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral-8x7b-tiny", "deepseek-v3.2-tiny"])
def test_compiled_moe_decoding_gives_the_same_tokens_and_does_not_recompile_per_routing(name):
    """MoE layers compile into the decode step: five rows route 10 assignments over 8 experts (more than the
    experts, the case that reads counts back eagerly), and new prompts, hence new routings, reuse the graphs.
    deepseek-v3.2-tiny adds sparse attention: each query keeps 8 of up to 11 keys, so the indexer's selection (a
    stable sort over the cache's slots, then a gather) runs inside the compiled graph, and new selections reuse it."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = build_model(get_preset(name)).eval()
    prompts = [[3, 14, 15, 92], [65, 35], [8, 9, 7, 9], [3, 2, 3], [8, 4, 6, 2, 6]]
    eager = generate(m, prompts, max_new_tokens=6)
    step = CompiledStep(m)
    compiled = generate(m, prompts, max_new_tokens=6, step=step)
    assert compiled.new_tokens == eager.new_tokens
    graphs = counters["stats"]["unique_graphs"]
    other = [[(7 * t + 3) % 250 for t in p] for p in prompts]
    again = generate(m, other, max_new_tokens=6, step=step)
    assert again.new_tokens == generate(m, other, max_new_tokens=6).new_tokens
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_finite_check_names_the_rows_with_nan_or_positive_infinity(bad):
    """-inf is a masked token and passes; NaN or +inf anywhere fails, naming its row."""
    from llmkit.errors import GenerationError
    from llmkit.generate.sampling import check_finite

    logits = torch.randn(3, 50)
    logits[0, 4] = float("-inf")
    check_finite(logits, 0)
    logits[2, 7] = bad
    with pytest.raises(GenerationError, match=r"step 5 \(rows \[2\]\)"):
        check_finite(logits, 5)


@pytest.mark.parametrize("name", ["llama2-70b-tiny", "gemma2-2b-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny"])
def test_an_eager_step_attends_over_the_filled_slots_only_and_writes_through(name, monkeypatch):
    """The eager step hands attention views of the filled slots: the logits do not depend on how many slots the
    cache was made with, and the keys land in the cache's own buffers."""
    from llmkit.generate.step import DecodeStep
    from llmkit.layers.attention import KVCache, LatentCache

    seen = []  # the slots attention was handed, per update
    update, latent_update = KVCache.update, LatentCache.update
    monkeypatch.setattr(KVCache, "update", lambda self, *a: seen.append(self.k.shape[2]) or update(self, *a))
    monkeypatch.setattr(
        LatentCache, "update", lambda self, *a: seen.append(self.c_kv.shape[1]) or latent_update(self, *a)
    )
    torch.manual_seed(0)
    m = build_model(get_preset(name)).eval()
    prompt = torch.randint(0, m.cfg.vocab_size, (2, 7))
    outs = []
    for room in (10, 300):
        cache = m.new_cache(2, room)
        step = DecodeStep(m)
        steps = [step(prompt, cache)[0]]
        for t in range(3):
            steps.append(step(prompt[:, t : t + 1], cache)[0])
        outs.append((steps, cache))
    (a, small), (b, big) = outs
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)
    with torch.no_grad():
        full = m(torch.cat([prompt, prompt[:, :3]], 1))
    torch.testing.assert_close(torch.cat([a[0], *a[1:]], 1), full, atol=1e-4, rtol=1e-4)
    assert set(seen) == {7, 8, 9, 10}  # the filled slots after each step, never the 300 made
    layer_small, layer_big = small.layers[0], big.layers[0]
    for name in ("k", "v") if hasattr(layer_small, "k") else ("c_kv", "k_pe"):
        a_buf, b_buf = getattr(layer_small, name), getattr(layer_big, name)
        slots = 2 if a_buf.dim() == 4 else 1  # (B, K, S, D) or (B, S, r)
        torch.testing.assert_close(a_buf.narrow(slots, 0, 10), b_buf.narrow(slots, 0, 10))
        assert b_buf.narrow(slots, 10, 290).abs().sum() == 0
