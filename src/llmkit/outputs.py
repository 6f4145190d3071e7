"""What a command writes: checked before any work, built aside, and put in place whole.

    OUT                 the output: a checkpoint or data folder, or a file
    OUT.tmp-<pid>       where it is built, in OUT's own folder (so the final rename stays on one file system and is
                        atomic)
    OUT.old-<pid>       the OUT it replaces, set aside for the instant of the swap, then removed

The rules every command follows (`claim`, before it loads or reads anything heavy):

- never over its own input: not the same path, not inside it, not a folder that holds it;
- an existing OUT of the same kind (a checkpoint where a checkpoint goes, ...) is replaced only with --overwrite, or
  when the command made it and owns it (`llmkit average` re-averaging RUN/averaged);
- never over something of another kind: a training run, a data folder where a checkpoint goes (or the reverse), a
  file where a folder goes, or a folder of other files that is none of llmkit's outputs, even with --overwrite.

A kill at any moment leaves the old OUT or the new one, each complete: the new one is finished in OUT.tmp-<pid>
before anything is renamed. A new OUT is one rename. Replacing a folder takes two, since rename() cannot swap two
folders: OUT -> OUT.old-<pid>, then OUT.tmp-<pid> -> OUT. A kill in the microseconds between them leaves OUT missing
and the old one whole in OUT.old-<pid>; the next command that claims OUT renames it back (`recover`), and loading a
missing OUT says where the old one is. Leftover OUT.tmp-<pid> folders of processes that are gone are removed at the
next claim the same way. (Durability across a power cut would need fsync as well; a killed process is covered.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, cast

from llmkit.errors import OutputError

Kind = Literal["checkpoint", "data", "file", "work"]
Found = Literal["missing", "empty", "file", "run", "checkpoint", "data", "work", "folder"]

DESCRIBED: dict[str, str] = {
    "file": "a file",
    "run": "a training run",
    "checkpoint": "a checkpoint",
    "data": "a prepared data folder",
    "work": "a work folder",
    "folder": "a folder of other files (none of llmkit's outputs)",
}


def found_at(path: Path) -> Found:
    """What `path` holds now, as far as writing over it goes."""
    if not path.exists() and not path.is_symlink():
        return "missing"
    if not path.is_dir():
        return "file"
    names = {p.name for p in path.iterdir()}
    if not names:
        return "empty"
    if "checkpoints" in names and (path / "checkpoints").is_dir():
        return "run"  # a run may also hold a model's files (one trained into a checkpoint folder): the run comes first
    if names & {"llmkit.json", "config.json", "adapter_config.json"}:
        return "checkpoint"
    if "meta.json" in names:
        return "data"
    if names <= {"train", "val"}:
        return "work"  # graft-mtp's and distill-draft's collected text
    return "folder"


def _pid_of(path: Path) -> int | None:
    """The process id in OUT.tmp-<pid> / OUT.old-<pid>."""
    tail = path.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else None


def _gone(pid: int | None) -> bool:
    """Whether the process that left a temporary file is gone (our own pid counts: one process never builds the
    same output twice at once, so its own leftovers are from an earlier, failed attempt)."""
    if pid is None or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def sibling(path: Path, role: Literal["tmp", "old"]) -> Path:
    """OUT.tmp-<pid> or OUT.old-<pid> of this process."""
    return path.with_name(f"{path.name}.{role}-{os.getpid()}")


def leftovers(path: Path, role: Literal["tmp", "old"]) -> list[Path]:
    """The OUT.tmp-* or OUT.old-* next to `path`."""
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f"{_glob_escape(path.name)}.{role}-*"))


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def recover(path: Path) -> list[str]:
    """Undo what a killed command left next to `path`: a missing OUT comes back from OUT.old-<pid>; leftover
    OUT.tmp-<pid> (unfinished) and OUT.old-<pid> (already replaced) of processes that are gone are removed. Returns
    what was done, to be reported. An OutputError if another process is building OUT right now."""
    done = []
    for old in leftovers(path, "old"):
        if not _gone(_pid_of(old)):
            continue
        if not path.exists():
            os.rename(old, path)
            done.append(f"{path} was missing after an interrupted replacement: restored the previous one from {old}")
        else:
            _remove(old)
    for tmp in leftovers(path, "tmp"):
        if not _gone(_pid_of(tmp)):
            raise OutputError(f"another process (pid {_pid_of(tmp)}) is writing {path} now ({tmp}); wait for it")
        _remove(tmp)
        done.append(f"removed {tmp}, left unfinished by an interrupted run")
    return done


def _related(a: Path, b: Path) -> str | None:
    """How output `a` stands to input `b`: 'is', 'is inside', 'holds', or None."""
    ra, rb = a.resolve(), b.resolve()
    if ra == rb:
        return "is"
    if rb in ra.parents:
        return "is inside"
    if ra in rb.parents:
        return "holds"
    return None


def overlaps(a: Path, b: Path) -> bool:
    """Whether one of two paths is, holds or lies inside the other (whether or not they exist yet)."""
    return _related(a, b) is not None


def check_not_input(path: Path, inputs: Sequence[str | os.PathLike[str] | None]) -> None:
    """An OutputError when `path` is one of `inputs` (those that exist), lies inside one, or holds one."""
    for given in inputs:
        if given is None or not Path(given).exists():
            continue
        how = _related(path, Path(given))
        if how is not None:
            what = {"is": "is also the input", "is inside": f"is inside its input {given}"}.get(
                how, f"holds the input {given}"
            )
            raise OutputError(f"{path} {what}: a command never writes over what it reads; write the output elsewhere")


@dataclass(frozen=True)
class Output:
    """An output path that `claim` checked; `building` writes it."""

    path: Path
    kind: Kind
    replace: bool  # whether an existing output of the same kind may be replaced (--overwrite, or owned)

    def check(self) -> None:
        """An OutputError unless what is at the path now may be replaced by this output."""
        found = found_at(self.path)
        if found == "missing" or (found == "empty" and self.kind != "file"):
            return
        if found == "empty":  # a file never replaces a folder, even an empty one
            raise OutputError(f"{self.path} is a folder: the output is a file; give a file name")
        if found == self.kind:
            if not self.replace:
                raise OutputError(
                    f"{self.path} already exists ({DESCRIBED[found]}): give --overwrite to replace it, or choose "
                    "another path"
                )
            return
        what = {"checkpoint": "a checkpoint", "data": "a data folder", "file": "a file", "work": "a work folder"}
        raise OutputError(
            f"{self.path} is {DESCRIBED[found]}: {what[self.kind]} is never written over it, even with "
            "--overwrite; choose another path"
        )


def claim(
    path: str | os.PathLike[str],
    kind: Kind,
    *,
    inputs: Sequence[str | os.PathLike[str] | None] = (),
    overwrite: bool = False,
    owned: bool = False,
) -> Output:
    """Check that a command may write `path` (see the module docstring), after recovering what an interrupted
    command left next to it; call it before any heavy work, so that a refusal costs nothing."""
    out = Output(Path(path), kind, overwrite or owned)
    check_not_input(out.path, inputs)
    for note in recover(out.path):
        print(f"note: {note}", file=sys.stderr)
    out.check()
    return out


@contextlib.contextmanager
def building(out: Output) -> Iterator[Path]:
    """A fresh OUT.tmp-<pid> to write the output into (a folder, created; for a file, the path to write); when the
    block ends without an error it replaces OUT, otherwise it is removed."""
    tmp = sibling(out.path, "tmp")
    if tmp.exists() or tmp.is_symlink():
        _remove(tmp)
    try:
        out.path.parent.mkdir(parents=True, exist_ok=True)
        if out.kind != "file":
            tmp.mkdir()
    except OSError as e:  # name the folder the user chose, not the temporary one inside it
        raise OSError(e.errno, e.strerror, str(out.path.parent if e.filename == str(tmp) else e.filename)) from None
    try:
        yield tmp
        out.check()  # again: something may have appeared at OUT while the output was being built
        publish(tmp, out.path)
    except BaseException:
        with contextlib.suppress(OSError):
            _remove(tmp)
        raise


def publish(tmp: Path, path: Path) -> None:
    """Put the finished `tmp` at `path`: one atomic rename, or, over an existing folder, two (see the module
    docstring for the instant between them)."""
    if tmp.is_file() or not path.is_dir():
        os.replace(tmp, path)  # a file, or a folder onto nothing: atomic
        return
    if not any(path.iterdir()):
        path.rmdir()
        os.rename(tmp, path)
        return
    aside = sibling(path, "old")
    if aside.exists():
        _remove(aside)
    os.rename(path, aside)
    os.rename(tmp, path)  # a kill before this line leaves the old output whole in `aside`; `recover` renames it back
    _remove(aside)


class _Sink:
    """A file whose write() remembers the OSError it raised (see `torch_save`)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def torch_save(obj: object, path: Path) -> None:
    """torch.save to `path`, a failed write (a full disk) raised as the OSError it is, naming the file: torch's zip
    writer reports one as a RuntimeError ("[enforce fail at inline_container.cc] unexpected pos")."""
    import torch

    try:
        with open(path, "wb") as f:
            sink = _Sink(f)
            try:
                torch.save(obj, cast(BinaryIO, sink))  # what torch uses of a file: write and flush
            except RuntimeError:
                if sink.error is None:
                    raise
                raise sink.error from None
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
