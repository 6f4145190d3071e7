"""Which backend runs a model's steps, decided in one place for `generate`, `chat`, evaluation, speculative decoding
and the serving engine alike.

    backend = resolve(model)                          the C++ step and batch invariance where the model lowers
    backend = resolve(model, invariant=False)         the C++ step without invariance (prompts in wide products)
    backend = resolve(model, compiled=True)           torch.compile's step
    step = step_for(model, backend)                   generate/step.py's DecodeStep (choose_step does both)

The serving engine turns the same value into its model runner (llmkit.serve.model_runner.model_runner), which also
asks whether the C++ step reads its paged pools. What the CPU can do is read once per process
(llmkit.machine.cpu.CpuFeatures) and each quantized layer holds how its many-row products multiply
(llmkit.quant.KernelChoice); neither is decided here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmkit.errors import InputError
from llmkit.models import DecoderLM
from llmkit.quant.native_step import NativeDecoder

NATIVE_NEEDS = "an x86 CPU with AVX2, fp32 or int4/int8 weights, and a grouped-query decoder"


@dataclass(frozen=True)
class Backend:
    """How a model's steps run: `kind` "native" (llmkit's C++ decode step, `native`, for the steps it takes; eager
    PyTorch for others), "compiled" (torch.compile) or "eager"; `invariant`: every token through the C++ step, its
    bits independent of the rows beside it; `required`: invariance was asked for, so a step the C++ step declines is
    an error instead of an eager step."""

    kind: Literal["native", "compiled", "eager"]
    invariant: bool = False
    required: bool = False
    native: NativeDecoder | None = None


def resolve(model: DecoderLM, compiled: bool = False, invariant: bool | None = None) -> Backend:
    """The backend for `model`: compiled when asked, else the C++ step where the model lowers to it
    (llmkit.quant.native_step, NativeDecoder.of), else eager. `invariant`: batch-invariant decoding, by default (None)
    wherever the C++ step runs and nothing is compiled; True requires it (an InputError where it cannot run); False
    turns it off."""
    if compiled and invariant:
        raise InputError("batch-invariant decoding runs in C++, not through torch.compile: ask for one of the two")
    if compiled:
        return Backend("compiled")
    native = NativeDecoder.of(model)
    if native is None:
        if invariant:
            why = f"{NATIVE_NEEDS} (see llmkit.quant.native_step)"
            raise InputError(f"batch-invariant decoding needs llmkit's C++ decode step: {why}")
        return Backend("eager")
    return Backend("native", invariant is not False, invariant is True, native)
