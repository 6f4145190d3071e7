"""The C++ decode step (llmkit/quant/cpu_decode.cpp via llmkit.quant.native_step) against the PyTorch modules it
stands in for: the same logits and caches from every block variant it accepts (fp32 to float rounding; int4/int8
within the activation rounding both paths share), the same greedy and beam outputs, padding and sliding windows
respected, and every model it does not accept left to PyTorch."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.config import ModelConfig
from llmkit.generate import beam_search, generate
from llmkit.generate.prompts import pad_prompts
from llmkit.generate.step import DecodeStep, NativeStep
from llmkit.quant import native, quantize
from llmkit.quant.native_step import HEAD_ROWS, MAX_TOKENS, NativeDecoder

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llmkit's AVX2 extension (x86 CPU, compiler)")


def model_of(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """The model with random weights, its norm gains (QK-norm's too) moved off 1 and its biases off 0 (they start
    there), so that each one counts."""
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.add_(0.5 * torch.randn_like(p))
    return model


def variant(name: str, **changes: object) -> ModelConfig:
    """A tiny preset with attention / position fields replaced."""
    cfg = get_preset(name)
    attention = {k: v for k, v in changes.items() if k in ("qkv_bias", "out_bias", "sliding_window")}
    position = {k: v for k, v in changes.items() if k in ("layout", "rope_fraction")}
    return dataclasses.replace(
        cfg,
        attention=dataclasses.replace(cfg.attention, **attention),
        position=dataclasses.replace(cfg.position, **position),
    )


CONFIGS = {
    "llama": get_preset("llama2-7b-tiny"),
    "gqa-70b": get_preset("llama2-70b-tiny"),
    "gpt2": get_preset("gpt2-tiny"),
    "qwen-biases": variant("llama2-7b-tiny", qkv_bias=True, out_bias=True),
    "interleaved-partial-rope": variant("llama2-7b-tiny", layout="interleaved", rope_fraction=0.5),
    "sliding-window": variant("llama2-7b-tiny", sliding_window=5),
    "qwen3-qk-norm": get_preset("qwen3-0.6b-tiny"),
}


def run_both(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> tuple[list, list, object, object]:
    """Prefill both caches in PyTorch, then `steps` single-token steps through PyTorch and through the C++ blocks,
    feeding both the PyTorch path's greedy tokens. Returns both lists of logits (B, V) and both caches."""
    tokens, mask = pad_prompts(prompts)
    B, T = tokens.shape
    nd = NativeDecoder.of(model)
    assert nd is not None
    eager, fast = DecodeStep(model), NativeStep(model, nd)
    ref_cache, nat_cache = model.new_cache(B, T + steps), model.new_cache(B, T + steps)
    ref, nat = [], []
    with torch.inference_mode():
        logits, _ = eager(tokens, ref_cache, mask)
        fast(tokens, nat_cache, mask)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            a, _ = eager(tok, ref_cache)
            b, _ = fast(tok, nat_cache)
            ref.append(a[:, -1])
            nat.append(b[:, -1])
            tok = a[:, -1].argmax(-1, keepdim=True)
    return ref, nat, ref_cache, nat_cache


PROMPTS = [[5, 17, 99, 3, 44, 12, 7, 250, 31], [8, 8, 1, 200], [60]]  # left-padded to 9: pads hidden by the mask


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_blocks_equal_pytorch(name):
    model = model_of(CONFIGS[name])
    ref, nat, ref_cache, nat_cache = run_both(model, PROMPTS, 8)
    for a, b in zip(ref, nat, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    for la, lb in zip(ref_cache.layers, nat_cache.layers, strict=True):
        torch.testing.assert_close(lb.k, la.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lb.v, la.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen-biases", "qwen3-qk-norm"])
def test_quantized_blocks_equal_pytorch(name, method):
    """Both paths run the same integer kernels; they differ only where float rounding in the norms moves an
    activation across an int8 rounding boundary (one step of 1/127 of its block's largest value)."""
    model = quantize(model_of(CONFIGS[name]), method, group_size=32, include_head=True)
    ref, nat, _, _ = run_both(model, PROMPTS, 8)
    for a, b in zip(ref, nat, strict=True):
        spread = (a.amax(-1) - a.amin(-1)).max()
        assert (a - b).abs().max() <= 0.02 * spread
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 2 / 3


def test_generate_and_beam_search_take_the_native_path_and_match(monkeypatch):
    model = model_of(CONFIGS["llama"])
    prompts = [[5, 17, 99, 3], [8, 8, 1]]
    calls = {"n": 0}
    real_run = NativeDecoder.run

    def counting_run(self, *args):
        calls["n"] += 1
        return real_run(self, *args)

    monkeypatch.setattr(NativeDecoder, "run", counting_run)
    fast = generate(model, prompts, max_new_tokens=12)
    beams = beam_search(model, [prompts[0]], num_beams=3, max_new_tokens=8)
    assert calls["n"] >= 11 + 7
    monkeypatch.setattr(NativeDecoder, "of", classmethod(lambda cls, m: None))
    assert generate(model, prompts, max_new_tokens=12).new_tokens == fast.new_tokens
    slow_beams = beam_search(model, [prompts[0]], num_beams=3, max_new_tokens=8)
    assert slow_beams.sequences == beams.sequences


@pytest.mark.parametrize("name", ["deepseek-v2-lite-tiny", "deepseek-v3.2-tiny", "gemma-2b-tiny", "gemma3-1b-tiny"])
def test_models_it_does_not_compute_are_left_to_pytorch(name):
    """MLA (DeepSeek), Gemma's offset norms (and Gemma 3's offset QK-norm): not the C++ step's operations."""
    assert NativeDecoder.of(model_of(get_preset(name))) is None


def moe_variant(name: str, **moe: object) -> ModelConfig:
    cfg = get_preset(name)
    assert cfg.moe is not None
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))


MOE_CONFIGS = {  # every router and expert variant moe.py has, behind grouped-query attention
    "mixtral": get_preset("mixtral-8x7b-tiny"),  # softmax top-2, renormalised
    "qwen2-moe": get_preset("qwen1.5-moe-a2.7b-tiny"),  # + a wide shared expert gated by sigmoid(x . w)
    "deepseek-v3-routing": moe_variant(  # GLM-4.5 / dots.llm1: V3's router behind GQA
        "mixtral-8x7b-tiny",
        n_experts=16,
        top_k=4,
        score_func="sigmoid",
        n_groups=4,
        topk_groups=2,
        score_bias=True,
        routed_scale=2.5,
        n_shared_experts=1,
    ),
    "deepseek-v2-routing": moe_variant(
        "mixtral-8x7b-tiny",
        n_experts=16,
        top_k=3,
        n_groups=4,
        topk_groups=2,
        group_score="max",
        norm_topk=False,
        routed_scale=1.5,
    ),
    "qwen3-moe": dataclasses.replace(  # QK-norm before the experts
        get_preset("qwen1.5-moe-a2.7b-tiny"),
        attention=dataclasses.replace(get_preset("qwen1.5-moe-a2.7b-tiny").attention, qk_norm=True),
    ),
    "switch-mlp-experts": moe_variant(
        "mixtral-8x7b-tiny", top_k=1, norm_topk=False, expert_kind="mlp", activation="gelu"
    ),
}


def moe_model(name: str) -> torch.nn.Module:
    model = model_of(MOE_CONFIGS[name])
    with torch.no_grad():  # a score bias that changes choices (it starts at zero)
        for m in model.modules():
            if getattr(m, "score_bias", None) is not None:
                m.score_bias.copy_(torch.randn_like(m.score_bias) * 0.05)
    return model


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_mixture_of_experts_blocks_equal_pytorch(name):
    """The router's choice, gates, groups, score bias, shared experts and expert products in C++: the module's
    logits and caches."""
    model = moe_model(name)
    ref, nat, ref_cache, nat_cache = run_both(model, PROMPTS, 8)
    for a, b in zip(ref, nat, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    for la, lb in zip(ref_cache.layers, nat_cache.layers, strict=True):
        torch.testing.assert_close(lb.k, la.k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_quantized_experts_decode_from_their_codes(name, method, monkeypatch):
    """Quantized expert stacks are read as codes, a chosen expert's rows at a time: the step never dequantizes a
    stack (the module's PyTorch path does, every call), and gives the module's logits within activation rounding."""
    from llmkit.quant.experts import QuantizedExperts

    model = quantize(moe_model(name), method, group_size=32, include_head=True)
    assert any(isinstance(m, QuantizedExperts) for m in model.modules())
    tokens, mask = pad_prompts(PROMPTS)
    ref_cache, nat_cache = model.new_cache(3, 20), model.new_cache(3, 20)
    nd = NativeDecoder.of(model)
    assert nd is not None
    eager, fast = DecodeStep(model), NativeStep(model, nd)
    with torch.inference_mode():
        logits, _ = eager(tokens, ref_cache, mask)
        fast(tokens, nat_cache, mask)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        a, _ = eager(tok, ref_cache)

        def refuse(self):
            raise AssertionError("the C++ step dequantized an expert stack")

        for stack in ("w1", "w2", "w3"):
            monkeypatch.setattr(QuantizedExperts, stack, property(refuse))
        b, _ = fast(tok, nat_cache)
    a, b = a[:, -1], b[:, -1]
    assert (a - b).abs().max() <= 0.02 * (a.amax(-1) - a.amin(-1)).max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 2 / 3


def test_mixture_of_experts_with_several_tokens_a_row_and_in_generate(monkeypatch):
    """A speculative round's T > 1 tokens per row route one by one; generate takes the C++ path and keeps the
    module's tokens."""
    model = moe_model("deepseek-v3-routing")
    tokens, mask = pad_prompts(PROMPTS)
    ref_cache, nat_cache = model.new_cache(3, 20), model.new_cache(3, 20)
    nd = NativeDecoder.of(model)
    assert nd is not None
    eager, fast = DecodeStep(model), NativeStep(model, nd)
    with torch.inference_mode():
        eager(tokens, ref_cache, mask)
        fast(tokens, nat_cache, mask)
        step = torch.tensor([[3, 9, 27], [81, 243 % 256, 5], [7, 7, 7]])
        a, _ = eager(step, ref_cache)
        b, _ = fast(step, nat_cache)
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    fast = generate(model, PROMPTS, max_new_tokens=10)
    monkeypatch.setattr(NativeDecoder, "of", classmethod(lambda cls, m: None))
    assert generate(model, PROMPTS, max_new_tokens=10).new_tokens == fast.new_tokens


def test_a_capacity_factor_is_left_to_pytorch():
    """Capacity limits drop assignments across the batch: not a per-row choice the C++ router makes."""
    assert NativeDecoder.of(model_of(moe_variant("mixtral-8x7b-tiny", capacity_factor=1.25))) is None


@pytest.mark.parametrize("change", [{"softcap": 3.0}, {"scale": 0.1}])
def test_soft_capped_or_rescaled_attention_is_left_to_pytorch(change):
    cfg = get_preset("llama2-7b-tiny")
    assert (
        NativeDecoder.of(model_of(dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, **change))))
        is None
    )


def test_soft_capped_logits_through_the_cpp_head():
    """Gemma 2's final soft-capping stays on in the C++ head, so native decoding gives the model's tokens."""
    model = model_of(dataclasses.replace(get_preset("llama2-7b-tiny"), logit_softcap=0.5))
    nd = NativeDecoder.of(model)
    assert nd is not None
    h = torch.randn(1, 2, model.cfg.d_model)
    with torch.no_grad():
        torch.testing.assert_close(nd.logits(h), model.logits(h), atol=1e-5, rtol=1e-5)
        assert model.logits(h).abs().max() < 0.5
    ref, nat, _, _ = run_both(model, PROMPTS, 4)
    for a, b in zip(ref, nat, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


def test_training_mode_bf16_and_other_kernels_are_left_to_pytorch():
    model = model_of(CONFIGS["llama"])
    assert NativeDecoder.of(model) is not None
    assert NativeDecoder.of(copy.deepcopy(model).train()) is None
    assert NativeDecoder.of(copy.deepcopy(model).to(torch.bfloat16)) is None
    assert NativeDecoder.of(quantize(copy.deepcopy(model), "int4", kernel="dequant")) is None


def test_long_prefills_and_bf16_caches_are_not_taken():
    model = model_of(CONFIGS["llama"])
    nd = NativeDecoder.of(model)
    assert nd is not None
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        step = cache.state.advance(MAX_TOKENS + 1)
        assert not nd.applies(torch.zeros(1, MAX_TOKENS + 1, dtype=torch.long), step, cache.layers)
        assert nd.applies(torch.zeros(1, 3, dtype=torch.long), cache.state.advance(3), cache.layers)
    one = torch.zeros(1, 1, dtype=torch.long)
    assert not nd.applies(one, cache.state.advance(1), cache.layers)  # gradients on: a training-time call
    with torch.no_grad():
        assert nd.applies(one, cache.state.advance(1), cache.layers)
        bf16 = [block.attn.new_cache(1, 8, dtype=torch.bfloat16) for block in model.blocks]
        assert not nd.applies(one, cache.state.advance(1), bf16)


def test_the_cpp_step_checks_its_arguments():
    model = model_of(CONFIGS["llama"])
    nd = NativeDecoder.of(model)
    assert nd is not None
    cache = model.new_cache(1, 8)
    k, v = cache.layers[0].k, cache.layers[0].v
    allowed = torch.ones(1, 8, dtype=torch.bool)
    F = model.cfg.rope_dim // 2
    x = torch.randn(1, model.cfg.d_model)
    cos, sin = torch.ones(1, F), torch.zeros(1, F)
    decode, blocks = nd.ext.decode, nd.blocks[:1]
    decode(blocks, x, [k], [v], 7, allowed, cos, sin)  # the last slot is fine
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode(blocks, x, [k], [v], 8, allowed, cos, sin)
    with pytest.raises(RuntimeError, match="fp32"):
        decode(blocks, x.double(), [k], [v], 0, allowed, cos, sin)
    with pytest.raises(RuntimeError, match="allowed"):
        decode(blocks, x, [k], [v], 0, allowed[:, :4], cos, sin)
    with pytest.raises(RuntimeError, match="cos and sin"):
        decode(blocks, x, [k], [v], 0, allowed, None, None)
    with pytest.raises(RuntimeError, match="one k and one v cache per block"):
        decode(blocks, x, [k, k], [v], 0, allowed, cos, sin)
    two = torch.randn(2, model.cfg.d_model)  # two new tokens for the cache's one row: slots 6 and 7
    decode(blocks, two, [k], [v], 6, allowed, cos, sin)
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode(blocks, two, [k], [v], 7, allowed, cos, sin)
    with pytest.raises(RuntimeError, match="T new tokens"):
        decode(
            blocks,
            torch.randn(3, model.cfg.d_model),
            [cache.layers[0].k.expand(2, -1, -1, -1).contiguous()],
            [cache.layers[0].v.expand(2, -1, -1, -1).contiguous()],
            0,
            allowed.expand(2, -1).contiguous(),
            cos,
            sin,
        )


def test_a_batch_beyond_the_small_row_kernel_equals_pytorch():
    """17 rows: several tiles of rows in every product, and more (row, head) pairs than threads."""
    model = model_of(CONFIGS["llama"])
    prompts = [[(7 * i + j) % 250 + 1 for j in range(1 + i % 5)] for i in range(17)]
    ref, nat, _, _ = run_both(model, prompts, 3)
    for a, b in zip(ref, nat, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral"])
def test_the_serving_engine_takes_the_native_path_over_its_paged_pools(name, monkeypatch):
    """Decoding rows of different lengths in one batch, each over its own blocks of the pool (a block size that
    splits every prompt): the same tokens and log-probabilities as the engine's PyTorch path."""
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.paged import PagedCache
    from llmkit.serve.request import SamplingParams

    model = moe_model(name) if name in MOE_CONFIGS else model_of(CONFIGS[name])
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 17, 30, 3, 9])]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    memory = PagedCache.bytes_per_block(model, 4, torch.float32) * 200

    def run() -> list:  # (prompts through PyTorch: the native path here is the decoding rows')
        config = EngineConfig(kv_memory=memory, block_size=4, step_tokens=16, batch_invariant=False)
        engine = Engine(model, None, config)
        return engine.generate(prompts, params)

    calls = {"n": 0}
    real = NativeDecoder.run_paged

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NativeDecoder, "run_paged", counting)
    fast = run()
    assert calls["n"] >= 9
    monkeypatch.setattr(NativeDecoder, "applies_paged", lambda self, new_tokens, keys: False)
    slow = run()
    for a, b in zip(fast, slow, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2", "sliding-window", "interleaved-partial-rope"])
def test_several_new_tokens_a_row_equal_pytorch(name):
    """Steps of T = 2..5 tokens per row after a left-padded prefill (what a speculative round verifies, and short
    prompts): the C++ blocks give PyTorch's logits at every position and write the same caches, each token seeing
    the earlier ones of its own step."""
    model = model_of(CONFIGS[name])
    nd = NativeDecoder.of(model)
    assert nd is not None
    eager, fast = DecodeStep(model), NativeStep(model, nd)
    tokens, mask = pad_prompts(PROMPTS)
    B, T = tokens.shape
    ref_cache, nat_cache = model.new_cache(B, T + 20), model.new_cache(B, T + 20)
    with torch.inference_mode():
        eager(tokens, ref_cache, mask)
        fast(tokens, nat_cache, mask)
        for n in (2, 5, 3):
            new = torch.randint(1, 250, (B, n))
            a, ha = eager(new, ref_cache)
            b, hb = fast(new, nat_cache)
            torch.testing.assert_close(hb, ha, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
            a, _ = eager(new[:, :2], ref_cache, last=True)
            b, _ = fast(new[:, :2], nat_cache, last=True)
            assert b.shape == (B, 1, model.cfg.vocab_size)
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    for la, lb in zip(ref_cache.layers, nat_cache.layers, strict=True):
        torch.testing.assert_close(lb.k, la.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lb.v, la.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_the_cpp_head_equals_the_models(tied, monkeypatch):
    """Up to HEAD_ROWS states through the C++ product, more through the model's own head: the same logits."""
    cfg = dataclasses.replace(get_preset("llama2-7b-tiny"), tie_embeddings=tied)
    model = model_of(cfg)
    nd = NativeDecoder.of(model)
    assert nd is not None
    with torch.no_grad():
        for shape in [(1, 1), (1, 3), (2, 4), (3, HEAD_ROWS)]:
            h = torch.randn(*shape, cfg.d_model)
            torch.testing.assert_close(nd.logits(h), model.logits(h), atol=1e-4, rtol=1e-5)
        q = quantize(copy.deepcopy(model), "int8", group_size=32, include_head=True)
        nq = NativeDecoder.of(q)
        assert nq is not None
        h = torch.randn(1, 2, cfg.d_model)
        expected = q.logits(h)
        # a quantized head: the model's own kernel, and its weights never dequantized on the way (that cost 80 ms a
        # step on SmolLM2 once: the `weight` property of a quantized layer builds the float matrix)
        monkeypatch.setattr(type(q.head), "dequantize", lambda *a, **k: pytest.fail("the head was dequantized"))
        torch.testing.assert_close(nq.logits(h), expected)


def test_speculative_rounds_take_the_native_path_and_keep_the_output(monkeypatch):
    """A draft model's rounds verified in C++ (two to four tokens a step) give plain greedy decoding's output."""
    from llmkit.generate import speculative_generate

    target, draft = model_of(CONFIGS["llama"], 0), model_of(CONFIGS["llama"], 1)
    prompts = [[5, 17, 99, 3], [8, 8, 1]]
    widths: list[int] = []
    real_run = NativeDecoder.run

    def recording_run(self, tokens, *args):
        widths.append(tokens.shape[1])
        return real_run(self, tokens, *args)

    plain = generate(target, prompts, max_new_tokens=16)
    monkeypatch.setattr(NativeDecoder, "run", recording_run)
    spec = speculative_generate(target, prompts, draft=draft, k=3, max_new_tokens=16)
    assert spec.new_tokens == plain.new_tokens
    assert 4 in widths  # the target's verifying steps (cur and three drafts) ran in C++


@pytest.mark.parametrize("K", [64, 200, 576])
def test_the_fp32_product_of_a_few_rows_equals_f_linear(K):
    """float_linear (the C++ steps' fp32 products and output head): up to six rows of x a pass over each weight row
    (a verifying step's k + 1 tokens), more rows in several passes, inputs that are not a multiple of 16."""
    ext = native.module()
    torch.manual_seed(0)
    w, bias = torch.randn(300, K), torch.randn(300)
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 13):
        x = torch.randn(M, K)
        expected = torch.nn.functional.linear(x, w, bias)
        torch.testing.assert_close(ext.float_linear(x, w, bias), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ext.float_linear(x, w, None), expected - bias, rtol=1e-4, atol=1e-4)


def test_argument_errors_with_numbers_in_their_message_raise():
    """Such errors once crashed the process on another machine (torch 2.11, GCC 13.3: TORCH_CHECK with a formatted
    number); the extension's checks now raise std::runtime_error built without iostreams."""
    ext = native.module()
    with pytest.raises(RuntimeError, match="x has 64 columns, the weights 32"):
        ext.int8_linear(torch.randn(2, 64), torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(RuntimeError, match="must be"):
        ext.float_linear(torch.randn(2, 8).double(), torch.randn(4, 8), None)
