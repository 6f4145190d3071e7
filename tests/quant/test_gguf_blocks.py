"""GGUF files load with every quantized tensor's blocks as stored (llmkit.quant.blocks), whatever the mix of types,
with the dequantized file's logits; an untied table stays blocks; a type without a kernel is dequantized, named."""

from __future__ import annotations

import pytest
import torch
from gguf_files import write_gguf

from llmkit.interop.gguf import load_gguf
from llmkit.quant import QuantizedLinear
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.embedding import BlockEmbedding, QuantizedEmbedding

gguf = pytest.importorskip("gguf")


def _logits(model: torch.nn.Module, tokens: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
    if kernel is not None:
        for m in model.modules():
            if isinstance(m, QuantizedLinear):
                m.kernel = kernel  # type: ignore[assignment]
                m.prepare()
    with torch.no_grad():
        return model(tokens)


def test_a_file_of_block_types_loads_as_stored_with_the_file_s_logits(tmp_path):
    """Every type llmkit holds, mixed in one file (a Q4_K_M-like mix and the rest): each layer holds its tensor's
    blocks (no type rounded to another), the tied head the table's, and the logits equal the dequantized file's."""
    path = tmp_path / "mixed.gguf"
    kinds = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q6_K", "attn_output": "Q4_1", "ffn_gate": "Q3_K"}
    write_gguf(path, kinds | {"ffn_up": "Q5_K", "ffn_down": "Q2_K", "token_embd": "Q8_0"})
    q, f = load_gguf(path, quantized=True), load_gguf(path, quantized=False)
    assert not q.notes
    layer = q.model.blocks[1]
    held = {n: m.block.name for n, m in layer.named_modules() if isinstance(m, BlockLinear)}
    assert held == {
        "attn.wq": "Q4_K", "attn.wk": "Q5_0", "attn.wv": "Q6_K", "attn.wo": "Q4_1",
        "ffn.w1": "Q3_K", "ffn.w3": "Q5_K", "ffn.w2": "Q2_K",
    }  # fmt: skip
    assert isinstance(q.model.head, BlockLinear) and q.model.head.block.name == "Q8_0"
    assert isinstance(q.model.embed, QuantizedEmbedding)  # rows read from the head's blocks
    tokens = torch.randint(0, 64, (2, 10))
    assert torch.equal(_logits(q.model, tokens, "dequant"), _logits(f.model, tokens))


def test_an_untied_quantized_table_is_held_as_blocks_and_a_type_without_a_kernel_dequantized_with_a_note(tmp_path):
    path = tmp_path / "untied.gguf"
    write_gguf(path, {"token_embd": "Q6_K", "output": "Q6_K", "attn_q": "IQ4_XS", "ffn_up": "IQ2_XXS"}, untied=True)
    q, f = load_gguf(path, quantized=True), load_gguf(path, quantized=False)
    assert isinstance(q.model.embed, BlockEmbedding) and q.model.embed.block.name == "Q6_K"
    assert q.model.head.block.name == "Q6_K" and q.model.blocks[0].attn.wq.block.name == "IQ4_XS"
    assert type(q.model.blocks[0].ffn.w3) is torch.nn.Linear  # no kernel: dequantized
    assert any("IQ2_XXS" in n and "dequantized" in n for n in q.notes)
    tokens = torch.randint(0, 64, (2, 10))
    assert torch.equal(_logits(q.model, tokens, "dequant"), _logits(f.model, tokens))


@pytest.mark.parametrize("tied", [True, False])
def test_f16_and_bf16_tensors_are_held_at_their_width_where_the_kernels_run(tmp_path, tied):
    """A GGUF file's F16 and BF16 tensors (what `convert_hf_to_gguf.py --outtype bf16` writes) are held as stored,
    views of the mapped file (as the K-quants are), with the dequantized file's logits; given a dtype, they load as
    floats in it."""
    from llmkit.quant import native

    path = tmp_path / "halves.gguf"
    kinds = {"attn_q": "F16", "attn_k": "BF16", "attn_v": "F16", "attn_output": "BF16"}
    kinds |= {"ffn_gate": "BF16", "ffn_up": "BF16", "ffn_down": "BF16"}
    write_gguf(path, kinds | {"token_embd": "BF16", "output": "F16"}, untied=not tied)
    q, f = load_gguf(path), load_gguf(path, quantized=False)
    if native.module() is None:
        pytest.skip("llmkit's C++ kernels do not run here: F16 and BF16 tensors load as floats")
    layer = q.model.blocks[0]
    held = {n: m.block.name for n, m in layer.named_modules() if isinstance(m, BlockLinear)}
    assert held == {
        "attn.wq": "F16", "attn.wk": "BF16", "attn.wv": "F16", "attn.wo": "BF16",
        "ffn.w1": "BF16", "ffn.w3": "BF16", "ffn.w2": "BF16",
    }  # fmt: skip
    assert q.model.head.block.name == ("BF16" if tied else "F16")
    assert isinstance(q.model.embed, QuantizedEmbedding if tied else BlockEmbedding)
    tokens = torch.randint(0, 64, (2, 10))
    want = _logits(f.model, tokens)
    torch.testing.assert_close(_logits(q.model, tokens), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    asked = load_gguf(path, dtype=torch.bfloat16).model
    assert type(asked.blocks[0].attn.wq) is torch.nn.Linear and asked.blocks[0].attn.wq.weight.dtype == torch.bfloat16
