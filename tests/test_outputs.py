"""llmkit.outputs: what a command may write over, and outputs that are whole or absent whatever happens to the
process writing them (an error, a full disk, SIGKILL at any point)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer

from llmkit import build_model, get_preset
from llmkit.errors import OutputError
from llmkit.interop.checkpoint import save_llmkit
from llmkit.interop.load import load_model
from llmkit.outputs import building, claim, found_at, leftovers, recover, torch_save


def tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320)).eval()
    return save_llmkit(model, path, tokenizer=tiny_tokenizer())


def dead_pid() -> int:
    """The pid of a process that has exited (so the leftovers it names are stale)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_what_is_found_at_a_path(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    tiny_checkpoint(tmp_path / "ck")
    found = {p: found_at(tmp_path / p) for p in ("none", "empty", "file", "data", "run", "notes", "ck")}
    assert found == {
        "none": "missing",
        "empty": "empty",
        "file": "file",
        "data": "data",
        "run": "run",
        "notes": "folder",
        "ck": "checkpoint",
    }


def test_an_output_is_never_its_own_input(tmp_path):
    ck = tiny_checkpoint(tmp_path / "ck")
    for target, how in [(ck, "is also the input"), (ck / "sub", f"is inside its input {ck}"),
                        (tmp_path, f"holds the input {ck}")]:  # fmt: skip
        with pytest.raises(OutputError) as e:
            claim(target, "checkpoint", inputs=[ck], overwrite=True)
        assert str(e.value).startswith(f"{target} {how}: a command never writes over what it reads"), str(e.value)
    claim(tmp_path / "other", "checkpoint", inputs=[ck, "bible:de-en", None])  # names that are not paths are no input


def test_what_may_be_replaced(tmp_path):
    ck = tiny_checkpoint(tmp_path / "ck")
    (tmp_path / "empty").mkdir()
    claim(tmp_path / "empty", "checkpoint")  # nothing to lose
    with pytest.raises(OutputError, match=r"already exists \(a checkpoint\): give --overwrite"):
        claim(ck, "checkpoint")
    claim(ck, "checkpoint", overwrite=True)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    refused = [(ck, "data", "is a checkpoint"), (tmp_path / "run", "checkpoint", "is a training run")]
    refused += [(tmp_path / "notes", "checkpoint", "other files"), (tmp_path / "file", "checkpoint", "is a file")]
    refused += [(ck, "file", "is a checkpoint")]
    for path, kind, why in refused:
        with pytest.raises(OutputError, match=f"{why}.*even with --overwrite"):
            claim(path, kind, overwrite=True)  # type: ignore[arg-type]
    with pytest.raises(OutputError, match="is a folder: the output is a file"):
        claim(tmp_path / "empty", "file", overwrite=True)
    with pytest.raises(OutputError, match=r"already exists \(a file\): give --overwrite"):
        claim(tmp_path / "file", "file")


def test_an_error_while_building_leaves_the_old_output_and_no_leftover(tmp_path):
    ck = tiny_checkpoint(tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    with pytest.raises(OSError, match="No space"), building(claim(ck, "checkpoint", overwrite=True)) as tmp:
        save_llmkit(build_model(get_preset("llama2-7b-tiny")), tmp)  # the new weights are all there...
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # ...when the disk fills
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert leftovers(ck, "tmp") == [] and leftovers(ck, "old") == []


def test_a_finished_output_replaces_the_old_one(tmp_path):
    ck = tiny_checkpoint(tmp_path / "ck")
    with building(claim(ck, "checkpoint", overwrite=True)) as tmp:
        tiny_checkpoint(tmp, seed=1)
    new = load_model(ck).model.state_dict()
    expected = load_model(tiny_checkpoint(tmp_path / "expected", seed=1)).model.state_dict()
    assert all(torch.equal(new[k], expected[k]) for k in new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "expected"]  # nothing left beside it


def test_leftovers_of_a_dead_process_are_removed_or_restored_at_the_next_claim(tmp_path, capsys):
    ck = tiny_checkpoint(tmp_path / "ck")
    pid = dead_pid()
    unfinished = tmp_path / f"ck.tmp-{pid}"
    unfinished.mkdir()
    (unfinished / "model.safetensors").write_bytes(b"half")
    claim(ck, "checkpoint", overwrite=True)
    assert not unfinished.exists()
    assert "removed" in capsys.readouterr().err
    # killed between the two renames of a replacement: OUT missing, the old one whole beside it
    aside = tmp_path / f"ck.old-{pid}"
    os.rename(ck, aside)
    with pytest.raises(Exception, match=r"ck\.old-\d+ holds its previous version"):
        load_model(ck)
    assert recover(ck) and load_model(ck).model is not None and not aside.exists()


# A command run in a child process that SIGKILLs itself at a chosen moment of writing its output.
KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import llmkit.interop.checkpoint as checkpoint
    from llmkit.cli import main

    moment = sys.argv[1]
    if moment == "after-weights":  # the new checkpoint is complete in OUT.tmp-<pid>, not yet renamed
        write_meta = checkpoint._write_meta
        def _write_meta(d, meta):
            write_meta(d, meta)
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint._write_meta = _write_meta
    else:  # between the renames of a replacement: OUT set aside, the new one not yet in its place
        rename, calls = os.rename, []
        def _rename(a, b):
            calls.append(a)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            rename(a, b)
        os.rename = _rename
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.parametrize("moment", ["after-weights", "between-renames"])
def test_quantize_killed_at_any_moment_leaves_the_old_or_the_new_checkpoint(tmp_path, moment):
    """`llmkit quantize CK OUT --overwrite` SIGKILLed while writing over an existing OUT: OUT is the old checkpoint
    (or comes back as it at the next command), never a mixture that loads neither."""
    source = tiny_checkpoint(tmp_path / "ck")
    out = tiny_checkpoint(tmp_path / "out", seed=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = ["quantize", str(source), str(out), "--to", "int8", "--overwrite"]
    child = subprocess.run([sys.executable, "-c", KILLED, moment, *args], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert leftovers(out, "tmp" if moment == "after-weights" else "old")  # killed where it was meant to be
    recover(out)  # what the next command that writes OUT does first
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old checkpoint, whole
    assert load_model(out).model is not None
    assert leftovers(out, "tmp") == [] and leftovers(out, "old") == []
    from llmkit.cli import main

    assert main(args) == 0  # and the next run writes the new one
    assert "quantization" in json.loads((out / "llmkit.json").read_text())
    assert load_model(out).model is not None


def test_torch_save_reports_a_full_disk_as_the_os_error(tmp_path, monkeypatch):
    """torch's zip writer turns a failed write into RuntimeError("unexpected pos"); torch_save gives the OSError."""
    import llmkit.outputs as outputs

    class FillsUp:
        def __init__(self, path: Path, mode: str) -> None:
            self.f = open(path, mode)  # noqa: SIM115
            self.room = 4096

        def write(self, data: bytes) -> int:
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= len(data)
            return self.f.write(data)

        def flush(self) -> None:
            self.f.flush()

        def __enter__(self) -> FillsUp:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr(outputs, "open", FillsUp, raising=False)
    with pytest.raises(OSError) as info:
        torch_save({"w": torch.zeros(100_000)}, tmp_path / "state.pt")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "state.pt")
