"""Activation names in config.json: every spelling transformers knows is read; one spelling per activation is written.

transformers looks `hidden_act` / `activation_function` up in `transformers.activations.ACT2FN`, which has several
names for one function. Each row below is one of those names and the llmkit activation it computes. The spelling
written is the row marked `default`, unless a family's own configs use another one (`families`): GPT-2's configs say
"gelu_new" and OPUS-MT's (Marian) say "swish", and writing them back that way keeps an exported config.json what the
family's published ones look like, and GPT-2's export bit-exact ("gelu_new" is the tanh formula written out, not
torch's fused kernel).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from llmkit.config import Activation
from llmkit.interop.hf.fields import Field


@dataclass(frozen=True)
class Spelling:
    """One config.json name for an activation. default: written unless the family is listed in another row's
    `families`."""

    name: str
    activation: Activation
    default: bool = False
    families: tuple[str, ...] = ()


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("silu", "silu", default=True),
    Spelling("swish", "silu", families=("marian",)),
    Spelling("gelu", "gelu", default=True),
    Spelling("gelu_pytorch_tanh", "gelu_tanh", default=True),  # torch's tanh GELU, what llmkit computes
    Spelling("gelu_new", "gelu_tanh", families=("gpt2", "marian")),
    Spelling("gelu_fast", "gelu_tanh"),
    Spelling("relu", "relu", default=True),
)


def activation_from_hf(name: Any) -> Activation:
    for s in SPELLINGS:
        if s.name == name:
            return s.activation
    raise ValueError("supported: " + ", ".join(s.name for s in SPELLINGS))


def activation_to_hf(activation: Activation, family: str) -> str:
    """The spelling `family` writes for `activation`."""
    rows = [s for s in SPELLINGS if s.activation == activation]
    return next((s.name for s in rows if family in s.families), next(s.name for s in rows if s.default))


def activation_field(ours: str | tuple[str, ...], theirs: str, family: str, default: Activation) -> Field:
    """The table entry for an activation key, written in `family`'s spelling."""
    return Field(ours, theirs, activation_from_hf, default, functools.partial(activation_to_hf, family=family))
