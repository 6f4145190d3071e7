"""Failures of the machine and careless flags on the command line: one line naming what and where and what to do,
a non-zero exit status, no traceback (`--debug` or LLMKIT_DEBUG=1 shows it)."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest
import torch
from helpers import one_line_error, tiny_tokenizer

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.cli.failure import describe
from llmkit.errors import InputError
from llmkit.interop.checkpoint import save_llmkit
from llmkit.machine.devices import check_device


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320)).eval()
    return save_llmkit(model, tmp_path_factory.mktemp("ck") / "ck", tokenizer=tiny_tokenizer())


def generate(ck: Path, *flags: str) -> list[str]:
    return ["generate", str(ck), "--prompt", "to be", "--max-new-tokens", "3", *flags]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "tpu:7"], "--device 'tpu:7' is not a device: use cpu, cuda, cuda:N or mps"),
        (["--device", "banana"], "--device 'banana' is not a device"),
        (["--seed", str(2**70)], "--seed 1180591620717411303424 is out of range"),
        (["--seed", str(-(2**70))], "is out of range"),
        (["--stop", ""], "--stop '' is empty"),
        (["--temperature", "nan"], "temperature=nan must be a finite number"),
        (["--repetition-penalty", "nan"], "repetition_penalty=nan must be a finite number"),
    ],
)
def test_flags_that_cannot_work_are_one_line(ck, capsys, flags, message):
    assert main(generate(ck, *flags)) == 2
    assert message in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("flags", [["--temperature", "1e-300"], ["--top-p", "1e-300"], ["--temperature", "5e-324"]])
def test_extreme_but_finite_sampling_settings_give_a_result(ck, capsys, flags):
    """A temperature or top_p this small is greedy decoding in effect, not a traceback from the sampler."""
    assert main(generate(ck, *flags, "--seed", "0")) == 0
    greedy = capsys.readouterr().out
    assert main(generate(ck, "--temperature", "0")) == 0
    assert capsys.readouterr().out == greedy


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_cuda_without_cuda_is_one_line(ck, capsys):
    assert main(generate(ck, "--device", "cuda")) == 2
    assert "--device 'cuda': CUDA is not available here" in one_line_error(capsys.readouterr().err)


def test_devices_are_checked_against_this_machine():
    assert check_device("cpu") == torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(InputError, match="CUDA"):
        check_device(f"cuda:{count}")  # one past the last (or CUDA itself missing)
    with pytest.raises(InputError, match=r"not on xla devices"):
        check_device("xla")


def test_debug_shows_the_traceback(ck, monkeypatch):
    with pytest.raises(InputError, match="is not a device"):
        main(["--debug", *generate(ck, "--device", "tpu:7")])
    with pytest.raises(InputError, match="is not a device"):
        main([*generate(ck, "--device", "tpu:7"), "--debug"])
    monkeypatch.setenv("LLMKIT_DEBUG", "1")
    with pytest.raises(InputError, match="is not a device"):
        main(generate(ck, "--device", "tpu:7"))


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (PermissionError(errno.EACCES, "Permission denied", "/data/x"), "/data/x: permission denied: check"),
        (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/out"), "/mnt/ro/out: the file system is read-only"),
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device: free some space"),
        (OSError(errno.ELOOP, "Too many levels of symbolic links", "a"), "a: too many levels of symbolic links"),
        (OSError(errno.ENODEV, "No such device", "/dev/nvme9"), "/dev/nvme9: no such device"),
        (OSError(errno.EXDEV, "Invalid cross-device link", "a", None, "b"), "a -> b: the paths are on different"),
        (MemoryError(), "out of memory"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB"), "out of memory"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "not UTF-8"),
    ],
)
def test_the_machine_s_failures_in_words(error, expected):
    assert expected in (describe(error) or "")


def test_other_failures_keep_their_traceback():
    assert describe(ValueError("a bug")) is None
    assert describe(RuntimeError("shape mismatch")) is None


def test_an_os_error_in_a_command_is_one_line_with_exit_status_1(ck, capsys, monkeypatch):
    def fails(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(ck / "model.safetensors"))

    # (the check every load makes: file_digest itself is skipped where an earlier load, long enough after the save,
    # stamped the file's digest, as on a slow machine; interop/stamps.py)
    monkeypatch.setattr("llmkit.interop.checkpoint.stamped_digest", fails)
    assert main(generate(ck)) == 1
    assert "model.safetensors: input/output error" in one_line_error(capsys.readouterr().err)


def test_a_reader_that_goes_away_ends_the_command_quietly(ck):
    """`llmkit generate ... | head -c 10`: more than a pipe's 64 KiB of text, the reader gone after 10 bytes."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "llmkit", *generate(ck, "--samples", "400", "--temperature", "1")]
    command[command.index("3")] = "200"  # --max-new-tokens: 400 x 200 tokens, at least a byte each
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    assert len(child.stdout.read(10)) == 10
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait() == 141 and "Traceback" not in err and "error" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculate", "2"], "--speculate applies with --mtp, --draft or --ngram, --draft-head-bits with --mtp"),
        (["--draft", "X", "--draft-head-bits", "8"], "--draft-head-bits with --mtp"),
        (["--mtp", "--draft", "X"], "--mtp, --draft and --ngram are three drafters: give one"),
        (["--ngram", "--mtp"], "--mtp, --draft and --ngram are three drafters: give one"),
        (["--mtp", "--speculate", "40"], "--speculate 40 is out of range: it must be 1 to 16"),
        (["--mtp", "--draft-head-bits", "3"], "--draft-head-bits 3 is out of range"),
        (["--mtp"], "speculative serving drafts with the model's multi-token-prediction module, and this model has"),
    ],
)
def test_serve_refuses_speculation_it_cannot_do_in_one_line(ck, capsys, flags, message):
    """Before it listens: no server starts on a port for flags that cannot work (this checkpoint has no MTP module,
    which is found once it is loaded: the error is the one line after the loading lines)."""
    assert main(["serve", str(ck), "--port", "1", *flags]) == 2
    err = "".join(line for line in capsys.readouterr().err.splitlines(True) if not line.startswith("loaded "))
    assert message in one_line_error(err)


def test_serve_refuses_a_draft_with_another_vocabulary(ck, tmp_path, capsys):
    torch.manual_seed(1)
    other = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=300)).eval()
    draft = save_llmkit(other, tmp_path / "draft", tokenizer=tiny_tokenizer())
    assert main(["serve", str(ck), "--port", "1", "--draft", str(draft)]) == 2
    err = "".join(line for line in capsys.readouterr().err.splitlines(True) if not line.startswith("loaded "))
    assert "the draft's vocabulary (300) differs from the model's (320)" in one_line_error(err)
