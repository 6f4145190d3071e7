"""Reading and writing safetensors checkpoints: one file or shards with an index, read lazily.

`open_tensors` returns a `LazyTensors` mapping: names and shapes come from the file headers, and a tensor is read
(memory-mapped) only when asked for, so loading a model never holds a second full copy of the weights; `part` reads
only a slice of one (a tensor-parallel rank's rows or columns), with pread. A file whose
data is shorter than its header promises is reported as truncated before anything is read.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from llmkit.errors import LLMKitError, os_error_in
from llmkit.parts import Index

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(LLMKitError, ValueError):
    """A checkpoint file is missing, truncated or corrupt."""


def check_file(path: Path) -> None:
    """Raise CheckpointError unless `path` is a complete safetensors file (header parses, data fully present)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path} is truncated: its header claims {n} bytes but the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not a valid safetensors file: bad header ({e})") from None
    entries = header.items() if isinstance(header, dict) else []
    ends = [_data_end(v) for k, v in entries if k != "__metadata__"]
    if not isinstance(header, dict) or None in ends:
        raise CheckpointError(f"{path} is not a valid safetensors file: its header does not describe tensors")
    end = max((e for e in ends if e is not None), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path} is truncated: its tensors need {8 + n + end} bytes but the file has {size} "
            "(an interrupted download or copy?)"
        )


def _data_end(entry: object) -> int | None:
    """Where a header entry's data ends, or None when the entry is not {dtype, shape, data_offsets: [a, b]}."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return None
    if not isinstance(entry.get("shape"), list):
        return None
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        return None
    return int(offsets[1]) if 0 <= offsets[0] <= offsets[1] else None


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """safetensors' own errors about a file's contents (a header that lies about sizes, dtypes or shapes) as a
    CheckpointError naming the file."""
    try:
        yield
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from None


class LazyTensors(Mapping[str, Tensor]):
    """Tensors of one or more safetensors files, read on access. `shapes` needs no reading."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._file_of = files  # tensor name -> file
        self._handles: dict[Path, Any] = {}
        self._maps: dict[Path, Any] = {}  # file -> its numpy memory map (mapped)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, tuple[str, int]] = {}  # tensor name -> (safetensors dtype, offset of its data)
        for path in sorted(set(files.values())):
            with _reading(path), safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if files.get(name) == path:
                        self.shapes[name] = tuple(f.get_slice(name).get_shape())
            header, start = _header(path)
            for name, entry in header.items():
                if files.get(name) == path:
                    self._where[name] = (entry["dtype"], start + entry["data_offsets"][0])

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            with _reading(path):
                self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def __getitem__(self, name: str) -> Tensor:
        """Tensor `name` whole, read as `part` reads (not through the memory map, whose pages would stay resident
        in this process beside the weights made from them: loading a 1.5B bf16 checkpoint peaked at twice its
        size)."""
        if name not in self._file_of:
            raise KeyError(name)
        return self.part(name, tuple((0, n) for n in self.shapes[name]))

    def part(self, name: str, index: Index) -> Tensor:
        """The part `index` ([start, stop) of each dimension) of tensor `name`, reading only its bytes.

        They are read with pread into the part's own memory, one run of contiguous bytes at a time (one for a block
        of rows, one a row for a block of columns), not through a memory map: the file's pages stay in the page
        cache instead of adding to the process's resident memory, so a rank's peak is its part."""
        if name not in self._file_of:
            raise KeyError(name)
        path, (kind, start), shape = self._file_of[name], self._where[name], self.shapes[name]
        dtype = _DTYPES.get(kind)
        if dtype is None:  # a dtype read no other way: safetensors' view of the memory-mapped file, copied
            with _reading(path):
                view = self._handle(path).get_slice(name)[tuple(slice(a, b) for a, b in index)]
            return view.clone(memory_format=torch.contiguous_format)
        return read_part(path, start, dtype, shape, index)

    def mapped(self, name: str) -> Tensor:
        """Tensor `name` as a read-only view of its file's memory map: nothing is read or copied until it is used,
        and its pages are the page cache's (shared, and dropped under memory pressure rather than swapped). For
        weights held as the file stores them (a bf16 checkpoint's layers held as BF16: held_width in weights.py);
        nothing llmkit runs writes into weights in place. check_file made sure the file holds every tensor."""
        if name not in self._file_of:
            raise KeyError(name)
        path, (kind, start), shape = self._file_of[name], self._where[name], self.shapes[name]
        dtype = _DTYPES.get(kind)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} is {kind}, which llmkit reads only by copying")
        if path not in self._maps:
            import numpy as np

            self._maps[path] = np.memmap(path, mode="r", dtype=np.uint8)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with warnings.catch_warnings():  # (torch warns that the array is read-only: that is the point)
            warnings.simplefilter("ignore")
            raw = torch.from_numpy(self._maps[path][start : start + n])
        return raw.view(dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}  # fmt: skip


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor entries only) and where its data starts (check_file ran first)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v for k, v in header.items() if k != "__metadata__"}, 8 + n


def weight_memory(n: int) -> bytearray | mmap.mmap:
    """n bytes of writable memory for weights: from 2 MB on, an anonymous map whose pages the reads fault in. Not
    advised to huge pages: in the VMs measured here (Firecracker, AMD EPYC Zen 4), where the host backs memory when
    it is first touched, fresh huge pages were first written at 0.37 GB/s against 1.6 GB/s for 4 KB pages; the 3B Q8_0
    file (3.3 GB, its pages cached) then loaded in 5.6-8.3 s against 5.1-5.9 s (4 runs each, interleaved), and
    decoding read either as fast, within the noise."""
    if n < 2 << 20:
        return bytearray(n)
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


# Bytes one reading thread reads at a time. Reads into fresh memory are bound by the first touch of its pages, which
# the kernel serves on the core that touches them: the 3B Q8_0 file's 3.3 GB read at 1.55 GB/s by one thread, 2.5-3.0
# by two (a 2-core Zen 4 VM, its pages cached).
PIECE = 8 << 20


@functools.cache
def _readers() -> ThreadPoolExecutor:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(min(4, cores), thread_name_prefix="llmkit-read")


def read_part(path: Path, start: int, dtype: torch.dtype, shape: tuple[int, ...], index: Index) -> Tensor:
    """Part `index` of the row-major tensor of `shape` whose data starts at byte `start` of `path`, read with pread
    into memory of its own (runs of contiguous bytes, in pieces of PIECE bytes read by up to 4 threads at once): the
    file's pages stay out of the process's resident memory, as they would not through a memory map. Any format that
    stores a tensor's bytes in row-major order (a safetensors file, a GGUF tensor's rows of blocks) reads its parts
    this way."""
    item = torch.empty((), dtype=dtype).element_size()
    strides = [item * math.prod(shape[d + 1 :]) for d in range(len(shape))]
    cut = [d for d, (a, b) in enumerate(index) if (a, b) != (0, shape[d])]
    last = cut[-1] if cut else 0  # the dimensions after it are whole: each run of bytes ends there
    a, b = index[last] if index else (0, 1)
    run = (b - a) * (strides[last] if shape else item)
    out = weight_memory(run * math.prod(hi - lo for lo, hi in index[:last]))
    view = memoryview(out)
    # a thread's reads, about PIECE bytes: (where in out, where in the file, bytes); a run longer than PIECE is cut
    # into pieces, and short runs (a column cut's rows) share a task
    tasks: list[list[tuple[int, int, int]]] = [[]]
    filled = 0  # bytes in the last task
    for k, outer in enumerate(itertools.product(*(range(lo, hi) for lo, hi in index[:last]))):
        at = start + sum(i * strides[d] for d, i in enumerate(outer)) + a * (strides[last] if shape else item)
        for o in range(0, run, PIECE):
            if filled >= PIECE:
                tasks.append([])
                filled = 0
            n = min(PIECE, run - o)
            tasks[-1].append((k * run + o, at + o, n))
            filled += n
    with path.open("rb") as f:

        def read(task: list[tuple[int, int, int]]) -> None:
            for to, at, n in task:
                done = 0
                while done < n:
                    got = os.preadv(f.fileno(), [view[to + done : to + n]], at + done)
                    if got <= 0:
                        raise CheckpointError(f"{path} ended while reading a tensor: truncated after it was opened?")
                    done += got

        if len(tasks) > 1:
            for _ in _readers().map(read, tasks):  # raises the first task's error
                pass
        else:
            read(tasks[0])
    parts = tuple(hi - lo for lo, hi in index)
    return torch.frombuffer(out, dtype=dtype).reshape(parts) if out else torch.empty(parts, dtype=dtype)


def open_tensors(directory: str | os.PathLike[str]) -> LazyTensors:
    """The weights of a checkpoint directory: model.safetensors, or the shards listed in its index."""
    d = Path(directory)
    index, single = d / INDEX, d / SINGLE
    files: dict[str, Path] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        for name, shard in weight_map.items():
            files[name] = d / shard
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} lists {shard.name}, which is missing")
    elif single.is_file():
        check_file(single)
        with _reading(single), safe_open(str(single), framework="pt") as f:
            files = dict.fromkeys(f.keys(), single)
    else:
        raise CheckpointError(f"{d} has neither {SINGLE} nor {INDEX}")
    for path in sorted(set(files.values())):
        check_file(path)
    return LazyTensors(files)


def save_tensors(
    tensors: Mapping[str, Tensor],
    directory: str | os.PathLike[str],
    max_shard_bytes: int = 5 * 1024**3,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write tensors as model.safetensors, or as shards plus model.safetensors.index.json when they exceed
    `max_shard_bytes`. Files are written under a temporary name and renamed, so an interrupted save never leaves a
    file that looks complete. Returns the written files."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    stale = [d / SINGLE, d / INDEX, *d.glob("model-*-of-*.safetensors")]
    for p in stale:
        p.unlink(missing_ok=True)
    written = []
    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for shard, fname in zip(shards, names, strict=True):
        tmp = d / (fname + ".tmp")
        _save_file(_unshare(shard), tmp, meta)
        tmp.replace(d / fname)
        written.append(d / fname)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: fname for shard, fname in zip(shards, names, strict=True) for n in shard},
        }
        (d / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(d / INDEX)
    return written


def _save_file(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with its I/O failures (a full disk: "I/O error: No space left on device (os error
    28)") raised as the OSError they are, naming the file, so that the command line reports them as one."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        raise os_error_in(e, path) or e from None


def _unshare(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share memory; give each its own storage."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
