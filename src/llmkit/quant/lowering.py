"""What the C++ decode step (native_step.py) computes, declared per module type: LOWERED.

A module is lowered onto the C++ step only when its exact type has an entry here and every name it holds (plain
attributes, parameters, buffers, submodules) is declared in that entry with a rule its value passes; a module with
forward hooks is not lowered either. A name an entry does not list (an option added to a layer later, a parameter
registered on an instance, a LoRA adapter) makes the step decline the model, which then decodes in PyTorch: the step
fails closed. native_step.py's builders read only what the entries declare, and check what a rule cannot see
(dtypes, kernels, two norms that must agree). tests/quant/test_native_lowering.py builds each layer with each option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.layers.block import TransformerBlock
from llmkit.layers.mlp import ACTIVATIONS, MLP, SwiGLU
from llmkit.layers.moe import GroupedExperts, MoE, Router
from llmkit.layers.norm import LayerNorm, RMSNorm
from llmkit.layers.residual import PreNorm
from llmkit.models import DecoderLM
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.experts import QuantizedExperts
from llmkit.quant.linear import Int4Linear, Int8Linear

ACTIVATION_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}  # cpu_decode.cpp's Activation

Rule = Callable[[Any], bool]


def anything(value: Any) -> bool:
    """Every value: the step computes each (a shape, an eps), or the value only matters in training (dropout)."""
    return True


def absent(value: Any) -> bool:
    return value is None


def one_of(*values: object) -> Rule:
    return lambda value: value in values


def lowered(*kinds: type[nn.Module] | None) -> Rule:
    """A submodule of one of these exact types (None: it may be absent) that is itself lowered."""
    return lambda m: None in kinds if m is None else type(m) in kinds and lowers(m)


def fields(rules: Mapping[str, Rule]) -> Rule:
    """A config dataclass with exactly these fields, each holding a value its rule accepts."""
    return lambda cfg: (
        {f.name for f in dataclasses.fields(cfg)} == rules.keys()
        and all(rule(getattr(cfg, name)) for name, rule in rules.items())
    )


@dataclass(frozen=True)
class Lowering:
    """What the C++ step computes of one module type: a rule per name of the module, and `holds`, relations between
    its values that no single rule sees."""

    names: Mapping[str, Rule]
    holds: Callable[[Any], bool] = anything


def _names(module: nn.Module) -> set[str]:
    """Everything a module holds that can change its output: plain attributes, parameters, buffers, submodules."""
    plain = {name for name in vars(module) if not name.startswith("_") and name != "training"}
    return plain | module._parameters.keys() | module._buffers.keys() | module._modules.keys()


def lowers(module: nn.Module) -> bool:
    """Whether the C++ step computes all of `module`: its exact type is declared in LOWERED, it is in eval mode with
    no forward hooks (LoRA adds its update through one), it holds no name the declaration lacks, and every value is
    one the declaration accepts."""
    entry = LOWERED.get(type(module))
    names = _names(module)
    if entry is None or module.training or module._forward_hooks or module._forward_pre_hooks:
        return False
    if not names <= entry.names.keys():
        return False
    return all(entry.names[name](getattr(module, name)) for name in names) and entry.holds(module)


_LINEAR = lowered(nn.Linear, Int4Linear, Int8Linear, BlockLinear)  # _projection reads it: fp32, codes or blocks
_ACTIVATION = one_of(*ACTIVATION_CODES)
_MOE_CONFIG = fields(
    {
        "n_experts": anything,
        "top_k": anything,
        "expert_hidden_dim": anything,
        "expert_kind": one_of("swiglu", "mlp"),
        "activation": _ACTIVATION,
        "n_shared_experts": anything,
        "shared_gate": anything,
        "score_func": one_of("softmax", "sigmoid"),
        "n_groups": anything,
        "topk_groups": anything,
        "group_score": one_of("max", "top2_sum"),
        "norm_topk": anything,
        "routed_scale": anything,
        "score_bias": anything,
        "capacity_factor": absent,  # drops assignments across the batch: not a per-row choice the C++ router makes
        "aux_loss_kind": anything,  # the balance and z losses: training's
        "aux_loss_coef": anything,
        "z_loss_coef": anything,
        "first_dense_layers": anything,  # which layers hold an MoE: the modules built say
    }
)


def _plain_attention(a: GroupedQueryAttention) -> bool:
    """The scale is D^-0.5 (Gemma 2 sets another), and QK-norm is on both projections with one eps."""
    if (a.q_norm is None) != (a.k_norm is None):
        return False
    same_eps = a.q_norm is None or a.k_norm is None or a.q_norm.eps == a.k_norm.eps
    return a.scale == a.head_dim**-0.5 and same_eps


def _own_activation(ffn: MLP | SwiGLU | GroupedExperts) -> bool:
    return ffn.act is ACTIVATIONS[ffn.activation]


_QUANTIZED: dict[str, Rule] = {
    "in_features": anything,
    "out_features": anything,
    "group_size": anything,
    "n_groups": anything,
    "kernel": anything,
    "resolved": anything,  # _projection takes a layer only when it resolved to llmkit's AVX2 kernel
    "kernel_choice": anything,  # how PyTorch's path multiplies many rows; the C++ step's products do not read it
    "qweight": anything,
    "scales": anything,
    "zeros": anything,
    "bias": anything,
    "dtype_probe": anything,
}

# quantize() leaves a record of what it did on the module it was given; the layers it swapped in are checked where
# they sit
_QUANTIZE_RECORD: dict[str, Rule] = {"quantization": anything}

LOWERED: dict[type[nn.Module], Lowering] = {
    DecoderLM: Lowering(
        {
            "cfg": anything,  # read through the modules built from it, and logit_softcap by `logits`
            "blocks": anything,  # each lowered on its own (_block)
            "rope_local": absent,  # one set of RoPE tables per step in C++; Gemma 3 has two
            # what runs in PyTorch around the C++ blocks: the embedding, positions, final norm, head
            "embed": anything,
            "inputs": anything,
            "rope": anything,
            "norm": anything,
            "head": anything,
            "head_bias": anything,
            "mtp": anything,  # the drafter lowers an MTP module's block on its own
            **_QUANTIZE_RECORD,
        }
    ),
    TransformerBlock: Lowering(
        {
            "attn": lowered(GroupedQueryAttention),
            "ffn": lowered(SwiGLU, MLP, MoE),
            "attn_residual": lowered(PreNorm),
            "ffn_residual": lowered(PreNorm),
            **_QUANTIZE_RECORD,  # an MTP block's low-bit copy (drafters.draft_block) is quantized on its own
        }
    ),
    PreNorm: Lowering({"norm": lowered(RMSNorm, LayerNorm), "dropout": lowered(nn.Dropout)}),
    nn.Dropout: Lowering({"p": anything, "inplace": anything}),  # identity in eval mode
    RMSNorm: Lowering({"eps": anything, "weight": anything}),
    LayerNorm: Lowering(
        {
            "normalized_shape": anything,
            "eps": anything,
            "elementwise_affine": one_of(True),
            "weight": anything,
            "bias": anything,
        }
    ),
    GroupedQueryAttention: Lowering(
        {
            "n_heads": anything,
            "n_kv_heads": anything,
            "head_dim": anything,
            "rope_dim": anything,
            "rope_layout": one_of("half", "interleaved"),
            "sliding_window": anything,
            "dropout": anything,
            "scale": anything,  # D^-0.5 only: _plain_attention
            "softcap": absent,  # soft-capped scores (Gemma 2)
            "prefill_kernel": anything,  # how a prompt attends in PyTorch
            "q_norm": lowered(RMSNorm, None),  # Gemma 3's offset gains are another type
            "k_norm": lowered(RMSNorm, None),
            "wq": _LINEAR,
            "wk": _LINEAR,
            "wv": _LINEAR,
            "wo": _LINEAR,
        },
        _plain_attention,
    ),
    SwiGLU: Lowering(
        {"activation": _ACTIVATION, "act": anything, "w1": _LINEAR, "w2": _LINEAR, "w3": _LINEAR}, _own_activation
    ),
    MLP: Lowering({"activation": _ACTIVATION, "act": anything, "w1": _LINEAR, "w2": _LINEAR}, _own_activation),
    MoE: Lowering(
        {
            "cfg": _MOE_CONFIG,
            "layer": anything,  # the index its statistics are reported under
            "router": lowered(Router),
            "experts": lowered(GroupedExperts, QuantizedExperts),
            "shared": lowered(SwiGLU, MLP, None),
            "shared_gate": lowered(nn.Linear, Int4Linear, Int8Linear, None),  # _moe reads its (dequantized) weight
        }
    ),
    Router: Lowering({"cfg": _MOE_CONFIG, "weight": anything, "score_bias": anything}),
    GroupedExperts: Lowering(
        {"kind": anything, "activation": _ACTIVATION, "act": anything, "w1": anything, "w2": anything, "w3": anything},
        _own_activation,
    ),
    QuantizedExperts: Lowering(
        {
            "kind": anything,
            "activation": _ACTIVATION,
            "act": anything,
            "kernel": anything,
            "shape": anything,
            "q1": lowered(Int4Linear, Int8Linear),
            "q2": lowered(Int4Linear, Int8Linear),
            "q3": lowered(Int4Linear, Int8Linear, None),
        },
        _own_activation,
    ),
    nn.Linear: Lowering({"in_features": anything, "out_features": anything, "weight": anything, "bias": anything}),
    Int4Linear: Lowering(_QUANTIZED),
    Int8Linear: Lowering(_QUANTIZED | {"zeros": absent}),
    BlockLinear: Lowering(
        {
            "in_features": anything,
            "out_features": anything,
            "group_size": anything,
            "n_groups": anything,
            "kernel": anything,
            "resolved": anything,  # _projection takes a layer only when it resolved to llmkit's CPU kernels
            "kernel_choice": anything,  # how PyTorch's path multiplies many rows; the C++ step does not read it
            "block": anything,  # every type the C++ products take
            "blocks": anything,
            "bias": anything,
            "dtype_probe": anything,
        }
    ),
}
