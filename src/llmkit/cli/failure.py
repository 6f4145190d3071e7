"""Failures that come from the machine rather than from llmkit, in one line a user can act on.

The operating system says what failed (errno) and often where (the exception's filename); this module adds what to
do. `describe` returns None for anything else: a bug keeps its traceback.
"""

from __future__ import annotations

import errno

# errno -> what it means here, and what to do about it
_HINTS: dict[int, str] = {
    errno.EACCES: "permission denied: check the permissions of the file or folder, or use another path",
    errno.EPERM: "operation not permitted: check the permissions of the file or folder, or use another path",
    errno.EROFS: "the file system is read-only: write to a folder on a writable disk",
    errno.ENOSPC: "no space left on the device: free some space, or write to another disk, and run the command again",
    errno.EDQUOT: "disk quota exceeded: free some space, or write to another disk, and run the command again",
    errno.EFBIG: "the file is too large for this file system: write to another disk",
    errno.ENOENT: "no such file or folder",
    errno.ELOOP: "too many levels of symbolic links (a link that leads back to itself): fix or remove the link",
    errno.ENAMETOOLONG: "the name is too long for this file system: use a shorter path",
    errno.ENOTDIR: "a part of the path is a file where a folder was expected",
    errno.EISDIR: "this is a folder where a file was expected",
    errno.EEXIST: "already exists: use another path",
    errno.ENODEV: "no such device: check that the disk or device is attached",
    errno.ENXIO: "no such device or address: check that the disk or device is attached",
    errno.EIO: "input/output error: the disk or the file system failed; check it (dmesg) before running again",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on the system: close some programs, or raise the limit",
    errno.ENOMEM: "out of memory: use smaller sizes, or a machine with more memory",
    errno.EBUSY: "the device or file is busy: try again when it is free",
    errno.ETXTBSY: "the file is busy: try again when it is free",
    errno.EXDEV: "the paths are on different file systems",
}


def describe_os_error(e: OSError) -> str:
    """`PATH: what happened: what to do`, or without the path when the system did not name one."""
    hint = _HINTS.get(e.errno or -1) or (e.strerror or str(e) or type(e).__name__)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    if not paths:
        return hint
    return f"{' -> '.join(paths)}: {hint}"


def _out_of_memory(e: BaseException) -> bool:
    """torch's allocation failures: torch.OutOfMemoryError on a GPU, a RuntimeError from the CPU allocator."""
    text = str(e)
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text)
    )


def describe(e: BaseException) -> str | None:
    """One line for a failure of the machine (the operating system, memory, undecodable text); None otherwise."""
    if isinstance(e, OSError):
        return describe_os_error(e)
    if _out_of_memory(e):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"out of memory ({first[:200]}): use smaller sizes (batch, sequence length, --samples), fewer "
            "processes, or a machine with more memory"
        )
    if isinstance(e, UnicodeDecodeError):
        return (
            f"a file that should hold text holds bytes that are not UTF-8 ({e.reason} at byte {e.start}); check the "
            "files the command reads"
        )
    return None
