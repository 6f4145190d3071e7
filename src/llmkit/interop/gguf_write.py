"""GGUF export: an llmkit decoder and its tokenizer written as a file llama.cpp loads (the llama, qwen2 and qwen3
architectures, the ones interop/gguf.py reads).

The tensor names and row orders are the reader's rules (gguf.gguf_rules) run backwards, so a file llmkit writes
reads back into the same model. Layers held in llama.cpp's block types (BlockLinear, BlockEmbedding: a GGUF file
loaded quantized, or a model quantized to Q4_K_M, Q8_0, ...) are written as their blocks, byte for byte; float
matrices in the model's dtype (F32, F16 or BF16) and vectors (norms, biases) in F32, as llama.cpp's converter does.
llmkit's own int8 / int4 layers have no GGUF type: they are refused (quantize the float model to a block type).
The `gguf` package (llama.cpp's own Python library) writes the file: its header, metadata and tensor alignment.

Metadata: the architecture's hyperparameters under its prefix, general.file_type (the mixture or the type most
weights have), and the tokenizer as llama.cpp's converter writes a byte-level BPE one: tokens padded to the model's
vocabulary, their types (normal, control for special added tokens, user-defined for the other added ones), merges,
the special ids, add_bos and the chat template. llama.cpp also wants the name of the pre-tokenizer (how text is cut
before BPE); it is recognised from the tokenizer's own description where it is one of the common ones (GPT-2's,
Llama 3's, SmolLM's digits-then-GPT-2), else left out, and llama.cpp falls back to its default, with a warning.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.gguf import gguf_rules
from llmkit.interop.keymap import expand
from llmkit.tokenizer import _LLAMA3_SPLIT, Tokenizer

FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
FILE_TYPES = {  # llama.cpp's llama_ftype for a file whose weights are mostly of this type (or this mixture)
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0", "Q2_K": "MOSTLY_Q2_K", "Q4_K": "MOSTLY_Q4_K_M",
    "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K", "IQ4_NL": "MOSTLY_IQ4_NL", "IQ4_XS": "MOSTLY_IQ4_XS",
    "Q4_K_M": "MOSTLY_Q4_K_M", "Q4_K_S": "MOSTLY_Q4_K_S", "Q5_K_M": "MOSTLY_Q5_K_M", "Q5_K_S": "MOSTLY_Q5_K_S",
}  # fmt: skip


def gguf_architecture(cfg: ModelConfig) -> str:
    """The GGUF architecture a decoder of `cfg` is written as (llama, qwen2 or qwen3), or a ConfigError naming what
    llama.cpp's three would not compute as llmkit does."""
    a, f, n, p = cfg.attention, cfg.ffn, cfg.norm, cfg.position
    unsupported = [
        (cfg.encoder is not None, "an encoder"),
        (cfg.moe is not None, "mixture-of-experts layers"),
        (a.kind != "gqa", f"{a.kind} attention"),
        (a.sliding_window is not None, "sliding-window attention"),
        (a.softcap is not None or cfg.logit_softcap is not None, "soft-capped scores"),
        (a.out_bias, "an output projection bias"),
        (a.scale is not None, "a custom attention scale"),
        (f.kind != "swiglu" or f.bias, f"a {f.kind} feed-forward{' with biases' if f.bias else ''}"),
        (n.kind != "rmsnorm" or n.placement != "pre" or n.unit_offset, "norms other than pre-RMSNorm"),
        (p.kind != "rope" or p.layout != "half" or p.local_theta is not None, f"{p.kind} positions"),
        (cfg.scale_embeddings or cfg.head_bias, "scaled embeddings or a head bias"),
        (a.qk_norm and a.qkv_bias, "both QK-norm and q/k/v biases"),
    ]
    found = [what for bad, what in unsupported if bad]
    if found:
        raise ConfigError(
            f"this model has {', '.join(found)}: llmkit writes GGUF files for the llama, qwen2 and qwen3 "
            "architectures only"
        )
    return "qwen3" if a.qk_norm else "qwen2" if a.qkv_bias else "llama"


def _pre_tokenizer(description: dict[str, Any]) -> str | None:
    """llama.cpp's name for the tokenizer's pre-tokenizer, where it is a common one; None where not recognised."""
    pre = description.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds and kinds[0] == "Split" and (steps[0].get("pattern") or {}).get("Regex") == _LLAMA3_SPLIT:
        return "llama-bpe"
    return None


def _tokenizer(writer: Any, tok: Tokenizer, vocab: int) -> list[str]:
    """Write `tok` (byte-level BPE) as llama.cpp's tokenizer metadata, padded to the model's `vocab`; returns notes."""
    import gguf

    description = json.loads(tok.backend.to_str())
    model = description.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"llmkit writes byte-level BPE tokenizers to GGUF; this one is {model.get('type')!r}")
    ids = tok.backend.get_vocab(with_added_tokens=True)
    if len(ids) > vocab:
        raise ConfigError(f"the tokenizer has {len(ids)} tokens, more than the model's {vocab} embedding rows")
    added = tok.backend.get_added_tokens_decoder()
    tokens = [f"[PAD{i}]" for i in range(vocab)]
    types = [int(gguf.TokenType.UNUSED)] * vocab
    for text, i in ids.items():
        tokens[i] = text
        special = i in added and added[i].special
        types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED if i in added else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    notes = []
    pre = _pre_tokenizer(description)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    else:
        notes.append("the tokenizer's pre-tokenizer is not one llmkit names for llama.cpp: it will use its default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for ident, add in ((tok.bos_id, writer.add_bos_token_id), (tok.eos_id, writer.add_eos_token_id),
                       (tok.pad_id, writer.add_pad_token_id)):  # fmt: skip
        if ident is not None:
            add(ident)
    writer.add_add_bos_token(tok.add_bos)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
    return notes


def _tensors(model: nn.Module, cfg: ModelConfig, arch: str) -> dict[str, tuple[Tensor, str]]:
    """GGUF name -> (data, type): blocks as uint8 rows of bytes, floats as they are (the reader's rules, reversed)."""
    from llmkit.quant import QuantizedLinear
    from llmkit.quant.block_linear import HeldBlocks
    from llmkit.quant.embedding import QuantizedEmbedding

    state = model.state_dict()
    out: dict[str, tuple[Tensor, str]] = {}

    def held(layer: str) -> HeldBlocks | None:
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            return None
        if isinstance(module, QuantizedEmbedding):  # a tied table read from the head's blocks
            module = module.source
        if isinstance(module, HeldBlocks):
            return module
        if isinstance(module, QuantizedLinear):
            raise ConfigError(
                f"{layer} is quantized to llmkit's {module.method}, which GGUF has no type for: quantize the float "
                "model to a GGUF type instead (llmkit convert ... --quant q4_k_m, or q8_0, ...)"
            )
        return None

    for c in expand(gguf_rules(cfg, arch), cfg):
        (ours,), (theirs,) = c.ours, c.theirs
        layer = ours.removesuffix(".weight")
        module = held(layer) if ours.endswith(".weight") else None
        if module is not None:
            blocks = module.state_dict()["blocks"]  # the file's layout, whatever the kernels hold
            out[theirs] = (c.transform.to_theirs([blocks])[0], module.block.name)
            continue
        (value,) = c.transform.to_theirs([state[ours]])
        if value.dim() == 1:
            out[theirs] = (value.float(), "F32")
        else:
            if value.dtype not in FLOAT_TYPES:
                raise ConfigError(f"{ours} is {value.dtype}, which GGUF has no float type for")
            out[theirs] = (value, FLOAT_TYPES[value.dtype])
    return out


def save_gguf(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None,
    name: str | None = None,
    mixture: str | None = None,
) -> list[str]:
    """Write `model` (a DecoderLM of the llama, qwen2 or qwen3 kind) and `tokenizer` to the GGUF file `path`;
    returns notes on what llama.cpp will make of it. `mixture` names the quantization mixture the weights were made
    with (Q4_K_M, ...: general.file_type). The file is written in place: `llmkit convert` writes it beside its
    destination and renames it there when it is complete (llmkit.outputs.building)."""
    import gguf

    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError("only llmkit's decoder models are written to GGUF")
    arch = gguf_architecture(cfg)
    tensors = _tensors(model, cfg, arch)
    p = Path(path)
    writer = gguf.GGUFWriter(str(p), arch)
    notes: list[str] = []
    try:
        a = cfg.attention
        head_dim = a.head_dim or cfg.d_model // a.n_heads
        writer.add_name(name or p.name.split(".")[0])
        writer.add_context_length(cfg.position.max_seq_len)
        writer.add_embedding_length(cfg.d_model)
        writer.add_block_count(cfg.n_layers)
        gate: Any = model.get_submodule("blocks.0.ffn.w1")  # nn.Linear or a quantized layer: out_features either way
        writer.add_feed_forward_length(int(gate.out_features))
        writer.add_head_count(a.n_heads)
        writer.add_head_count_kv(cfg.n_kv_heads)
        writer.add_layer_norm_rms_eps(cfg.norm.eps)
        writer.add_rope_freq_base(cfg.position.theta)
        writer.add_rope_dimension_count(round(head_dim * cfg.position.rope_fraction))
        if head_dim != cfg.d_model // a.n_heads:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        scaling = cfg.position.scaling
        if scaling is not None:
            if scaling.kind not in ("linear", "yarn"):
                raise ConfigError(f"RoPE scaling {scaling.kind!r} is not written to GGUF (linear and yarn are)")
            writer.add_rope_scaling_type(gguf.RopeScalingType(scaling.kind))
            writer.add_rope_scaling_factor(scaling.factor)
            if scaling.original_max_seq_len:
                writer.add_rope_scaling_orig_ctx_len(scaling.original_max_seq_len)
        writer.add_vocab_size(cfg.vocab_size)
        kinds = Counter(kind for data, kind in tensors.values() if data.dim() == 2)
        main = mixture.upper() if mixture else kinds.most_common(1)[0][0]
        writer.add_file_type(int(gguf.LlamaFileType[FILE_TYPES.get(main, "GUESSED")]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if tokenizer is not None:
            notes += _tokenizer(writer, tokenizer, cfg.vocab_size)
        else:
            notes.append("no tokenizer: llama.cpp needs one to run the file")
        for theirs, (data, kind) in tensors.items():
            if kind in FLOAT_TYPES.values():
                array = data.detach().cpu().contiguous()
                if kind == "BF16":  # numpy has no bfloat16: its bytes, as the type says
                    raw = array.view(torch.int16).numpy().view(np.uint8).reshape(array.shape[0], -1)
                    writer.add_tensor(theirs, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)
                else:
                    writer.add_tensor(theirs, array.numpy())
            else:
                writer.add_tensor(theirs, data.detach().cpu().contiguous().numpy(),
                                  raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return notes
