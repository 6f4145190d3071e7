"""GGUF (llama.cpp) import for the llama architecture, with its tokenizer.

The `gguf` package parses the file and dequantizes each tensor (Q4_0, Q4_1, Q8_0, K-quants, ...) to fp32 on access.
Names map declaratively as for Hugging Face:

    token_embd / output_norm / output         embed / norm / head (absent: tied to the embedding)
    blk.{i}.attn_norm / ffn_norm              blocks.{i}.attn_residual.norm / ffn_residual.norm
    blk.{i}.attn_q / attn_k                   blocks.{i}.attn.wq / wk     rows permuted: llama.cpp stores RoPE pairs
                                                                          interleaved, llmkit (like HF) half-split
    blk.{i}.attn_v / attn_output              blocks.{i}.attn.wv / wo
    blk.{i}.ffn_gate / ffn_up / ffn_down      blocks.{i}.ffn.w1 / w3 / w2
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmkit.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig, RopeScaling
from llmkit.errors import ConfigError
from llmkit.interop.keymap import Concrete, RopeToHalf, Rule, expand
from llmkit.interop.loaded import Loaded
from llmkit.interop.safetensors_io import CheckpointError
from llmkit.interop.weights import build_with_weights
from llmkit.tokenizer import Tokenizer

SUPPORTED = ("llama",)


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of a GGUF file as plain Python values."""
    meta = {}
    for key, f in reader.fields.items():
        try:
            meta[key] = f.contents()
        except Exception:
            continue
    return meta


def config_from_gguf(meta: dict[str, Any], names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if "rope_freqs.weight" in names:
        raise ConfigError("GGUF files with a rope_freqs tensor (Llama-3.1-style scaling) are not supported yet")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata has no {arch}.{key}")
        return value

    d, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or d // heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or 0)
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        factor = float(get("rope.scaling.factor"))
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        scaling = RopeScaling(kind=kind, factor=factor, original_max_seq_len=int(original) if original else None)
    elif kind not in (None, "none"):
        raise ConfigError(f"GGUF rope scaling {kind!r} is not supported")
    return ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=int(get("block_count")),
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads), head_dim=head_dim
        ),
        ffn=FFNConfig(kind="swiglu", hidden_dim=int(get("feed_forward_length"))),
        position=PositionConfig(
            kind="rope",
            max_seq_len=int(get("context_length")),
            theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
            layout="half",
            rope_fraction=rope_dim / head_dim,
            scaling=scaling,
        ),
        norm=NormConfig(kind="rmsnorm", eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5)),
        tie_embeddings="output.weight" not in names,
    )


def gguf_rules(cfg: ModelConfig) -> list[Rule]:
    a = cfg.attention
    b = "blk.{i}."
    return [
        Rule("embed.weight", "token_embd.weight"),
        Rule("norm.weight", "output_norm.weight"),
        Rule("head.weight", "output.weight", when=lambda c: not c.tie_embeddings),
        Rule("blocks.{i}.attn_residual.norm.weight", b + "attn_norm.weight", where="layers"),
        Rule("blocks.{i}.attn.wq.weight", b + "attn_q.weight", RopeToHalf(a.n_heads), where="layers"),
        Rule("blocks.{i}.attn.wk.weight", b + "attn_k.weight", RopeToHalf(cfg.n_kv_heads), where="layers"),
        Rule("blocks.{i}.attn.wv.weight", b + "attn_v.weight", where="layers"),
        Rule("blocks.{i}.attn.wo.weight", b + "attn_output.weight", where="layers"),
        Rule("blocks.{i}.ffn_residual.norm.weight", b + "ffn_norm.weight", where="layers"),
        Rule("blocks.{i}.ffn.w1.weight", b + "ffn_gate.weight", where="layers"),
        Rule("blocks.{i}.ffn.w3.weight", b + "ffn_up.weight", where="layers"),
        Rule("blocks.{i}.ffn.w2.weight", b + "ffn_down.weight", where="layers"),
    ]


def load_gguf(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Loaded:
    """Load a llama-architecture GGUF file: weights dequantized to `dtype` (default fp32) and its tokenizer."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p} does not exist")
    try:
        reader = GGUFReader(str(p))
    except Exception as e:
        raise CheckpointError(f"{p} is not a readable GGUF file: {e}") from None
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(meta, set(tensors))
    concrete: list[Concrete] = expand(gguf_rules(cfg), cfg)
    shapes = {n: tuple(int(s) for s in reversed(t.shape)) for n, t in tensors.items()}

    def get(name: str) -> Tensor:
        t = tensors[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(shapes[name])

    model = build_with_weights(cfg, concrete, get, shapes, lambda n: False, dtype or torch.float32, device, str(p))
    tokenizer = Tokenizer.from_gguf_metadata(meta) if "tokenizer.ggml.tokens" in meta else None
    generation = {}
    if tokenizer is not None:
        generation = {
            k: v for k, v in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id)) if v is not None
        }
    return Loaded(model, tokenizer, "gguf", p, "llama", None, generation)
