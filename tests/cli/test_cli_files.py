"""The commands that write files, used as a careless user would: over their own input, over an existing
checkpoint or data folder, into a file, onto a full or read-only disk. Each answer is one line on stderr and a
non-zero exit status, and what was there before is still there and still loads."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest
import torch
from helpers import one_line_error, tiny_tokenizer
from safetensors import SafetensorError

from llmkit import build_model, get_preset
from llmkit.cli import main
from llmkit.interop.checkpoint import save_llmkit
from llmkit.interop.load import load_model
from llmkit.outputs import leftovers

CORPUS = "to be or not to be, that is the question\nwhether tis nobler in the mind to suffer\n" * 30


def tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320)).eval()
    return save_llmkit(model, path, tokenizer=tiny_tokenizer())


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    return tiny_checkpoint(tmp_path / "ck")


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text(CORPUS)
    return path


@pytest.mark.parametrize(
    "command",
    [["convert", "{ck}", "{ck}", "--to", "hf"], ["quantize", "{ck}", "{ck}", "--to", "int8"]],
    ids=["convert", "quantize"],
)
@pytest.mark.parametrize("overwrite", [False, True])
def test_convert_and_quantize_never_write_over_their_input(ck, capsys, command, overwrite):
    before = snapshot(ck)
    args = [a.format(ck=ck) for a in command] + (["--overwrite"] if overwrite else [])
    assert main(args) == 2
    assert "is also the input" in one_line_error(capsys.readouterr().err)
    assert snapshot(ck) == before
    load_model(ck)


def test_quantize_into_a_checkpoint_of_a_run_is_inside_its_input(tmp_path, capsys):
    run = tmp_path / "run"
    tiny_checkpoint(run / "checkpoints" / "step-000001")
    (run / "checkpoints" / "step-000001" / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    assert main(["quantize", str(run), str(run / "checkpoints" / "q"), "--to", "int8"]) == 2
    assert "inside its input" in one_line_error(capsys.readouterr().err)


def test_an_existing_checkpoint_is_replaced_only_with_overwrite(ck, tmp_path, capsys):
    out = tiny_checkpoint(tmp_path / "out", seed=1)
    before = snapshot(out)
    assert main(["quantize", str(ck), str(out), "--to", "int8"]) == 2
    assert "already exists (a checkpoint): give --overwrite" in one_line_error(capsys.readouterr().err)
    assert snapshot(out) == before
    assert main(["quantize", str(ck), str(out), "--to", "int8", "--overwrite"]) == 0
    assert snapshot(out) != before and load_model(out).model is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]  # nothing left beside them


def test_convert_onto_a_file_or_a_folder_of_other_things(ck, tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    assert main(["convert", str(ck), str(tmp_path / "afile"), "--overwrite"]) == 2
    assert "afile is a file" in one_line_error(capsys.readouterr().err)
    assert (tmp_path / "afile").read_text() == "mine"
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("years of work")
    assert main(["convert", str(ck), str(tmp_path / "home"), "--overwrite"]) == 2
    assert "other files" in one_line_error(capsys.readouterr().err)
    assert (tmp_path / "home" / "thesis.tex").read_text() == "years of work"


def test_prepare_never_writes_over_its_input_a_checkpoint_or_a_run(ck, corpus, tmp_path, capsys):
    before = snapshot(ck)
    assert main(["prepare", str(corpus), "--out", str(ck), "--vocab-size", "300", "--overwrite"]) == 2
    assert "is a checkpoint: a data folder is never written over it" in one_line_error(capsys.readouterr().err)
    assert snapshot(ck) == before and load_model(ck).model is not None
    assert main(["prepare", str(corpus), "--out", str(corpus), "--vocab-size", "300"]) == 2
    assert "is also the input" in one_line_error(capsys.readouterr().err)
    assert corpus.read_text() == CORPUS
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "run"), "--vocab-size", "300", "--overwrite"]) == 2
    assert "is a training run" in one_line_error(capsys.readouterr().err)
    tokenizer = ["--tokenizer", str(ck)]
    assert main(["prepare", str(corpus), "--out", str(ck / "data"), *tokenizer]) == 2
    assert "inside its input" in one_line_error(capsys.readouterr().err)


def test_prepare_replaces_a_data_folder_only_with_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["prepare", str(corpus), "--out", str(out), "--vocab-size", "300"]) == 0
    first = snapshot(out)
    capsys.readouterr()
    assert main(["prepare", str(corpus), "--out", str(out), "--vocab-size", "290"]) == 2
    assert "already exists (a prepared data folder): give --overwrite" in one_line_error(capsys.readouterr().err)
    assert snapshot(out) == first
    assert main(["prepare", str(corpus), "--out", str(out), "--vocab-size", "290", "--overwrite"]) == 0
    assert snapshot(out) != first


def full_disk(*args: object, **kwargs: object) -> None:
    """safetensors' save_file when the disk is full (its own error type, as the library raises it)."""
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_is_one_line_and_leaves_the_old_checkpoint(ck, tmp_path, capsys, monkeypatch):
    out = tiny_checkpoint(tmp_path / "out", seed=1)
    before = snapshot(out)
    monkeypatch.setattr("llmkit.interop.safetensors_io.save_file", full_disk)
    for command in (["convert", str(ck), str(tmp_path / "new")], ["quantize", str(ck), str(out), "--to", "int8"]):
        assert main([*command, "--overwrite"]) == 1
        line = one_line_error(capsys.readouterr().err)
        assert "no space left on the device" in line and "model.safetensors" in line
    assert not (tmp_path / "new").exists() and snapshot(out) == before
    assert leftovers(out, "tmp") == [] and leftovers(tmp_path / "new", "tmp") == []


def test_a_read_only_disk_and_a_denied_permission_are_one_line(ck, corpus, tmp_path, capsys, monkeypatch):
    """Simulated (the tests may run as root, for whom chmod denies nothing): the file system's own errors."""
    mkdir = Path.mkdir

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        if tmp_path / "ro" in (self, *self.parents):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "ro" / "data"), "--vocab-size", "300"]) == 1
    assert "ro: the file system is read-only" in one_line_error(capsys.readouterr().err)
    assert main(["convert", str(ck), str(tmp_path / "ro" / "hf"), "--to", "hf"]) == 1
    assert "read-only" in one_line_error(capsys.readouterr().err)
    monkeypatch.undo()

    import llmkit.interop.checkpoint as checkpoint

    def denied(path: object, *args: object, **kwargs: object) -> object:
        if str(path).endswith("model.safetensors"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(checkpoint, "open", denied, raising=False)
    assert main(["generate", str(ck), "--prompt", "to be", "--max-new-tokens", "2"]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert "model.safetensors: permission denied: check the permissions" in line


def test_files_that_are_not_what_they_should_be_are_one_line(ck, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_bytes(b"\xff\n")
    assert main(["generate", str(run), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert "latest does not hold a checkpoint name" in one_line_error(capsys.readouterr().err)
    (tmp_path / "c.yaml").write_bytes(bytes(range(256)))
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    assert "c.yaml is not a YAML text file" in one_line_error(capsys.readouterr().err)
    (ck / "tokenizer.json").write_text('{"garbage')
    assert main(["generate", str(ck), "--prompt", "a", "--max-new-tokens", "2", "--no-verify"]) == 2
    assert "tokenizer.json is not a valid tokenizer file" in one_line_error(capsys.readouterr().err)
    # the same file given to `prepare --tokenizer` was a traceback (Exception: EOF while parsing an object)
    assert (
        main(["prepare", "shakespeare", "--tokenizer", str(ck / "tokenizer.json"), "--out", str(tmp_path / "p")]) == 2
    )
    assert "tokenizer.json is not a valid tokenizer file: EOF" in one_line_error(capsys.readouterr().err)
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    assert main(["generate", str(tmp_path / "loop1"), "--prompt", "a"]) == 1
    assert "loop1: too many levels of symbolic links" in one_line_error(capsys.readouterr().err)


def test_leftovers_of_a_killed_convert_are_removed_at_the_next_start(ck, tmp_path, capsys):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a process that is gone
    leftover = tmp_path / f"hf.tmp-{child.pid}"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half a file")
    assert main(["convert", str(ck), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert not leftover.exists() and (tmp_path / "hf" / "config.json").is_file()
    assert f"removed {leftover}" in capsys.readouterr().err


def test_average_replaces_its_own_average_but_not_another_checkpoint(tmp_path, capsys):
    from llmkit.train.checkpoint import TrainState, save

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320))
    run = tmp_path / "run"
    for step in (1, 2):
        save(run, model, model.state_dict(), {}, TrainState(step, 0, 0.0), 3, tiny_tokenizer(), {})
    assert main(["average", str(run), "--last", "2"]) == 0
    assert main(["average", str(run), "--last", "2"]) == 0  # RUN/averaged is the run's own: replaced freely
    other = tiny_checkpoint(tmp_path / "other", seed=1)
    capsys.readouterr()
    assert main(["average", str(run), "--last", "2", "--out", str(other)]) == 2
    assert "give --overwrite" in one_line_error(capsys.readouterr().err)
    assert main(["average", str(run), "--last", "2", "--out", str(other), "--overwrite"]) == 0


def test_quantize_to_a_gguf_block_type_writes_a_checkpoint_of_blocks(ck, tmp_path, capsys):
    from llmkit.quant.block_linear import BlockLinear

    out = tmp_path / "q4"
    assert main(["quantize", str(ck), str(out), "--to", "q4_0", "--include-head"]) == 0
    assert "Q4_0:" in capsys.readouterr().out
    model = load_model(out).model
    assert isinstance(model.blocks[0].ffn.w2, BlockLinear) and model.head.block.name == "Q4_0"
    assert main(["quantize", str(ck), str(tmp_path / "q8"), "--to", "q8_0", "--group-size", "64"]) == 2
    assert "--group-size is for int8, int4 and fp8" in one_line_error(capsys.readouterr().err)
    # llama.cpp's Q4_K_M mixture; this model's rows (64 wide) are not whole 256-weight super-blocks, so each type
    # falls back as llama.cpp's does: Q4_K to Q5_0, Q6_K to Q8_0
    assert main(["quantize", str(ck), str(tmp_path / "q4km"), "--to", "q4_k_m"]) == 0
    mixed = load_model(tmp_path / "q4km").model
    assert mixed.blocks[0].attn.wq.block.name == "Q5_0"
    assert mixed.blocks[-1].ffn.w2.block.name == "Q8_0"  # the last layer gets more bits
    assert mixed.head.block.name == "Q8_0"
    # bf16 / f16: the weights at that width, held as block layers (the flag was passed through lowercase once)
    assert main(["quantize", str(ck), str(tmp_path / "bf16"), "--to", "bf16", "--include-head"]) == 0
    halves = load_model(tmp_path / "bf16").model
    assert halves.blocks[0].attn.wq.block.name == "BF16" and halves.head.block.name == "BF16"
    assert main(["quantize", str(ck), str(tmp_path / "q3"), "--to", "q3_k_m"]) == 0
    assert load_model(tmp_path / "q3").model.blocks[0].attn.wq.block.name == "Q4_0"  # Q3_K's fallback at 64 wide
