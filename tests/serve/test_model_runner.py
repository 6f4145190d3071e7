"""The model runner alone: a plan in, the logits a plain forward gives out, for every backend it can choose."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import llmkit
from llmkit.errors import InputError
from llmkit.kernels import triton_usable
from llmkit.serve.forward import Row
from llmkit.serve.kernel_runner import KernelRunner, StaticStep
from llmkit.serve.model_runner import (
    InvariantRunner,
    ModelRunner,
    NativeRunner,
    StepPlan,
    TorchRunner,
    model_runner,
)
from llmkit.serve.paged import PagedCache
from llmkit.serve.runner_base import TokenRunner

BS = 4  # slots per cache block


def _runner(model: llmkit.DecoderLM, backend: str) -> ModelRunner:
    cache = PagedCache(model, 16, BS, model.device, model.dtype)
    if backend == "torch":
        return TorchRunner(model, cache, BS)
    if backend in ("kernel", "gathered"):  # the GPU's runner: its Triton kernel (interpreted here), or the reference
        if backend == "kernel" and not triton_usable(model.device):
            pytest.skip("Triton is not installed")
        return KernelRunner(model, cache, BS, kernel=backend == "kernel")
    runner = model_runner(model, cache, BS, invariant=backend == "invariant", lockstep=None)
    if not isinstance(runner, NativeRunner):
        pytest.skip("llmkit's C++ step is not available here")
    assert isinstance(runner, InvariantRunner) == (backend == "invariant")
    return runner


def _plain(model: llmkit.DecoderLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].float()  # (L, V)


PRESETS = ["llama2-7b-tiny"]
# the kernel runner on every attention it takes: sliding windows and soft caps (Gemma 2), query/key norms (Qwen 3),
# latent attention (DeepSeek-V3), sparse attention's top-k keys (DeepSeek-V3.2: 8 of them), MQA (Gemma)
KERNEL_PRESETS = [
    "llama2-7b-tiny",
    "gemma2-2b-tiny",
    "qwen3-0.6b-tiny",
    "deepseek-v3-tiny",
    "deepseek-v3.2-tiny",
    "gemma-2b-tiny",
]


@pytest.mark.parametrize(
    ("backend", "preset"),
    [(b, p) for b in ("torch", "native", "invariant") for p in PRESETS]
    + [(b, p) for b in ("kernel", "gathered") for p in KERNEL_PRESETS],
)
def test_a_runner_gives_each_row_the_logits_of_a_plain_forward(backend, preset):
    """Two prompts' chunks in one plan, then a decoding row, then a row with drafts: each row's logits (and the
    prompt logits and states it was asked for) are what one uncached forward over its whole text gives."""
    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset(preset)).eval()
    runner = _runner(model, backend)
    a, b = [5, 9, 2, 7, 1, 3, 8], [4, 8, 6]
    plain_a, plain_b = _plain(model, a), _plain(model, b)
    first = StepPlan((Row(a[:5], 0, [0, 1], prompt_n=4), Row(b, 0, [2])))
    assert (first.decoding, first.chunks) == ([], [0, 1])
    with torch.inference_mode():
        out = runner.execute(first)
    assert set(out.logits) == {0, 1} and not out.verified
    torch.testing.assert_close(out.logits[0], plain_a[4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1], plain_b[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.prompt[0], plain_a[:4], atol=1e-4, rtol=1e-4)
    assert out.prompt[1] is None and [h.shape[0] for h in (out.hidden[0], out.hidden[1])] == [5, 3]
    with torch.inference_mode():
        out = runner.execute(StepPlan((Row(a[5:6], 5, [0, 1]), Row(b[2:], 2, [2]))))  # b again: slot 2 rewritten
    torch.testing.assert_close(out.logits[0], plain_a[5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1], plain_b[2], atol=1e-4, rtol=1e-4)
    if not isinstance(runner, TokenRunner):
        return
    drafts = (8, 2)  # a's next tokens as drafts: its slots 6 and 7 are written, and each is verified
    with torch.inference_mode():
        out = runner.execute(StepPlan((Row(a[6:7], 6, [0, 1, 3], drafts=drafts),)))
    assert set(out.verified) == {0} and not out.logits and out.hidden[0].shape[0] == 3
    torch.testing.assert_close(out.verified[0], _plain(model, a + list(drafts))[6:9], atol=1e-4, rtol=1e-4)


def test_a_group_that_fails_is_computed_row_by_row_and_only_the_failing_row_is_missing():
    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset("llama2-7b-tiny")).eval()
    runner = _runner(model, "torch")
    real, calls = runner.forward, []

    def forward(rows):
        calls.append(len(rows))
        if any(r.request == "bad" for r in rows):
            raise RuntimeError("simulated: a kernel refused this shape")
        return real(rows)

    runner.forward = forward  # type: ignore[method-assign]
    plan = StepPlan((Row([1, 2, 3], 0, [0], request="ok"), Row([4, 5], 0, [1], request="bad")))
    with torch.inference_mode():
        out = runner.execute(plan)
    assert calls == [2, 1, 1] and not out.failed(0) and out.failed(1)
    torch.testing.assert_close(out.logits[0], _plain(model, [1, 2, 3])[2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["kernel", "gathered"])
@pytest.mark.parametrize("preset", ["gemma3-1b-tiny", "gemma2-2b-tiny", "deepseek-v3.2-tiny"])
def test_the_kernel_runner_past_the_sliding_window(backend, preset):
    """A 45-token text, longer than the 16-slot windows of Gemma's local layers and than the 8 keys DeepSeek-V3.2's
    indexer picks, in prompt chunks beside another row and then decoding rows: every row's logits equal an uncached
    forward's (windows, soft caps, local RoPE; each query's top-k keys scored and attended in place)."""
    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset(preset)).eval()
    runner = _runner(model, backend)
    text = torch.randint(0, model.cfg.vocab_size, (45,)).tolist()
    other = [3, 1, 4, 1, 5]
    plain, plain_other = _plain(model, text), _plain(model, other)
    table = [15, 2, 9, 4, 11, 0, 7, 13, 1, 5, 8, 12]  # scattered blocks
    steps = [(0, 20), (20, 40)] + [(n, n + 1) for n in range(40, 45)]
    for i, (s, e) in enumerate(steps):
        rows = [Row(text[s:e], s, table[: -(-e // BS)])]
        if i == 1:
            rows.append(Row(other, 0, [3, 6]))
        with torch.inference_mode():
            out = runner.execute(StepPlan(tuple(rows)))
        torch.testing.assert_close(out.logits[0], plain[e - 1], atol=1e-4, rtol=1e-4)
        if i == 1:
            torch.testing.assert_close(out.logits[1], plain_other[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gathered"])
@pytest.mark.parametrize("preset", ["llama2-7b-tiny", "deepseek-v3-tiny"])
def test_a_captured_steps_buffers_give_the_eager_steps_logits(preset, kernel):
    """What a CUDA graph replays, run as it is: 3 decoding rows filled into a step of 4 (the spare row on the scratch
    block, tables padded to the model's context) give each row the logits and cache writes of the eager runner."""
    torch.manual_seed(0)
    model = llmkit.build_model(llmkit.get_preset(preset)).eval()
    if kernel and not triton_usable(model.device):
        pytest.skip("Triton is not installed")
    runners = [
        KernelRunner(model, PagedCache(model, 16, BS, model.device, model.dtype, scratch=True), BS, kernel)
        for _ in range(2)
    ]
    step_runner, eager = runners
    prompts, tables = [[5, 9, 2, 7, 1], [4, 8, 6], [1, 2, 3, 4, 5, 6, 7, 8]], [[3, 0], [7], [2, 12, 9]]
    with torch.inference_mode():
        for r in runners:
            r.execute(StepPlan(tuple(Row(p, 0, t) for p, t in zip(prompts, tables, strict=True))))
        rows = [Row([11 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
        step = StaticStep(step_runner, 4, width=-(-model.max_seq_len // BS), scratch=16)
        step.fill(rows)
        _, logits = step.forward()
        want = eager.execute(StepPlan(tuple(rows)))
    for i in range(3):
        torch.testing.assert_close(logits[i], want.logits[i], atol=1e-5, rtol=1e-5)
    for a, b in zip(step_runner.cache.layers, eager.cache.layers, strict=True):  # the same blocks written
        for x, y in zip(vars(a).values(), vars(b).values(), strict=True):
            if isinstance(x, torch.Tensor):  # every block but the scratch one: (K, N, bs, D) or (N, bs, r)
                blocks = 1 if x.dim() == 4 else 0
                torch.testing.assert_close(x.narrow(blocks, 0, 16), y.narrow(blocks, 0, 16), atol=1e-6, rtol=1e-6)


def _dense(preset: str) -> llmkit.DecoderLM:
    """The preset's tiny model, its mixture-of-experts layers (which the batch-invariant mode refuses) made dense."""
    cfg = llmkit.get_preset(preset)
    if cfg.moe is not None:
        cfg = dataclasses.replace(cfg, moe=None)
    return llmkit.build_model(cfg).eval()


# MHA with learned positions and LayerNorm; GQA with RMSNorm; windows and soft caps; latent and sparse attention
@pytest.mark.parametrize(
    "preset", ["gpt2-tiny", "llama2-7b-tiny", "gemma2-2b-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny"]
)
def test_the_batch_invariant_kernel_runner_gives_a_row_its_bits_whatever_the_rows_beside_it(preset):
    """A text's logits, bit for bit, whether its prompt runs alone in two chunks and decodes alone, or in one chunk
    beside another prompt's chunk and then decodes beside other rows (products, norms and attention each by one
    program shape, llmkit.kernels.invariant). Without the mode, the rows beside it change the bits."""
    torch.manual_seed(0)
    model = _dense(preset)
    if not triton_usable(model.device):
        pytest.skip("Triton is not installed")
    text = torch.randint(0, model.cfg.vocab_size, (11,)).tolist()
    other = torch.randint(0, model.cfg.vocab_size, (12,)).tolist()

    def logits(invariant: bool, crowded: bool) -> list[torch.Tensor]:
        runner = KernelRunner(model, PagedCache(model, 16, BS, model.device, model.dtype), BS, invariant=invariant)
        table, table_other = ([0, 1, 2, 3], [4, 5, 6]) if crowded else ([9, 3, 12, 7], [])
        chunks = [(0, 8)] if crowded else [(0, 3), (3, 8)]
        out = []
        with torch.inference_mode():
            for s, e in chunks:  # the prompt, text[:8]
                rows = [Row(text[s:e], s, table)] + ([Row(other[:7], 0, table_other)] if crowded else [])
                out.append(runner.execute(StepPlan(tuple(rows))).logits[0])
            for n in range(8, 11):  # three decoding steps, beside the other text's where crowded
                rows = [Row(text[n : n + 1], n, table)] + ([Row(other[n - 1 : n], n - 1, table_other)] * crowded)
                out.append(runner.execute(StepPlan(tuple(rows))).logits[0])
        return out[-4:]  # after the prompt, and after each decoded token

    alone, crowded = logits(True, False), logits(True, True)
    for a, b in zip(alone, crowded, strict=True):
        assert torch.equal(a, b)
    plain = _plain(model, text)
    for a, want in zip(alone, plain[7:11], strict=True):
        torch.testing.assert_close(a, want, atol=1e-4, rtol=1e-4)
    if preset == "llama2-7b-tiny":  # the test can fail: torch's own products give other bits in a crowd
        assert not all(torch.equal(a, b) for a, b in zip(logits(False, False), logits(False, True), strict=True))


def test_the_batch_invariant_kernel_runner_refuses_what_it_has_no_kernels_for():
    model = llmkit.build_model(llmkit.get_preset("mixtral-8x7b-tiny")).eval()
    with pytest.raises(InputError, match="mixture-of-experts"):
        KernelRunner(model, PagedCache(model, 16, BS, model.device, model.dtype), BS, invariant=True)
