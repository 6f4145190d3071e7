"""Training a model split across processes (`--parallel fsdp+tp --tp N`): tensor parallelism (llmkit.parallel)
inside each group of N processes, FSDP2 across the groups, on a 2-D device mesh ("dp", "tp"), as torchtitan
composes them.

    split_for_training   the model split in place before FSDP wraps it; what each process holds of each whole
                         tensor is recorded (llmkit.parts), and which parts several processes hold alike
    clip_grad_norm       the gradient norm of the whole model: the squares of split gradients summed over the
                         split (a part held by several processes counted once), whole ones counted once
    whole_state          the checkpoint's state: every process's parts put back together under the whole model's
                         names, model and optimizer alike, so that one process, or any other layout, resumes it
    local_state          the inverse: this process's parts of a whole checkpoint

FSDP2 shards each process's part (plain tensors, not DTensors: the split is llmkit's own, see parallel/tensor.py)
across the data-parallel group; gradients of parameters held whole but used in part are summed over the split by
hooks on the parameters FSDP hands to the forward (parallel/collectives.summed_grads).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmkit.errors import ConfigError
from llmkit.models.decoder import DecoderLM
from llmkit.parallel.collectives import TensorParallel
from llmkit.parallel.tensor import split_model
from llmkit.parts import Index, mark_sources, narrowed, parts_of

Part = tuple[str, Index | None]  # (the whole tensor's name, this part of it; None: all of it)


@dataclass
class Split:
    """What this process holds of the whole model, and what every process of its split holds."""

    tp: TensorParallel
    parts: dict[str, Part]  # this process's state names -> the part each is
    every: list[dict[str, Part]]  # the same, for every process of the split (rank order)
    holders: dict[str, int]  # this process's state names -> how many processes of the split hold the same part


def split_for_training(model: nn.Module, tp: TensorParallel) -> Split:
    """Split `model` (the same whole model in every process: built from one seed) in place across `tp`'s ranks."""
    if not isinstance(model, DecoderLM):
        raise ConfigError(f"train.parallel='fsdp+tp' splits decoder-only models, not {type(model).__name__}")
    mark_sources(model)
    split_model(model, tp)
    parts = parts_of(model)
    every: list[dict[str, Part]] = [{} for _ in range(tp.world)]
    dist.all_gather_object(every, parts, group=tp.group)
    count = Counter(key for ranks in every for key in set(ranks.values()))
    return Split(tp, parts, every, {name: count[key] for name, key in parts.items()})


@torch.no_grad()
def clip_grad_norm(model: nn.Module, split: Split, group: Any, max_norm: float) -> float:
    """Scale the gradients so that the whole model's gradient norm is at most `max_norm` (inf: only measure);
    returns the norm before scaling, the same in every process. `group`: the data-parallel group over which FSDP
    shards each gradient (None: none)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")  # NCCL reduces tensors on the GPU
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # squares of [split gradients / holders, whole ones]
    for name, p in named_parameters(model):
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP: this process's shard
        square = g.detach().double().pow(2).sum()
        if split.parts[name][1] is None:
            sums[1] += square  # the same in every process of the split: counted once
        else:
            sums[0] += square / split.holders[name]
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    split_part = sums[:1].clone()
    dist.all_reduce(split_part, group=split.tp.group)
    norm = math.sqrt(float(split_part[0] + sums[1]))
    coefficient = min(1.0, max_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_ computes it
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return norm


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters under their state-dict names (activation checkpointing's wrapper, which adds a
    `_checkpoint_wrapped_module.` to each name inside a block, left out, as its state dict leaves it out)."""
    return [(name.replace(WRAPPED, ""), p) for name, p in model.named_parameters()]


WRAPPED = "_checkpoint_wrapped_module."


def whole_state(
    model_state: dict[str, Tensor], optim_state: dict[str, Any], split: Split
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The whole model's state and its optimizer's from every process's parts (each process's full, unsharded
    state under its own names): every process of the split takes part; process 0 of the split gets the result."""
    model = _assembled(model_state, split, lambda state, name: state.get(name))
    optim: dict[str, Any] = {"state": {}, "param_groups": []}
    state = optim_state.get("state", {})
    seen: list[set[str]] = [set() for _ in range(split.tp.world)]
    dist.all_gather_object(seen, {f for s in state.values() for f in s}, group=split.tp.group)
    fields = sorted(set().union(*seen))  # AdamW's step, exp_avg, exp_avg_sq
    for field in fields:
        for source, t in _assembled(state, split, lambda s, name, f=field: (s.get(name) or {}).get(f)).items():
            optim["state"].setdefault(source, {})[field] = t
    for group in optim_state.get("param_groups", []):  # process 0 holds every kind of parameter
        names = list(dict.fromkeys(split.parts[n][0] for n in group["params"]))
        optim["param_groups"].append({**group, "params": names})
    return model, optim


def _assembled(state: dict[str, Any], split: Split, get: Any) -> dict[str, Tensor]:
    """Each whole tensor from its parts, in process 0 of the split (the others get {}): `get(state, local name)`
    gives this process's part (None: not a tensor of this kind). What each process holds (shapes, dtypes) is
    exchanged first; then a whole tensor process 0 holds stays where it is, and parts travel as flat buffers padded
    to the largest (all_gather needs one size)."""
    mine = {name: t for name in split.parts if isinstance(t := get(state, name), Tensor)}
    meta = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in mine.items()}
    every: list[dict[str, Any]] = [{} for _ in range(split.tp.world)]
    dist.all_gather_object(every, meta, group=split.tp.group)
    holders: dict[str, list[tuple[int, str, Index | None]]] = {}  # whole name -> (process, its name, its part)
    for r, ranks in enumerate(split.every):
        for name, (source, index) in ranks.items():
            if name in every[r]:
                holders.setdefault(source, []).append((r, name, _index(index, every[r][name][0])))
    device = next((t.device for t in mine.values() if t.dim()), torch.device("cpu"))  # NCCL gathers on the GPU
    out: dict[str, Tensor] = {}
    for source, held in holders.items():  # the same order in every process
        whole_at_0 = next((name for r, name, index in held if r == 0 and index is None), None)
        if whole_at_0 is not None:  # process 0 holds it whole
            if split.tp.rank == 0:
                out[source] = mine[whole_at_0]
            continue
        pieces_of: list[tuple[int, str, Index]] = [
            (r, name, index if index is not None else tuple((0, n) for n in every[r][name][0]))
            for r, name, index in held
        ]
        r0, name0, index0 = pieces_of[0]
        dtype = getattr(torch, every[r0][name0][1])
        width = max(math.prod(b - a for a, b in index) for _, _, index in pieces_of)
        flat = torch.zeros(width, dtype=dtype, device=device)
        own = next((n for r, n, _ in pieces_of if r == split.tp.rank), None)
        if own is not None:
            flat[: mine[own].numel()] = mine[own].reshape(-1)
        pieces = [torch.empty_like(flat) for _ in range(split.tp.world)]
        dist.all_gather(pieces, flat, group=split.tp.group)
        if split.tp.rank == 0:
            shape = [max(index[d][1] for _, _, index in pieces_of) for d in range(len(index0))]
            whole = torch.empty(shape, dtype=dtype, device=device)
            for r, _, index in pieces_of:
                sizes = [b - a for a, b in index]
                narrowed(whole, index).copy_(pieces[r][: math.prod(sizes)].view(sizes))
            out[source] = whole
    return out


def _index(index: Index | None, shape: tuple[int, ...]) -> Index | None:
    """A parameter's part, for a tensor of `shape` that goes with it: the same part where the tensor is shaped like
    it (an optimizer's moments), None (whole) where it is not (AdamW's step count)."""
    return index if index is not None and shape == tuple(b - a for a, b in index) else None


def local_state(
    model_state: dict[str, Tensor], optim_state: dict[str, Any], split: Split, optimizer_groups: list[list[str]]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This process's parts of a whole checkpoint (model and optimizer, the whole model's names) under its own
    names; `optimizer_groups`: the names of the parameters in each of this process's optimizer groups."""
    model = {name: _part(model_state[source], index) for name, (source, index) in split.parts.items()}
    state = optim_state.get("state", {})
    optim_local: dict[str, Any] = {"state": {}, "param_groups": []}
    for names in optimizer_groups:
        for name in names:
            source, index = split.parts[name]
            if source in state:
                optim_local["state"][name] = {
                    k: _part(v, index) if isinstance(v, Tensor) and v.dim() else v for k, v in state[source].items()
                }
    for group, names in zip(optim_state.get("param_groups", []), optimizer_groups, strict=True):
        optim_local["param_groups"].append({**group, "params": list(names)})
    return model, optim_local


def _part(t: Tensor, index: Index | None) -> Tensor:
    return t if index is None else narrowed(t, index).clone()
