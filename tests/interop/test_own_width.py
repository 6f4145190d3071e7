"""Half-width Hugging Face checkpoints held at their own width (load_model(..., own_width=True); weights.held_width):
every linear layer, the head and the embedding table are BF16 / F16 block layers over the memory-mapped files, the
activations fp32, and the model computes what the same checkpoint loaded in fp32 computes (the weights are the same
numbers; only the order of the fp32 sums differs), through the C++ decode step where it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkit.generate import generate
from llmkit.interop.load import load_model
from llmkit.quant import native
from llmkit.quant.block_linear import BlockLinear

from .hf_models import transformers

needs_native = pytest.mark.skipif(not native.available(), reason="llmkit's C++ kernels do not run here")


def _llama(directory: Path, dtype: torch.dtype, tied: bool, width: int = 64, layers: int = 2) -> Path:
    """A tiny Llama saved in `dtype` (every layer's inputs whole blocks of 32)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=width, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * width, max_position_embeddings=256, tie_word_embeddings=tied,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    d = directory / f"llama-{dtype}-{'tied' if tied else 'untied'}-{width}"
    model.to(dtype).save_pretrained(d)
    return d


def _mapped_files(t: torch.Tensor) -> set[str]:
    """The files whose memory map holds tensor t's data (from /proc/self/maps)."""
    at, found = t.data_ptr(), set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= at < hi and len(fields) >= 6:
            found.add(fields[5])
    return found


@needs_native
@pytest.mark.parametrize(("dtype", "kind"), [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
@pytest.mark.parametrize("tied", [False, True])
def test_a_half_width_checkpoint_is_held_as_stored_and_computes_what_fp32_does(tmp_path, dtype, kind, tied):
    d = _llama(tmp_path, dtype, tied)
    held = load_model(d, own_width=True).model.eval()
    fp32 = load_model(d, dtype=torch.float32).model.eval()
    assert held.dtype == torch.float32
    linears = [m for m in held.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 2 * 7 + 1 and all(m.block.name == kind for m in linears)  # the head too
    assert not any(type(m) is torch.nn.Linear for m in held.modules())
    q = held.blocks[0].attn.wq
    assert str(d / "model.safetensors") in _mapped_files(q.blocks)  # a view of the file, not a copy
    stored = load_model(d, dtype=dtype).model.blocks[0].attn.wq.weight
    assert torch.equal(q.blocks.view(dtype), stored)  # the file's numbers
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = fp32(tokens)
        torch.testing.assert_close(held(tokens), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    from llmkit.quant.native_step import NativeDecoder

    assert NativeDecoder.of(held) is not None  # decoding runs in the C++ step
    a, b = (generate(m, tokens[:, :4], max_new_tokens=8).new_tokens for m in (held, fp32))
    assert a == b  # the same numbers up to the sums' order: the same greedy tokens
    from llmkit.generate.step import DecodeStep

    # the C++ step and the PyTorch modules over the same block layers: the same tokens
    fast, eager = (generate(held, tokens[:, :4], max_new_tokens=8, step=s).new_tokens for s in (None, DecodeStep(held)))
    assert fast == eager


@needs_native
def test_own_width_applies_only_where_it_was_asked_for_and_fits(tmp_path):
    bf16 = _llama(tmp_path, torch.bfloat16, tied=False)
    asked = load_model(bf16, dtype=torch.bfloat16, own_width=True).model  # a dtype: PyTorch's layers in it
    assert asked.dtype == torch.bfloat16 and not any(isinstance(m, BlockLinear) for m in asked.modules())
    plain = load_model(bf16).model  # the library's default: the checkpoint's dtype, PyTorch's layers
    assert plain.dtype == torch.bfloat16 and not any(isinstance(m, BlockLinear) for m in plain.modules())
    fp32 = _llama(tmp_path, torch.float32, tied=False)
    assert not any(isinstance(m, BlockLinear) for m in load_model(fp32, own_width=True).model.modules())
    odd = _llama(tmp_path, torch.bfloat16, tied=False, width=48)  # inputs of 48: not whole blocks of 32
    model = load_model(odd, own_width=True).model
    assert model.dtype == torch.bfloat16 and not any(isinstance(m, BlockLinear) for m in model.modules())


CHILD = """
import json, sys
from llmkit.interop.load import load_model
def rss():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024
load_model(sys.argv[1], own_width=True)  # once: every lazy import and allocator pool in place
before = rss()
loaded = load_model(sys.argv[1], own_width=True)
after = rss()
from llmkit.quant import weight_bytes
print(json.dumps({"growth": after - before, "weights": weight_bytes(loaded.model)}))
"""


@needs_native
@pytest.mark.slow
def test_loading_a_bf16_checkpoint_reads_none_of_its_weights(tmp_path):
    """The layers are views of the mapped file, so loading a second time in a child process grows its resident memory
    by less than a fifth of the weights' bytes (the norms are copied; nothing of the blocks is read until used)."""
    d = _llama(tmp_path, torch.bfloat16, tied=False, width=512, layers=6)
    out = subprocess.run([sys.executable, "-c", CHILD, str(d)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["weights"] > 20e6
    assert r["growth"] < 0.2 * r["weights"], r
