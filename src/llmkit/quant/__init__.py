"""Weight-only quantization applied from outside the model: int8 (per output row or per group), int4 (groups of
32-256, scale and zero each), fp8 (E4M3 numbers, per output row or per group), and llama.cpp's block types held as
GGUF files store them (blocks.py, BlockLinear). See apply.py."""

from llmkit.quant.apply import (
    apply_spec,
    describe,
    kernel_choice_set,
    parameter_count,
    quantize,
    set_kernel_choice,
    weight_bytes,
)
from llmkit.quant.experts import QuantizedExperts
from llmkit.quant.linear import Fp8Linear, Int4Linear, Int8Linear, QuantizedLinear
from llmkit.quant.native import KernelChoice
from llmkit.quant.spec import METHODS, QuantSpec, quantized_spec

__all__ = [
    "METHODS",
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "KernelChoice",
    "QuantSpec",
    "QuantizedExperts",
    "QuantizedLinear",
    "apply_spec",
    "describe",
    "kernel_choice_set",
    "parameter_count",
    "quantize",
    "quantized_spec",
    "set_kernel_choice",
    "weight_bytes",
]
