"""What every Hugging Face family declares, and the conversions that follow from it.

A family is data: the model_types it reads, the class name each is saved under, its config.json table (`fields`, see
`llmkit.interop.hf.fields`), its declarative key map (`rules`, see `llmkit.interop.keymap`), and for
`llmkit compare`, which transformers Auto class loads it, where that model keeps its layer stacks and how one input
runs through both implementations. Everything about Hugging Face names lives under `llmkit.interop.hf`; the models
never see them.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import Tensor

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.hf.fields import Entry, differences, read_fields, write_fields
from llmkit.interop.keymap import Rule


@dataclass(frozen=True)
class OneInput:
    """One input for both implementations: llmkit's positional arguments and transformers' keyword arguments."""

    ours: tuple[Tensor, ...]
    theirs: dict[str, Tensor]


class Family(abc.ABC):
    """One Hugging Face model family: several model_types may share its layout and its table."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    architectures: ClassVar[dict[str, str]]  # model_type -> class name written to config.json
    fields: ClassVar[tuple[Entry, ...]]
    auto_class: ClassVar[Literal["AutoModelForCausalLM", "AutoModelForSeq2SeqLM"]] = "AutoModelForCausalLM"
    reference_stacks: ClassVar[tuple[str, ...]] = ("model.layers",)  # transformers' layer stacks, in llmkit's order

    def config_from_hf(self, hf: Mapping[str, Any], names: Collection[str] = ()) -> ModelConfig:
        """ModelConfig from config.json (and the checkpoint's tensor names, where they decide a detail)."""
        return read_fields(self.fields, hf, names, self._model_type(hf.get("model_type") or self.model_types[0]))

    def config_to_hf(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        """config.json for `cfg` as `model_type`; ConfigError naming the first field it cannot hold."""
        model_type = self._model_type(model_type)
        out = {"model_type": model_type, "architectures": [self.architectures[model_type]]}
        return {**out, **write_fields(self.fields, cfg, model_type)}

    @abc.abstractmethod
    def rules(self, cfg: ModelConfig, names: Collection[str]) -> list[Rule]:
        """The key map for `cfg`; `names` (the checkpoint's tensor names, or empty when writing) picks a layout where
        a family has more than one (fused or split experts, prefixed or bare GPT-2 names)."""

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        """Tensors a checkpoint may hold that llmkit recomputes or ties: rotary tables, a tied head's copy."""
        return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")

    def why_not(self, cfg: ModelConfig, model_type: str) -> str | None:
        """Why `cfg` cannot be written as `model_type`, or None when its config.json reads back to the same
        architecture."""
        try:
            back = self.config_from_hf(self.config_to_hf(cfg, model_type))
        except ConfigError as e:
            return str(e)
        lost = differences(cfg.architecture().to_dict(), back.architecture().to_dict())
        if not lost:
            return None
        return "; ".join(
            f"{path}={ours!r} cannot be written as model_type {model_type!r} (its config.json reads back {back!r})"
            for path, ours, back in lost
        )

    def model_type_for(self, cfg: ModelConfig) -> str | None:
        """The first of this family's model_types whose config.json describes the same architecture as `cfg`."""
        return next((mt for mt in self.model_types if self.why_not(cfg, mt) is None), None)

    def one_input(self, tokens: Tensor, hf_config: Mapping[str, Any]) -> OneInput:
        """How `llmkit compare` runs token ids (1, T) through both implementations: a decoder reads them as they are."""
        return OneInput((tokens,), {"input_ids": tokens})

    def _model_type(self, model_type: str) -> str:
        if model_type not in self.model_types:
            raise ConfigError(f"the {self.name} family reads {', '.join(self.model_types)}, not {model_type!r}")
        return model_type
