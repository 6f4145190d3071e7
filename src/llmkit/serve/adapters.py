"""Per-request LoRA adapters: fine-tunes of one base model served together, each request choosing one by its `model`
(vLLM's, SGLang's and llama.cpp's multi-LoRA serving; Punica and S-LoRA batch them as here).

    y = W x                                    the base projection, once for every row of the step
    y[rows of a] += B_a (A_a x[rows of a])     for each adapter a in the step: a grouped low-rank product over its
                                               rows (B_a holds alpha / r), the base rows untouched

A step of few tokens (decoding) takes every token's update in two batched products instead (Punica's BGMV): each
token gathers its adapter's A and B from the step's stacks (a zero pair for the base's tokens, ranks padded with
zeros) and torch.bmm does them all at once, four kernels a projection whatever the number of adapters. A step of
many tokens (a prompt) groups them by adapter: two products an adapter, over its tokens only.

On the C++ decode step's runners (llmkit.serve.model_runner's NativeRunner, InvariantRunner) the rows the step runs
(decoding rows; with InvariantRunner, every token) keep it with their adapters: `low_rank` hands it each block's
stacks and each row's adapter, and the step adds B (A x) for each adapted row after each projection (cpu_decode.cpp's
add_low_rank), every token's update on its own.

Elsewhere the adapters are applied from outside the model, as llmkit's LoRA (llmkit.adapters.lora) is: a forward
hook on each projection some adapter of the step targets, registered around the step's forward with which adapter
each token's row chose (`Adapters.rows`) and removed after it (a model with hooks is not lowered to the C++ step). A
projection only some adapters target is unchanged for the others' rows.

At most `most` adapters are resident: asking for another loads it from its path (PEFT's adapter_config.json and
adapter_model.safetensors, which llmkit's LoRA runs save too) and unloads the least recently used one that no request
in flight uses. Each adapter's sequences start their prefix-cache digest chain from the adapter's own root (its name
and a digest of its tensors), so a cached block is only ever shared by requests of the same adapter: the same
prompt under another adapter has other keys and values.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.models.decoder import DecoderLM


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    updates: dict[str, tuple[Tensor, Tensor]]  # projection's qualified name -> A (r, I), B (O, r) times alpha / r
    root: bytes  # where its sequences' prefix-cache digest chains start


def read_adapter(model: DecoderLM, name: str, path: str) -> Adapter:
    """An adapter folder (PEFT's files) for `model`: InputError when it cannot be read or does not fit the model."""
    from llmkit.interop.peft import read_peft
    from llmkit.interop.safetensors_io import CheckpointError

    try:
        config, state = read_peft(path, model.cfg)
    except (CheckpointError, OSError, ValueError) as e:
        raise InputError(f"adapter {name!r}: {e}") from e
    r = int(config["r"])
    scale = float(config["lora_alpha"]) / (math.sqrt(r) if config.get("use_rslora") else r)
    layers = dict(model.named_modules())
    like = next(model.parameters())
    dtype = like.dtype if like.dtype.is_floating_point else torch.float32
    updates: dict[str, tuple[Tensor, Tensor]] = {}
    digest = hashlib.blake2b(name.encode(), digest_size=16)
    for key in sorted(k for k in state if k.endswith(".lora.A")):
        module = key.removesuffix(".lora.A")
        a, b = state[key], state[module + ".lora.B"]
        layer: Any = layers.get(module)
        if not module.startswith("blocks.") or layer is None:
            raise InputError(f"adapter {name!r} adapts {module}: only the blocks' projections take served adapters")
        if a.shape != (r, layer.in_features) or b.shape != (layer.out_features, r):
            raise InputError(
                f"adapter {name!r}: {module}'s update has shapes {tuple(a.shape)}, {tuple(b.shape)}; the model's "
                f"projection is {layer.in_features} -> {layer.out_features} (another base model?)"
            )
        digest.update(module.encode() + a.float().numpy().tobytes() + b.float().numpy().tobytes())
        updates[module] = (a.to(like.device, dtype), (b.float() * scale).to(like.device, dtype))
    return Adapter(name, str(path), updates, digest.digest())


GATHER_TOKENS = 64  # steps of at most this many tokens gather each token's adapter (BGMV); larger ones group them
# the projections the C++ decode step adds an adapter's update to, in its order (a dense block's)
NATIVE_TARGETS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2")


@dataclass(frozen=True)
class LowRankStep:
    """A step's adapters as the C++ decode step takes them: for each block and each of NATIVE_TARGETS, the step's
    adapters' A (k + 1, r, I) and B (k + 1, O, r) stacked (None where none of them targets it), and each token's
    adapter `which` (n,) (k: the base's)."""

    a: list[list[Tensor | None]]
    b: list[list[Tensor | None]]
    which: Tensor


@dataclass(frozen=True)
class _Step:
    which: Tensor  # (n,) each token's adapter: an index into `chosen`, len(chosen) for the base
    chosen: list[Adapter]
    gathered: bool  # few tokens: batched gathered products; else grouped by adapter over `rows`
    rows: list[Tensor]  # (grouped) each adapter's token indices


class Adapters:
    """The adapters a server knows (name -> path), the ones resident on `model` (at most `most`), and the hooks."""

    def __init__(self, model: DecoderLM, most: int, busy: Callable[[], set[str]]) -> None:
        if most < 1:
            raise InputError(f"max_adapters={most} must be >= 1")
        self.model, self.most, self.busy = model, most, busy
        self.known: dict[str, str] = {}
        self.resident: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self._layers: dict[str, nn.Module] = dict(model.named_modules())
        self._step: _Step | None = None  # the forward in progress: which token chose which adapter
        self._stacks: dict[tuple[str, tuple[str, ...]], tuple[Tensor, Tensor]] = {}  # (module, adapters) -> A, B
        # the C++ step's stacks of a mix of adapters (every block's, every target's), kept while it runs
        self._low: dict[tuple[str, ...], tuple[list[list[Tensor | None]], list[list[Tensor | None]]]] = {}
        # the projections the C++ step adds updates to
        self._native = {f"blocks.{i}.{t}" for i in range(len(model.blocks)) for t in NATIVE_TARGETS}

    def register(self, name: str, path: str) -> Adapter:
        """Know `name` as the adapter at `path` (replacing what it named), loaded now so that a bad one is refused
        at once."""
        adapter = read_adapter(self.model, name, path)
        self.known[name] = path
        self.resident.pop(name, None)
        self._forget()
        self._make_room(keep=name)
        self.resident[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        if name not in self.known:
            raise InputError(f"no adapter is named {name!r}")
        if name in self.busy():
            raise InputError(f"adapter {name!r} is in use by requests in flight; unload it when they are done")
        del self.known[name]
        self.resident.pop(name, None)
        self._forget()

    def get(self, name: str) -> Adapter:
        """The resident adapter `name`, loaded again if it was unloaded to make room (the most recently used now)."""
        if name not in self.known:
            raise InputError(f"no adapter is named {name!r}")
        adapter = self.resident.pop(name, None)
        if adapter is None:
            self._make_room(keep=name)
            adapter = read_adapter(self.model, name, self.known[name])
        self.resident[name] = adapter
        return adapter

    def _make_room(self, keep: str) -> None:
        busy = self.busy()
        while len(self.resident) >= self.most:
            idle = next((n for n in self.resident if n not in busy and n != keep), None)
            if idle is None:
                raise InputError(
                    f"all {self.most} resident adapters are in use by requests in flight; try again later "
                    "(or start the server with more --max-adapters)"
                )
            del self.resident[idle]
            self._forget()

    def _adder(self, module: str) -> Callable[[nn.Module, tuple[Any, ...], Tensor], Tensor]:
        def add(_: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
            step = self._step
            if step is None or not any(module in a.updates for a in step.chosen):
                return output
            x = args[0].reshape(-1, args[0].shape[-1])  # (n, I)
            assert x.shape[0] == step.which.numel(), f"{module}: {x.shape[0]} rows for {step.which.numel()} tokens"
            out = output.reshape(-1, output.shape[-1])  # (n, O), the projection's own new tensor: added to in place
            if step.gathered:  # few tokens: every token's update in two batched products (BGMV)
                a, b = self._stack(module, step.chosen)  # (k + 1, r, I), (k + 1, O, r); the last pair zero
                h = torch.bmm(a[step.which], x.to(a.dtype)[:, :, None])  # (n, r, 1)
                out += torch.bmm(b[step.which], h).squeeze(2).to(out.dtype)
                return output
            for adapter, rows in zip(step.chosen, step.rows, strict=True):  # many: grouped by adapter
                update = adapter.updates.get(module)
                if update is not None and rows.numel():
                    a, b = update
                    out.index_add_(0, rows, (x.index_select(0, rows).to(a.dtype) @ a.T @ b.T).to(out.dtype))
            return output

        return add

    def _forget(self) -> None:
        """Drop the stacks (an adapter came or went)."""
        self._stacks.clear()
        self._low.clear()

    def _stack(self, module: str, chosen: list[Adapter]) -> tuple[Tensor, Tensor]:
        """The step's adapters' A and B for `module`, stacked (ranks padded with zeros), and a zero pair last (for
        the base's tokens and the adapters that leave `module` alone); kept while the same adapters run."""
        key = (module, tuple(a.name for a in chosen))
        found = self._stacks.get(key)
        if found is not None:
            return found
        layer: Any = self._layers[module]
        pairs = [a.updates.get(module) for a in chosen]
        r = max(p[0].shape[0] for p in pairs if p is not None)
        like = next(p[0] for p in pairs if p is not None)
        a_stack = like.new_zeros(len(chosen) + 1, r, layer.in_features)
        b_stack = like.new_zeros(len(chosen) + 1, layer.out_features, r)
        for i, pair in enumerate(pairs):
            if pair is not None:
                a_stack[i, : pair[0].shape[0]] = pair[0]
                b_stack[i, :, : pair[1].shape[1]] = pair[1]
        if len(self._stacks) > 4096:  # (many different mixes of adapters: start again)
            self._forget()
        self._stacks[key] = (a_stack, b_stack)
        return a_stack, b_stack

    @contextmanager
    def rows(self, names: list[str | None], counts: list[int]) -> Iterator[None]:
        """Around one forward over rows of `counts` tokens each (laid out row after row, as run_rows packs them),
        whose rows chose the adapters `names` (None: the base)."""
        chosen = [self.get(n) for n in dict.fromkeys(n for n in names if n is not None)]
        if not chosen:
            yield
            return
        index = {a.name: i for i, a in enumerate(chosen)}
        # each token's adapter: its index in `chosen`, or len(chosen) (the zero pair) for the base's
        per_row = torch.tensor([index[n] if n is not None else len(chosen) for n in names], device=self.model.device)
        which = torch.repeat_interleave(per_row, torch.tensor(counts, device=self.model.device))
        gathered = which.numel() <= GATHER_TOKENS
        rows = [] if gathered else [(which == i).nonzero().squeeze(1) for i in range(len(chosen))]
        self._step = _Step(which, chosen, gathered, rows)
        # the hooks exist only around the forward: a model with forward hooks is not lowered to the C++ step, which
        # the base's rows, and other users of the model, keep
        targets = sorted({module for a in chosen for module in a.updates})
        hooks = [self._layers[m].register_forward_hook(self._adder(m)) for m in targets]
        try:
            yield
        finally:
            self._step = None
            for hook in hooks:
                hook.remove()

    def in_cpp_step(self, names: list[str | None]) -> bool:
        """Whether the C++ step adds the updates of the adapters `names` (None: the base) itself: every projection
        they adapt is one of a dense block's NATIVE_TARGETS (not a mixture of experts')."""
        return all(set(self.get(n).updates) <= self._native for n in dict.fromkeys(names) if n is not None)

    def low_rank(self, names: list[str | None], counts: list[int]) -> LowRankStep:
        """The C++ step's view of rows of `counts` tokens that chose the adapters `names` (None: the base), which
        in_cpp_step must allow."""
        chosen = [self.get(n) for n in dict.fromkeys(n for n in names if n is not None)]
        key = tuple(a.name for a in chosen)
        if key not in self._low:
            n_blocks = len(self.model.blocks)
            a_stacks: list[list[Tensor | None]] = [[None] * len(NATIVE_TARGETS) for _ in range(n_blocks)]
            b_stacks: list[list[Tensor | None]] = [[None] * len(NATIVE_TARGETS) for _ in range(n_blocks)]
            for i in range(n_blocks):
                for t, target in enumerate(NATIVE_TARGETS):
                    module = f"blocks.{i}.{target}"
                    if any(module in a.updates for a in chosen):
                        a, b = self._stack(module, chosen)
                        a_stacks[i][t], b_stacks[i][t] = a.float().contiguous(), b.float().contiguous()
            self._low[key] = a_stacks, b_stacks
        index = {name: i for i, name in enumerate(key)}
        per_row = torch.tensor([index[n] if n is not None else len(key) for n in names])
        return LowRankStep(*self._low[key], torch.repeat_interleave(per_row, torch.tensor(counts)))

    def cards(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter the server knows."""
        return [(n, p) for n, p in self.known.items()]


def parse_adapter(text: str) -> tuple[str, str]:
    """`name=PATH` (the --adapter flag) -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise InputError(f"--adapter {text!r}: give NAME=PATH (a folder with adapter_config.json)")
    if not Path(path).is_dir():
        raise InputError(f"--adapter {name}: {path} is not a folder")
    return name, path
