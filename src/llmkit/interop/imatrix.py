"""Importance matrices: how large each input of each linear layer is on real text, so that quantizing spends its
precision where the activations are (llmkit.quant.weighted uses them; llama.cpp's `llama-imatrix` computes the
same thing).

For every linear layer the model runs over calibration text, `collect` adds up x_j^2 over every token for each input
column j, and counts the tokens; a layer's importance is the mean, sums / count. Text is cut into chunks of
`context` tokens (the first token of each chunk a BOS where the tokenizer adds one), each run as one sequence.

Files are llama.cpp's imatrix GGUF format, so that a matrix from `llama-imatrix` quantizes with llmkit and one from
llmkit with `llama-quantize --imatrix`: general.type "imatrix", imatrix.datasets / chunk_count / chunk_size, and per
weight tensor (by its GGUF name, "blk.0.attn_q.weight") an F32 `<name>.in_sum2` of the sums and an F32
`<name>.counts` of the count. The older binary format (`.dat`: entries of name, calls, and sums already divided by
the count) is read too. The matrix is keyed by GGUF names; `for_model` gives each of a model's layers its row.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from llmkit.errors import InputError

GENERAL_TYPE = "imatrix"


@dataclass
class ImportanceMatrix:
    """sums: GGUF tensor name -> (inputs,) float64 sums of x^2 over the tokens seen; counts: name -> tokens seen;
    chunks: how many chunks of chunk_size tokens went in; datasets: where the text came from."""

    sums: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    chunks: int = 0
    chunk_size: int = 0
    datasets: list[str] = field(default_factory=list)

    def importance(self, name: str) -> Tensor | None:
        """The mean x^2 of each input of tensor `name` (float32), None where the matrix has no row for it. A count
        of 0 gives ones, as llama-quantize does."""
        if name not in self.sums:
            return None
        count = self.counts.get(name, 0.0)
        if count <= 0:
            return torch.ones_like(self.sums[name], dtype=torch.float32)
        return (self.sums[name] / count).float()

    def for_model(self, model: nn.Module) -> dict[str, Tensor]:
        """Layer name ("blocks.0.attn.wq", "head") -> its importance, for every layer of `model` the matrix has a
        row for; a row whose width is not the layer's input width is an error naming both."""
        out = {}
        for layer, name in gguf_names(model).items():
            row = self.importance(name)
            if row is None:
                continue
            module = model.get_submodule(layer)
            width = int(getattr(module, "in_features", row.numel()))
            if row.numel() != width:
                raise InputError(
                    f"importance matrix: {name} has {row.numel()} inputs but the model's {layer} takes {width} "
                    "(a matrix computed for another model?)"
                )
            out[layer] = row
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write llama.cpp's imatrix GGUF file (`llama-quantize --imatrix PATH` reads it)."""
        import gguf

        writer = gguf.GGUFWriter(str(path), arch=GENERAL_TYPE)
        try:
            writer.add_type(GENERAL_TYPE)
            writer.add_array("imatrix.datasets", list(self.datasets) or ["unknown"])
            writer.add_uint32("imatrix.chunk_count", self.chunks)
            writer.add_uint32("imatrix.chunk_size", self.chunk_size)
            for name in sorted(self.sums):
                sums = self.sums[name].to(torch.float32).numpy().reshape(1, -1)
                writer.add_tensor(f"{name}.in_sum2", sums)
                writer.add_tensor(f"{name}.counts", np.array([[self.counts[name]]], dtype=np.float32))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


def load_imatrix(path: str | os.PathLike[str]) -> ImportanceMatrix:
    """Read an imatrix file: llama.cpp's GGUF format, or its older binary one."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"cannot read the importance matrix {p}: {e.strerror or e}") from e
    return _load_gguf(p) if magic == b"GGUF" else _load_legacy(p)


def is_imatrix_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an imatrix file (a GGUF file of general.type imatrix, or a .dat file), not text."""
    p = Path(path)
    if p.suffix == ".dat":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _load_gguf(p: Path) -> ImportanceMatrix:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(p))
    except (ValueError, OSError) as e:
        raise InputError(f"{p} is not a readable GGUF file: {e}") from e

    def value(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    kind = value("general.type")
    if kind != GENERAL_TYPE:
        raise InputError(f"{p} is a GGUF file of general.type {kind!r}, not an importance matrix")
    out = ImportanceMatrix(
        chunks=int(value("imatrix.chunk_count") or 0),
        chunk_size=int(value("imatrix.chunk_size") or 0),
        datasets=list(value("imatrix.datasets") or []),
    )
    tensors = {t.name: t for t in reader.tensors}
    for key, t in tensors.items():
        if not key.endswith(".in_sum2"):
            continue
        name = key.removesuffix(".in_sum2")
        counts = tensors.get(f"{name}.counts")
        if counts is None:
            raise InputError(f"{p}: {name} has sums but no counts")
        c = np.asarray(counts.data, dtype=np.float32).reshape(-1)
        if c.size != 1:
            raise InputError(f"{p}: {name} has {c.size} count rows (experts' matrices are not read)")
        out.sums[name] = torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(-1).astype(np.float64))
        out.counts[name] = float(c[0])
    if not out.sums:
        raise InputError(f"{p} holds no importance rows")
    return out


def _load_legacy(p: Path) -> ImportanceMatrix:
    """The binary format: int32 entries; per entry int32 name length, name, int32 calls, int32 values, float32 values
    (already divided by the count, times calls); then optionally int32 chunks and the dataset's name."""
    data = p.read_bytes()
    at = 0

    def take(fmt: str) -> tuple[Any, ...]:
        nonlocal at
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise InputError(f"{p} ends inside an entry: not an importance matrix (or truncated)")
        values = struct.unpack_from(fmt, data, at)
        at += size
        return values

    (entries,) = take("<i")
    if entries < 1:
        raise InputError(f"{p} is not an importance matrix (it says {entries} entries)")
    out = ImportanceMatrix()
    for _ in range(entries):
        (length,) = take("<i")
        if length <= 0 or length > 4096:
            raise InputError(f"{p} is not an importance matrix (a name of {length} bytes)")
        name = bytes(take(f"<{length}s")[0]).decode("utf-8", "replace")
        calls, n = take("<ii")
        if n < 1:
            raise InputError(f"{p}: {name} has {n} values")
        values = np.frombuffer(data, dtype="<f4", count=n, offset=at).astype(np.float64)
        at += 4 * n
        out.sums[name] = torch.from_numpy(values)  # the legacy sums are means times calls: divide by calls
        out.counts[name] = float(calls)
    if at + 4 <= len(data):
        (out.chunks,) = take("<i")
        if at + 4 <= len(data):
            (length,) = take("<i")
            if 0 < length <= len(data) - at:
                out.datasets.append(bytes(take(f"<{length}s")[0]).decode("utf-8", "replace"))
    return out


def gguf_names(model: nn.Module) -> dict[str, str]:
    """Layer name -> GGUF weight name for every linear layer of an llmkit decoder that a GGUF file names (the
    llama, qwen2 and qwen3 architectures)."""
    from llmkit.config import ModelConfig
    from llmkit.interop.gguf import gguf_rules
    from llmkit.interop.gguf_write import gguf_architecture
    from llmkit.interop.keymap import expand

    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise InputError("an importance matrix is kept for llmkit's decoder models")
    out = {}
    for c in expand(gguf_rules(cfg, gguf_architecture(cfg)), cfg):
        (ours,), (theirs,) = c.ours, c.theirs
        if ours.endswith(".weight") and ours != "embed.weight" and not ours.endswith("norm.weight"):
            out[ours.removesuffix(".weight")] = theirs
    return out


@torch.no_grad()
def collect(
    model: nn.Module,
    chunks: Iterable[list[int]],
    dataset: str = "",
    context: int = 0,
) -> ImportanceMatrix:
    """Run `model` (an llmkit decoder) over each chunk of token ids and sum x^2 of every input of every linear layer
    a GGUF file names; `context` is recorded as the chunk size."""
    names = gguf_names(model)
    out = ImportanceMatrix(chunk_size=context, datasets=[dataset] if dataset else [])
    hooks = []

    def hook(name: str) -> Any:
        def add(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            flat = x.reshape(-1, x.shape[-1]).double()
            s = (flat * flat).sum(0)
            if name in out.sums:
                out.sums[name] += s
            else:
                out.sums[name] = s
            out.counts[name] = out.counts.get(name, 0.0) + flat.shape[0]

        return add

    try:
        for layer, name in names.items():
            try:
                module = model.get_submodule(layer)
            except AttributeError:  # a tied head: no layer of its own
                continue
            hooks.append(module.register_forward_pre_hook(hook(name)))
        was_training = model.training
        model.eval()
        for ids in chunks:
            model(torch.tensor([ids], dtype=torch.long, device=_device(model)))
            out.chunks += 1
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    return out


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def text_chunks(ids: list[int], context: int, bos: int | None, limit: int | None = None) -> list[list[int]]:
    """Token ids cut into whole chunks of `context` (each beginning with `bos` where given), at most `limit`."""
    if context < 2:
        raise InputError(f"an importance matrix needs chunks of at least 2 tokens, not {context}")
    body = context - (bos is not None)
    chunks = [([bos] if bos is not None else []) + ids[i : i + body] for i in range(0, len(ids) - body + 1, body)]
    if not chunks:
        raise InputError(
            f"the calibration text is {len(ids)} tokens, less than one chunk of {context}: give more text (or "
            "shorter chunks: llmkit imatrix --context N)"
        )
    return chunks[:limit] if limit is not None else chunks
