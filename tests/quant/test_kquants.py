"""Quantizing to llama.cpp's K-quants (llmkit.quant.kquants), IQ4_NL and IQ4_XS (llmkit.quant.iquants) and its
mixtures (llmkit.quant.mixtures): the bytes llama.cpp's `llama-quantize` wrote, the error each type allows, and a
model quantized to Q4_K_M as llama.cpp would."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.errors import InputError
from llmkit.quant import describe, iquants, kquants, native, quantize
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.blocks import TYPES, dequantize, quantize_blocks
from llmkit.quant.embedding import BlockEmbedding, QuantizedEmbedding
from llmkit.quant.mixtures import mixture_spec, more_bits

K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
IQ4 = ["IQ4_NL", "IQ4_XS"]


def test_the_bytes_are_llama_quantize_s():
    """32 super-blocks of each type, as `llama-quantize` (llama.cpp 0c1e570, no importance matrix) wrote them from a
    bf16 file of random weights of Qwen2.5-1.5B's shape: the first 32 of blk.0.attn_k (Q4_K), blk.1.attn_k (Q5_K) and
    blk.0.ffn_down (Q6_K), and 32 drawn from the first 64 rows of blk.0.attn_q (Q2_K, of the Q2_K mixture) and
    blk.0.attn_k (Q3_K, of Q3_K_S). bench/quantize_bench.py compares every block of the whole Q4_K_M and Q5_K_M files
    (all equal); for Q2_K and Q3_K every block of the first 64 rows of 10 tensors was compared when this was written
    (7,552 super-blocks, all equal)."""
    data = np.load(Path(__file__).with_name("llama_quantize_blocks.npz"))
    for kind in K_QUANTS:
        x = torch.from_numpy(data[kind + "_bf16"].astype(np.int32) << 16).view(torch.float32)
        assert np.array_equal(quantize_blocks(x, kind).numpy(), data[kind]), kind


def test_the_iq4_bytes_are_llama_quantize_s():
    """32 blocks of IQ4_NL and 32 super-blocks of IQ4_XS that `llama-quantize` (same build, no importance matrix: 7
    tries a block) wrote from blk.4.attn_q of the same bf16 file, drawn at random from its first 64 rows. Checked
    beside them when this was written: every block of the first 64 rows of blk.4.attn_q, blk.10.ffn_gate,
    blk.20.attn_output and token_embd (12,288 blocks of IQ4_NL, 1,536 super-blocks of IQ4_XS) byte-equal."""
    data = np.load(Path(__file__).with_name("llama_quantize_blocks.npz"))
    for kind in IQ4:
        x = torch.from_numpy(data[kind + "_bf16"].astype(np.int32) << 16).view(torch.float32)
        assert np.array_equal(quantize_blocks(x, kind).numpy(), data[kind]), kind


@pytest.mark.parametrize("kind", IQ4)
def test_iq4_error_and_edge_blocks(kind):
    torch.manual_seed(0)
    w = torch.randn(16, 512) * 0.02
    w[0, :256] = 0  # all zeros: every scale 0, every code the level nearest 0
    w[1, :32] = 0.01  # a block of one value: the level -127 (the largest magnitude) times d (IQ4_XS: d's 6 bits)
    blocks = quantize_blocks(w, kind)
    assert blocks.shape == (16, 512 // TYPES[kind].weights * TYPES[kind].bytes) and blocks.dtype == torch.uint8
    back = dequantize(blocks, kind, 512)
    assert torch.equal(back[0, :256], torch.zeros(256))
    torch.testing.assert_close(back[1, :32], w[1, :32], rtol=2e-3 if kind == "IQ4_NL" else 5e-2, atol=0)
    err = (back[2:] - w[2:]).pow(2).mean().sqrt() / w[2:].pow(2).mean().sqrt()
    q4_0 = dequantize(quantize_blocks(w[2:], "Q4_0"), "Q4_0", 512)
    assert err < 0.95 * (q4_0 - w[2:]).pow(2).mean().sqrt() / w[2:].pow(2).mean().sqrt()  # the non-uniform levels win
    assert torch.equal(quantize_blocks(w[3:5], kind), blocks[3:5])  # a row's blocks do not depend on the others


def test_iq4_mixtures_are_llama_cpp_s():
    """IQ4_NL / IQ4_XS without an importance matrix: the head Q6_K, attn_v Q5_K where 4 or more query heads share a
    key/value head, ffn_down Q5_K in the first eighth of the layers; IQ4_XS falls back to IQ4_NL on rows that are not
    whole super-blocks (checked against llama-quantize on the Qwen2.5-1.5B shape: all 198 tensors' types equal)."""
    model = _model(tied=False, layers=16)  # llama2-7b-tiny: 4 heads over 4 key/value heads (no sharing)
    spec = mixture_spec(model, "IQ4_XS")
    assert spec.for_layer("head")[0] == "Q6_K" and spec.embedding == "IQ4_XS"
    assert [spec.for_layer(f"blocks.{i}.ffn.w2")[0] for i in range(4)] == ["Q5_K", "Q5_K", "IQ4_XS", "IQ4_XS"]
    assert {spec.for_layer(f"blocks.{i}.attn.wv")[0] for i in range(16)} == {"IQ4_XS"}
    cfg = dataclasses.replace(model.cfg, attention=dataclasses.replace(model.cfg.attention, n_kv_heads=1))
    shared = mixture_spec(build_model(cfg), "iq4_nl")
    assert {shared.for_layer(f"blocks.{i}.attn.wv")[0] for i in range(16)} == {"Q5_K"}
    assert shared.for_layer("blocks.5.attn.wq")[0] == "IQ4_NL"
    narrow = mixture_spec(_model(tied=False, width=64, layers=2), "IQ4_XS")
    assert narrow.for_layer("blocks.0.attn.wq")[0] == "IQ4_NL" and narrow.for_layer("head")[0] == "Q8_0"


@pytest.mark.parametrize("kind", K_QUANTS)
def test_the_error_is_the_type_s_and_edge_blocks_are_exact(kind):
    torch.manual_seed(0)
    w = torch.randn(16, 512) * 0.02
    w[0, :256] = 0  # an all-zero super-block
    w[1, :32] = 0.01  # a sub-block of equal values
    w[2, 256:] = -0.03  # a super-block of one negative value
    blocks = quantize_blocks(w, kind)
    assert blocks.shape == (16, 2 * TYPES[kind].bytes) and blocks.dtype == torch.uint8
    back = dequantize(blocks, kind, 512)
    assert torch.equal(back[0, :256], torch.zeros(256))
    err = (back[3:] - w[3:]).pow(2).mean().sqrt() / w[3:].pow(2).mean().sqrt()
    bound = {"Q2_K": 0.5, "Q3_K": 0.25, "Q4_K": 0.11, "Q5_K": 0.055, "Q6_K": 0.03}[kind]
    assert err < bound  # about 2^-bits of the spread, as llama.cpp's
    if kind not in ("Q2_K", "Q3_K"):  # (their 4- and 6-bit scales against one d do not hit every value exactly)
        torch.testing.assert_close(back[2, 256:], w[2, 256:], rtol=2e-3, atol=0)
    assert torch.equal(quantize_blocks(w[3:5], kind), blocks[3:5])  # a row's blocks do not depend on the others


def _model(tied: bool, width: int = 256, layers: int = 8) -> torch.nn.Module:
    cfg = get_preset("llama2-7b-tiny")
    cfg = dataclasses.replace(
        cfg, d_model=width, n_layers=layers, tie_embeddings=tied, ffn=dataclasses.replace(cfg.ffn, hidden_dim=2 * width)
    )
    torch.manual_seed(0)
    return build_model(cfg).eval()


def test_q4_k_m_gives_attn_v_and_ffn_down_more_bits_as_llama_cpp_does():
    model = _model(tied=False)
    spec = mixture_spec(model, "q4_k_m")
    more = [i for i in range(8) if more_bits(i, 8)]
    assert more == [0, 3, 6, 7]  # the first and last eighth, and every third layer between
    for i in range(8):
        assert spec.for_layer(f"blocks.{i}.attn.wv")[0] == ("Q6_K" if i in more else "Q4_K")
        assert spec.for_layer(f"blocks.{i}.ffn.w2")[0] == ("Q6_K" if i in more else "Q4_K")
        assert spec.for_layer(f"blocks.{i}.attn.wq")[0] == "Q4_K"
        assert spec.for_layer(f"blocks.{i}.ffn.w1")[0] == "Q4_K"
    assert spec.for_layer("head")[0] == "Q6_K" and spec.embedding == "Q4_K"
    s = mixture_spec(model, "Q4_K_S")
    assert [s.for_layer(f"blocks.{i}.attn.wv")[0] for i in range(8)] == ["Q5_K"] * 4 + ["Q4_K"] * 4
    assert [s.for_layer(f"blocks.{i}.ffn.w2")[0] for i in range(8)] == ["Q5_K"] + ["Q4_K"] * 7
    assert mixture_spec(model, "Q5_K_M").for_layer("blocks.3.ffn.w2")[0] == "Q6_K"
    narrow = mixture_spec(_model(tied=False, width=64, layers=2), "Q4_K_M")  # rows not whole super-blocks
    assert narrow.for_layer("blocks.0.attn.wq")[0] == "Q5_0" and narrow.for_layer("head")[0] == "Q8_0"
    assert narrow.for_layer("blocks.1.attn.wv")[0] == "Q8_0" and narrow.embedding == "Q5_0"
    with pytest.raises(InputError, match="unknown mixture 'Q1_K_M'"):
        mixture_spec(model, "Q1_K_M")


def test_the_2_and_3_bit_mixtures_are_llama_cpp_s():
    """llama_tensor_get_type for Q2_K and Q3_K_S / M / L on a dense decoder: the head Q6_K; attn_v, ffn_down and
    attn_output raised (Q2_K: Q4_K where 4+ query heads share a key/value head, else Q3_K; Q3_K; Q3_K. Q3_K_M: Q5_K in
    the first two layers then Q4_K; Q5_K in the first sixteenth then Q4_K; Q4_K. Q3_K_L: Q5_K for all three); the
    embedding table in the base type; Q4_0 on rows that are not whole super-blocks."""
    model = _model(tied=False, layers=32)  # 4 query heads over 4 key/value heads
    q2 = mixture_spec(model, "Q2_K")
    assert q2.for_layer("head")[0] == "Q6_K" and q2.embedding == "Q2_K"
    assert {q2.for_layer(f"blocks.{i}.attn.wv")[0] for i in range(32)} == {"Q3_K"}
    assert {q2.for_layer(f"blocks.{i}.ffn.w2")[0] for i in range(32)} == {"Q3_K"}
    assert q2.for_layer("blocks.7.attn.wo")[0] == "Q3_K" and q2.for_layer("blocks.7.ffn.w1")[0] == "Q2_K"
    cfg = dataclasses.replace(model.cfg, attention=dataclasses.replace(model.cfg.attention, n_kv_heads=1))
    assert mixture_spec(build_model(cfg), "q2_k").for_layer("blocks.9.attn.wv")[0] == "Q4_K"
    m = mixture_spec(model, "Q3_K_M")
    assert [m.for_layer(f"blocks.{i}.attn.wv")[0] for i in range(4)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert [m.for_layer(f"blocks.{i}.ffn.w2")[0] for i in range(4)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    assert m.for_layer("blocks.30.attn.wo")[0] == "Q4_K" and m.for_layer("blocks.30.attn.wq")[0] == "Q3_K"
    big = mixture_spec(model, "Q3_K_L")
    assert {big.for_layer(f"blocks.{i}.{n}")[0] for i in range(32) for n in ("attn.wv", "ffn.w2", "attn.wo")} == {
        "Q5_K"
    }
    small = mixture_spec(model, "Q3_K_S")
    assert {small.for_layer(f"blocks.{i}.{n}")[0] for i in range(32) for n in ("attn.wv", "ffn.w2", "attn.wq")} == {
        "Q3_K"
    }
    assert small.for_layer("head")[0] == "Q6_K" and small.embedding == "Q3_K"
    narrow = mixture_spec(_model(tied=False, width=64, layers=2), "Q3_K_S")
    assert narrow.for_layer("blocks.0.attn.wq")[0] == "Q4_0" and narrow.embedding == "Q4_0"


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_quantized_to_q4_k_m_runs_saves_and_loads(tmp_path, tied):
    from llmkit.interop.checkpoint import load_llmkit, save_llmkit

    model = _model(tied)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(tokens)
    quantize(model, "Q4_K_M")
    assert isinstance(model.head, BlockLinear) and model.head.block.name == "Q6_K"
    assert isinstance(model.embed, QuantizedEmbedding if tied else BlockEmbedding)
    assert model.blocks[3].ffn.w2.block.name == "Q6_K" and model.blocks[4].ffn.w2.block.name == "Q4_K"
    assert "Q4_K" in describe(model) and "Q6_K" in describe(model)
    with torch.no_grad():
        got = model(tokens)
    plain = quantize(_model(tied), "Q4_0", include_head=True)  # what the mixture's extra bits buy
    with torch.no_grad():
        q4_0 = plain(tokens)
    assert (got - exact).norm() < 0.85 * (q4_0 - exact).norm()  # 0.67-0.77 here (random weights, 8 layers)
    loaded = load_llmkit(save_llmkit(model, tmp_path / "q")).model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens), got)
    with pytest.raises(InputError, match="no group size"):
        quantize(_model(tied), "Q4_K_M", group_size=32)


def _awkward_rows() -> torch.Tensor:
    """96 rows of 256 weights of spreads from 1e-4 to 10, with zero, constant, one-signed and outlier blocks, and a
    row of small integers (ties in the codes and between levels)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 256, generator=g) * torch.logspace(-4, 1, 96)[:, None]
    x[0] = 0
    x[1, :32] = 0.5
    x[2] = x[2].abs()
    x[3] = -x[3].abs()
    x[4, 17] = 40.0
    x[5, :16] = 0
    x[6] = torch.randint(-3, 4, (256,), generator=g).float()
    return x


@pytest.mark.skipif(not native.available(), reason="llmkit's C++ extension does not run here")
@pytest.mark.parametrize("kind", K_QUANTS)
def test_the_cpp_quantizer_writes_the_reference_s_bytes(kind):
    """cpu_kquants.cpp (what quantize_blocks runs where the extension builds) against kquants.py, bit for bit, on
    weights of several spreads, with zero, constant, one-signed and outlier sub-blocks."""
    x = _awkward_rows()
    assert torch.equal(native.module().quantize_k(x, TYPES[kind].ggml), kquants.quantize_k(x, kind))


@pytest.mark.skipif(not native.available(), reason="llmkit's C++ extension does not run here")
@pytest.mark.parametrize("kind", IQ4)
def test_the_cpp_iq4_quantizer_writes_the_reference_s_bytes(kind):
    """cpu_kquants.cpp's IQ4_NL / IQ4_XS against iquants.py, bit for bit, on the same kinds of blocks."""
    x = _awkward_rows()
    units = x.reshape(-1, TYPES[kind].weights).contiguous()
    assert torch.equal(native.module().quantize_iq4(units, TYPES[kind].ggml), iquants.quantize_iq4(units, kind))


@pytest.mark.parametrize("tied", [False, True])
def test_quantizing_while_loading_gives_what_quantizing_after_gives(tmp_path, tied):
    """load_model(..., quantize=) quantizes each layer as it is read (the float model is never whole in memory):
    the same blocks and logits as loading the floats and quantizing them, from an llmkit checkpoint and from a
    Hugging Face directory."""
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.interop.hf import save_hf
    from llmkit.interop.load import load_model

    model = _model(tied)
    save_llmkit(model, tmp_path / "ck")
    save_hf(model, tmp_path / "hf", model_type="llama")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    for method in ("Q4_K_M", "Q8_0"):
        after = quantize(load_model(tmp_path / "ck").model.eval(), method, include_head=True)
        for source in ("ck", "hf"):
            during = load_model(tmp_path / source, quantize=method).model.eval()
            assert during.quantization == after.quantization
            mine, theirs = during.state_dict(), after.state_dict()
            assert set(mine) == set(theirs)
            assert all(torch.equal(mine[k], theirs[k]) for k in mine), (method, source)
            with torch.no_grad():
                assert torch.equal(during(tokens), after(tokens))
    with pytest.raises(InputError, match="quantized already"):
        load_model(save_llmkit(after, tmp_path / "q"), quantize="Q4_K_M")
