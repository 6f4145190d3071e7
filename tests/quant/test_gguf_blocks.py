"""llama.cpp's block formats against the `gguf` package's own dequantization: Q8_0, Q5_0, Q4_0, Q4_1 and Q4_K convert
to llmkit's int8 / int4 exactly; the other block types (Q6_K, Q5_K, Q5_1, Q3_K, Q2_K) are rounded to int8 within half
a step of each group of 32; and a GGUF file whose linear tensors mix them all loads kept quantized, with the
dequantized file's logits (exactly for the exact types)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import random_blocks, write_gguf

from llmkit.interop.gguf import load_gguf
from llmkit.quant import Int4Linear, Int8Linear, QuantizedLinear
from llmkit.quant.formats import (
    GGUF_KINDS,
    dequantize_int4,
    dequantize_int8,
    from_gguf_blocks,
    requantized_int8,
)

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
INEXACT = ["Q6_K", "Q5_K", "Q5_1", "Q3_K", "Q2_K"]


def reference(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).copy()).reshape(shape)


@pytest.mark.parametrize("kind", sorted(GGUF_KINDS))
def test_exact_block_types_convert_exactly(kind):
    shape = (6, 512)
    raw = random_blocks(kind, *shape)
    parts = from_gguf_blocks(kind, raw, shape)
    if GGUF_KINDS[kind] == "int4":
        ours = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"])
    else:
        ours = dequantize_int8(parts["qweight"], parts["scales"])
    assert parts["scales"].shape == (6, 512 // 32)
    assert torch.equal(ours, reference(kind, raw, shape))


@pytest.mark.parametrize("kind", INEXACT)
def test_other_block_types_round_to_int8_within_half_a_step(kind):
    shape = (6, 512)
    theirs = reference(kind, random_blocks(kind, *shape), shape)
    parts = requantized_int8(theirs)
    ours = dequantize_int8(parts["qweight"], parts["scales"])
    step = theirs.reshape(6, -1, 32).abs().amax(-1) / 127  # (N, G): int8's step in each group of 32
    error = (ours - theirs).reshape(6, -1, 32).abs().amax(-1)
    assert (error <= step / 2 * (1 + 1e-5)).all()
    with pytest.raises(Exception, match="no exact llmkit format"):
        from_gguf_blocks(kind, random_blocks(kind, *shape), shape)


def _logits(model: torch.nn.Module, tokens: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
    if kernel is not None:
        for m in model.modules():
            if isinstance(m, QuantizedLinear):
                m.kernel = kernel  # type: ignore[assignment]
                m.prepare()
    with torch.no_grad():
        return model(tokens)


def test_a_file_of_exact_block_types_loads_kept_quantized_with_identical_logits(tmp_path):
    path = tmp_path / "exact.gguf"
    kinds = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q4_K"}
    write_gguf(path, kinds | {"ffn_up": "Q5_0", "ffn_down": "Q4_K", "token_embd": "Q8_0"})
    q, f = load_gguf(path, quantized=True), load_gguf(path, quantized=False)
    assert not q.notes
    blocks = q.model.blocks
    assert isinstance(blocks[0].attn.wq, Int4Linear) and isinstance(blocks[1].ffn.w2, Int4Linear)
    assert isinstance(blocks[0].attn.wk, Int8Linear) and isinstance(q.model.head, Int8Linear)  # Q5_0, Q8_0
    tokens = torch.randint(0, 64, (2, 10))
    assert torch.equal(_logits(q.model, tokens, "dequant"), _logits(f.model, tokens))


def test_other_block_types_load_as_int8_with_a_note(tmp_path):
    """A Q4_K_M-like mix: Q4_K, with Q6_K for the values, the down projections and the tied head, and Q5_K."""
    path = tmp_path / "mixed.gguf"
    write_gguf(path, {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "ffn_up": "Q5_K", "attn_q": "Q4_K"})
    q, f = load_gguf(path, quantized=True), load_gguf(path, quantized=False)
    assert any("Q6_K" in n and "int8" in n for n in q.notes) and any("Q5_K" in n for n in q.notes)
    assert isinstance(q.model.blocks[0].attn.wv, Int8Linear) and isinstance(q.model.head, Int8Linear)
    assert isinstance(q.model.blocks[0].attn.wq, Int4Linear)
    assert type(q.model.blocks[0].attn.wk) is torch.nn.Linear  # F32 stays float
    tokens = torch.randint(0, 64, (2, 10))
    a, b = _logits(q.model, tokens, "dequant"), _logits(f.model, tokens)
    assert (a - b).abs().max() <= 0.01 * (b.amax() - b.amin())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
