"""llmkit's own checkpoint format (`load_model` in interop/load.py opens it and every other format).

    DIR/llmkit.json          {"format": "llmkit", "version": 1, "config": ModelConfig, "hf": {...} | null, ...,
                              "quantization": QuantSpec (only for a quantized model, see llmkit.quant)}
    DIR/model.safetensors    weights under llmkit's own names (sharded with an index when large); a quantized
                             layer's as NAME.qweight (int8 / packed int4 codes), NAME.scales, NAME.zeros
    DIR/tokenizer.json ...   the tokenizer, when there is one (the target side's, for translation)
    DIR/source_tokenizer/    a translation model's source tokenizer, when the two sides have separate vocabularies

The "hf" entry keeps the Hugging Face model_type and config.json a model came from, so that converting back writes
the same config (token ids, and fields llmkit does not model, survive the round trip).

A LoRA fine-tuning checkpoint holds adapters instead of weights:

    DIR/llmkit.json          {..., "config": the base's ModelConfig, "adapter": {"base": PATH, "quantized": bool}}
    DIR/adapter_config.json, adapter_model.safetensors     the adapters in PEFT's layout (llmkit.interop.peft)

`load_model` (interop/load.py) opens it: the base checkpoint (float weights) with the adapters folded in.

Integrity: llmkit.json carries a manifest of everything that decides what the checkpoint computes, and loading
verifies it first (`verify=False`, `--no-verify`, skips it; SHA-256 runs at ~1.5 GB/s here, a third of a second for
500 MB, and a file already hashed in the same state is not hashed again: stamps.py):

    "checksums"   the SHA-256 of every other file the save wrote ({"model.safetensors": "sha256:...", tokenizer
                  files, adapters, source_tokenizer/...}): bytes damaged in place (a bad disk, an interrupted copy) are
                  reported with the file's name instead of loading as garbage weights
    "manifest"    the SHA-256 of llmkit.json's own other fields, "checksums" included, written canonically (sorted
                  keys, no spaces): a one-byte edit of the config (eps 1e-05 -> 1e-01 changes every logit), of the
                  quantization record, the adapter's base or the Hugging Face config, or a removed "checksums", is
                  a mismatch

A file that loading would read (weights, index, tokenizer files) but the checksums do not list was added after the
save, and is refused too. A checkpoint without a manifest (saved before llmkit wrote one, or with the manifest
removed) loads only unverified, with a note saying so: nothing else tells it apart from one whose config was edited.
`llmkit convert OLD NEW --to llmkit --no-verify` writes a verified copy of one you trust.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError, InputError
from llmkit.interop.keymap import IDENTITY, Concrete
from llmkit.interop.loaded import Loaded
from llmkit.interop.safetensors_io import CheckpointError, open_tensors, save_tensors
from llmkit.interop.stamps import stamped_digest
from llmkit.interop.weights import LayerImportance, Split, build_quantized, build_with_weights, expected_shapes
from llmkit.layers.precision import cast_state, fp32_state
from llmkit.models import DecoderLM, EncoderDecoder, RNNConfig, RNNSeq2Seq, build_rnn
from llmkit.parts import Index
from llmkit.quant import QuantSpec, quantized_spec
from llmkit.tokenizer import Tokenizer

FORMAT_FILE = "llmkit.json"
SOURCE_TOKENIZER = "source_tokenizer"
VERSION = 1
CHUNK = 1 << 24  # bytes hashed per read


def file_digest(path: Path) -> str:
    """ "sha256:<hex>" of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return f"sha256:{h.hexdigest()}"


def record_checksums(directory: Path) -> dict[str, str]:
    """The digest of every file under `directory` but llmkit.json and unfinished (*.tmp) files, by relative path."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != FORMAT_FILE and p.suffix != ".tmp")
    return {p.relative_to(directory).as_posix(): file_digest(p) for p in files}


# the files a load reads: one of them that the checksums do not list was put there after the save
READ_BY_LOADING = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "adapter_config.json",
    "adapter_model.safetensors",
)


def manifest_digest(meta: dict[str, Any]) -> str:
    """ "sha256:<hex>" of llmkit.json's fields but "manifest" itself, as canonical JSON (sorted keys, no spaces):
    the same for the dict that was written and the one read back, whatever the file's layout."""
    fields = {k: v for k, v in meta.items() if k != "manifest"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"sha256:{hashlib.sha256(text.encode('ascii')).hexdigest()}"


def has_manifest(meta: dict[str, Any]) -> bool:
    return "manifest" in meta


def verify_manifest(directory: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> None:
    """A CheckpointError unless llmkit.json's fields match its manifest and every file matches its recorded
    checksum (names the first field set or file that does not), and no file that loading reads is unlisted."""
    d = Path(directory)
    meta = meta if meta is not None else read_meta(d)
    if not has_manifest(meta):
        raise CheckpointError(
            f"{d / FORMAT_FILE} has no manifest (the checksums of the checkpoint's config and files), so nothing tells "
            "it apart from one whose config or weights were changed: it was saved by an older llmkit, or the manifest "
            f"was removed. If you trust it, load it with --no-verify (verify=False), or write a verified copy with "
            f"`llmkit convert {d} NEW --to llmkit --no-verify`"
        )
    if meta["manifest"] != manifest_digest(meta):
        raise CheckpointError(
            f"{d / FORMAT_FILE} was changed after the checkpoint was saved: its fields (config, checksums, ...) differ "
            "from the manifest recorded with them, and a changed config changes what the model computes. Restore it "
            "from a copy (or load anyway with --no-verify / verify=False)"
        )
    recorded = meta.get("checksums") or {}
    for name, digest in recorded.items():
        path = d / name
        # (realpath: Path.resolve raises RuntimeError on a link that leads back to itself before Python 3.13)
        if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(d)):
            raise CheckpointError(f"{d / FORMAT_FILE}: checksum entry {name!r} points outside the checkpoint")
        try:
            os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{path} is missing: the checkpoint was saved with it ({FORMAT_FILE} lists it)"
            ) from None
        except OSError as e:  # a link that loops, a file that cannot be read
            raise CheckpointError(f"{path} cannot be read: {e.strerror}: fix or replace it") from None
        if not path.is_file():
            raise CheckpointError(f"{path} is not a file: the checkpoint was saved with a file there")
        if stamped_digest(path, file_digest) != digest:
            raise CheckpointError(
                f"{path} is damaged: its SHA-256 differs from the one recorded when it was saved. Restore it from a "
                "copy (or load anyway with --no-verify / verify=False)"
            )
    for path in [*d.iterdir(), *(d / SOURCE_TOKENIZER).glob("*")]:
        name = path.relative_to(d).as_posix()
        if path.is_file() and name not in recorded and any(fnmatch.fnmatch(path.name, p) for p in READ_BY_LOADING):
            raise CheckpointError(
                f"{path} is not in the checkpoint's manifest: it was put there after the save, and loading would read "
                "it. Remove it (or load anyway with --no-verify / verify=False)"
            )


def _write_meta(d: Path, meta: dict[str, Any]) -> None:
    """llmkit.json with the checksums of the files already written and the manifest over both, atomically
    (written last: its presence says the checkpoint is complete)."""
    meta = {**meta, "checksums": record_checksums(d)}
    meta["manifest"] = manifest_digest(meta)
    tmp = d / (FORMAT_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(d / FORMAT_FILE)


class Weights(Protocol):
    """What is saved of a model: its config and its state dict (a model, or a state gathered from shards)."""

    @property
    def cfg(self) -> ModelConfig | RNNConfig: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


def save_llmkit(
    model: DecoderLM | EncoderDecoder | RNNSeq2Seq | Weights,
    directory: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    source_tokenizer: Tokenizer | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    hf_model_type: str | None = None,
    hf_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write `model` in llmkit's format, with its tokenizer (an object, or the files of `tokenizer_dir`)."""
    d = Path(directory)
    keep = fp32_state(model) if isinstance(model, nn.Module) else set()
    state = cast_state(model.state_dict(), dtype, keep)
    save_tensors(state, d, max_shard_bytes)
    meta = {
        "format": "llmkit",
        "version": VERSION,
        "config": model.cfg.to_dict(),
        "hf": {"model_type": hf_model_type, "config": hf_config} if hf_model_type else None,
        "generation_config": generation_config or {},
    }
    spec = quantized_spec(model) if isinstance(model, nn.Module) else None
    if spec is not None:
        meta["quantization"] = spec.to_dict()
    if tokenizer_dir is not None:
        from llmkit.interop.hf import copy_tokenizer_files

        copy_tokenizer_files(tokenizer_dir, d)
    elif tokenizer is not None:
        tokenizer.save(d)
    if source_tokenizer is not None and source_tokenizer is not tokenizer:
        source_tokenizer.save(d / SOURCE_TOKENIZER)
    _write_meta(d, meta)
    return d


def save_llmkit_adapter(
    model: nn.Module,
    cfg: ModelConfig,
    directory: str | os.PathLike[str],
    *,
    base: str,
    quantized: bool = False,
    tokenizer: Tokenizer | None = None,
    generation_config: dict[str, Any] | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the LoRA adapters of `model` (whose base is the checkpoint `base`) as an llmkit checkpoint."""
    from llmkit.interop.peft import save_peft

    d = Path(directory)
    save_peft(model, cfg, d, base=base, state=state)
    if tokenizer is not None:
        tokenizer.save(d)
    meta = {
        "format": "llmkit",
        "version": VERSION,
        "config": cfg.to_dict(),
        "adapter": {"base": base, "quantized": quantized},
        "hf": None,
        "generation_config": generation_config or {},
    }
    _write_meta(d, meta)
    return d


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """An llmkit checkpoint's llmkit.json, checked for format and version."""
    d = Path(directory)
    try:
        meta = json.loads((d / FORMAT_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{d} has no {FORMAT_FILE}: not an llmkit checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{d / FORMAT_FILE} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != "llmkit" or meta.get("version") != VERSION:
        raise CheckpointError(f"{d / FORMAT_FILE} is not an llmkit checkpoint of version {VERSION}")
    for key, kind in _META_FIELDS.items():
        value = meta.get(key)
        if value is not None and not isinstance(value, kind):
            raise CheckpointError(f"{d / FORMAT_FILE}: {key!r} must be a {kind.__name__}, not {type(value).__name__}")
    adapter, hf = meta.get("adapter"), meta.get("hf")
    if adapter and not isinstance(adapter.get("base"), str):
        raise CheckpointError(f"{d / FORMAT_FILE}: 'adapter' must name its base checkpoint ('base': PATH)")
    if hf and not (isinstance(hf.get("model_type"), str | None) and isinstance(hf.get("config"), dict | None)):
        raise CheckpointError(f"{d / FORMAT_FILE}: 'hf' must hold a model_type string and a config mapping")
    checksums = meta.get("checksums") or {}
    if "manifest" in meta and not isinstance(meta["manifest"], str):
        raise CheckpointError(f"{d / FORMAT_FILE}: 'manifest' must be a digest string")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()):
        raise CheckpointError(f"{d / FORMAT_FILE}: 'checksums' must map file names to digests")
    return meta


# the types of llmkit.json's fields (each may also be absent or null)
_META_FIELDS: dict[str, type] = {
    "config": dict,
    "hf": dict,
    "generation_config": dict,
    "quantization": dict,
    "adapter": dict,
    "checksums": dict,
}


def load_llmkit(
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    verify: bool = True,
    split: Split | None = None,
    quantize: str | None = None,
    importance: LayerImportance | None = None,
) -> Loaded:
    """An llmkit checkpoint, its config and files verified against their manifest first (unless not `verify`).
    `split` cuts the model on the meta device before loading, and only the parts it keeps are read (weights.py);
    `quantize` (a GGUF block type or a mixture) quantizes a float checkpoint's layers as they are read."""
    d = Path(directory)
    meta = read_meta(d)
    if meta.get("adapter"):
        raise CheckpointError(f"{d} holds LoRA adapters, not weights: open it with llmkit.interop.load.load_model")
    if verify:
        verify_manifest(d, meta)
    try:
        raw = meta["config"]
        rnn = isinstance(raw, dict) and raw.get("arch") == "rnn"
        cfg: ModelConfig | RNNConfig = RNNConfig.from_dict(raw) if rnn else ModelConfig.from_dict(raw)
    except KeyError:
        raise CheckpointError(f"{d / FORMAT_FILE} has no config") from None
    except ConfigError as e:
        raise CheckpointError(f"{d / FORMAT_FILE} holds an invalid config: {e}") from None
    tensors = open_tensors(d)
    model: DecoderLM | EncoderDecoder | RNNSeq2Seq
    if isinstance(cfg, RNNConfig):
        if quantize is not None:
            raise InputError(f"{d} holds a recurrent model, which has no layers llmkit quantizes to GGUF types")
        if split is not None:
            raise CheckpointError(f"{d} holds a recurrent model: only decoder-only models load split across ranks")
        model = _load_rnn(cfg, tensors, dtype, device, d)
    elif meta.get("quantization"):
        if quantize is not None:
            raise InputError(f"{d} is quantized already: quantize its float source instead")
        try:
            spec = QuantSpec.from_dict(meta["quantization"])
        except (InputError, TypeError) as e:
            raise CheckpointError(f"{d / FORMAT_FILE} holds an invalid quantization record: {e}") from None

        def part(name: str, index: Index | None) -> torch.Tensor:
            return tensors[name] if index is None else tensors.part(name, index)

        model = build_quantized(
            cfg, spec, lambda _: {n: tensors[n] for n in tensors.shapes}, dtype, device, str(d),
            split=split, part=part, shapes=tensors.shapes,
        )  # fmt: skip
    else:
        concrete = [Concrete((n,), (n,), IDENTITY) for n in expected_shapes(cfg)]
        model = build_with_weights(
            cfg, concrete, tensors.__getitem__, tensors.shapes, lambda n: False, dtype, device, str(d),
            split=split, part=tensors.part, quantize=quantize, importance=importance,
        )  # fmt: skip
    hf = meta.get("hf") or {}
    loaded = Loaded(
        model,
        Tokenizer.from_dir(d),
        "llmkit",
        d,
        hf.get("model_type"),
        hf.get("config"),
        meta.get("generation_config") or {},
        Tokenizer.from_dir(d / SOURCE_TOKENIZER) if (d / SOURCE_TOKENIZER).is_dir() else None,
    )
    if not verify:
        loaded.notes.extend(unverified_notes(d, meta))
    return loaded


def unverified_notes(d: Path, meta: dict[str, Any]) -> list[str]:
    """What to say of a checkpoint loaded with verify=False that has no manifest: nothing vouches for it."""
    if has_manifest(meta):
        return []
    return [f"{d} has no manifest: its config and files were loaded unverified (--no-verify)"]


def _load_rnn(
    cfg: RNNConfig, tensors: Any, dtype: torch.dtype | None, device: torch.device | str | None, d: Path
) -> RNNSeq2Seq:
    """An RNN encoder-decoder (small, built directly) with every weight checked by name and shape."""
    model = build_rnn(cfg, device=device)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = dict(tensors.shapes)
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{d}: weights do not match the RNN config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    bad = [k for k in expected if tuple(found[k]) != expected[k]]
    if bad:
        raise CheckpointError(f"{d}: {bad[0]} has shape {tuple(found[bad[0]])}, the config needs {expected[bad[0]]}")
    model.load_state_dict({k: tensors[k] for k in expected})
    return model.to(dtype=dtype) if dtype is not None else model
