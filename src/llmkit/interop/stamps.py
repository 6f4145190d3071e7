"""Verified stamps: a checkpoint's files hashed once, not on every start.

Loading an llmkit checkpoint checks each file against the SHA-256 its manifest records (checkpoint.py). For a
4.5 GB file that is 3 s of hashing before every start, and it reads the whole file even where the load then maps
only what it needs. After a file has been hashed, a stamp records the digest with what identifies that state of the
file: device, inode, size, modification time and change time (ctime). The next load hashes it again only if any of
them moved. The kernel sets ctime on every write, rename or metadata change, and a process cannot set it back (as it
can the modification time with `touch -d`), so a file whose ctime has not moved has not been written.

Racily clean files (as git calls them): the kernel's timestamps are coarse (a clock tick, 1-10 ms), so a file written
again within the tick in which it was hashed could keep its ctime. A stamp is therefore only written for a file whose
ctime is at least `SETTLED` seconds older than the clock at hashing time; a file changed more recently than that is
hashed again next time.

Stamps live in `$LLMKIT_STAMPS`, else `$XDG_CACHE_HOME/llmkit/verified` (`~/.cache/llmkit/verified`), one small JSON
file per checkpoint file, named by the SHA-256 of its absolute path and written atomically. A stamp that cannot be
read, parsed or written only means hashing again: never an error and never a skipped check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

SETTLED = 2.0  # seconds between a file's last change and the hashing a stamp may vouch for


def stamp_directory() -> Path:
    if explicit := os.environ.get("LLMKIT_STAMPS"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmkit" / "verified"


def _identity(st: os.stat_result) -> dict[str, int]:
    return {
        "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
    }  # fmt: skip


def _stamp_file(path: Path) -> Path:
    key = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()
    return stamp_directory() / f"{key}.json"


def _read(stamp: Path) -> dict[str, object] | None:
    try:
        data = json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(stamp: Path, record: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, stamp)


def stamped_digest(path: Path, digest: Callable[[Path], str], now: Callable[[], float] = time.time) -> str:
    """`digest(path)`, or the digest a stamp recorded for this very state of the file (same device, inode, size,
    modification and change times). A fresh digest is stamped when the file had settled before it was hashed."""
    path = path.resolve()
    stamp = _stamp_file(path)
    before = os.stat(path)
    record = _read(stamp)
    if record is not None and record.get("path") == str(path) and record.get("file") == _identity(before):
        recorded = record.get("digest")
        if isinstance(recorded, str):
            return recorded
    started = now()
    value = digest(path)
    after = os.stat(path)
    if _identity(after) == _identity(before) and started - after.st_ctime_ns / 1e9 >= SETTLED:
        _write(stamp, {"path": str(path), "file": _identity(after), "digest": value})
    return value
