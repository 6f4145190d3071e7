"""GGUF files of the llama, qwen2 and qwen3 architectures against transformers' own GGUF loader: the same logits from
a file written in the test (random weights; qwen2's q / k / v biases, qwen3's QK-norm and heads wider than width /
heads), and the same logits again when llmkit keeps the file's blocks quantized."""

from __future__ import annotations

import pytest
import torch
from gguf_files import write_gguf

from llmkit.interop.gguf import load_gguf
from llmkit.quant import QuantizedLinear

transformers = pytest.importorskip("transformers")

ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}}  # transformers reads no key_length: 128


def theirs(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_architectures_give_transformers_logits(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, {}, seed=3, arch=arch, **ARCHS[arch])
    ours = load_gguf(path, quantized=False)
    assert ours.hf_model_type == arch
    assert ours.model.cfg.attention.qkv_bias == (arch == "qwen2")
    assert ours.model.cfg.attention.qk_norm == (arch == "qwen3")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours.model(tokens), theirs(path)(tokens).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_quantized_blocks_of_other_architectures_stay_quantized(tmp_path, arch):
    path = tmp_path / f"{arch}-q.gguf"
    write_gguf(path, {"ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q4_0", "attn_q": "Q5_0"}, arch=arch)
    q, f = load_gguf(path, quantized=True), load_gguf(path, quantized=False)
    assert sum(isinstance(m, QuantizedLinear) for m in q.model.modules()) == 2 * 4
    for m in q.model.modules():
        if isinstance(m, QuantizedLinear):
            m.kernel = "dequant"  # type: ignore[assignment]
            m.prepare()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(q.model(tokens), f.model(tokens), atol=1e-5, rtol=1e-5)


def test_an_architecture_it_does_not_read_is_refused_by_name(tmp_path):
    from llmkit.errors import ConfigError

    path = tmp_path / "gemma.gguf"
    write_gguf(path, {}, arch="gemma2")
    with pytest.raises(ConfigError, match="'gemma2' is not supported"):
        load_gguf(path)
