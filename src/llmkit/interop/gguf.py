"""GGUF (llama.cpp) import for the llama, qwen2 and qwen3 architectures, with the tokenizer.

The `gguf` package parses the file and dequantizes each tensor (Q4_0, Q4_1, Q8_0, K-quants, ...) to fp32 on access.
Names map declaratively as for Hugging Face:

    token_embd / output_norm / output         embed / norm / head (absent: tied to the embedding)
    blk.{i}.attn_norm / ffn_norm              blocks.{i}.attn_residual.norm / ffn_residual.norm
    blk.{i}.attn_q / attn_k                   blocks.{i}.attn.wq / wk     rows permuted: llama.cpp stores RoPE pairs
                                                                          interleaved, llmkit (like HF) half-split
    blk.{i}.attn_v / attn_output              blocks.{i}.attn.wv / wo
    blk.{i}.ffn_gate / ffn_up / ffn_down      blocks.{i}.ffn.w1 / w3 / w2
    blk.{i}.attn_q / attn_k / attn_v.bias     blocks.{i}.attn.wq / wk / wv.bias            (qwen2)
    blk.{i}.attn_q_norm / attn_k_norm         blocks.{i}.attn.q_norm / k_norm              (qwen3: QK-norm)

Only the llama architecture's q / k rows are permuted (llama.cpp's converter interleaves RoPE pairs for it alone;
qwen2 and qwen3 use NeoX-style RoPE over the rows as Hugging Face stores them). Qwen3's heads are 128 wide whatever
the width (`attention.key_length`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llmkit.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig, RopeScaling
from llmkit.errors import ConfigError
from llmkit.interop.gguf_file import GGUFFile
from llmkit.interop.keymap import IDENTITY, Concrete, RopeToHalf, Rule, check_against, expand
from llmkit.interop.loaded import Loaded
from llmkit.interop.safetensors_io import CheckpointError, read_part
from llmkit.interop.weights import (
    LayerImportance,
    RuleReader,
    Split,
    build_quantized,
    build_with_weights,
    expected_shapes,
)
from llmkit.parts import Index
from llmkit.tokenizer import Tokenizer

SUPPORTED = ("llama", "qwen2", "qwen3")


def open_gguf(path: Path) -> GGUFFile:
    """A GGUF file's header, checked (gguf_file.py); CheckpointError when it is missing, truncated or damaged."""
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    return GGUFFile(path)


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer a GGUF file's metadata describes, or None when it has none."""
    return Tokenizer.from_gguf_metadata(meta) if "tokenizer.ggml.tokens" in meta else None


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer | None:
    """Only the tokenizer of a GGUF file (its weights are not read)."""
    return gguf_tokenizer(read_metadata(open_gguf(Path(path))))


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key-value field of a GGUF file as plain Python values."""
    return dict(reader.fields)


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

    blocks = {n.split(".")[1] for n in names if n.startswith("blk.")}
    if int(get("block_count")) != len(blocks):
        raise ConfigError(
            f"GGUF metadata says {arch}.block_count={get('block_count')}, but the file holds tensors of {len(blocks)} "
            "blocks (blk.N.*): the file is damaged"
        )
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
    qwen3 = arch == "qwen3"
    if qwen3 != ("blk.0.attn_q_norm.weight" in names):
        raise ConfigError(
            f"GGUF architecture {arch!r} with{'out' if qwen3 else ''} QK-norm tensors: the file is damaged"
        )
    return ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=int(get("block_count")),
        attention=AttentionConfig(
            n_heads=heads,
            n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm=qwen3,
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


def gguf_rules(cfg: ModelConfig, arch: str = "llama") -> list[Rule]:
    a = cfg.attention
    b = "blk.{i}."
    # llama.cpp interleaves the llama architecture's RoPE pairs in q / k rows; the others keep Hugging Face's rows
    q_rows, k_rows = (RopeToHalf(a.n_heads), RopeToHalf(cfg.n_kv_heads)) if arch == "llama" else (IDENTITY, IDENTITY)
    extra = [
        Rule("blocks.{i}.attn.wq.bias", b + "attn_q.bias", q_rows, where="layers", when=lambda c: c.attention.qkv_bias),
        Rule("blocks.{i}.attn.wk.bias", b + "attn_k.bias", k_rows, where="layers", when=lambda c: c.attention.qkv_bias),
        Rule("blocks.{i}.attn.wv.bias", b + "attn_v.bias", where="layers", when=lambda c: c.attention.qkv_bias),
        Rule(
            "blocks.{i}.attn.q_norm.weight",
            b + "attn_q_norm.weight",
            where="layers",
            when=lambda c: c.attention.qk_norm,
        ),
        Rule(
            "blocks.{i}.attn.k_norm.weight",
            b + "attn_k_norm.weight",
            where="layers",
            when=lambda c: c.attention.qk_norm,
        ),
    ]
    return [
        *extra,
        Rule("embed.weight", "token_embd.weight"),
        Rule("norm.weight", "output_norm.weight"),
        Rule("head.weight", "output.weight", when=lambda c: not c.tie_embeddings),
        Rule("blocks.{i}.attn_residual.norm.weight", b + "attn_norm.weight", where="layers"),
        Rule("blocks.{i}.attn.wq.weight", b + "attn_q.weight", q_rows, where="layers"),
        Rule("blocks.{i}.attn.wk.weight", b + "attn_k.weight", k_rows, where="layers"),
        Rule("blocks.{i}.attn.wv.weight", b + "attn_v.weight", where="layers"),
        Rule("blocks.{i}.attn.wo.weight", b + "attn_output.weight", where="layers"),
        Rule("blocks.{i}.ffn_residual.norm.weight", b + "ffn_norm.weight", where="layers"),
        Rule("blocks.{i}.ffn.w1.weight", b + "ffn_gate.weight", where="layers"),
        Rule("blocks.{i}.ffn.w3.weight", b + "ffn_up.weight", where="layers"),
        Rule("blocks.{i}.ffn.w2.weight", b + "ffn_down.weight", where="layers"),
    ]


def load_gguf(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    quantized: bool | None = None,
    split: Split | None = None,
    quantize: str | None = None,
    importance: LayerImportance | None = None,
) -> Loaded:
    """Load a llama-architecture GGUF file and its tokenizer. `split` cuts the model on the meta device first, and
    only the rows and blocks of columns of its parts are read from the file (interop/weights.py).

    quantized: hold every quantized tensor as its blocks (llmkit.quant.blocks: Q4_0 ... Q6_K, IQ4_NL, IQ4_XS,
    multiplied as stored, as views of the file's memory map), and F16 / F32 tensors as floats; a type
    llmkit has no kernel for is dequantized (`Loaded.notes` says which); a tensor-parallel rank's part (`split`)
    reads its rows and whole blocks of its columns;
    False: dequantize every tensor to `dtype` (default fp32);
    None: keep them when no dtype is asked for and the device has a fast kernel for them (llmkit.quant.kernels),
    else dequantize. `quantize` (a block type or a mixture) dequantizes every tensor and quantizes each layer anew
    as it is read."""
    from gguf.quants import dequantize

    p = Path(path)
    reader = open_gguf(p)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(meta, set(tensors))
    arch = str(meta["general.architecture"])
    concrete: list[Concrete] = expand(gguf_rules(cfg, arch), cfg)
    shapes = {n: tuple(int(s) for s in reversed(t.shape)) for n, t in tensors.items()}

    def get(name: str) -> Tensor:
        t = tensors[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(shapes[name])

    def part(name: str, index: Index) -> Tensor:
        t = tensors[name]
        if len(index) == 1:  # a vector: always float
            ((a, b),) = index
            return torch.from_numpy(dequantize(t.data[a:b], t.tensor_type).copy())
        (a, b), (c, d) = index
        raw, c0, _ = _blocks(t, a, b, c, d, p)
        values = torch.from_numpy(dequantize(raw, t.tensor_type).copy()).reshape(b - a, -1)
        return values[:, c - c0 : d - c0].contiguous()

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if quantized is None:
        quantized = dtype is None and quantize is None and fast_kernels(dev, torch.float32)
    if quantized and quantize is not None:
        raise ConfigError("quantizing a GGUF file anew reads its weights dequantized: pass quantized=False")
    notes: list[str] = []
    if quantized:  # every block type held as stored
        check_against(concrete, expected_shapes(cfg), shapes, lambda n: False, str(p))
        from llmkit.quant import native

        halves = dev.type == "cpu" and dtype is None and native.module() is not None
        spec, notes = _block_spec(concrete, tensors, cfg, halves)

        def read(expected: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
            return _block_state(concrete, tensors, shapes, spec, get, p)

        parts = _BlockParts(cfg, spec, concrete, tensors, shapes, RuleReader(concrete, get, part), p)
        model = build_quantized(cfg, spec, read, dtype or torch.float32, device, str(p), split=split, part=parts)
    else:
        model = build_with_weights(
            cfg, concrete, get, shapes, lambda n: False, dtype or torch.float32, device, str(p), split=split, part=part,
            quantize=quantize, importance=importance,
        )  # fmt: skip
    tokenizer = gguf_tokenizer(meta)
    generation = {}
    if tokenizer is not None:
        generation = {
            k: v for k, v in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id)) if v is not None
        }
    return Loaded(model, tokenizer, "gguf", p, arch, None, generation, notes=notes)


def fast_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `device` has a quantized int4 kernel faster than dequantizing (see llmkit.quant.kernels)."""
    from llmkit.quant.kernels import choose

    return choose(4, device, torch.bfloat16 if device.type == "cuda" else dtype, False, 4096) != "dequant"


def _block_spec(
    concrete: list[Concrete], tensors: dict[str, Any], cfg: ModelConfig, halves: bool
) -> tuple[Any, list[str]]:
    """Which of our layers hold a GGUF tensor's blocks as stored (name -> [block type, None]): every type llmkit
    multiplies (llmkit.quant.blocks.TYPES), F16 and BF16 too where `halves` (llmkit's C++ kernels run) and a row is
    whole blocks of 32; F32 tensors stay float, and a type llmkit has no kernel for is dequantized to floats (the
    notes say which). A tied head holds the embedding table's blocks, which the embedding reads its rows from; an
    untied table stored quantized is held as blocks too (BlockEmbedding)."""
    from torch import nn

    from llmkit.models import build_model
    from llmkit.quant import QuantSpec
    from llmkit.quant.blocks import FLOAT_TYPES, TYPES
    from llmkit.quant.formats import GGUF_FLOAT

    def holds(t: Any) -> bool:  # a tensor llmkit multiplies as the file stores it
        kind = t.tensor_type.name
        if kind in FLOAT_TYPES:
            return halves and int(t.shape[0]) % TYPES[kind].weights == 0  # (shape: columns first)
        return kind in TYPES

    linears = {n for n, m in build_model(cfg, device="meta").named_modules() if isinstance(m, nn.Linear)}
    layers: dict[str, list[Any]] = {}
    floats: dict[str, list[str]] = {}  # quantized types without a kernel -> their tensors
    for c in concrete:
        name, theirs = c.ours[0], c.theirs[0]
        kind = tensors[theirs].tensor_type.name
        if name.removesuffix(".weight") not in linears:
            continue
        if holds(tensors[theirs]):
            layers[name.removesuffix(".weight")] = [kind, None]
        elif kind not in GGUF_FLOAT:
            floats.setdefault(kind, []).append(theirs)
    embed_kind = tensors["token_embd.weight"].tensor_type.name
    held = holds(tensors["token_embd.weight"])
    if embed_kind not in TYPES and embed_kind not in GGUF_FLOAT:
        floats.setdefault(embed_kind, []).append("token_embd.weight")
    tied = cfg.tie_embeddings and held
    if tied:
        layers["head"] = [embed_kind, None]
    notes = [
        f"{len(v)} {k} tensors dequantized to floats (llmkit has no kernel for {k}), e.g. {v[0]}"
        for k, v in floats.items()
    ]
    counts: dict[str, int] = {}
    for method, _ in layers.values():
        counts[method] = counts.get(method, 0) + 1
    main = max(counts, key=counts.__getitem__) if counts else "Q8_0"
    embedding = embed_kind if held and not cfg.tie_embeddings else None
    spec = QuantSpec(main, None, "head" in layers, layers, embedding_from_head=tied, embedding=embedding)
    return spec, notes


def mapped(data: Any) -> Tensor:
    """A tensor over a numpy view of the file's (read-only) memory map: nothing llmkit runs writes into weights in
    place, and the warning torch gives for a read-only array says only that."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.from_numpy(data)


def read_blocks(path: Path, t: Any, shape: tuple[int, int], index: Index) -> Tensor:
    """Part `index` of GGUF tensor t's rows of blocks (rows, row bytes), read with pread (read_part)."""
    return read_part(path, int(t.data_offset), torch.uint8, shape, index)


def _block_state(
    concrete: list[Concrete],
    tensors: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    spec: Any,
    get: Any,
    path: Path,
) -> dict[str, Tensor]:
    """Our state dict: each held layer's blocks (its rule's row transform applied), everything else dequantized by
    `get`. A tensor whose rows need no transform is a view of the file's memory map (its pages are read when the
    kernels first touch them, and are the page cache's, shared); the others (llama's query and key rows, reordered
    for RoPE) are read with pread into memory of their own (mapped pages would stay resident beside them)."""
    from llmkit.quant.blocks import TYPES

    def blocks(theirs: str, transform: Any) -> Tensor:
        t = tensors[theirs]
        kind = TYPES[t.tensor_type.name]
        rows, row_bytes = shapes[theirs][0], kind.row_bytes(shapes[theirs][1])
        if transform is IDENTITY:
            return mapped(t.data.view(np.uint8).reshape(rows, row_bytes))  # (F16's array holds values)
        return transform.to_ours([read_blocks(path, t, (rows, row_bytes), ((0, rows), (0, row_bytes)))])[0]

    state: dict[str, Tensor] = {}
    for c in concrete:
        name = c.ours[0]
        if name == "embed.weight" and spec.embedding_from_head:
            continue  # the head's blocks are the table
        layer = name.removesuffix(".weight")
        if name == "embed.weight" and spec.embedding is not None:
            state["embed.blocks"] = blocks(c.theirs[0], c.transform)
        elif spec.layers is not None and layer in spec.layers and name.endswith(".weight"):
            state[f"{layer}.blocks"] = blocks(c.theirs[0], c.transform)
        else:
            for ours, t in zip(c.ours, c.transform.to_ours([get(n) for n in c.theirs]), strict=True):
                state[ours] = t
    if spec.embedding_from_head and "head.weight" not in {c.ours[0] for c in concrete}:
        state["head.blocks"] = blocks("token_embd.weight", IDENTITY)
    return state


def _blocks(t: Any, a: int, b: int, c: int, d: int, path: Path) -> tuple[Any, int, int]:
    """Rows [a, b) of a 2-D GGUF tensor and the whole blocks holding its columns [c, d), read from `path` alone
    (pread: not through the memory map, whose pages would stay in this process's resident memory): (their raw data,
    the columns [c0, d1) they hold)."""
    from gguf import GGML_QUANT_SIZES

    per, size = GGML_QUANT_SIZES[t.tensor_type]  # values and bytes a block
    c0, d1 = c // per * per, -(-d // per) * per
    values = t.data.shape[-1] == int(t.shape[0])  # the array holds values (F32, F16), not bytes
    item = t.data.itemsize
    lo, hi = (c0 * item, d1 * item) if values else (c0 // per * size, d1 // per * size)
    rows = (int(t.data.shape[0]), int(t.data.shape[-1]) * item)  # in bytes
    raw = read_part(path, int(t.data_offset), torch.uint8, rows, ((a, b), (lo, hi))).numpy()
    return (raw.view(t.data.dtype) if values else raw), c0, d1


class _BlockParts:
    """Parts of the state `_block_state` makes, read alone: a held layer's rows and bytes of blocks (the cuts of
    parallel/shard.py keep whole blocks); float tensors come from `floats` (their rules, in part)."""

    def __init__(
        self, cfg: ModelConfig, spec: Any, concrete: list[Concrete], tensors: dict[str, Any],
        shapes: dict[str, tuple[int, ...]], floats: RuleReader, path: Path,
    ) -> None:  # fmt: skip
        from llmkit.models import build_model
        from llmkit.quant import apply_spec

        model = build_model(cfg, device="meta")
        apply_spec(model, spec)
        self.expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.held = {  # our state name -> (their tensor, the rule's row transform)
            f"{c.ours[0].removesuffix('.weight')}.blocks": (c.theirs[0], c.transform)
            for c in concrete
            if c.ours[0].endswith(".weight") and spec.layers is not None and c.ours[0][: -len(".weight")] in spec.layers
        }
        if spec.embedding is not None:
            self.held["embed.blocks"] = ("token_embd.weight", IDENTITY)
        if spec.embedding_from_head and "head.blocks" not in self.held:
            self.held["head.blocks"] = ("token_embd.weight", IDENTITY)  # tied: the head's blocks are the table's
        self.tensors, self.shapes, self.floats, self.path = tensors, shapes, floats, path

    def __call__(self, name: str, index: Index | None) -> Tensor:
        from llmkit.quant.blocks import TYPES

        if name not in self.held:
            return self.floats(name, index, self.expected[name])
        theirs, transform = self.held[name]
        t = self.tensors[theirs]
        N, row = self.shapes[theirs][0], TYPES[t.tensor_type.name].row_bytes(self.shapes[theirs][1])
        (a, b), (x, y) = index or ((0, N), (0, row))
        how = transform.part((theirs,), ((a, b),), (N,)) if (a, b) != (0, N) else ([], transform)
        rows = (a, b) if how is not None else (0, N)  # a row transform that needs every row: read them, cut after
        raw = read_blocks(self.path, t, (N, row), (rows, (x, y)))
        out = (how[1] if how is not None else transform).to_ours([raw])[0]
        return (out if how is not None else out[a:b]).contiguous()
