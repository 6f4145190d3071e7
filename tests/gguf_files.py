"""GGUF files written by the tests (with the `gguf` package's writer): small llama / qwen2 / qwen3 models with random
weights, their linear tensors F32 or random blocks of any llama.cpp type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# where each type keeps its half-precision fields (scale d, and the min / dmin), as byte offsets in a block
FP16_FIELDS = {
    "Q8_0": [0], "Q5_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q5_1": [0, 2],
    "Q6_K": [-2], "Q3_K": [-2], "Q2_K": [-4, -2], "IQ4_NL": [0], "IQ4_XS": [0], "IQ2_XXS": [0],
}  # fmt: skip


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid raw blocks of `kind` for a (rows, cols) tensor: random bytes, with finite half-precision scales of a
    weight's size (any byte pattern is a valid block otherwise)."""
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    rng = np.random.default_rng(seed)
    if kind in ("F16", "BF16"):  # unquantized: finite values of a weight's size (the package's rounding)
        return gguf.quants.quantize(rng.normal(0, 0.02, (rows, cols)).astype(np.float32), Q[kind]).view(np.uint8)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        at = at % size
        halves = rng.uniform(0.0005, 0.004, size=(rows, cols // block)).astype(np.float16)
        raw[..., at : at + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    kinds: dict[str, str],
    seed: int = 0,
    arch: str = "llama",
    head_dim: int | None = None,
    untied: bool = False,
    width: int = 256,
    layers: int = 2,
) -> None:
    """A 2-block GGUF file of architecture `arch` (width 256, 4 query and 2 kv heads, vocab 64, tied embedding) whose
    tensors named in `kinds` (a GGUF name's suffix -> block type, e.g. "attn_q" -> "Q4_K") hold random blocks; the
    rest are F32. qwen2 adds q / k / v biases, qwen3 QK-norm gains; head_dim (qwen3) sets attention.key_length;
    untied adds an output head of its own; width (and twice it, the feed-forward's) and layers scale it up."""
    C, F, V, L, H, KH = width, 2 * width, 64, layers, 4, 2
    D = head_dim or C // H
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(C)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KH)
    if head_dim is not None:
        w.add_key_length(D)
        w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(V)
    rng = np.random.default_rng(seed)
    shapes: dict[str, tuple[int, ...]] = {"token_embd": (V, C), "output_norm": (C,)}
    if untied:
        shapes["output"] = (V, C)
    for i in range(L):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm": (C,), b + "ffn_norm": (C,), b + "attn_q": (H * D, C), b + "attn_k": (KH * D, C)}
        shapes |= {b + "attn_v": (KH * D, C), b + "attn_output": (C, H * D), b + "ffn_gate": (F, C)}
        shapes |= {b + "ffn_up": (F, C), b + "ffn_down": (C, F)}
        if arch == "qwen2":
            shapes |= {b + "attn_q.bias": (H * D,), b + "attn_k.bias": (KH * D,), b + "attn_v.bias": (KH * D,)}
        if arch == "qwen3":
            shapes |= {b + "attn_q_norm": (D,), b + "attn_k_norm": (D,)}
    for n, (name, shape) in enumerate(shapes.items()):
        full = name if name.endswith(".bias") else name + ".weight"
        kind = next((k for suffix, k in kinds.items() if name.endswith(suffix)), None)
        if kind is None or len(shape) == 1:
            mean = 1.0 if len(shape) == 1 and not name.endswith(".bias") else 0.0
            w.add_tensor(full, rng.normal(mean, 0.05 if mean else 0.1, size=shape).astype(np.float32))
        else:
            w.add_tensor(full, random_blocks(kind, *shape, seed=seed + n), raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
