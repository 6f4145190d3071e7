"""Everything applied to a model from outside it: device, distributed data parallelism (DDP) or fully sharded data
parallelism (FSDP2), activation checkpointing, torch.compile. The model code itself has no parallel code.

Distributed runs start with torchrun, which sets RANK / WORLD_SIZE / MASTER_ADDR for every process:

    torchrun --nproc_per_node 2 -m llmkit train run.yaml --parallel ddp            one machine, 2 processes
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 \\
             --nproc_per_node 8 -m llmkit train run.yaml --parallel fsdp             the first of two machines

    torchrun --nproc_per_node 4 -m llmkit train run.yaml --parallel fsdp+tp --tp 2
             a 2-D mesh: the model split across 2 processes (tensor parallelism, llmkit.parallel), FSDP across
             the 2 such groups; data is split by FSDP's ranks (the processes of one split share each batch)

The backend is gloo on CPU and NCCL on CUDA. Checkpoints hold full (unsharded, unsplit) state, written by process 0,
so a run saved under FSDP, or split, resumes in one process or another layout, and the other way round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmkit.errors import ConfigError, InputError
from llmkit.layers.block import CrossAttentionBlock, TransformerBlock
from llmkit.machine.devices import check_device
from llmkit.parallel.collectives import TensorParallel
from llmkit.train.optim import Optimizer, parts


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank among `world` data-parallel processes (what the data and the sums of
    losses and token counts are split over) and its device. With tensor parallelism, `tp` is this process's place
    in the model's split and `group` the data-parallel group it sums with (None: every process)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    tp: TensorParallel | None = None
    group: Any = None
    mesh: Any = None  # the 2-D device mesh ("dp", "tp") of fsdp+tp

    @property
    def main(self) -> bool:
        return self.rank == 0 and (self.tp is None or self.tp.rank == 0)

    @property
    def distributed(self) -> bool:
        return self.world * (self.tp.world if self.tp is not None else 1) > 1


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return check_device(spec, "train.device")
    except InputError as e:
        raise ConfigError(str(e)) from None


def setup(parallel: str, device_spec: str, tp: int = 1) -> Runtime:
    """Start the process group when run under torchrun with --parallel ddp|fsdp|fsdp+tp."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel == "none":
        if world > 1:
            raise ConfigError(f"started with {world} processes but train.parallel='none'; pass --parallel ddp|fsdp")
        return Runtime(0, 1, 0, pick_device(device_spec))
    if "RANK" not in os.environ:
        raise ConfigError(f"--parallel {parallel} needs the process-group environment: start with torchrun")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_spec)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if parallel != "fsdp+tp":
        return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device)
    world = dist.get_world_size()
    if world % tp:
        raise ConfigError(f"--tp {tp} does not divide the {world} processes torchrun started")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    split = TensorParallel.of(mesh["tp"])
    return Runtime(mesh["dp"].get_local_rank(), world // tp, local_rank, device, split, mesh["dp"].get_group(), mesh)


def teardown(rt: Runtime, finished: bool = False) -> None:
    """End the process group. After a run that `finished` on every rank, first wait for all of them: a rank that
    destroys its group while another still talks to it can make that one abort (gloo; seen as a rare SIGABRT,
    "terminate called without an active exception", in the two-process tests). After a failure, no barrier: the
    others may never come (torchrun ends them)."""
    if rt.distributed and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def blocks_of(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every Transformer block of a model as (parent module, attribute name, block), outermost first."""
    found: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, (TransformerBlock, CrossAttentionBlock)):
                found.append((parent, name, child))
    return found


def _require_blocks(model: nn.Module, setting: str) -> list[tuple[nn.Module, str, nn.Module]]:
    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError(f"{setting} applies to Transformer blocks, and this model has none")
    return blocks


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of storing them: memory for compute. Each
    block is replaced by a checkpointing wrapper around it (torch.distributed's checkpoint_wrapper, as torchtitan
    does); state-dict keys keep their names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for parent, name, block in _require_blocks(model, "train.activation_checkpointing"):
        parent.register_module(name, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each block (the repeated unit), as torchtitan does: compile time stays small and the model keeps
    its eager structure and names."""
    for _, _, block in _require_blocks(model, "train.compile"):
        block.compile()


def wrap(model: nn.Module, parallel: str, rt: Runtime, find_unused: bool = False) -> nn.Module:
    """The module the training loop calls: DDP around the model, or FSDP2 sharding of each block and the root."""
    if not rt.distributed or parallel == "none":
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [rt.device.index] if rt.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused)
    from torch.distributed.fsdp import fully_shard

    dp = rt.mesh["dp"] if rt.mesh is not None else None  # fsdp+tp: each process's part sharded across its group
    for _, _, block in blocks_of(model):
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def full_state(
    model: nn.Module, optimizer: Optimizer | None, every_process: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Unsharded model and optimizer state (on CPU), keyed by parameter names, whatever the wrapping. Every process
    must call this under FSDP; only process 0 needs the result, unless `every_process` (a split model: each process
    holds its own parts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not every_process)  # offloaded: process 0 only
    inner = _unwrapped(model)
    model_state = get_model_state_dict(inner, options=opts)
    optim_state = get_optimizer_state_dict(inner, parts(optimizer), options=opts) if optimizer is not None else {}
    return model_state, optim_state


def load_full_state(
    model: nn.Module, optimizer: Optimizer | None, model_state: dict[str, Any], optim_state: dict[str, Any]
) -> None:
    """Load unsharded state into a (possibly sharded) model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    inner = _unwrapped(model)
    set_model_state_dict(inner, model_state, options=opts)
    if optimizer is not None and optim_state:
        set_optimizer_state_dict(inner, parts(optimizer), optim_state, options=opts)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside DDP (FSDP2 shards in place, so there is nothing to unwrap)."""
    inner = getattr(model, "module", model)
    assert isinstance(inner, nn.Module)
    return inner


def all_reduce_sum(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """`t` summed over the data-parallel processes (those of one tensor-parallel split hold the same values)."""
    if rt.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=rt.group)
    return t


def agree(flag: bool, rt: Runtime) -> bool:
    """Whether any process raised `flag`: all processes stop at the same step if any of them wants to."""
    if not rt.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
