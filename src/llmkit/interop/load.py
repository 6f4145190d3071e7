"""`load_model`: open any supported checkpoint (a Hugging Face directory, a GGUF file, an llmkit checkpoint) by
looking at what the path holds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmkit.interop.checkpoint import FORMAT_FILE, load_llmkit, read_meta, unverified_notes, verify_manifest
from llmkit.interop.gguf import load_gguf
from llmkit.interop.hf import load_hf
from llmkit.interop.loaded import Format, Loaded
from llmkit.interop.safetensors_io import CheckpointError
from llmkit.interop.weights import Split
from llmkit.models import DecoderLM
from llmkit.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmkit.interop.imatrix import ImportanceMatrix


def load_with_adapters(
    directory: str | os.PathLike[str],
    base: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tokenizer: Tokenizer | None = None,
    verify: bool = True,
) -> Loaded:
    """The base checkpoint with the LoRA adapters of `directory` (PEFT's layout) folded into its weights. A quantized
    base is loaded as float weights for this (an adapter is a float update)."""
    from llmkit.adapters import merge_lora
    from llmkit.interop.peft import load_peft

    d, b = Path(directory), Path(base)
    if not b.exists():
        raise CheckpointError(
            f"{d} holds LoRA adapters for the checkpoint {b}, which is not there (the adapters need their base)"
        )
    own = read_meta(d) if (d / FORMAT_FILE).is_file() else None  # an llmkit checkpoint's, not a folder PEFT saved
    if verify and own is not None:
        verify_manifest(d, own)
    loaded = load_model(b, dtype=dtype, device=device, quantized=False, verify=verify)
    model = loaded.model
    if not isinstance(model, DecoderLM):
        raise CheckpointError(f"{b} is not a decoder-only model; llmkit's adapters are for language models")
    names = load_peft(model, model.cfg, d)
    merge_lora(model)
    loaded.path = d
    loaded.notes.append(f"LoRA adapters on {len(names)} projections from {d} merged into {b}")
    if not verify and own is not None:
        loaded.notes.extend(unverified_notes(d, own))
    if tokenizer is not None:
        loaded.tokenizer = tokenizer
    return loaded


def load_peft_folder(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    verify: bool = True,
) -> Loaded:
    """A folder PEFT saved (adapter_config.json, adapter_model.safetensors): its base_model_name_or_path, a local
    checkpoint, with the adapters folded in."""
    from llmkit.interop.peft import read_adapter_config

    base = read_adapter_config(path).get("base_model_name_or_path")
    if not base:
        raise CheckpointError(f"{path}: adapter_config.json names no base_model_name_or_path to load the adapters onto")
    return load_with_adapters(path, base, dtype=dtype, device=device, tokenizer=Tokenizer.from_dir(path), verify=verify)


def detect_format(path: str | os.PathLike[str]) -> Format:
    """'gguf', 'llmkit' or 'hf' for a checkpoint path; CheckpointError if it is none of them."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"
    if p.is_dir() and (p / FORMAT_FILE).is_file():
        return "llmkit"
    if p.is_dir() and ((p / "config.json").is_file() or (p / "adapter_config.json").is_file()):
        return "hf"  # a Hugging Face model, or PEFT's adapters for one
    if p.is_symlink() and not p.exists():
        os.stat(p)  # a link that loops or leads nowhere: the OSError says which (ELOOP, ENOENT) and names the path
    if not p.exists():
        from llmkit.outputs import leftovers

        aside = leftovers(p, "old")
        if aside:  # a replacement killed between its two renames (llmkit.outputs)
            raise CheckpointError(
                f"{p} does not exist, but {aside[-1]} holds its previous version, left by an interrupted replacement: "
                f"rename it back to {p.name} (the next command that writes {p.name} does so itself)"
            )
        raise CheckpointError(f"{p} does not exist")
    raise CheckpointError(
        f"{p} is not a checkpoint: expected a .gguf file, a directory with {FORMAT_FILE} (llmkit) or one with "
        "config.json (Hugging Face)"
    )


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    quantized: bool | None = None,
    verify: bool = True,
    split: Split | None = None,
    quantize: str | None = None,
    own_width: bool = False,
    importance: ImportanceMatrix | None = None,
) -> Loaded:
    """Load any supported checkpoint: a Hugging Face directory, a GGUF file, or an llmkit checkpoint (quantized
    ones too); LoRA adapters (an llmkit fine-tuning checkpoint, or a folder PEFT saved) come folded into their base
    checkpoint's weights. `quantized` applies to GGUF files (see load_gguf). With `verify`, an llmkit checkpoint's
    files are checked against their recorded checksums first; whatever the source, weights that are NaN or infinite
    after loading are a CheckpointError naming the tensor.

    `split` (llmkit.parallel.split_loader) cuts the model, built on the meta device, to one tensor-parallel rank's
    part before any weight is read, and only those parts are read from the files (interop/weights.py).

    `quantize` (a GGUF block type, "Q8_0", ..., or one of llama.cpp's mixtures, "Q4_K_M", ...) quantizes each layer
    as it is read, so memory holds the quantized model and one float tensor at a time, never the float model (an
    8B checkpoint is 32 GB in fp32); LoRA adapters are folded into their base first, which needs the whole
    weights. `importance` (llmkit.interop.imatrix) weighs each layer's quantization by its inputs' importance.

    `own_width` (for inference: the model's layers become block layers, which do not train): a Hugging Face
    checkpoint stored in bf16 or fp16, loaded on the CPU with dtype None, keeps its linear layers, head and
    embedding table at that width as views of the memory-mapped files (BF16 / F16 block layers multiplied by
    llmkit's C++ kernels), with activations, norms and caches in fp32 (interop/weights.py: held_width)."""
    kind = detect_format(path)
    if split is not None and (
        (kind == "hf" and not (Path(path) / "config.json").is_file())
        or (kind == "llmkit" and read_meta(path).get("adapter"))
    ):
        raise CheckpointError(
            f"{path} holds LoRA adapters, which cannot be read in slices: folding them into their base needs the "
            f"whole weights. Write the merged model first (`llmkit merge {path} MERGED`) and load that"
        )
    rows_for = importance.for_model if importance is not None else None
    whole = False  # adapters fold into their base's whole weights: quantized after loading
    if kind == "hf" and not (Path(path) / "config.json").is_file():  # PEFT's adapters
        loaded, whole = load_peft_folder(path, dtype=dtype, device=device, verify=verify), True
    elif kind == "llmkit":
        adapter = read_meta(path).get("adapter")
        if adapter:  # a LoRA fine-tuning checkpoint: its base with the adapters folded in
            loaded = load_with_adapters(
                path, adapter["base"], dtype=dtype, device=device, tokenizer=Tokenizer.from_dir(path), verify=verify
            )
            loaded.source, whole = "llmkit", True
        else:
            loaded = load_llmkit(
                path, dtype=dtype, device=device, verify=verify, split=split, quantize=quantize, importance=rows_for
            )
    elif kind == "gguf":
        if quantize is not None:
            quantized = False
        loaded = load_gguf(
            path, dtype=dtype, device=device, quantized=quantized, split=split, quantize=quantize, importance=rows_for
        )
    else:
        ck = load_hf(
            path, dtype=dtype, device=device, split=split, quantize=quantize, own_width=own_width, importance=rows_for
        )
        loaded = Loaded(
            ck.model, Tokenizer.from_dir(path), "hf", Path(path), ck.model_type, ck.hf_config, ck.generation_config
        )
    if whole and quantize is not None:
        from llmkit.quant import quantize as quantize_model

        rows = importance.for_model(loaded.model) if importance is not None else None
        quantize_model(loaded.model, quantize, include_head=True, importance=rows)
    check_finite_weights(loaded.model, Path(path))
    return loaded


@torch.no_grad()
def check_finite_weights(model: torch.nn.Module, path: Path) -> None:
    """A CheckpointError naming the first floating-point parameter or buffer of `model` that holds NaN or an
    infinity (read from `path`): such a model's every output would be NaN."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(
                f"{path}: tensor {name} {tuple(t.shape)} holds {bad} NaN or infinite value(s): the file is damaged "
                "or was saved from a model that diverged"
            )
