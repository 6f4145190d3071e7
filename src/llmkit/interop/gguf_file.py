"""Reading a GGUF file's header: its metadata as plain Python values and its tensors as views of one memory map.

    magic "GGUF", version (2 or 3), tensor count, metadata count
    metadata: key (string), value type, value          (strings and arrays carry their lengths)
    tensors:  name, dims (innermost first), ggml type, offset from the data section
    data section: at the header's end rounded up to general.alignment (32 by default)

Every count and length is checked against the bytes that are there as it is read, and every tensor's extent against
the file's size, before anything is mapped, so a truncated or damaged file is a one-line CheckpointError, never a
read past the end (a SIGBUS through the map). The `gguf` package's reader does the same job, but it keeps each
value (each of a vocabulary's 49,152 tokens) as numpy arrays: 160 MB of resident memory and 4 s on a 1.5B model's
file; this one takes a few MB and a fraction of a second. The package still supplies the type tables
(GGMLQuantizationType, GGML_QUANT_SIZES) and the reference dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.interop.safetensors_io import CheckpointError

# metadata value types (the spec's gguf_type): struct format of a scalar; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_MAX_DIMS = 8
# float tensor types: numpy's dtype for their values
_FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


@dataclass
class GGUFTensor:
    """One tensor of the file, with the `gguf` package's ReaderTensor's names: shape innermost first, `data` a
    read-only view of the map (values for F32 / F16 / F64, in row-major shape; else rows of blocks, (rows,
    row bytes) uint8), data_offset absolute in the file."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data_offset: int
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> str, int, float, bool or list) and tensors (`tensors`)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        size = path.stat().st_size
        if size < 24:
            raise CheckpointError(f"{path} is truncated: {size} bytes, too short for a GGUF header")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _Header(buf, size, path)
            if header.take("<I") != 0x46554747:  # b"GGUF"
                raise CheckpointError(f"{path} is not a GGUF file (no GGUF magic)")
            if header.take("<I") not in (2, 3):
                raise CheckpointError(f"{path}: only GGUF versions 2 and 3 are read")
            n_tensors, n_kv = header.take("<Q"), header.take("<Q")
            if n_tensors > size or n_kv > size:
                raise CheckpointError(f"{path} is damaged: it claims {n_tensors} tensors and {n_kv} metadata entries")
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = header.string()
                self.fields[key] = header.value(header.take("<I"))
            records = []
            for _ in range(n_tensors):
                name = header.string()
                n_dims = header.take("<I")
                if n_dims > _MAX_DIMS:
                    raise CheckpointError(f"{path} is damaged: tensor {name} has {n_dims} dimensions")
                dims = [header.take("<Q") for _ in range(n_dims)]
                records.append((name, dims, header.take("<I"), header.take("<Q")))
            alignment = int(self.fields.get("general.alignment", 32))
            if alignment < 1 or alignment & (alignment - 1):
                raise CheckpointError(f"{path} is damaged: general.alignment is {alignment}")
            start = -(-header.at // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        data = np.memmap(path, mode="r", dtype=np.uint8) if records else np.zeros(0, np.uint8)
        for name, dims, kind, offset in records:
            try:
                tensor_type = GGMLQuantizationType(kind)
                per, nbytes = GGML_QUANT_SIZES[tensor_type]
            except (ValueError, KeyError):
                raise CheckpointError(f"{path}: tensor {name} has an unknown ggml type {kind}") from None
            count = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % per:
                raise CheckpointError(f"{path} is damaged: tensor {name}'s rows of {dims[0]} are not blocks of {per}")
            n_bytes, at = count // per * nbytes, start + offset
            if at + n_bytes > size:
                raise CheckpointError(
                    f"{path} is truncated or damaged: tensor {name} ends at byte {at + n_bytes}, past the file's {size}"
                )
            raw = data[at : at + n_bytes]
            rows = list(reversed(dims))
            if tensor_type.name in _FLOATS:
                view = raw.view(_FLOATS[tensor_type.name]).reshape(rows)
            else:
                view = raw.reshape(*rows[:-1], dims[0] // per * nbytes) if dims else raw
            self.tensors.append(GGUFTensor(name, tensor_type, np.array(dims), at, n_bytes, view))


class _Header:
    """A cursor over the header's bytes that refuses to read past the end."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.at = buf, size, path, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise CheckpointError(
                f"{self.path} is truncated or damaged: {what} of {n} bytes at byte {self.at} runs past the end"
            )

    def take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, "a header field")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += n
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.need(n, "a string")
        text = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: 49,152-151,936 of them), read as string() reads one, in one loop
        (a third of the time)."""
        buf, at, size, out = self.buf, self.at, self.size, []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if at + 8 > size:
                self.at = at
                self.need(8, "a header field")
            (n,) = length(buf, at)
            if at + 8 + n > size:
                self.at = at + 8
                self.need(n, "a string")
            out.append(str(buf[at + 8 : at + 8 + n], "utf-8", "replace"))
            at += 8 + n
        self.at = at
        return out

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9 and depth == 0:
            inner, count = self.take("<I"), self.take("<Q")
            if inner in _NUMPY:
                width = np.dtype(_NUMPY[inner]).itemsize
                self.need(count * width, "an array")
                values = np.frombuffer(self.buf, _NUMPY[inner], count, self.at).tolist()
                self.at += count * width
                return values
            if inner in (8, 9) and count <= self.size - self.at:  # each entry takes at least 8 bytes
                return self.strings(count) if inner == 8 else [self.value(inner, depth + 1) for _ in range(count)]
            raise CheckpointError(f"{self.path} is damaged: an array of type {inner} and {count} entries")
        raise CheckpointError(f"{self.path} is damaged: unknown metadata type {kind} at byte {self.at}")
