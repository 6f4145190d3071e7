"""Serving a model split across processes (tensor parallelism): rank 0 runs the HTTP server, the scheduler and the
sampler; every rank runs each step's forward with the same inputs, since each holds part of every layer and the
layers' collectives need them all.

    rank 0      HTTP ─► Engine.step ─► Lockstep.run(fn, *args) ─┬─► fn(its part of the model) ─► sampler
    rank 1..N-1                        follow(): wait for ──────┴─► fn(its part of the model)

What travels is a module-level function and its arguments (token ids, slots and block tables of a step: a few KB),
over a gloo group of its own whatever the model's backend (NCCL on CUDA), as vLLM sends its scheduler's output to
its workers. Every rank's cache is built from the same block count, so the block tables rank 0's scheduler writes
hold on every rank.

A failure cannot be confined to one request here: a rank whose forward raised has left the others inside a
collective. So any error in a split step ends the server (RanksLost, a clear message and a non-zero exit), and a
rank that dies ends the run: torchrun stops the others, and a collective waiting on a dead peer fails instead of
hanging (gloo notices the closed connection).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from llmkit.errors import LLMKitError
from llmkit.models.decoder import DecoderLM
from llmkit.serve.embeddings import pool_states
from llmkit.serve.forward import Forward, Row, run_rows
from llmkit.serve.paged import PagedCache

IDLE = timedelta(days=365)  # how long a follower waits for the next step: a server may sit idle for long


class RanksLost(LLMKitError):
    """A tensor-parallel step failed: the ranks no longer run the same steps, and the server must end."""


@dataclass
class Part:
    """What a follower runs steps on: its part of the model and of the cache (on rank 0: the engine's
    LockstepRunner)."""

    model: DecoderLM
    cache: PagedCache | None = None


class Lockstep:
    """Rank 0's end of the channel to the other ranks. Every rank creates it (`create` is collective)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.stopped = False  # stop() was sent, or a step failed (the others are not listening any more)

    @classmethod
    def create(cls) -> Lockstep:
        return cls(dist.new_group(backend="gloo", timeout=IDLE))

    def tell(self, fn: Any, *args: Any) -> None:
        """Have the other ranks run fn(their part, *args)."""
        dist.broadcast_object_list([(fn, args)], src=0, group=self.group)

    def run(self, fn: Any, part: Any, *args: Any) -> Any:
        """fn(part, *args) here and on every other rank; any failure is RanksLost."""
        try:
            self.tell(fn, *args)
            return fn(part, *args)
        except Exception as e:
            self.stopped = True
            raise RanksLost(
                f"a tensor-parallel step failed ({type(e).__name__}: {e}); the ranks can no longer run the same "
                "steps, so the server ends"
            ) from e

    def stop(self) -> None:
        """Let the other ranks' `follow` return (once)."""
        if not self.stopped:
            self.stopped = True
            dist.broadcast_object_list([None], src=0, group=self.group)


def follow(model: DecoderLM, lockstep: Lockstep) -> None:
    """A rank other than 0: run what rank 0 sends until it says stop. An error here ends this process."""
    part = Part(model)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=lockstep.group)
        if box[0] is None:
            return
        fn, args = box[0]
        with torch.inference_mode():
            fn(part, *args)


# ---- what rank 0 has every rank run


def make_cache(part: Any, n_blocks: int, block_size: int, dtype: torch.dtype) -> None:
    part.cache = PagedCache(part.model, n_blocks, block_size, part.model.device, dtype)


def forward_step(part: Any, block_size: int, rows: list[Row]) -> Forward:
    return run_rows(part.model, part.cache, block_size, rows)


def embed_step(part: Any, prompt: list[int]) -> Tensor:
    return pool_states(part.model, prompt)
