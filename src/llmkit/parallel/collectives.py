"""The collectives tensor parallelism is made of, as autograd functions (Megatron's f and g), so that a split
model's gradients are right too.

    copy_in   before a split computation: identity forward; backward sums the ranks' gradients (each rank's part
              contributed only its own term)
    sum_out   after a row-parallel layer: the ranks' terms summed forward; backward hands every rank the gradient
    gather    each rank's slice of the last dimension -> all of it (the vocabulary-parallel head)
    summed_grads  a parameter held whole by every rank but used by one rank's part of a computation (MLA's latent
              projections): its gradient summed over ranks as it is computed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.parallel.shard import span


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

    def span(self, size: int) -> tuple[int, int]:
        """This rank's part [a, b) of range(size)."""
        return span(size, self.rank, self.world)


class _CopyIn(torch.autograd.Function):
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
    @staticmethod
    def forward(ctx: Any, y: Tensor, tp: TensorParallel) -> Tensor:
        y = y.contiguous().clone()
        dist.all_reduce(y, group=tp.group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """(..., n_r) on each rank -> (..., n) in rank order; backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, tp: TensorParallel, size: int) -> Tensor:
        spans = [span(size, r, tp.world) for r in range(tp.world)]
        ctx.a, ctx.b = spans[tp.rank]
        widest = -(-size // tp.world)
        padded = torch.nn.functional.pad(y, (0, widest - y.shape[-1])).contiguous()  # all_gather needs equal parts
        parts = [torch.empty_like(padded) for _ in range(tp.world)]
        dist.all_gather(parts, padded, group=tp.group)
        return torch.cat([p[..., : b - a] for p, (a, b) in zip(parts, spans, strict=True)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad[..., ctx.a : ctx.b], None, None


def copy_in(x: Tensor, tp: TensorParallel) -> Tensor:
    return _CopyIn.apply(x, tp) if torch.is_grad_enabled() and x.requires_grad else x


def sum_out(y: Tensor, tp: TensorParallel) -> Tensor:
    if torch.is_grad_enabled() and y.requires_grad:
        return _SumOut.apply(y, tp)
    dist.all_reduce(y, group=tp.group)  # a fresh output: summed in place
    return y


def gather(y: Tensor, tp: TensorParallel, size: int) -> Tensor:
    """Each rank's part of the last dimension (`span(size)` of it) -> the whole (..., size) on every rank."""
    return _Gather.apply(y, tp, size)


def summed_grads(module: nn.Module, names: list[str], tp: TensorParallel, among: list[int] | None = None) -> None:
    """Sum the gradients of `module`'s parameters `names` over the ranks as they are computed: over all of them, or
    over the ranks `among` (those holding the same part: a key/value head shared by fewer ranks than all).

    The hooks go on the parameters the module holds when it runs, so that parameters replaced after the split (a
    loader assigning this rank's weights to a model split on the meta device) are summed too."""

    def summed(grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        if among is None:
            dist.all_reduce(grad, group=tp.group)
            return grad
        parts = [torch.empty_like(grad) for _ in range(tp.world)]
        dist.all_gather(parts, grad, group=tp.group)  # every rank takes part: only `among`'s parts are summed
        return torch.stack([parts[r] for r in among]).sum(0)

    def hooked(m: nn.Module, _: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for name in names:
            p = m.get_parameter(name)
            if p.requires_grad and not getattr(p, SUMMED, False):
                p.register_hook(summed)
                setattr(p, SUMMED, True)

    module.register_forward_pre_hook(hooked)


SUMMED = "_llmkit_summed"  # a parameter's attribute: its gradient hook is registered
