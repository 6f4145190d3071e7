"""Where a run's model comes from: built fresh from the `model` section, or read from the checkpoint it names.

    model: {preset: llama2-7b-tiny, ...}          Fresh: the config (vocabulary from the data), initialised weights
    model: {checkpoint: PATH, dropout: 0.1}       Pretrained: the checkpoint's config with training settings changed,
                                                  its weights (a GGUF file dequantized)
    model: {checkpoint: PATH, mtp_depth: 1}       the same with new MTP modules grafted on (graft.graft_mtp)
    model: {checkpoint: PATH, keep_blocks: [0, 29]}   the same with only those blocks, in that order (graft.prune):
                                                  a draft model made out of its target
    model: {checkpoint: FILE.gguf} + lora.quantized   the quantized model itself, the frozen base of QLoRA

A checkpoint is read once, when the source is made, so that its config is known before anything is built (the
memory check, the task's checks); `build` makes the model on the training device. A run that starts from a checkpoint
must read token ids as the checkpoint does, so the data's tokenizer is checked against the checkpoint's first.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError
from llmkit.models import DecoderLM, EncoderDecoder, RNNConfig, RNNSeq2Seq, build_any
from llmkit.tokenizer import Tokenizer
from llmkit.train.config import TrainConfig, pretrained_config
from llmkit.train.graft import graft_mtp, prune

Model = DecoderLM | EncoderDecoder | RNNSeq2Seq


class TrainingError(LLMKitError, RuntimeError):
    """Training cannot go on (a non-finite loss, an unusable configuration)."""


class ModelSource(abc.ABC):
    """A run's model before it is built: its config, and `build(device)`."""

    config: ModelConfig | RNNConfig
    checkpoint: str | None = None  # the checkpoint it starts from (where adapter checkpoints point)
    quantized: bool = False  # whether its weights are quantized (only adapters can train on them)

    @abc.abstractmethod
    def build(self, device: torch.device) -> Model:
        """The model on `device`, in training mode (call once, after seeding: a fresh model's weights are random)."""


@dataclass
class Fresh(ModelSource):
    """A new model of the `model` section's config, initialised."""

    config: ModelConfig | RNNConfig

    def build(self, device: torch.device) -> Model:
        return build_any(self.config, device=device)


class Pretrained(ModelSource):
    """A decoder-only checkpoint's weights under `config` (its own config, training settings changed), with new MTP
    modules grafted on when `config` asks for more than it has."""

    def __init__(self, config: ModelConfig, model: DecoderLM, checkpoint: str, quantized: bool) -> None:
        self.config, self.checkpoint, self.quantized = config, checkpoint, quantized
        self._loaded: DecoderLM | None = model

    def build(self, device: torch.device) -> Model:
        loaded, self._loaded = self._loaded, None  # the loaded tensors themselves are copied once, then let go
        if loaded is None:
            raise TrainingError("a pretrained source builds its model once")
        if self.quantized:  # QLoRA: the quantized model is the base, used as it is
            return loaded.to(device).train()
        config = self.config
        assert isinstance(config, ModelConfig)
        if config.mtp_depth > loaded.cfg.mtp_depth:
            return graft_mtp(loaded, config.mtp_depth, config).to(device).train()
        model = build_any(self.config, device=device)
        model.load_state_dict(loaded.state_dict())
        return model


class InMemory(ModelSource):
    """A model at hand (a library caller's), trained as it is: moved to the device, its config its own."""

    def __init__(self, model: Model) -> None:
        self.config, self._model = model.cfg, model

    def build(self, device: torch.device) -> Model:
        return self._model.to(device).train()


def model_source(cfg: TrainConfig, vocab: dict[str, int | None], tokenizer: Tokenizer | None) -> ModelSource:
    """The source the `model` section names: a checkpoint (language models only; `tokenizer` is the data's, checked
    against it), or a config whose vocabulary sizes default to the data's (`vocab`: vocab_size, src_vocab_size)."""
    if "checkpoint" not in cfg.model:
        return Fresh(cfg.model_config(**vocab))
    return pretrained(cfg, tokenizer)


def pretrained(cfg: TrainConfig, tokenizer: Tokenizer | None) -> Pretrained:
    """The checkpoint `model.checkpoint` names, float (a GGUF file dequantized) unless lora.quantized keeps its
    quantized layers, after checking that the data was prepared with its tokenizer."""
    from llmkit.interop.load import load_model
    from llmkit.quant import quantized_spec
    from llmkit.runs import resolve_checkpoint

    quantized = cfg.lora.quantized
    path = resolve_checkpoint(str(cfg.model["checkpoint"]))
    loaded = load_model(path, dtype=torch.float32, quantized=quantized)
    model = loaded.model
    if not isinstance(model, DecoderLM):
        raise TrainingError(f"model.checkpoint: {path} is not a decoder-only language model")
    quant = quantized_spec(model)
    if quant is not None and not quantized:
        raise TrainingError(
            f"model.checkpoint: {path} holds quantized weights ({quant}); training starts from float weights: use "
            "the checkpoint it was quantized from, or train LoRA adapters on them (lora.r > 0, lora.quantized)"
        )
    if quantized and quant is None:
        raise TrainingError(
            f"lora.quantized: {path} holds float weights (a GGUF file with quantized tensors keeps them quantized)"
        )
    check_same_tokenizer(loaded.tokenizer, tokenizer, path, cfg.data.dir)
    spec = dict(cfg.model)
    keep = spec.pop("keep_blocks", None)
    if keep is not None:
        if quantized or cfg.lora.r:
            raise TrainingError("model.keep_blocks: a pruned draft trains every weight (no LoRA adapters)")
        model = prune(model, keep)
    config = pretrained_config(spec, model.cfg, cfg.data.seq_len)
    base = str(path.resolve()) if path.exists() else str(path)
    return Pretrained(config, model, base, quantized)


def check_same_tokenizer(model: Tokenizer | None, data: Tokenizer | None, checkpoint: object, data_dir: str) -> None:
    """A run that starts from a checkpoint must see token ids as the checkpoint does: the data prepared with its
    tokenizer (`llmkit prepare ... --tokenizer CHECKPOINT`). Compared on the vocabulary (token -> id)."""
    if model is None:
        raise TrainingError(
            f"model.checkpoint: {checkpoint} has no tokenizer, so the data's token ids cannot be checked against it"
        )
    hint = f"prepare the data with its tokenizer: llmkit prepare ... --tokenizer {checkpoint}"
    if data is None:
        raise TrainingError(f"{data_dir} holds no tokenizer; {hint}")
    a, b = model.backend.get_vocab(with_added_tokens=True), data.backend.get_vocab(with_added_tokens=True)
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise TrainingError(
            f"the data in {data_dir} was prepared with another tokenizer than the checkpoint {checkpoint}'s "
            f"({len(b)} against {len(a)} tokens; e.g. {differ}): {hint}"
        )


def load_teacher(path: str, student: Any, device: torch.device) -> DecoderLM:
    """The frozen teacher `loss.distill_from` names, in eval mode on `device` (float weights; a GGUF file
    dequantized): a decoder-only model with the student's vocabulary, the student without MTP modules."""
    from llmkit.interop.load import load_model
    from llmkit.runs import resolve_checkpoint

    if student.cfg.mtp_depth:
        raise TrainingError("loss.distill_from: distillation trains models without MTP modules (mtp_depth 0)")
    teacher = load_model(resolve_checkpoint(path), dtype=torch.float32, quantized=False).model.to(device).eval()
    if not isinstance(teacher, DecoderLM):
        raise TrainingError(f"loss.distill_from: {path} is not a decoder-only model")
    if teacher.cfg.vocab_size != student.cfg.vocab_size:
        raise TrainingError(
            f"loss.distill_from: the teacher's vocabulary ({teacher.cfg.vocab_size}) differs from the "
            f"model's ({student.cfg.vocab_size}): prepare the data with the teacher's tokenizer"
        )
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher
