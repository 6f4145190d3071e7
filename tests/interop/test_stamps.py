"""Verified stamps (llmkit/interop/stamps.py): a checkpoint file is hashed once per state of the file; any change
that moves its identity (a replaced file, a new size, a rewrite) is hashed again, and a file changed just before
it was hashed gets no stamp. Clocks are injected: nothing here waits."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from llmkit import build_model, get_preset
from llmkit.interop import checkpoint, stamps
from llmkit.interop.checkpoint import file_digest, verify_manifest
from llmkit.interop.safetensors_io import CheckpointError


@pytest.fixture(autouse=True)
def _own_stamps(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMKIT_STAMPS", str(tmp_path / "stamps"))


class Counting:
    """file_digest, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, path: Path) -> str:
        self.calls += 1
        return file_digest(path)


def settled(path: Path):
    """A clock reading 10 s after the file's last change."""
    return lambda: os.stat(path).st_ctime_ns / 1e9 + 10


def test_a_settled_file_is_hashed_once(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights" * 1000)
    digest = Counting()
    first = stamps.stamped_digest(f, digest, now=settled(f))
    assert first == file_digest(f) and digest.calls == 1
    assert stamps.stamped_digest(f, digest, now=settled(f)) == first
    assert digest.calls == 1


def test_a_file_changed_just_before_hashing_gets_no_stamp(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights")
    digest = Counting()
    just_now = lambda: os.stat(f).st_ctime_ns / 1e9 + 0.5  # noqa: E731
    stamps.stamped_digest(f, digest, now=just_now)
    stamps.stamped_digest(f, digest, now=just_now)
    assert digest.calls == 2
    assert not any(stamps.stamp_directory().glob("*.json"))


@pytest.mark.parametrize("change", ["replaced", "longer", "same size, time restored"])
def test_a_changed_file_is_hashed_again(tmp_path, change):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    digest = Counting()
    stamps.stamped_digest(f, digest, now=settled(f))
    before = os.stat(f)
    if change == "replaced":  # a new file renamed over it: another inode
        new = tmp_path / "w.new"
        new.write_bytes(b"b" * 4096)
        os.replace(new, f)
    elif change == "longer":
        with open(f, "ab") as out:
            out.write(b"b")
    else:  # bytes rewritten in place and the modification time set back: only the change time moves. The kernel's
        # clock is coarse, so the time is set back again until a new tick shows in ctime (bounded)
        with open(f, "r+b") as out:
            out.write(b"b")
        os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
        deadline = time.monotonic() + 5
        while os.stat(f).st_ctime_ns == before.st_ctime_ns and time.monotonic() < deadline:
            os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
        if os.stat(f).st_ctime_ns == before.st_ctime_ns:
            pytest.skip("this file system does not move a file's change time")
        assert os.stat(f).st_mtime_ns == before.st_mtime_ns and os.stat(f).st_size == before.st_size
    assert stamps.stamped_digest(f, digest, now=settled(f)) == file_digest(f) != "sha256:" + "0" * 64
    assert digest.calls == 2


def test_an_unreadable_stamp_means_hashing_again(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights")
    digest = Counting()
    stamps.stamped_digest(f, digest, now=settled(f))
    (stamp,) = stamps.stamp_directory().glob("*.json")
    stamp.write_text("{not json")
    assert stamps.stamped_digest(f, digest, now=settled(f)) == file_digest(f)
    assert digest.calls == 2


def test_a_forged_stamp_for_another_path_is_not_used(tmp_path):
    f, g = tmp_path / "f.bin", tmp_path / "g.bin"
    f.write_bytes(b"one")
    g.write_bytes(b"two")
    digest = Counting()
    stamps.stamped_digest(f, digest, now=settled(f))
    (stamp,) = stamps.stamp_directory().glob("*.json")
    # the stamp moved to g's name: its recorded path (and file identity) are f's, so g is hashed
    os.replace(stamp, stamps._stamp_file(g.resolve()))
    assert stamps.stamped_digest(g, digest, now=settled(g)) == file_digest(g)
    assert digest.calls == 2


def test_a_verified_checkpoint_is_not_hashed_again_and_damage_is_still_found(tmp_path, monkeypatch):
    from llmkit.interop.checkpoint import save_llmkit

    torch.manual_seed(0)
    d = tmp_path / "ckpt"
    save_llmkit(build_model(get_preset("llama2-7b-tiny")), d)
    counting = Counting()
    monkeypatch.setattr(checkpoint, "file_digest", counting)
    monkeypatch.setattr(stamps, "SETTLED", -60.0)  # every file counts as settled
    verify_manifest(d)
    hashed = counting.calls
    assert hashed >= 1
    verify_manifest(d)
    assert counting.calls == hashed  # nothing hashed the second time
    weights = d / "model.safetensors"
    with open(weights, "ab") as out:  # damaged: a byte more
        out.write(b"\0")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is damaged"):
        verify_manifest(d)
