"""Weight-only quantization applied from outside the model: int8 (per output row or per group) and int4 (groups of
32-256, scale and zero each), GGUF's Q8_0 / Q4_0 / Q4_1 blocks taken over exactly. See apply.py."""

from llmkit.quant.apply import (
    METHODS,
    QuantSpec,
    apply_spec,
    describe,
    parameter_count,
    quantize,
    quantized_spec,
    weight_bytes,
)
from llmkit.quant.experts import QuantizedExperts
from llmkit.quant.linear import Int4Linear, Int8Linear, QuantizedLinear

__all__ = [
    "METHODS",
    "Int4Linear",
    "Int8Linear",
    "QuantSpec",
    "QuantizedExperts",
    "QuantizedLinear",
    "apply_spec",
    "describe",
    "parameter_count",
    "quantize",
    "quantized_spec",
    "weight_bytes",
]
