"""Token arrays on disk: raw little-endian arrays that readers memory-map, and a meta.json that says their dtype."""

from __future__ import annotations

from pathlib import Path

import numpy as np

META = "meta.json"


def token_dtype(vocab_size: int) -> type:
    """The smallest unsigned integer type that holds every id of a vocabulary: half the bytes of uint32 for the
    vocabularies of up to 65,536 tokens that llmkit trains."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def write_array(array: np.ndarray, path: Path) -> None:
    """Write `array` to `path` whole or not at all (through a temporary file), so that an interrupted run never
    leaves a truncated file that looks prepared."""
    tmp = path.with_name(path.name + ".tmp")
    array.tofile(tmp)
    tmp.replace(path)
