"""Helpers shared by test modules."""

import socket
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from llmkit.tokenizer import Tokenizer


def byte_level_bpe(text: str, vocab_size: int) -> Backend:
    """A byte-level BPE trained on `text` (any text encodes), with <s> and </s> as ids 0 and 1."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([text] * 20, trainer)
    return backend


def tiny_tokenizer() -> Tokenizer:
    backend = byte_level_bpe("to be or not to be, that is the question", 300)
    return Tokenizer(backend, bos_id=0, eos_id=1, add_bos=True, chat_template="{{ messages }}")


def one_line_error(err: str) -> str:
    """The error line of a failed command (captured stderr), checked to be all it said and not a traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmkit "), err
    return lines[0]


def fuzz_settings() -> object:
    """Hypothesis settings shared by the fuzz tests: a bounded number of examples (40; LLMKIT_FUZZ_EXAMPLES=N for
    more), the same examples every run (a failure in CI is a failure on every machine) unless LLMKIT_FUZZ_RANDOM=1
    draws new ones, no deadline (a busy machine is not a failure)."""
    import os

    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=int(os.environ.get("LLMKIT_FUZZ_EXAMPLES", "40")),
        deadline=None,
        derandomize=os.environ.get("LLMKIT_FUZZ_RANDOM") != "1",
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that lour'd "
    "upon our house in the deep bosom of the ocean buried. To be, or not to be, that is the question."
)


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE of TEXT (360 tokens), <s> and </s> first (</s> pads), no start token added."""
    return Tokenizer(byte_level_bpe(TEXT, 400), bos_id=0, eos_id=1, pad_id=1, add_bos=False)


def save_tiny(folder: Path, family: str, context: int = 128) -> Path:
    """A random two-block model of `family` (llama or qwen2) and the byte tokenizer, as a Hugging Face directory;
    `context`: its max_position_embeddings."""
    transformers = pytest.importorskip("transformers")
    tok = byte_tokenizer()
    shape = dict(
        vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=context, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save(folder)
    return folder


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the processes a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
