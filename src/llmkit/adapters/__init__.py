"""Adapters: small trainable additions to a frozen model. LoRA (lora.py); its files in PEFT's layout are
llmkit.interop.peft."""

from llmkit.adapters.lora import (
    DEFAULT_TARGETS,
    LoRA,
    adapters,
    add_lora,
    attach_lora,
    has_lora,
    lora_state_dict,
    merge_lora,
    remove_lora,
    trainable_count,
)

__all__ = [
    "DEFAULT_TARGETS",
    "LoRA",
    "adapters",
    "add_lora",
    "attach_lora",
    "has_lora",
    "lora_state_dict",
    "merge_lora",
    "remove_lora",
    "trainable_count",
]
