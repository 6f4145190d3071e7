"""The processes of a tensor-parallel command: `torchrun --nproc_per_node N -m llmkit generate CHECKPOINT --tp N`
starts N copies of the command; each joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR in
its environment; gloo on CPU, NCCL on CUDA, one GPU a process), loads the model, keeps its part of it
(tensor.parallelize) and runs the same steps. Rank 0 alone prints; the others' standard output goes nowhere.

Every rank must sample the same tokens: they compute the same logits, and they share one seed (rank 0's, sent to
the others when none is given). A rank that fails ends the run: torchrun stops the others, and a collective waiting
on a rank that is gone gives up after `TIMEOUT` instead of hanging.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llmkit.errors import InputError
from llmkit.machine.devices import check_device

TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a tensor-parallel run."""

    rank: int
    world: int
    device: torch.device

    def shared_seed(self, seed: int | None) -> int:
        """`seed`, or when None one drawn by rank 0, the same on every rank."""
        box = [seed if seed is not None else random.randrange(2**31)]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])


def start(tp: int, device: str | None) -> Ranks | None:
    """Join torchrun's process group for `--tp tp` (None when tp is 1 and this is the only process); checks the
    launch first, so that a mistake is one clear error before any model loads."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1:
        raise InputError(f"--tp must be at least 1, got {tp}")
    if tp == 1:
        if world > 1:
            raise InputError(f"started as {world} processes (torchrun) but --tp is 1: pass --tp {world}")
        return None
    if "RANK" not in os.environ:
        raise InputError(
            f"--tp {tp} runs as {tp} processes: start it with torchrun --nproc_per_node {tp} -m llmkit ... --tp {tp}"
        )
    if world != tp:
        raise InputError(f"--tp {tp} but torchrun started {world} processes: the two must be equal")
    where = check_device(device) if device is not None else torch.device("cpu")
    if where.type == "cuda":
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    return Ranks(rank, dist.get_world_size(), where)


def end(ranks: Ranks | None, finished: bool) -> None:
    """Leave the process group; after a run that finished everywhere, first wait for every rank (one that leaves
    while another still talks to it can abort that one, see train/parallel.teardown)."""
    if ranks is None or not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()
