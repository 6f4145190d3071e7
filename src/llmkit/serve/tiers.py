"""Prefix-cache tiers: full blocks the pool gives up kept in host memory, then on disk, and brought back on a hit
instead of being computed again (SGLang's HiCache and vLLM's KV offloading do this; llama.cpp keeps a host prompt
cache and saves slots).

    pool ──a cached block evicted──► host (least recently used first, up to host_bytes) ──spilled──► disk (dir)
      ▲                                                                                                │
      └──── a prompt's next full block, by its digest: copied into a new pool block ◄──────────────────┘

A block is found by its digest (blocks.py), which names its tokens and every token before them, so a block found
holds exactly the keys and values the prompt would compute. A store belongs to one cache `key`: the model's
fingerprint (its config and a sample of every weight), the cache's dtype and layout and the block size; blocks of
another model are never read. On disk each block is a file `<key>/<digest>.kvb`: a header (format, key, digest,
length, checksum of the payload) and the payload, written to a temporary file and renamed into place, so a crash
leaves whole files or none. A file that is damaged, truncated or of another key is ignored with a log line and
removed; a full disk or any other OSError costs the block (logged once), never a request. At shutdown the blocks
still in the pool and in host memory are written too (`Engine.close`), so a restarted server finds the prompts
it had cached; the disk tier is bounded by `disk_bytes`, oldest files removed first.

Nothing here knows a tensor's meaning: a block is its bytes, as PagedCache.read_block lays them out.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections import OrderedDict
from pathlib import Path

import torch
from torch import Tensor

from llmkit.models.decoder import DecoderLM

log = logging.getLogger("llmkit.serve")

MAGIC = b"llmkit-kv-block 1\n"
_SAMPLES = 64  # values read from each weight for the model's fingerprint


def cache_key(model: DecoderLM, dtype: torch.dtype, block_size: int, layout: str) -> str:
    """The identity of a cache's blocks: the model (its config, and every parameter's and buffer's name, shape, dtype
    and 64 values spread over it: two checkpoints, or a checkpoint and its fine-tune, differ there), the cache's
    dtype, its layout and the block size. Hex, 32 characters."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(model.cfg).encode())
    h.update(f"{dtype}|{block_size}|{layout}".encode())
    for name, t in sorted(model.state_dict(keep_vars=False).items()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            step = max(flat.numel() // _SAMPLES, 1)
            h.update(flat[::step][:_SAMPLES].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


class BlockStore:
    """Blocks kept off the pool: `host_bytes` of them in memory (least recently used spilled first), the rest in
    `directory` up to `disk_bytes` (None: no disk tier)."""

    def __init__(self, key: str, host_bytes: int, directory: str | os.PathLike[str] | None, disk_bytes: int) -> None:
        self.key, self.host_bytes, self.disk_bytes = key, host_bytes, disk_bytes
        self.host: OrderedDict[bytes, Tensor] = OrderedDict()  # digest -> payload (uint8, CPU), oldest first
        self.held = 0  # bytes in host memory
        self.dir = Path(directory) / key if directory is not None else None
        self.disk: OrderedDict[bytes, int] = OrderedDict()  # digest -> file size, oldest first
        self.on_disk = 0  # bytes of the files
        self.restored = {"host": 0, "disk": 0}  # blocks brought back from each tier
        self._write_failed = False
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.host or digest in self.disk

    def put(self, digest: bytes, payload: Tensor) -> None:
        """Keep a block the pool gives up (its bytes, copied off the pool already)."""
        if digest in self.host:
            self.host.move_to_end(digest)
            return
        if payload.numel() > self.host_bytes:  # no host tier (or a block bigger than it): straight to disk
            self._write(digest, payload)
            return
        self.host[digest] = payload
        self.held += payload.numel()
        while self.held > self.host_bytes:
            old, data = self.host.popitem(last=False)
            self.held -= data.numel()
            self._write(old, data)

    def take(self, digest: bytes) -> Tensor | None:
        """The block's bytes, from host memory or disk (None: neither has it, or its file failed a check). A block
        taken from host memory leaves it (it goes back into the pool); its file, if any, stays for a restart."""
        data = self.host.pop(digest, None)
        if data is not None:
            self.held -= data.numel()
            self.restored["host"] += 1
            return data
        data = self._read(digest)
        if data is not None:
            self.restored["disk"] += 1
        return data

    def save(self, digest: bytes, payload: Tensor) -> None:
        """Write a block to disk (at shutdown) unless it is there already."""
        if self.dir is not None and digest not in self.disk:
            self._write(digest, payload)

    def flush(self) -> None:
        """Write what host memory holds to disk (at shutdown)."""
        for digest, data in list(self.host.items()):
            self.save(digest, data)

    # ---- disk

    def _path(self, digest: bytes) -> Path:
        assert self.dir is not None
        return self.dir / f"{digest.hex()}.kvb"

    def _scan(self) -> None:
        """The files a previous run left, oldest first (their checks wait until one is read)."""
        assert self.dir is not None
        found = []
        for path in self.dir.glob("*.kvb"):
            try:
                digest = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, digest, stat.st_size))
        for _, digest, size in sorted(found):
            self.disk[digest] = size
            self.on_disk += size

    def _write(self, digest: bytes, payload: Tensor) -> None:
        if self.dir is None or digest in self.disk:
            return
        body = payload.numpy().tobytes()
        header = {"key": self.key, "digest": digest.hex(), "bytes": len(body),
                  "blake2b": hashlib.blake2b(body, digest_size=16).hexdigest()}  # fmt: skip
        data = MAGIC + json.dumps(header).encode() + b"\n" + body
        if len(data) > self.disk_bytes:
            return
        while self.disk and self.on_disk + len(data) > self.disk_bytes:
            self._remove(next(iter(self.disk)))
        path = self._path(digest)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)
        except OSError as e:
            temporary.unlink(missing_ok=True)
            if not self._write_failed:
                log.warning("prefix cache: cannot write blocks to %s (%s); they are dropped instead", self.dir, e)
                self._write_failed = True
            return
        self.disk[digest] = len(data)
        self.on_disk += len(data)

    def _read(self, digest: bytes) -> Tensor | None:
        if digest not in self.disk:
            return None
        path = self._path(digest)
        try:
            data = path.read_bytes()
        except OSError as e:
            log.warning("prefix cache: cannot read %s (%s); computing the block instead", path.name, e)
            self._remove(digest)
            return None
        why = self._check(data, digest)
        if why is not None:
            log.warning("prefix cache: ignoring %s: %s; computing the block instead", path, why)
            self._remove(digest)
            return None
        self.disk.move_to_end(digest)
        body = data[data.index(b"\n", len(MAGIC)) + 1 :]
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    def _check(self, data: bytes, digest: bytes) -> str | None:
        """Why the file's bytes cannot be used (None: they can)."""
        if not data.startswith(MAGIC):
            return "not an llmkit cache block"
        end = data.find(b"\n", len(MAGIC))
        try:
            header = json.loads(data[len(MAGIC) : end])
        except (ValueError, UnicodeDecodeError):
            return "its header is damaged"
        if not isinstance(header, dict) or header.get("key") != self.key:
            return "it belongs to another model or cache layout"
        body = data[end + 1 :]
        if header.get("digest") != digest.hex() or header.get("bytes") != len(body):
            return "it is truncated or misnamed"
        if header.get("blake2b") != hashlib.blake2b(body, digest_size=16).hexdigest():
            return "its checksum does not match (damaged)"
        return None

    def _remove(self, digest: bytes) -> None:
        self.on_disk -= self.disk.pop(digest, 0)
        with contextlib.suppress(OSError):
            self._path(digest).unlink(missing_ok=True)
