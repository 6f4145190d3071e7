"""Hugging Face checkpoints in and out: `load_hf(directory)` and `save_hf(model, directory)`.

A checkpoint directory holds config.json, model.safetensors (or shards listed in model.safetensors.index.json),
and usually generation_config.json and tokenizer files. The config's model_type picks a family (llama, mistral,
qwen2, mixtral, gpt2, deepseek_v3, deepseek_v32, marian); the family maps config.json to a ModelConfig and gives the
key map between the checkpoint's tensor names and llmkit's. Loading checks every name and shape against the config
before reading a byte, then reads tensors lazily, one rule at a time, straight into the requested dtype.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.base import Family
from llmkit.interop.hf.deepseek import DeepSeekFamily
from llmkit.interop.hf.gemma import GemmaFamily
from llmkit.interop.hf.glm4_moe import GLM4MoEFamily
from llmkit.interop.hf.gpt2 import GPT2Family
from llmkit.interop.hf.llama import LlamaFamily
from llmkit.interop.hf.marian import MarianFamily
from llmkit.interop.hf.mixtral import MixtralFamily
from llmkit.interop.hf.phi3 import Phi3Family
from llmkit.interop.hf.qwen_moe import QwenMoEFamily
from llmkit.interop.hf.stablelm import StableLMFamily
from llmkit.interop.hf.starcoder2 import StarCoder2Family
from llmkit.interop.keymap import check_against, convert_to_ours, convert_to_theirs, expand
from llmkit.interop.safetensors_io import CheckpointError, open_tensors, save_tensors
from llmkit.interop.weights import LayerImportance, Split, build_with_weights, expected_shapes
from llmkit.layers.precision import cast_state, fp32_state
from llmkit.models import DecoderLM, EncoderDecoder

FAMILIES: list[Family] = [
    LlamaFamily(),
    MixtralFamily(),
    QwenMoEFamily(),
    GLM4MoEFamily(),
    GemmaFamily(),
    Phi3Family(),
    StarCoder2Family(),
    StableLMFamily(),
    GPT2Family(),
    DeepSeekFamily(),
    MarianFamily(),
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "source.spm",
    "target.spm",
    "chat_template.jinja",
    "chat_template.json",
)


def supported_model_types() -> list[str]:
    """Every model_type llmkit reads and writes, in the order `infer_model_type` tries them."""
    return [mt for f in FAMILIES for mt in f.model_types]


def family_for(model_type: str | None) -> Family:
    """The family that reads `model_type`, or a ConfigError listing what is supported."""
    if not model_type:
        raise ConfigError(f"config.json has no model_type; supported: {', '.join(supported_model_types())}")
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}")


def infer_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that describes the same architecture as `cfg`."""
    for f in FAMILIES:
        mt = f.model_type_for(cfg)
        if mt is not None:
            return mt
    raise ConfigError(
        "this model has no Hugging Face equivalent among "
        f"{', '.join(supported_model_types())} (its configuration mixes parts no single family has)"
    )


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint directory's config.json, or a CheckpointError saying why it cannot be read."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{Path(directory)} has no config.json: not a Hugging Face checkpoint directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def config_from_hf(hf: dict[str, Any], names: Collection[str] = ()) -> ModelConfig:
    """The ModelConfig a config.json describes (`names`: the checkpoint's tensor names, where they decide a detail)."""
    return family_for(hf.get("model_type")).config_from_hf(hf, names)


def state_dict_from_hf(
    hf_state: Mapping[str, Tensor], hf_config: dict[str, Any], dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """llmkit's state dict from a Hugging Face one (disk or in-memory layout), checked against the config."""
    family = family_for(hf_config.get("model_type"))
    cfg = family.config_from_hf(hf_config, hf_state.keys())
    concrete = expand(family.rules(cfg, hf_state.keys()), cfg)
    shapes = {n: tuple(t.shape) for n, t in hf_state.items()}
    check_against(concrete, expected_shapes(cfg), shapes, lambda n: family.ignored(n, cfg), "the state dict")
    return dict(convert_to_ours(concrete, hf_state.__getitem__, dtype))


def state_dict_to_hf(state: Mapping[str, Tensor], cfg: ModelConfig, model_type: str | None = None) -> dict[str, Tensor]:
    """A Hugging Face state dict (disk layout: one tensor per expert) from llmkit's."""
    mt = model_type or infer_model_type(cfg)
    family = family_for(mt)
    return convert_to_theirs(expand(family.rules(cfg, ()), cfg), state)


@dataclass
class HFCheckpoint:
    """A model loaded from a Hugging Face directory, with what came along with it."""

    model: DecoderLM | EncoderDecoder
    model_type: str
    hf_config: dict[str, Any]
    directory: Path
    generation_config: dict[str, Any] = field(default_factory=dict)


def load_hf(
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    split: Split | None = None,
    quantize: str | None = None,
    own_width: bool = False,
    importance: LayerImportance | None = None,
) -> HFCheckpoint:
    """Load a Hugging Face checkpoint directory into llmkit. dtype None keeps the checkpoint's floating dtype.
    `split` cuts the model on the meta device before loading, and only its parts are read (interop/weights.py);
    `quantize` (a GGUF block type or a mixture) quantizes each layer as it is read. `own_width`: a bf16 or fp16
    checkpoint loaded on the CPU with dtype None holds its weights as the files store them, mapped, and computes in
    fp32 (weights.held_width)."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory")
    hf = read_config(d)
    family = family_for(hf.get("model_type"))
    tensors = open_tensors(d)
    cfg = family.config_from_hf(hf, tensors.shapes.keys())
    concrete = expand(family.rules(cfg, tensors.shapes.keys()), cfg)
    model = build_with_weights(
        cfg, concrete, tensors.__getitem__, tensors.shapes, lambda n: family.ignored(n, cfg), dtype, device, str(d),
        split=split, part=tensors.part, quantize=quantize, own_width=own_width, view=tensors.mapped,
        importance=importance,
    )  # fmt: skip
    gen_path = d / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return HFCheckpoint(model, str(hf["model_type"]), hf, d, generation)


def save_hf(
    model: DecoderLM | EncoderDecoder,
    directory: str | os.PathLike[str],
    *,
    model_type: str | None = None,
    hf_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write `model` as a Hugging Face checkpoint directory that `from_pretrained` loads.

    hf_config: the config.json the model came from, if any; its extra fields (token ids, ...) are kept.
    tokenizer_dir: a directory whose tokenizer files are copied along."""
    cfg = model.cfg
    mt = model_type or (hf_config or {}).get("model_type") or infer_model_type(cfg)
    family = family_for(mt)
    why = family.why_not(cfg, mt)
    if why is not None:
        raise ConfigError(f"this model cannot be saved as a Hugging Face checkpoint: {why}")
    state = cast_state(model.state_dict(), dtype, fp32_state(model))
    hf_state = convert_to_theirs(expand(family.rules(cfg, ()), cfg), state)
    d = Path(directory)
    save_tensors(hf_state, d, max_shard_bytes)
    # token ids llmkit does not know are written as null: left out, transformers would take the family's defaults
    # (Phi-3's 32000, GPT-2's 50256), which may lie outside this model's vocabulary
    unknown = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    config = {**unknown, **(hf_config or {}), **family.config_to_hf(cfg, mt)}
    weight_dtype = next(v.dtype for k, v in state.items() if v.is_floating_point())
    config["dtype"] = config["torch_dtype"] = str(weight_dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if generation_config:
        (d / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, d)
    return d


def copy_tokenizer_files(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer files present in `source` to `target`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(source) / name
        if src.is_file() and src.resolve() != (Path(target) / name).resolve():
            shutil.copyfile(src, Path(target) / name)
            copied.append(name)
    return copied


__all__ = [
    "FAMILIES",
    "TOKENIZER_FILES",
    "HFCheckpoint",
    "config_from_hf",
    "copy_tokenizer_files",
    "family_for",
    "infer_model_type",
    "load_hf",
    "read_config",
    "save_hf",
    "state_dict_from_hf",
    "state_dict_to_hf",
    "supported_model_types",
]
