"""How the model is spread over the processes of a run, a strategy the loop is given (it never names one):

- Replicated: train.parallel none, ddp or fsdp: every process computes with the whole model (DDP: a copy each,
  gradients all-reduced once per step, on its last micro-step; FSDP: each block's weights sharded and gathered for
  its turn). The state saved and restored is the whole model's, unsharded (parallel.full_state).
- SplitLayers: fsdp+tp: each process holds its part of every layer (tensor_parallel.py), sharded across its
  data-parallel group. The gradient norm is the whole model's, from the parts; a checkpoint holds the whole model,
  assembled in process 0, and a resume cuts each process's parts out of it again.

What each does: wrap the module the loop calls, give a micro-step's gradient-sync context, clip the gradients,
give the whole state to save, load a whole state back.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from llmkit.train.control import checkpoint_keys, wrapper_keys
from llmkit.train.optim import Optimizer
from llmkit.train.parallel import Runtime, full_state, load_full_state, wrap
from llmkit.train.tensor_parallel import Split, clip_grad_norm, local_state, named_parameters, whole_state


class Replicated:
    """none, DDP or FSDP (train.parallel): the whole model in every process's computation."""

    def __init__(self, parallel: str, rt: Runtime) -> None:
        self.parallel, self.rt = parallel, rt
        self.wrapped: nn.Module | None = None

    def wrap(self, runner: nn.Module) -> nn.Module:
        """The module the loop calls."""
        self.wrapped = wrap(runner, self.parallel, self.rt, find_unused=False)
        return self.wrapped

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """A micro-step's context: DDP reduces the gradients once, on the step's last micro-step."""
        no_sync = getattr(self.wrapped, "no_sync", None)
        return no_sync() if no_sync is not None and not last else contextlib.nullcontext()

    def clip(self, model: nn.Module, max_norm: float) -> float:
        """Clip the gradients to `max_norm` (0: no clipping); the norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def state(self, runner: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The whole model's state (keyed by the model's names) and the optimizer's, as a checkpoint holds them
        (every process must call this; process 0's is complete)."""
        model_state, optim_state = full_state(runner, optimizer)
        return {k.removeprefix("model."): v for k, v in model_state.items()}, checkpoint_keys(optim_state)

    def load(self, runner: nn.Module, optimizer: Optimizer, state: dict[str, Any], optim: dict[str, Any]) -> None:
        """A checkpoint's whole state into this process's model and optimizer."""
        model_state = {"model." + k: v.to(self.rt.device) for k, v in state.items()}
        load_full_state(runner, optimizer, model_state, wrapper_keys(optim))


class SplitLayers(Replicated):
    """fsdp+tp: each process's part of every layer (`split`), sharded across its data-parallel group."""

    def __init__(self, rt: Runtime, split: Split, model: nn.Module) -> None:
        super().__init__("fsdp", rt)
        self.split, self.model = split, model

    def clip(self, model: nn.Module, max_norm: float) -> float:
        """The whole model's norm, from the parts."""
        return clip_grad_norm(model, self.split, self.rt.group, max_norm if max_norm > 0 else float("inf"))

    def state(self, runner: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The whole model's state, assembled in process 0 from every process's parts."""
        model_state, optim_state = full_state(runner, optimizer, every_process=True)
        state = {k.removeprefix("model."): v for k, v in model_state.items()}
        return whole_state(state, checkpoint_keys(optim_state), self.split)

    def load(self, runner: nn.Module, optimizer: Optimizer, state: dict[str, Any], optim: dict[str, Any]) -> None:
        """This process's parts cut out of the whole state, then loaded."""
        name_of = {id(p): n for n, p in named_parameters(self.model)}
        names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        super().load(runner, optimizer, *local_state(state, optim, self.split, names))
