"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM): one model's layers split across N processes, applied to a
built model from outside it, as FSDP is (the model code has no collectives).

    attention      wq, wk, wv  column-parallel: rank r computes its H/N query heads (and their key/value heads)
                   wo          row-parallel: each rank's heads give one term of the output; an all-reduce sums them
    latent (MLA)   wq_b, wkv_b column-parallel by heads, wo row-parallel; the latent projections stay whole
    feed-forward   w1 (w3)     column-parallel: rank r computes its hidden/N units
                   w2          row-parallel, one all-reduce
    experts        a mixture's experts spread over the ranks (expert parallelism), its router whole, one all-reduce
    embedding      rows split by vocabulary: a rank looks up the tokens in its range (zeros elsewhere), an
                   all-reduce completes every row
    output head    split by vocabulary: each rank's logits for its tokens, an all-gather assembles them

Two all-reduces of (B, T, C) a block and one gather of the logits: what flows between ranks is activations, never
weights; norms, residuals and RoPE run whole on every rank. A grouped-query model with fewer key/value heads K than
ranks (Llama-2-70B: K = 8 at N = 16; MQA: K = 1) gives each rank the one key/value head its query heads read (N a
multiple of K): those heads are computed on N/K ranks each instead of being split. Each rank's KV cache holds its own
key/value heads, so the cache is sharded like them; latent attention caches one latent a token for all heads, which
every rank holds whole. How each layer splits is splits.py; the collectives are collectives.py.

Collectives are plain torch.distributed calls inside small autograd functions (Megatron's f and g: identity
forward / all-reduce backward before a column-parallel layer; all-reduce forward / identity backward after a
row-parallel one), placed with forward hooks. Why not DTensor's parallelize_module with ColwiseParallel /
RowwiseParallel: those shard nn.Linear and nn.Embedding only, and llmkit splits its quantized layers (int8, int4,
GGUF kept quantized: rows by output, columns by whole input groups) and the quantized tied embedding the same way;
and a key/value head held by several ranks is no DTensor placement (Replicate would make every rank compute all of
them). What is split is written down in `plan_of`; `parallelize` checks it all before changing anything.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

from torch import nn

from llmkit.errors import InputError
from llmkit.models.decoder import DecoderLM
from llmkit.parallel.collectives import TensorParallel
from llmkit.parallel.splits import problem, split, split_vocab

Plan = dict[str, str]  # module path pattern (fnmatch) -> "heads" | "ffn" | "vocab"


def plan_of(model: nn.Module) -> Plan:
    """The default plan of a decoder: every self-attention split by heads, every feed-forward by hidden units (a
    mixture by experts), embedding and head by vocabulary (MTP modules' blocks too)."""
    return {"embed": "vocab", "head": "vocab", "*.attn": "heads", "*.ffn": "ffn"}


def _matches(plan: Plan, model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    found = []
    for name, module in model.named_modules():
        styles = {style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)}
        if len(styles) > 1:
            raise InputError(f"the plan gives {name} more than one style: {sorted(styles)}")
        if styles:
            found.append((name, module, styles.pop()))
    return found


def check(model: nn.Module, world: int, plan: Plan | None = None) -> None:
    """Raise InputError unless `model` splits `world` ways under `plan`, naming the sizes that would."""
    if not isinstance(model, DecoderLM):
        raise InputError(f"tensor parallelism splits decoder-only models, not {type(model).__name__}")
    if world < 1:
        raise InputError(f"tensor-parallel size must be at least 1, got {world}")
    found = _matches(plan or plan_of(model), model)
    problems = [p for name, m, style in found if (p := problem(name, m, style, world)) is not None]
    if problems:
        good = [n for n in range(1, 65) if not any(problem(name, m, s, n) for name, m, s in found)]
        raise InputError(
            f"this model does not split {world} ways: {problems[0]}"
            + (f" ({len(problems) - 1} more like it)" if len(problems) > 1 else "")
            + f"; sizes that would: {', '.join(map(str, good))}"
        )


def split_sizes(model: nn.Module, plan: Plan | None = None, most: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `most` that split `model`."""
    found = _matches(plan or plan_of(model), model)
    return [n for n in range(1, most + 1) if not any(problem(name, m, s, n) for name, m, s in found)]


def parallelize(model: DecoderLM, mesh: Any = None, plan: Plan | None = None) -> DecoderLM:
    """Split `model` in place across the ranks of `mesh` (a 1-D DeviceMesh, a process group, or None for the
    default group) as `plan` says (default: plan_of(model)); every rank calls this with the same model. Returns the
    model, whose forward, caches and generation work as before, each rank holding about 1/N of the weights and of
    the key/value cache, and every rank computing the same logits."""
    return split_model(model, TensorParallel.of(mesh), plan)


def split_model(model: DecoderLM, tp: TensorParallel, plan: Plan | None = None) -> DecoderLM:
    """parallelize's work for rank tp.rank of tp.world; on the meta device it needs no process group (what
    `llmkit inspect --tp` measures each rank's part on)."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise InputError("this model is already split across ranks")
    plan = plan or plan_of(model)
    check(model, tp.world, plan)
    found = _matches(plan, model)
    for _, module, style in found:
        if style != "vocab":
            split(module, style, tp)
    if any(style == "vocab" for _, _, style in found):
        split_vocab(model, tp)
    object.__setattr__(model, "tensor_parallel", tp)  # a plain attribute: which ranks hold the model
    return model


def split_loader(mesh: Any = None, plan: Plan | None = None) -> Callable[[nn.Module], DecoderLM]:
    """What `load_model(path, split=...)` takes to load this rank's part of a checkpoint: the model is split on the
    meta device (checked, nothing read yet) and only the slices each tensor keeps are read from the files, so that
    no rank ever holds the whole model."""
    tp = TensorParallel.of(mesh)

    def cut(model: nn.Module) -> DecoderLM:
        if not isinstance(model, DecoderLM):
            raise InputError(f"tensor parallelism splits decoder-only models, not {type(model).__name__}")
        return split_model(model, tp, plan)

    return cut
