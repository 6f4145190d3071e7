"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM): one model's layers split across N processes, applied to a
built model from outside it, as FSDP is (the model code has no collectives).

    attention      wq, wk, wv  column-parallel: rank r computes its H/N query heads (and their key/value heads)
                   wo          row-parallel: each rank's heads give one term of the output; an all-reduce sums them
    feed-forward   w1 (w3)     column-parallel: rank r computes its hidden/N units
                   w2          row-parallel, one all-reduce
    embedding      rows split by vocabulary: a rank looks up the tokens in its range (zeros elsewhere), an
                   all-reduce completes every row
    output head    split by vocabulary: each rank's logits for its tokens, an all-gather assembles them

Two all-reduces of (B, T, C) a block and one gather of the logits: what flows between ranks is activations, never
weights; norms, residuals and RoPE run whole on every rank. A grouped-query model with fewer key/value heads K than
ranks (Llama-2-70B: K = 8 at N = 16; MQA: K = 1) gives each rank the one key/value head its query heads read (N a
multiple of K): those heads are computed on N/K ranks each instead of being split. Each rank's KV cache holds its own
key/value heads, so the cache is sharded like them.

Collectives are plain torch.distributed calls inside four small autograd functions (Megatron's f and g: identity
forward / all-reduce backward before a column-parallel layer; all-reduce forward / identity backward after a
row-parallel one), placed with forward hooks. Why not DTensor's parallelize_module with ColwiseParallel /
RowwiseParallel: those shard nn.Linear and nn.Embedding only, and llmkit splits its quantized layers (int8, int4,
GGUF kept quantized: rows by output, columns by whole input groups) and the quantized tied embedding the same way;
and a key/value head held by several ranks is no DTensor placement (Replicate would make every rank compute all of
them). What is split is written down in `plan_of`; `parallelize` checks it all before changing anything.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.layers.mlp import MLP, SwiGLU
from llmkit.models.decoder import DecoderLM
from llmkit.parallel.shard import span, take_columns, take_embedding_rows, take_rows
from llmkit.quant.embedding import QuantizedEmbedding
from llmkit.quant.linear import QuantizedLinear

Plan = dict[str, str]  # module path pattern (fnmatch) -> "heads" | "ffn" | "vocab"
STYLES = ("heads", "ffn", "vocab")


@dataclass(frozen=True)
class TensorParallel:
    """The ranks a model is split across: this process is `rank` of `world` in `group` (None: the default group)."""

    rank: int
    world: int
    group: Any = None

    @classmethod
    def of(cls, mesh: Any = None) -> TensorParallel:
        """From a 1-D DeviceMesh, a process group or None (the default group, which must be initialized)."""
        if not dist.is_initialized():
            raise InputError("tensor parallelism needs torch.distributed initialized (start processes with torchrun)")
        group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
        return cls(dist.get_rank(group), dist.get_world_size(group), group)


def plan_of(model: nn.Module) -> Plan:
    """The default plan of a decoder: every self-attention split by heads, every dense feed-forward by hidden units,
    embedding and head by vocabulary (MTP modules' blocks too)."""
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


# ---- checks: every split is possible before anything changes


def _problem(name: str, module: nn.Module, style: str, world: int) -> str | None:
    """Why `module` cannot be split `world` ways in `style` (None: it can)."""
    if style == "heads":
        if not isinstance(module, GroupedQueryAttention):
            return f"{name} is {type(module).__name__}: only grouped-query attention is split by heads so far"
        H, K, D = module.n_heads, module.n_kv_heads, module.head_dim
        if H % world:
            return f"{name} has {H} query heads"
        if K % world and world % K:
            return f"{name} has {K} key/value heads (the ranks must divide them or be a multiple of them)"
        return _groups(name, module.wo, H * D // world)
    if style == "ffn":
        if not isinstance(module, (MLP, SwiGLU)):
            return f"{name} is {type(module).__name__}: only dense feed-forwards are split so far"
        hidden = module.w1.out_features
        return f"{name} has {hidden} hidden units" if hidden % world else _groups(name, module.w2, hidden // world)
    if style == "vocab":
        return None  # any vocabulary: the parts may differ by one row
    return f"{name}: unknown style {style!r} (one of {', '.join(STYLES)})"


def _groups(name: str, layer: nn.Module, width: int) -> str | None:
    g = getattr(layer, "group_size", None)
    return f"{name}'s quantized groups of {g} inputs" if g is not None and width % g else None


def check(model: nn.Module, world: int, plan: Plan | None = None) -> None:
    """Raise InputError unless `model` splits `world` ways under `plan`, naming the sizes that would."""
    if not isinstance(model, DecoderLM):
        raise InputError(f"tensor parallelism splits decoder-only models, not {type(model).__name__}")
    if world < 1:
        raise InputError(f"tensor-parallel size must be at least 1, got {world}")
    found = _matches(plan or plan_of(model), model)
    problems = [p for name, m, style in found if (p := _problem(name, m, style, world)) is not None]
    if problems:
        good = [n for n in range(1, 65) if not any(_problem(name, m, s, n) for name, m, s in found)]
        raise InputError(
            f"this model does not split {world} ways: {problems[0]}"
            + (f" ({len(problems) - 1} more like it)" if len(problems) > 1 else "")
            + f"; sizes that would: {', '.join(map(str, good))}"
        )


def split_sizes(model: nn.Module, plan: Plan | None = None, most: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `most` that split `model`."""
    found = _matches(plan or plan_of(model), model)
    return [n for n in range(1, most + 1) if not any(_problem(name, m, s, n) for name, m, s in found)]


# ---- the collectives, as autograd functions (Megatron's f and g)


class _CopyIn(torch.autograd.Function):
    """Before column-parallel layers: the same x on every rank; backward sums the ranks' gradients for it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _SumOut(torch.autograd.Function):
    """After a row-parallel layer: the ranks' terms summed; backward hands every rank the whole gradient."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, tp: TensorParallel) -> Tensor:
        y = y.contiguous().clone()
        dist.all_reduce(y, group=tp.group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherVocab(torch.autograd.Function):
    """Each rank's logits (..., V_r) -> all of them (..., V); backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, tp: TensorParallel, vocab: int) -> Tensor:
        widest = -(-vocab // tp.world)
        ctx.a, ctx.b = span(vocab, tp.rank, tp.world)
        padded = torch.nn.functional.pad(y, (0, widest - y.shape[-1])).contiguous()  # all_gather needs equal parts
        parts = [torch.empty_like(padded) for _ in range(tp.world)]
        dist.all_gather(parts, padded, group=tp.group)
        return torch.cat([p[..., : b - a] for p, (a, b) in zip(parts, _spans(vocab, tp), strict=True)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad[..., ctx.a : ctx.b], None, None


def _spans(size: int, tp: TensorParallel) -> list[tuple[int, int]]:
    return [span(size, r, tp.world) for r in range(tp.world)]


def copy_in(x: Tensor, tp: TensorParallel) -> Tensor:
    return _CopyIn.apply(x, tp) if torch.is_grad_enabled() and x.requires_grad else x


def sum_out(y: Tensor, tp: TensorParallel) -> Tensor:
    if torch.is_grad_enabled() and y.requires_grad:
        return _SumOut.apply(y, tp)
    dist.all_reduce(y, group=tp.group)  # a fresh output: summed in place
    return y


# ---- the splits


def _split_heads(attn: GroupedQueryAttention, tp: TensorParallel) -> None:
    H, K, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q0, q1 = span(H, tp.rank, tp.world)
    if K % tp.world == 0:
        k0, k1 = span(K, tp.rank, tp.world)
    else:  # fewer key/value heads than ranks: the one this rank's query heads read (H/K of them share it)
        k0 = q0 // (H // K)
        k1 = k0 + 1
    take_rows(attn.wq, q0 * D, q1 * D)
    take_rows(attn.wk, k0 * D, k1 * D)
    take_rows(attn.wv, k0 * D, k1 * D)
    take_columns(attn.wo, q0 * D, q1 * D, keep_bias=tp.rank == 0)
    attn.n_heads, attn.n_kv_heads = q1 - q0, k1 - k0
    attn.register_forward_pre_hook(lambda _, args: (copy_in(args[0], tp), *args[1:]))
    attn.wo.register_forward_hook(lambda _, __, y: sum_out(y, tp))


def _split_ffn(ffn: MLP | SwiGLU, tp: TensorParallel) -> None:
    a, b = span(ffn.w1.out_features, tp.rank, tp.world)
    take_rows(ffn.w1, a, b)
    if isinstance(ffn, SwiGLU):
        take_rows(ffn.w3, a, b)
    take_columns(ffn.w2, a, b, keep_bias=tp.rank == 0)
    ffn.register_forward_pre_hook(lambda _, args: (copy_in(args[0], tp), *args[1:]))
    ffn.w2.register_forward_hook(lambda _, __, y: sum_out(y, tp))


class VocabParallelHead(nn.Module):
    """The output head split by vocabulary: this rank's rows of the projection (and of the bias), its logits
    gathered with the other ranks'. h (..., C) -> logits (..., V)."""

    def __init__(self, layer: nn.Module, tp: TensorParallel, vocab: int) -> None:
        super().__init__()
        self.layer, self.tp, self.vocab = layer, tp, vocab

    def forward(self, h: Tensor) -> Tensor:
        local = self.layer(copy_in(h, self.tp))  # (..., V_r)
        return _GatherVocab.apply(local, self.tp, self.vocab)


def _split_vocab(model: DecoderLM, tp: TensorParallel) -> None:
    """Embedding and head split by vocabulary (a tied head keeps sharing the embedding's rows)."""
    V = model.cfg.vocab_size
    a, b = span(V, tp.rank, tp.world)
    embed, head = model.embed, model.head
    if head is not None and not isinstance(head, (nn.Linear, QuantizedLinear)):
        raise InputError(f"the output head is {type(head).__name__}: not split by vocabulary")
    if isinstance(embed, QuantizedEmbedding):  # rows read from the (quantized) head: splitting the head splits both
        assert head is not None
        take_rows(head, a, b)
    elif isinstance(embed, nn.Embedding):
        take_embedding_rows(embed, a, b)
        if head is not None:
            take_rows(head, a, b)
    else:
        raise InputError(f"the embedding is {type(embed).__name__}: not split by vocabulary")
    if head is None:  # tied: a linear layer over the embedding's own rows
        head = nn.Linear(model.cfg.d_model, b - a, bias=False, device="meta")
        head.weight = embed.weight
    if model.head_bias is not None:  # the bias's rows go with the head's
        head.bias = nn.Parameter(model.head_bias.detach()[a:b].clone())
        model.head_bias = None
    model.head = VocabParallelHead(head, tp, V)

    held: list[Tensor] = []

    def local_ids(_: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        ids = args[0]
        held[:] = [(ids < a) | (ids >= b)]  # tokens of other ranks: looked up as row 0, zeroed after
        return ((ids - a).clamp(0, b - a - 1), *args[1:])

    def completed(_: nn.Module, __: Any, rows: Tensor) -> Tensor:
        rows = rows.masked_fill(held.pop()[..., None], 0.0)
        return sum_out(rows, tp)

    embed.register_forward_pre_hook(local_ids)
    embed.register_forward_hook(completed)


def parallelize(model: DecoderLM, mesh: Any = None, plan: Plan | None = None) -> DecoderLM:
    """Split `model` in place across the ranks of `mesh` (a 1-D DeviceMesh, a process group, or None for the
    default group) as `plan` says (default: plan_of(model)); every rank calls this with the same model. Returns the
    model, whose forward, caches and generation work as before, each rank holding about 1/N of the weights and of
    the key/value cache, and every rank computing the same logits."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise InputError("this model is already split across ranks")
    tp = TensorParallel.of(mesh)
    plan = plan or plan_of(model)
    check(model, tp.world, plan)
    found = _matches(plan, model)
    for _, module, style in found:
        if style == "heads":
            _split_heads(module, tp)  # type: ignore[arg-type]
        elif style == "ffn":
            _split_ffn(module, tp)  # type: ignore[arg-type]
    if any(style == "vocab" for _, _, style in found):
        _split_vocab(model, tp)
    object.__setattr__(model, "tensor_parallel", tp)  # a plain attribute: which ranks hold the model
    return model
