"""`load_model`: open any supported checkpoint (a Hugging Face directory, a GGUF file, an llmkit checkpoint) by
looking at what the path holds."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from llmkit.interop.checkpoint import FORMAT_FILE, load_llmkit
from llmkit.interop.gguf import load_gguf
from llmkit.interop.hf import load_hf
from llmkit.interop.loaded import Format, Loaded
from llmkit.interop.safetensors_io import CheckpointError
from llmkit.tokenizer import Tokenizer


def detect_format(path: str | os.PathLike[str]) -> Format:
    """'gguf', 'llmkit' or 'hf' for a checkpoint path; CheckpointError if it is none of them."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"
    if p.is_dir() and (p / FORMAT_FILE).is_file():
        return "llmkit"
    if p.is_dir() and (p / "config.json").is_file():
        return "hf"
    if not p.exists():
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
) -> Loaded:
    """Load any supported checkpoint: a Hugging Face directory, a GGUF file, or an llmkit checkpoint (quantized
    ones too). `quantized` applies to GGUF files (see load_gguf)."""
    kind = detect_format(path)
    if kind == "llmkit":
        return load_llmkit(path, dtype=dtype, device=device)
    if kind == "gguf":
        return load_gguf(path, dtype=dtype, device=device, quantized=quantized)
    ck = load_hf(path, dtype=dtype, device=device)
    return Loaded(
        ck.model, Tokenizer.from_dir(path), "hf", Path(path), ck.model_type, ck.hf_config, ck.generation_config
    )
