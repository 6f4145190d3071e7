"""A prompt's causal attention on the CPU's bf16 dot-product units (llmkit.quant.native.causal_attention,
cpu_attention.cpp), and where llmkit takes it: the prefill of quantized models' attention layers, in `generate`
and in the serving engine's prompt chunks."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

import llmkit
from llmkit.generate import choose_step, generate
from llmkit.layers.attention import AttentionMask
from llmkit.layers.attention.core import attend
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.machine.cpu import CpuFeatures, cpu_features
from llmkit.quant import KernelChoice, kernel_choice_set, native, quantize
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.paged import PagedCache
from llmkit.serve.request import SamplingParams

needs_kernel = pytest.mark.skipif(
    not (cpu_features().avx512_bf16 and native.available()), reason="needs AVX512-BF16 and llmkit's CPU kernels"
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """fp64 SDPA of q (H, T, D) at positions offset.. over k, v (K, S, D)."""
    T, n = q.shape[1], offset + q.shape[1]
    allowed = torch.arange(n)[None, :] <= (offset + torch.arange(T))[:, None]
    out = F.scaled_dot_product_attention(
        q[None].double(),
        k[None, :, :n].double(),
        v[None, :, :n].double(),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )
    return out[0]


def _qkv(H: int, K: int, T: int, S: int, D: int, dtype: torch.dtype = torch.float32):
    q = torch.randn(T, H, D).transpose(0, 1).to(dtype)  # (H, T, D) laid out (T, H, D), as a layer's projection gives
    return q, torch.randn(K, S, D).to(dtype), torch.randn(K, S, D).to(dtype)


@needs_kernel
@pytest.mark.parametrize(
    ("H", "K", "T", "D", "offset"),
    [
        (9, 3, 100, 64, 0),
        (9, 3, 37, 64, 50),
        (4, 4, 130, 128, 3),
        (8, 2, 17, 32, 0),
        (6, 2, 70, 48, 200),
        (2, 1, 1, 256, 5),
        (4, 1, 64, 16, 64),
    ],
)
def test_the_kernel_is_attention_within_bf16_rounding(H, K, T, D, offset):
    torch.manual_seed(0)
    q, k, v = _qkv(H, K, T, offset + T + 7, D)  # keys past the last query's position are never read
    out = native.causal_attention(q, k, v, offset, D**-0.5)
    expected = _reference(q, k, v, offset, D**-0.5)
    assert out.shape == (H, T, D) and out.dtype == torch.float32
    assert out.transpose(0, 1).is_contiguous()  # (T, H, D) in memory: the layer's transpose back is free
    assert ((out.double() - expected).norm() / expected.norm()) < 1e-2  # bf16 keeps ~3 significant digits
    assert (out.double() - expected).abs().max() < 0.05


@needs_kernel
def test_bf16_inputs_give_bf16_outputs():
    torch.manual_seed(0)
    q, k, v = _qkv(6, 3, 40, 40, 64, torch.bfloat16)
    out = native.causal_attention(q, k, v, 0, 0.125)
    expected = _reference(q, k, v, 0, 0.125)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - expected).norm() / expected.norm()) < 1e-2


@needs_kernel
def test_a_query_gives_the_same_bits_in_whatever_chunk_it_comes():
    """Its keys are visited in the same blocks from key 0 whatever other queries share its call: a prompt cut into
    chunks attends exactly as in one piece."""
    torch.manual_seed(0)
    q, k, v = _qkv(9, 3, 300, 300, 64)
    whole = native.causal_attention(q, k, v, 0, 0.125)
    cuts = [0, 33, 100, 101, 117, 300]
    parts = [native.causal_attention(q[:, a:b], k, v, a, 0.125) for a, b in itertools.pairwise(cuts)]
    assert torch.equal(whole, torch.cat(parts, dim=1))


@needs_kernel
def test_bad_shapes_are_refused_in_one_line():
    q, k, v = _qkv(4, 2, 8, 8, 64)
    with pytest.raises(RuntimeError, match="8 keys for 8 queries from position 1"):
        native.causal_attention(q, k, v, 1, 0.125)
    with pytest.raises(RuntimeError, match="3 query heads over 2 kv heads"):
        native.causal_attention(q[:3], k, v, 0, 0.125)
    with pytest.raises(RuntimeError, match="head dims 40"):
        native.causal_attention(q[..., :40], k[..., :40], v[..., :40], 0, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.causal_attention(q, k.bfloat16(), v, 0, 0.125)


def test_the_causal_offset_of_masks():
    """causal_offset: where queries in consecutive slots see exactly the keys up to theirs; None for anything else."""
    S, T = 12, 5
    filled = torch.arange(S) < 9
    slots = torch.arange(4, 9)
    assert AttentionMask(causal=True, first=True).causal_offset(T, S) == 0
    assert AttentionMask(causal=True).causal_offset(T, S) == S - T  # queries are the last T slots
    assert AttentionMask(filled[None, None, None], causal=True, query_slots=slots[None]).causal_offset(T, S) == 4
    assert AttentionMask(filled[None, None, None], causal=True, query_slots=slots).causal_offset(T, S) == 4
    hole = filled.clone()
    hole[2] = False  # padding among the keys
    assert AttentionMask(hole[None, None, None], causal=True, query_slots=slots).causal_offset(T, S) is None
    assert AttentionMask(filled[None, None, None], causal=True, query_slots=slots.flip(0)).causal_offset(T, S) is None
    assert AttentionMask(filled[None, None, None], causal=False, query_slots=slots).causal_offset(T, S) is None
    assert AttentionMask(causal=True, first=True, window=3).causal_offset(T, S) is None
    two_rows = torch.stack([filled, filled])[:, None, None]
    assert AttentionMask(two_rows, causal=True, query_slots=slots).causal_offset(T, S) == 4  # rows alike
    assert AttentionMask(two_rows, causal=True, query_slots=torch.stack([slots, slots + 1])).causal_offset(T, S) is None
    per_query = filled.expand(T, S)[None, None]  # (1, 1, T, S): a mask of its own for each query
    assert AttentionMask(per_query, causal=True, query_slots=slots).causal_offset(T, S) is None


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the kernel's calls (each entry: the call's queries)."""
    calls: list[int] = []
    real = native.causal_attention

    def counted(q, k, v, offset, scale):
        calls.append(q.shape[1])
        return real(q, k, v, offset, scale)

    monkeypatch.setattr(native, "causal_attention", counted)
    return calls


@needs_kernel
def test_attend_gives_a_layers_kernel_the_prompts_it_takes(monkeypatch):
    torch.manual_seed(0)
    calls = _counting(monkeypatch)
    kernel, fp32 = native.PrefillAttention(KernelChoice("bf16")), native.PrefillAttention(KernelChoice("fp32"))
    q, k, v = (t[None] for t in _qkv(6, 2, 32, 32, 64))
    mask = AttentionMask(causal=True, first=True)
    fast, _ = attend(q, k, v, mask, 0.125, prefill_kernel=kernel)
    assert calls == [32]
    plain, _ = attend(q, k, v, mask, 0.125)  # a float model's layer: fp32 SDPA
    attend(q[:, :, :8], k, v, AttentionMask(causal=True), 0.125, prefill_kernel=kernel)  # too few queries
    trained = q.clone().requires_grad_()
    attend(trained, k, v, mask, 0.125, prefill_kernel=kernel)  # training: autograd needs torch's kernels
    attend(q, k, v, mask, 0.125, need_weights=True, prefill_kernel=kernel)
    padded = AttentionMask(torch.arange(32)[None, None, None] > 0, causal=True, query_slots=torch.arange(32))
    attend(q, k, v, padded, 0.125, prefill_kernel=kernel)  # a padding key
    attend(q, k, v, mask, 0.125, prefill_kernel=fp32)  # products in fp32: attention too
    attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.125, prefill_kernel=fp32)  # bf16 already
    assert calls == [32, 32]
    assert ((fast - plain).norm() / plain.norm()) < 1e-2
    calls.clear()
    rows = [torch.randn(3, t.shape[1], 32, 64) for t in (q, k, v)]  # evaluation windows: rows of one length
    batch, _ = attend(*rows, mask, 0.125, prefill_kernel=kernel)
    assert calls == [32, 32, 32]
    assert torch.equal(batch[1], native.causal_attention(*(t[1] for t in rows), 0, 0.125))


def test_tensors_off_the_cpu_are_not_given_to_the_kernel(monkeypatch):
    """A model quantized on the CPU and moved to a GPU keeps its layers' prefill kernel: its queries there (meta
    tensors stand in for CUDA ones) must go to torch's attention, not to C++ that reads their pointers (on an H100
    machine with AVX512-BF16, bf16 QLoRA on the GPU crashed the process). The extension refuses them too."""
    monkeypatch.setattr(native, "module", lambda: object())  # built, as far as the gate can tell
    bf16_cpu = CpuFeatures(frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}), True)
    choice = KernelChoice("bf16", bf16_cpu)
    q, v = (torch.empty(4, 32, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    assert not choice.attention_applies(q, v)
    assert choice.attention_applies(torch.empty_like(q, device="cpu"), torch.empty_like(v, device="cpu"))
    assert not KernelChoice("bf16", CpuFeatures(frozenset({"avx2"}))).attention_applies(
        torch.empty_like(q, device="cpu"), torch.empty_like(v, device="cpu")
    )


@needs_kernel
def test_the_extension_refuses_tensors_off_the_cpu():
    ext = native.module()
    q = torch.empty(4, 32, 64, device="meta")
    with pytest.raises(RuntimeError, match="is on meta: llmkit's C\\+\\+ kernels take CPU tensors"):
        ext.causal_attention(q, q, q, 0, 0.125)
    w = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="x is on meta"):
        ext.int8_linear(q[0], w, torch.ones(8, 1), 1, False)
    with pytest.raises(RuntimeError, match="qweight is on meta"):
        ext.int8_linear(torch.zeros(1, 64), w.to("meta"), torch.ones(8, 1), 1, False)


def _quantized_model() -> llmkit.DecoderLM:
    torch.manual_seed(0)
    cfg = dataclasses.replace(llmkit.get_preset("llama2-7b-tiny"), n_layers=2)
    return quantize(llmkit.build_model(cfg).eval(), "int8")


def test_quantizing_gives_the_attention_layers_the_kernel():
    model = _quantized_model()
    kernels = [m.prefill_kernel for m in model.modules() if isinstance(m, GroupedQueryAttention)]
    assert len(kernels) == model.cfg.n_layers
    assert all(isinstance(k, native.PrefillAttention) and k.choice == native.default_choice() for k in kernels)
    plain = llmkit.build_model(model.cfg)
    assert all(m.prefill_kernel is None for m in plain.modules() if isinstance(m, GroupedQueryAttention))


@needs_kernel
def test_a_quantized_models_prefill_attends_on_bf16_units(monkeypatch):
    """generate's prefill and the serving engine's prompt chunks (the first and the later ones, over the paged
    cache) take the kernel; the tokens are those of the fp32 prefill on this small model."""
    model = _quantized_model()
    prompt = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    step = choose_step(model, invariant=False)  # (the batch-invariant mode prefills in the C++ step instead)
    with kernel_choice_set(model, KernelChoice("fp32")):
        expected = generate(model, prompt, max_new_tokens=6, step=step)
    calls = _counting(monkeypatch)
    with kernel_choice_set(model, KernelChoice("bf16")):
        fast = generate(model, prompt, max_new_tokens=6, step=step)
        assert calls == [70] * model.cfg.n_layers
        calls.clear()
        per_block = PagedCache.bytes_per_block(model, 4, torch.float32)
        config = EngineConfig(kv_memory=per_block * 100, block_size=4, step_tokens=32, batch_invariant=False)
        engine = Engine(model, None, config)
        done = engine.generate([prompt[0].tolist()], SamplingParams(max_tokens=6, temperature=0.0))
    assert calls == [32] * model.cfg.n_layers + [32] * model.cfg.n_layers  # chunks of 32, 32; the last 6 too few
    assert fast.new_tokens == expected.new_tokens
    assert done[0].token_ids == expected.new_tokens[0]
