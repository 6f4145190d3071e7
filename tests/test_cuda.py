"""CUDA: every tiny preset computes on the GPU what it computes on the CPU; decoding (eager, compiled, beam,
speculative) gives the CPU's tokens; training runs in fp16 (with its gradient scaler) and bf16, and under DDP with
NCCL. Skipped without a GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.config.presets import PRESETS
from llmkit.generate import CompiledStep, beam_search, generate, speculative_generate
from llmkit.models import DecoderLM, EncoderDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = [n for n in PRESETS if n.endswith("-tiny")]
PROMPTS = [[5, 17, 33, 2, 41, 9], [60, 12, 7], [3]]


def pair(name: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights on the CPU and on the GPU."""
    cfg = get_preset(name)
    if cfg.moe is not None:  # route every token: capacity limits would couple tokens across the batch
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=None))
    torch.manual_seed(0)
    cpu = build_model(cfg).eval()
    gpu = build_model(cfg, device="cuda", dtype=dtype).eval()
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def needs_fp8() -> None:
    """Skip on a GPU without fp8 conversions (NVIDIA before compute capability 8.9, or not NVIDIA)."""
    if torch.version.hip is not None or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs an NVIDIA GPU of compute capability 8.9 or later")


@pytest.mark.parametrize("name", TINY)
def test_gpu_forward_equals_cpu(name):
    cpu, gpu = pair(name)
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        if isinstance(cpu, EncoderDecoder):
            ref, out = cpu(tokens, tokens), gpu(tokens.cuda(), tokens.cuda())
        else:
            ref, out = cpu(tokens), gpu(tokens.cuda())
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-3, atol=1e-3)  # TF32 and kernel differences


@pytest.mark.parametrize("name", [n for n in TINY if get_preset(n).encoder is None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_cached_decoding_equals_full_forward(name, dtype):
    _, gpu = pair(name, dtype)
    assert isinstance(gpu, DecoderLM)
    tokens = torch.randint(0, 256, (2, 10), device="cuda")
    with torch.no_grad():
        full = gpu(tokens).float()
        cache = gpu.new_cache(2, 16)
        steps = [gpu(tokens[:, :6], cache=cache)] + [gpu(tokens[:, t : t + 1], cache=cache) for t in range(6, 10)]
    cached = torch.cat(steps, 1).float()
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert torch.isfinite(cached).all()
    torch.testing.assert_close(cached, full, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["llama2-7b-tiny", "mixtral-8x7b-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny"])
def test_gpu_generation_compiled_beam_and_speculative(name):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # greedy tokens compared with the CPU's: no TF32 rounding
    try:
        cpu, gpu = pair(name)
        expected = generate(cpu, PROMPTS, max_new_tokens=12).new_tokens
        assert generate(gpu, PROMPTS, max_new_tokens=12).new_tokens == expected
        assert generate(gpu, PROMPTS, max_new_tokens=12, step=CompiledStep(gpu)).new_tokens == expected
        assert beam_search(gpu, PROMPTS, num_beams=1, max_new_tokens=12).sequences == expected
        draft = gpu if not len(gpu.mtp) else None
        assert speculative_generate(gpu, PROMPTS, draft=draft, max_new_tokens=12, k=3).new_tokens == expected
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32  # as it was (the default is off; later tests compare fp32)


def _train(tmp_path: Path, precision: str, launcher: tuple[str, ...] = ("-m", "llmkit"), *extra: str) -> list[float]:
    from llmkit.data.prepare import prepare

    data = tmp_path / "data"
    text = tmp_path / "corpus.txt"
    text.write_text("to be, or not to be, that is the question:\nwhether 'tis nobler in the mind to suffer\n" * 200)
    prepare(str(text), data, vocab_size=300, progress=False)
    out = tmp_path / f"run-{precision}"
    settings = {
        "model.preset": "llama2-7b-tiny",
        "data.dir": data,
        "data.seq_len": 64,
        "data.batch_size": 8,
        "train.steps": 30,
        "train.precision": precision,
        "train.device": "cuda",
        "train.progress": "false",
        "train.out": out,
        "train.eval_every": 30,
        "optim.lr": 3e-3,
        "schedule.warmup_steps": 5,
    }
    cmd = [sys.executable, *launcher, "train", *extra]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    subprocess.run(cmd, check=True, env=env, timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_training_in_half_precision(tmp_path, precision):
    losses = _train(tmp_path, precision)
    assert all(x == x and abs(x) < 1e6 for x in losses) and losses[-1] < losses[0] - 1.0


def test_ddp_with_nccl(tmp_path):
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29533", "-m", "llmkit")
    losses = _train(tmp_path, "fp32", torchrun, "--parallel", "ddp")
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("name", [n for n in TINY if PRESETS[n].config.encoder is None])
def test_gpu_serving_engine_equals_generate(name):
    """The serving engine on the GPU (paged cache, continuous batching, prefix cache, preemption) gives the tokens of
    `generate` on the same device."""
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.paged import PagedCache
    from llmkit.serve.request import SamplingParams

    _, gpu = pair(name)
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, *p] for p in PROMPTS]
    per_block = PagedCache.bytes_per_block(gpu, 4, torch.float32)
    engine = Engine(gpu, None, EngineConfig(kv_memory=per_block * 12, block_size=4, step_tokens=8))
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        expected = generate(gpu, torch.tensor([prompt], device="cuda"), max_new_tokens=12).tokens[0, len(prompt) :]
        assert out.token_ids == expected.tolist()
    assert engine.pool.used == 0 and not any(engine.pool.refs)
    from llmkit.serve.kernel_runner import KernelRunner
    from llmkit.serve.model_runner import attends_in_place

    # the paged-attention kernels and CUDA graphs wherever every layer takes them (all but DSA's selection)
    assert isinstance(engine.runner, KernelRunner) == attends_in_place(gpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunks", [1, 3])
def test_gpu_paged_attention_kernel_equals_its_reference(dtype, chunks):
    """The Triton kernel compiled for the GPU (the CPU tests run it interpreted, where bf16 products are wrong)
    against the reference: GQA with windows and caps, and MLA's two-part keys."""
    from llmkit.kernels.paged_attention import PagedRows, paged_attention, paged_attention_reference

    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = PagedRows.of(torch.randperm(64)[:48].view(4, 12), [5, 0, 40, 17], [1, 30, 1, 8], dev)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    k, v = (torch.randn(2, 64, 4, 64, device=dev, dtype=dtype) for _ in range(2))
    q = torch.randn(40, 8, 64, device=dev, dtype=dtype)
    for window, softcap in [(None, None), (9, 30.0)]:
        got = paged_attention(q, k, v, rows, 0.125, softcap, window, chunks=chunks)
        want = paged_attention_reference(q, k, v, rows, 0.125, softcap, window)
        torch.testing.assert_close(got.float(), want.float(), **tol)
    latent, rope = (
        torch.randn(1, 64, 4, 128, device=dev, dtype=dtype),
        torch.randn(1, 64, 4, 32, device=dev, dtype=dtype),
    )
    q = torch.randn(40, 16, 160, device=dev, dtype=dtype)
    got = paged_attention(q, latent, latent, rows, 0.1, k_rope=rope, chunks=chunks)
    want = paged_attention_reference(q, latent, latent, rows, 0.1, k_rope=rope)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    select = torch.randint(-1, 40, (40, 24), device=dev)  # sparse attention's chosen keys (-1: none)
    got = paged_attention(q, latent, latent, rows, 0.1, k_rope=rope, chunks=chunks, select=select)
    want = paged_attention_reference(q, latent, latent, rows, 0.1, k_rope=rope, select=select)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_paged_attention_kernel_reads_quantized_pools(dtype, codes):
    """--kv-dtype int8 / fp8: the compiled kernel over codes and scales against the reference, in one pass and in
    runs, with a window and a cap."""
    from llmkit.kernels.paged_attention import PagedRows, paged_attention, paged_attention_reference
    from llmkit.layers.attention.cache import quantize_kv

    if codes == torch.float8_e4m3fn:
        needs_fp8()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = PagedRows.of(torch.randperm(64)[:48].view(4, 12), [5, 0, 40, 17], [1, 30, 1, 8], dev)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    (k, k_scale), (v, v_scale) = (quantize_kv(torch.randn(2, 64, 4, 64, device=dev), codes) for _ in range(2))
    q = torch.randn(40, 8, 64, device=dev, dtype=dtype)
    for window, softcap in [(None, None), (9, 30.0)]:
        want = paged_attention_reference(q, k, v, rows, 0.125, softcap, window, k_scale=k_scale, v_scale=v_scale)
        for chunks in (1, 3):
            got = paged_attention(q, k, v, rows, 0.125, softcap, window, chunks=chunks, k_scale=k_scale,
                                  v_scale=v_scale)  # fmt: skip
            torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_gpu_serving_engine_with_a_quantized_cache(kv_dtype, monkeypatch):
    """--kv-dtype int8 / fp8 on the GPU: the kernel runner with CUDA graphs gives the greedy tokens of the same
    engine attending through the reference (which gathers and dequantizes), with preemption and prefix hits."""
    from llmkit.serve import engine as engine_module
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.kernel_runner import KernelRunner
    from llmkit.serve.paged import PagedCache
    from llmkit.serve.request import SamplingParams

    if kv_dtype == "fp8":
        needs_fp8()
    _, gpu = pair("llama2-7b-tiny")
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, *p] for p in PROMPTS]
    per_block = PagedCache.bytes_per_block(gpu, 4, torch.float32, kv_dtype)
    config = EngineConfig(kv_memory=per_block * 12, block_size=4, step_tokens=8, kv_dtype=kv_dtype)
    outs = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(engine_module, "model_runner", lambda m, c, bs, *_: KernelRunner(m, c, bs, False))
        engine = Engine(gpu, None, config)
        assert isinstance(engine.runner, KernelRunner) and (engine.runner.graphs is not None) == kernel
        outs.append([o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))])
        assert engine.scheduler.preemptions > 0 or engine.scheduler.prefix.hit > 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_index_scores_kernel_equals_its_reference(dtype):
    """The lightning indexer's scores over a paged pool, compiled for the card, against the reference."""
    from llmkit.kernels.index_scores import index_scores, index_scores_reference
    from llmkit.kernels.paged_attention import PagedRows

    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = PagedRows.of(torch.randperm(64)[:48].view(4, 12), [5, 0, 40, 17], [1, 30, 1, 8], dev)
    keys = torch.randn(64, 4, 128, device=dev, dtype=dtype)
    q, w = torch.randn(40, 64, 128, device=dev, dtype=dtype), torch.randn(40, 64, device=dev)
    got, want = index_scores(q, w, keys, rows, 128**-0.5), index_scores_reference(q, w, keys, rows, 128**-0.5)
    assert torch.equal(got.isinf(), want.isinf())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("name", ["llama2-70b-tiny", "gemma2-2b-tiny", "deepseek-v3-tiny"])
def test_gpu_cuda_graph_replay_equals_the_eager_step(name):
    """Decoding steps of 1, 3 and 5 rows (buckets 1, 4 and 8, spare rows on the scratch block) replayed from CUDA
    graphs give the eager kernel runner's logits, and leave the rows' blocks as the eager steps leave them."""
    from llmkit.serve.forward import Row
    from llmkit.serve.kernel_runner import KernelRunner
    from llmkit.serve.model_runner import StepPlan
    from llmkit.serve.paged import PagedCache

    _, gpu = pair(name)
    runners = []
    for graphs in (True, False):
        cache = PagedCache(gpu, 32, 4, gpu.device, gpu.dtype, scratch=True)
        runners.append(KernelRunner(gpu, cache, 4, graphs=graphs))
    graphed, eager = runners
    prompts = [list(range(3 + i, 10 + 2 * i)) for i in range(5)]
    tables = [[5 * i + j for j in range(5)] for i in range(5)]
    with torch.inference_mode():
        for r in runners:  # the prompts, eagerly
            r.execute(StepPlan(tuple(Row(p, 0, t) for p, t in zip(prompts, tables, strict=True))))
        for step, n in enumerate([1, 3, 5, 5]):
            rows = tuple(Row([step + i], len(prompts[i]) + step, tables[i]) for i in range(n))
            a, b = graphed.execute(StepPlan(rows)), eager.execute(StepPlan(rows))
            for i in range(n):
                torch.testing.assert_close(a.logits[i], b.logits[i], atol=1e-4, rtol=1e-4)
    assert graphed.graphs is not None and sorted(graphed.graphs.captured) == [1, 4, 8]
    for x, y in zip(graphed.cache.layers, eager.cache.layers, strict=True):
        for name_ in ("k", "v", "c_kv", "k_pe"):
            if hasattr(x, name_):
                torch.testing.assert_close(getattr(x, name_)[:32], getattr(y, name_)[:32], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama2-7b-tiny", "deepseek-v3-tiny", "mixtral-8x7b-tiny"])
def test_gpu_quantized_models_match_the_cpu(name, method):
    """A quantized model on the GPU (torch's int8 / int4 weight-only kernels where they apply, bf16 for int4)
    computes what the same quantized model computes on the CPU, and decodes with its cache."""
    from llmkit.quant import QuantizedLinear, quantize

    cpu, _ = pair(name)
    quantize(cpu, method, group_size=16 if method == "int4" else None, kernel="dequant")  # exact on the CPU
    gpu = __import__("copy").deepcopy(cpu).to("cuda")
    for m in gpu.modules():
        if isinstance(m, QuantizedLinear):  # the kernels `auto` picks on the GPU
            m.kernel = "auto"
            m.prepare()
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = cpu(tokens)
        got = gpu(tokens.cuda()).cpu()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        bf16 = __import__("copy").deepcopy(gpu).to(torch.bfloat16)
        out = bf16(tokens.cuda()).float().cpu()
        assert (out - expected).abs().max() < 0.05 * expected.abs().max() + 0.05
    out = generate(gpu, tokens.cuda(), max_new_tokens=6).tokens.cpu()
    assert torch.equal(out, generate(cpu, tokens, max_new_tokens=6).tokens)


@pytest.mark.parametrize("bits", [8, 4])
def test_gpu_quantized_kernels_match_the_dequantized_reference(bits):
    """torch's CUDA weight-only kernels (int8: fp32/bf16; int4: bf16 with widths a multiple of 128), as `auto`
    picks them, against F.linear with the dequantized weight."""
    from llmkit.quant import Int4Linear, Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=True)
    layer = (Int8Linear if bits == 8 else Int4Linear).from_linear(linear).to("cuda", torch.bfloat16)
    assert layer.resolved == ("int8-wo" if bits == 8 else "int4-wo")
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = torch.nn.functional.linear(x.float(), layer.dequantize(), layer.bias.float())
        out = layer(x).float()
    assert (out - reference).abs().max() < 0.02 * reference.abs().max()


def test_gpu_evaluation_equals_the_cpu():
    """`llmkit eval`'s scoring and perplexity give on the GPU what they give on the CPU (fp32)."""
    from llmkit.evaluate import divergence, score

    cpu, gpu = pair("llama2-7b-tiny")
    pairs = [([5, 17, 33, 2], [41, 9]), ([5, 17, 33, 2], [8]), ([60, 12], [7, 3, 3, 1]), ([3], [44, 45])]
    on_cpu = score(cpu, pairs, max_length=64, batch_size=2)
    on_gpu = score(gpu, pairs, max_length=64, batch_size=2)
    assert [s.logprob for s in on_gpu] == pytest.approx([s.logprob for s in on_cpu], abs=1e-3)
    from helpers import byte_tokenizer

    tok = byte_tokenizer()
    cfg = dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    cpu = build_model(cfg).eval()
    gpu = build_model(cfg, device="cuda").eval()
    gpu.load_state_dict(cpu.state_dict())
    text = "to be or not to be, that is the question " * 6
    d_cpu = divergence(cpu, cpu, tok, text, window=24, stride=12)
    d_gpu = divergence(gpu, gpu, tok, text, window=24, stride=12)
    assert float(d_gpu.kl.max()) == 0.0
    assert d_gpu.model.nll == pytest.approx(d_cpu.model.nll, rel=1e-4)


def test_gpu_gguf_blocks_dequantize_to_the_cpu_s_weights():
    """Every GGUF block type on the GPU (no C++ kernels there: PyTorch dequantizes the blocks as stored) gives the
    CPU's weights bit for bit, and the layer multiplies by them in fp32 and bf16."""
    from gguf_files import random_blocks

    from llmkit.quant.block_linear import BlockLinear
    from llmkit.quant.blocks import TYPES, dequantize

    for kind, block in sorted(TYPES.items()):
        cols = 576 if block.weights == 32 else 768
        raw = torch.from_numpy(random_blocks(kind, 6, cols, seed=1))
        layer = BlockLinear(cols, 6, bias=True, block=kind, kernel="dequant")
        layer.blocks.copy_(raw)
        layer.bias.data.normal_()
        want = dequantize(raw, kind, cols)
        gpu = __import__("copy").deepcopy(layer).to("cuda")
        assert gpu.resolved == "dequant", kind
        assert torch.equal(gpu.dequantize().cpu(), want), kind
        x = torch.randn(3, cols)
        with torch.no_grad():
            exact = torch.nn.functional.linear(x.double(), want.double(), layer.bias.double()).float()
            torch.testing.assert_close(gpu(x.cuda()).cpu(), exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))
            half = gpu.to(torch.bfloat16)(x.cuda().bfloat16()).float().cpu()
        assert (half - exact).abs().max() < 0.02 * exact.abs().max(), kind


def test_gpu_gguf_file_decodes_the_cpu_s_tokens(tmp_path):
    """A GGUF file of K-quants and 32-weight blocks, loaded onto the GPU with its blocks kept as stored, gives the
    logits and greedy tokens the same file gives on the CPU with the exact (dequantizing) kernel."""
    from gguf_files import write_gguf

    from llmkit.interop.load import load_model
    from llmkit.quant import QuantizedLinear

    path = tmp_path / "mixed.gguf"
    kinds = {"ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "attn_q": "Q5_0", "attn_v": "IQ4_NL"}
    write_gguf(path, kinds, untied=True)
    cpu = load_model(path).model.eval()
    for m in cpu.modules():
        if isinstance(m, QuantizedLinear):
            m.kernel = "dequant"  # type: ignore[assignment]
            m.prepare()
    gpu = load_model(path, device="cuda").model.eval()
    assert sum(isinstance(m, QuantizedLinear) for m in gpu.modules()) == 2 * len(kinds)
    tokens = torch.tensor([[5, 17, 33, 2, 41, 9]])
    with torch.no_grad():
        torch.testing.assert_close(gpu(tokens.cuda()).cpu(), cpu(tokens), rtol=1e-4, atol=1e-4)
    out = generate(gpu, tokens.cuda(), max_new_tokens=8).tokens.cpu()
    assert torch.equal(out, generate(cpu, tokens, max_new_tokens=8).tokens)


def test_gpu_speculative_serving_equals_plain_serving():
    """A draft model on the GPU runner (drafts verified in the packed step): greedy output equals the plain engine's,
    and the model drafting for itself keeps every draft."""
    from llmkit.serve.drafters import ModelSpeculator
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.paged import PagedCache
    from llmkit.serve.request import SamplingParams

    _, gpu = pair("llama2-70b-tiny")
    torch.manual_seed(1)
    weak = build_model(dataclasses.replace(get_preset("llama2-70b-tiny"), n_layers=1), device="cuda").eval()
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, *p] for p in PROMPTS]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    def engine(draft: DecoderLM | None) -> Engine:
        per_block = 2 * PagedCache.bytes_per_block(gpu, 4, torch.float32)
        config = EngineConfig(kv_memory=per_block * 64, block_size=4, step_tokens=8, draft_tokens=3 if draft else 0)
        return Engine(gpu, None, config, draft=draft)

    plain = [o.token_ids for o in engine(None).generate(prompts, greedy)]
    for draft in (weak, gpu):
        e = engine(draft)
        assert isinstance(e.drafter, ModelSpeculator)
        e.drafter.drafts_for = lambda rows: 3  # type: ignore[method-assign]
        assert [o.token_ids for o in e.generate(prompts, greedy)] == plain
    assert e.drafter.accepted == e.drafter.drafted > 0


@pytest.mark.parametrize("name", ["llama2-70b-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny"])
def test_gpu_mtp_speculation_equals_plain_serving(name):
    """The MTP module drafting on the GPU (its block through the paged-attention kernel, keys from slot 1; DeepSeek's
    own with latent and sparse attention): greedy output equals the plain engine's."""
    from llmkit.serve.drafters import MTPSpeculator
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.paged import PagedCache
    from llmkit.serve.request import SamplingParams

    torch.manual_seed(0)
    cfg = dataclasses.replace(get_preset(name), mtp_depth=1)
    if cfg.moe is not None:  # route every token: capacity limits would couple tokens across the batch
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=None))
    gpu = build_model(cfg, device="cuda").eval()
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, *p] for p in PROMPTS]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    per_block = PagedCache.bytes_per_block(gpu, 4, torch.float32)

    def engine(k: int) -> Engine:
        config = EngineConfig(kv_memory=per_block * 64, block_size=4, step_tokens=8, draft_tokens=k)
        return Engine(gpu, None, config)

    plain = [o.token_ids for o in engine(0).generate(prompts, greedy)]
    spec = engine(3)
    assert isinstance(spec.drafter, MTPSpeculator) and spec.drafter.native is None
    spec.drafter.drafts_for = lambda rows: 3  # type: ignore[method-assign]
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == plain
    assert spec.drafter.drafted > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [224, 576, 8992])  # not multiples of 128 (torch's int4 kernel refuses): Triton's
def test_gpu_int4_layers_of_any_width_take_the_triton_kernel(width, dtype):
    from llmkit.quant.linear import Int4Linear

    torch.manual_seed(0)
    dense = torch.nn.Linear(width, 96, bias=True)
    layer = Int4Linear.from_linear(dense, group_size=32).to("cuda")
    x = torch.randn(5, width, device="cuda", dtype=dtype)
    want = x.float() @ layer.dequantize(torch.float32).T + layer.bias.float()
    assert layer._prepared is None  # torch's int4 layout was not made: the Triton kernel runs
    got = layer(x)
    assert got.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol * width**0.5, rtol=tol)


@pytest.mark.parametrize("name", ["llama2-70b-tiny", "gpt2-tiny", "gemma2-2b-tiny"])
def test_gpu_batch_invariant_engine_answers_each_request_as_alone(name):
    """The batch-invariant mode on the GPU runner (llmkit.kernels.invariant's products and norms, attention in one
    pass, CUDA graphs): 16 concurrent requests in bf16, sampled with seeds, each get the tokens and log-probabilities
    they get alone, bit for bit."""
    from llmkit.serve.engine import Engine, EngineConfig
    from llmkit.serve.kernel_runner import KernelRunner
    from llmkit.serve.paged import PagedCache
    from llmkit.serve.request import SamplingParams

    _, gpu = pair(name, torch.bfloat16)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 256, (int(n),)).tolist() for n in torch.randint(3, 40, (16,))]
    per_block = PagedCache.bytes_per_block(gpu, 4, torch.bfloat16)

    def engine() -> Engine:
        config = EngineConfig(kv_memory=per_block * 400, block_size=4, step_tokens=64, batch_invariant=True)
        e = Engine(gpu, None, config)
        assert isinstance(e.runner, KernelRunner) and e.runner.invariant
        return e

    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5)
    together, one_by_one = engine().generate(prompts, params), engine()
    for prompt, out in zip(prompts, together, strict=True):
        alone = one_by_one.generate([prompt], params)[0]  # (its own batch: generate runs it to the end)
        assert (alone.token_ids, alone.logprobs) == (out.token_ids, out.logprobs)


def test_gpu_batch_invariant_products_give_a_row_its_bits_whatever_the_batch():
    """llmkit's invariant product in bf16 on the GPU: rows alone and among 1 .. 300 others have the same bits."""
    from llmkit.kernels.invariant import mm

    torch.manual_seed(0)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    full = mm(x, w.t())
    torch.testing.assert_close(full.float(), (x @ w.t()).float(), atol=0.5, rtol=2e-2)
    for m in (1, 7, 64, 65, 299):
        assert torch.equal(mm(x[:m], w.t()), full[:m])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [224, 576, 4096])
def test_gpu_int8_layers_with_grouped_scales_take_the_triton_kernel(width, dtype, monkeypatch):
    """int8 with a scale per 32 inputs (torch's int8 kernel takes one a row): llmkit's Triton kernel, any width."""
    from llmkit.kernels import weight_matmul
    from llmkit.quant.linear import Int8Linear

    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(width, 96, bias=True), group_size=32).to("cuda")
    x = torch.randn(5, width, device="cuda", dtype=dtype)
    want = x.float() @ layer.dequantize(torch.float32).T + layer.bias.float()
    calls, real = [], weight_matmul._launch
    monkeypatch.setattr(weight_matmul, "_launch", lambda *a: calls.append(a[-1]) or real(*a))
    got = layer(x)
    assert calls == ["int8"] and got.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol * width**0.5, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp8_layers_take_the_triton_kernel(dtype, monkeypatch):
    """fp8 (E4M3) weights on the GPU: llmkit's Triton kernel decodes the bytes (any card), equal to the product with
    the dequantized weights; a whole model quantized to fp8 decodes the tokens its CPU copy decodes."""
    from llmkit.kernels import weight_matmul
    from llmkit.quant import quantize
    from llmkit.quant.linear import Fp8Linear

    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(576, 96, bias=True), group_size=32).to("cuda")
    x = torch.randn(5, 576, device="cuda", dtype=dtype)
    want = x.float() @ layer.dequantize(torch.float32).T + layer.bias.float()
    calls, real = [], weight_matmul._launch
    monkeypatch.setattr(weight_matmul, "_launch", lambda *a: calls.append(a[-1]) or real(*a))
    got = layer(x)
    assert calls == ["fp8"] and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=5e-2 * 576**0.5, rtol=5e-2)
    cpu, _ = pair("llama2-7b-tiny")
    quantize(cpu, "fp8")
    gpu = __import__("copy").deepcopy(cpu).to("cuda")
    tokens = torch.tensor([PROMPTS[0]])
    out = generate(gpu, tokens.cuda(), max_new_tokens=6).tokens.cpu()
    assert torch.equal(out, generate(cpu, tokens, max_new_tokens=6).tokens)
