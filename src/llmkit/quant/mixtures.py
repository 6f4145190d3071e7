"""llama.cpp's quantization mixtures ("file types"): which block type each tensor of a model gets under Q4_K_M,
Q5_K_S, ... (llama-quant.cpp's llama_tensor_get_type, for the types llmkit quantizes to), as a QuantSpec whose
`layers` name every layer's type.

A mixture spends more bits where quantization hurts most. Under Q4_K_M, say, the weights are Q4_K, but the output
head is Q6_K (and so is the embedding table, if the head is tied to it), and `attn_v` and `ffn_down` are Q6_K in the
first eighth of the layers, the last eighth and every third layer between (`more_bits`). The 2- and 3-bit mixtures
keep the head Q6_K and raise `attn_v`, `ffn_down` and `attn_output`: Q2_K gives them Q4_K (`attn_v`, where 4 or more
query heads share a key/value head; else Q3_K), Q3_K and Q3_K; Q3_K_M Q5_K in the first two layers then Q4_K, Q5_K
in the first sixteenth then Q4_K, and Q4_K; Q3_K_L Q5_K for all three; Q3_K_S none. Under IQ4_NL and IQ4_XS
(written without an importance matrix) the head is Q6_K, `attn_v` Q5_K where 4 or more query heads share a
key/value head, and `ffn_down` Q5_K in the first eighth of the layers. A layer whose input width is not a whole
number of 256-weight super-blocks falls back to a 32-weight type of about the same size (Q2_K and Q3_K to Q4_0, Q4_K
to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, IQ4_XS to IQ4_NL; the head to Q8_0), as llama.cpp's does.

Only the dense decoder's rules are written here (llama, qwen2/3, mistral, ...); llama.cpp's extra rules for
mixtures of experts, Falcon and 70B models are not, and such a model is quantized by these plain ones.
"""

from __future__ import annotations

import re

from torch import nn

from llmkit.errors import InputError
from llmkit.quant.blocks import QK_K
from llmkit.quant.spec import QuantSpec, embedding_table, targets

# mixture -> the type of every tensor no rule below names
BASE = {
    "Q2_K": "Q2_K",
    "Q3_K_S": "Q3_K",
    "Q3_K_M": "Q3_K",
    "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K",
    "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K",
    "Q5_K_M": "Q5_K",
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
}  # fmt: skip  (Q6_K: the plain type)
FALLBACK = {  # rows not whole super-blocks
    "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL",
}  # fmt: skip
MIXTURES = tuple(BASE)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _attn_v(mixture: str, layer: int, layers: int, gqa: int) -> str | None:
    if mixture == "Q2_K":
        return "Q4_K" if gqa >= 4 else "Q3_K"
    if mixture == "Q3_K_M":
        return "Q5_K" if layer < 2 else "Q4_K"
    if mixture == "Q3_K_L":
        return "Q5_K"
    if mixture in ("IQ4_NL", "IQ4_XS") and gqa >= 4:
        return "Q5_K"
    if mixture in ("Q4_K_M", "Q5_K_M") and more_bits(layer, layers):
        return "Q6_K"
    if mixture == "Q4_K_S" and layer < 4:
        return "Q5_K"
    return None


def _ffn_down(mixture: str, layer: int, layers: int, importance: bool = False) -> str | None:
    if mixture == "Q2_K":
        return "Q3_K"
    if mixture == "Q3_K_M":
        return "Q5_K" if layer < layers // 16 else "Q4_K"
    if mixture == "Q3_K_L":
        return "Q5_K"
    if mixture in ("Q4_K_M", "Q5_K_M") and more_bits(layer, layers):
        return "Q6_K"
    if mixture == "Q4_K_S" and layer < layers // 8:
        return "Q5_K"
    if mixture in ("IQ4_NL", "IQ4_XS") and layer < layers // 8 and not importance:
        return "Q5_K"
    return None


def _attn_output(mixture: str) -> str | None:
    return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(mixture)


def _fits(kind: str, inputs: int) -> str:
    return kind if kind not in FALLBACK or inputs % QK_K == 0 else FALLBACK[kind]


def mixture_spec(model: nn.Module, mixture: str, importance: bool = False) -> QuantSpec:
    """The QuantSpec of `mixture` (one of MIXTURES, case-insensitive) for `model`: every linear layer in the blocks
    and the output head, each with its block type, and an untied embedding table in the base type. `importance`:
    as chosen when an importance matrix is given (IQ4_NL / IQ4_XS then keep ffn_down in their own type)."""
    name = mixture.upper()
    if name not in BASE:
        raise InputError(f"unknown mixture {mixture!r}; llmkit writes {', '.join(MIXTURES)}")
    base = BASE[name]
    layers: dict[str, list[object]] = {}
    tied = getattr(model, "head", "absent") is None
    probe = QuantSpec(base, include_head=True)
    n_layers = len(getattr(model, "blocks", ()))
    cfg = getattr(model, "cfg", None)
    gqa = cfg.attention.n_heads // cfg.n_kv_heads if cfg is not None and cfg.attention.kind == "gqa" else 1
    for target, module in targets(model, probe):
        if not isinstance(module, nn.Linear):
            raise InputError(f"{target}: {name} is written for dense models; quantize experts with int8 or int4")
        match = re.match(r"blocks\.(\d+)\.", target)
        kind = base
        if target == "head":
            kind = "Q6_K" if module.in_features % QK_K == 0 else "Q8_0"
        elif match and target.endswith("attn.wv"):
            kind = _attn_v(name, int(match[1]), n_layers, gqa) or base
        elif match and target.endswith("ffn.w2"):
            kind = _ffn_down(name, int(match[1]), n_layers, importance) or base
        elif match and target.endswith("attn.wo"):
            kind = _attn_output(name) or base
        layers[target] = [_fits(kind, module.in_features), None]
    width = int(embedding_table(model).shape[1])
    if tied:  # the table is the head's: llama.cpp quantizes a tied token_embd as the output
        layers["head"] = ["Q6_K" if width % QK_K == 0 else "Q8_0", None]
        return QuantSpec(base, None, True, layers, embedding_from_head=True)
    return QuantSpec(base, None, True, layers, embedding=_fits(base, width))
