"""Importance matrices (llmkit.interop.imatrix) and quantizing with them (llmkit.quant.weighted): what is collected is
each layer's mean square input, the file is llama.cpp's format, the weighted quantizers write the bytes
`llama-quantize --imatrix` wrote and lower the error that the importance weighs, and the commands use them."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import one_line_error, tiny_tokenizer

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.errors import InputError
from llmkit.interop.checkpoint import save_llmkit
from llmkit.interop.imatrix import ImportanceMatrix, collect, gguf_names, load_imatrix, text_chunks
from llmkit.interop.load import load_model
from llmkit.quant import native, quantize
from llmkit.quant.blocks import dequantize, quantize_blocks
from llmkit.quant.mixtures import mixture_spec
from llmkit.quant.weighted import WEIGHTED, quantize_weighted, quantize_weighted_reference

FIXTURE = Path(__file__).with_name("llama_quantize_imatrix_blocks.npz")


def _model(width: int = 256, layers: int = 2, vocab: int = 320) -> torch.nn.Module:
    cfg = get_preset("llama2-7b-tiny")
    cfg = dataclasses.replace(
        cfg, d_model=width, n_layers=layers, vocab_size=vocab, ffn=dataclasses.replace(cfg.ffn, hidden_dim=2 * width)
    )
    torch.manual_seed(0)
    return build_model(cfg).eval()


def _blocks(layer: torch.nn.Module) -> torch.Tensor:
    """A block layer's blocks in the file's layout (whatever its kernels hold)."""
    return layer.state_dict()["blocks"]


def test_the_bytes_are_llama_quantize_imatrix_s():
    """Two rows of each type as `llama-quantize --imatrix` (llama.cpp 0c1e570) wrote them from the bf16 file of random
    weights of Qwen2.5-1.5B's shape, with an importance matrix llmkit wrote (exp of normal values per input): Q4_K,
    Q6_K (Q4_K_M), Q5_K (Q5_K_M), IQ4_XS, IQ4_NL, Q4_0 and Q4_1 (Q4_0: ffn_down of the first eighth of the layers is
    Q4_1 with an importance matrix), Q5_0 and Q5_1, Q2_K and Q3_K (Q2_K). When this was written every block of the
    first 64 rows of four tensors of each type in each file was compared (all equal)."""
    data = np.load(FIXTURE)
    kinds = sorted(k for k in data.files if not k.endswith(("_bf16", "_importance")))
    assert set(kinds) == set(WEIGHTED)
    for kind in kinds:
        x = torch.from_numpy(data[kind + "_bf16"].astype(np.int32) << 16).view(torch.float32)
        importance = torch.from_numpy(data[kind + "_importance"])
        assert np.array_equal(quantize_blocks(x, kind, importance).numpy(), data[kind]), kind
        assert np.array_equal(quantize_weighted_reference(x, kind, importance).numpy(), data[kind]), kind


@pytest.mark.skipif(native.module() is None, reason="needs llmkit's C++ extension")
def test_the_cpp_quantizers_give_the_reference_bytes():
    torch.manual_seed(0)
    w = torch.randn(24, 1536) * 0.02
    w[0, :256] = 0  # all zeros
    w[1, :32] = 0.01  # a block of one value
    importance = torch.randn(1536).exp()
    importance[:64] = 0  # inputs never seen
    for kind in WEIGHTED:
        assert torch.equal(quantize_weighted(w, kind, importance), quantize_weighted_reference(w, kind, importance))


@pytest.mark.parametrize("kind", WEIGHTED)
def test_the_importance_lowers_the_error_it_weighs(kind):
    """Inputs whose importance is 100x the others' are fitted better: the importance-weighted squared error of the
    weights is smaller than without the matrix (and than with a flat one, which is a valid weighting too)."""
    torch.manual_seed(0)
    w = torch.randn(64, 512) * 0.02
    importance = torch.ones(512)
    importance[torch.randperm(512)[:64]] = 100.0

    def error(blocks: torch.Tensor) -> float:
        return float((importance * (dequantize(blocks, kind, 512) - w) ** 2).sum())

    weighted, plain = error(quantize_blocks(w, kind, importance)), error(quantize_blocks(w, kind))
    assert weighted < 0.9 * plain, (weighted, plain)
    assert torch.equal(quantize_blocks(w[3:5], kind, importance), quantize_blocks(w, kind, importance)[3:5])


def test_types_that_do_not_use_it_ignore_it():
    w = torch.randn(4, 256)
    imp = torch.rand(256)
    for kind in ("Q8_0", "BF16", "F16"):
        assert torch.equal(quantize_blocks(w, kind, imp), quantize_blocks(w, kind))
    with pytest.raises(InputError, match="an importance row of 128 inputs for a matrix of 256"):
        quantize_blocks(w, "Q4_K", imp[:128])


def test_collect_sums_the_squares_of_each_layer_s_inputs():
    model = _model()
    chunks = [[1, 5, 9, 200, 7, 3, 3, 8], [2, 4, 6, 8, 10, 12, 14, 16]]
    m = collect(model, chunks, dataset="t", context=8)
    names = gguf_names(model)
    assert names["blocks.0.attn.wq"] == "blk.0.attn_q.weight" and names["head"] == "output.weight"
    assert set(m.sums) == set(names.values()) and m.chunks == 2 and m.chunk_size == 8
    # the first layer's query projection sees the first norm of the embeddings: its mean square, by hand
    ids = torch.tensor(chunks)
    with torch.no_grad():
        x = model.blocks[0].attn_residual.norm(model.embed(ids)).reshape(-1, 256).double()
    assert m.counts["blk.0.attn_q.weight"] == 16
    torch.testing.assert_close(m.importance("blk.0.attn_q.weight"), (x * x).mean(0).float())
    assert torch.equal(m.importance("blk.0.attn_q.weight"), m.importance("blk.0.attn_v.weight"))  # the same input
    assert m.importance("nothing.weight") is None


def test_the_file_is_llama_cpp_s_format_and_reads_back(tmp_path):
    import gguf

    m = ImportanceMatrix(
        sums={"blk.0.attn_q.weight": torch.arange(1.0, 5.0, dtype=torch.float64)},
        counts={"blk.0.attn_q.weight": 4.0},
        chunks=3,
        chunk_size=512,
        datasets=["shakespeare"],
    )
    m.save(tmp_path / "m.gguf")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.chunk_count"].contents() == 3 and r.fields["imatrix.chunk_size"].contents() == 512
    assert r.fields["imatrix.datasets"].contents() == ["shakespeare"]
    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    assert np.array_equal(tensors["blk.0.attn_q.weight.in_sum2"].reshape(-1), [1, 2, 3, 4])
    assert np.array_equal(tensors["blk.0.attn_q.weight.counts"].reshape(-1), [4])
    back = load_imatrix(tmp_path / "m.gguf")
    assert torch.equal(back.importance("blk.0.attn_q.weight"), torch.tensor([0.25, 0.5, 0.75, 1.0]))
    assert back.datasets == ["shakespeare"] and back.chunks == 3


def test_the_legacy_binary_format_reads_and_a_damaged_one_is_one_line(tmp_path):
    name = b"blk.0.ffn_down.weight"
    values = np.array([2.0, 4.0, 6.0], dtype="<f4")
    raw = struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 2, 3) + values.tobytes()
    raw += struct.pack("<ii", 7, 4) + b"wiki"
    (tmp_path / "m.dat").write_bytes(raw)
    m = load_imatrix(tmp_path / "m.dat")
    assert torch.equal(m.importance("blk.0.ffn_down.weight"), torch.tensor([1.0, 2.0, 3.0]))  # sums / calls
    assert m.chunks == 7 and m.datasets == ["wiki"]
    (tmp_path / "cut.dat").write_bytes(raw[:30])
    with pytest.raises(InputError, match="ends inside an entry"):
        load_imatrix(tmp_path / "cut.dat")
    with pytest.raises(InputError, match="cannot read the importance matrix"):
        load_imatrix(tmp_path / "none.dat")


def test_a_matrix_of_another_model_is_refused_by_name():
    small, wide = _model(), _model(width=512)
    m = collect(small, [[1, 2, 3, 4]])
    with pytest.raises(InputError, match=r"output\.weight has 256 inputs but the model.s head takes 512"):
        m.for_model(wide)


def test_quantize_with_an_importance_matrix_weights_the_layers_it_names():
    model = _model()
    m = collect(model, [[1, 5, 9, 200, 7, 3, 3, 8]])
    weighted = quantize(_model(), "Q4_K_M", importance=m.for_model(model))
    plain = quantize(_model(), "Q4_K_M")
    wq = model.blocks[0].attn.wq.weight
    imp = m.importance("blk.0.attn_q.weight")
    assert torch.equal(_blocks(weighted.blocks[0].attn.wq), quantize_blocks(wq, "Q4_K", imp))
    assert not torch.equal(_blocks(weighted.blocks[0].attn.wq), _blocks(plain.blocks[0].attn.wq))
    assert torch.equal(_blocks(weighted.embed), _blocks(plain.embed))  # a lookup table: no inputs to weigh
    with pytest.raises(InputError, match="not llmkit's int8"):
        quantize(_model(), "int8", importance=m.for_model(model))


def test_iq4_mixtures_keep_ffn_down_in_their_type_with_an_importance_matrix():
    model = _model(layers=8)
    assert mixture_spec(model, "IQ4_XS").for_layer("blocks.0.ffn.w2")[0] == "Q5_K"
    assert mixture_spec(model, "IQ4_XS", importance=True).for_layer("blocks.0.ffn.w2")[0] == "IQ4_XS"


def test_text_chunks():
    assert text_chunks(list(range(10)), 4, bos=99) == [[99, 0, 1, 2], [99, 3, 4, 5], [99, 6, 7, 8]]
    assert text_chunks(list(range(10)), 5, bos=None, limit=1) == [[0, 1, 2, 3, 4]]
    with pytest.raises(InputError, match="less than one chunk of 64"):
        text_chunks(list(range(10)), 64, bos=None)


def test_the_commands_compute_write_and_use_a_matrix(tmp_path, capsys):
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320)).eval()
    ck = save_llmkit(model, tmp_path / "ck", tokenizer=tiny_tokenizer())
    text = tmp_path / "calib.txt"
    text.write_text("to be or not to be, that is the question\n" * 40)
    assert main(["imatrix", str(ck), str(text), str(tmp_path / "m.gguf"), "--chunks", "3", "--context", "32"]) == 0
    capsys.readouterr()
    m = load_imatrix(tmp_path / "m.gguf")
    assert m.chunks == 3 and m.chunk_size == 32 and "blk.1.ffn_down.weight" in m.sums
    # from the file, and computed from the text on the way: the same matrix, so the same checkpoint
    assert main(["quantize", str(ck), str(tmp_path / "a"), "--to", "q4_0", "--imatrix", str(tmp_path / "m.gguf")]) == 0
    assert (
        main(
            ["quantize", str(ck), str(tmp_path / "b"), "--to", "q4_0", "--imatrix", str(text), "--imatrix-chunks", "3"]
        )
        == 2
    )  # fmt: skip  (its chunks are 512 tokens: the text is shorter)
    assert "less than one chunk of 512" in one_line_error(capsys.readouterr().err)
    assert main(["quantize", str(ck), str(tmp_path / "c"), "--to", "q4_0"]) == 0
    a, c = load_model(tmp_path / "a").model, load_model(tmp_path / "c").model
    wq = model.blocks[0].attn.wq.weight
    assert torch.equal(_blocks(a.blocks[0].attn.wq), quantize_blocks(wq, "Q4_0", m.importance("blk.0.attn_q.weight")))
    assert not torch.equal(_blocks(a.blocks[0].attn.wq), _blocks(c.blocks[0].attn.wq))
    assert main(["quantize", str(ck), str(tmp_path / "d"), "--to", "int8", "--imatrix", str(text)]) == 2
    assert "--imatrix weighs llama.cpp's block types" in one_line_error(capsys.readouterr().err)
    out = tmp_path / "w.gguf"
    assert (
        main(["convert", str(ck), str(out), "--to", "gguf", "--quant", "q4_0", "--imatrix", str(tmp_path / "m.gguf")])
        == 0
    )
    assert torch.equal(_blocks(load_model(out).model.blocks[0].attn.wq), _blocks(a.blocks[0].attn.wq))
