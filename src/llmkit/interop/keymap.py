"""Declarative weight maps between llmkit's parameter names and another format's (Hugging Face, GGUF).

A family's map is a list of `Rule`s. Each rule pairs llmkit name templates with the other format's name templates
and a named, invertible `Transform`:

    Rule("blocks.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight")               identity
    Rule("blocks.{i}.attn.wq.weight", "h.{i}.attn.c_attn.weight", ...)                           transpose + split
    Rule("blocks.{i}.ffn.experts.w1", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", Stack()) one per expert

`{i}` runs over the layers a rule applies to (all, dense-only, MoE-only, or MTP layers), `{e}` over the experts. The
same rules convert in both directions (`to_ours`, `to_theirs`), and because transforms also run on meta tensors, the
expected shape of every tensor in the other format is known before a byte is read: loading checks names and shapes
first and fails with the names of what is missing, unexpected or misshapen.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError
from llmkit.parts import Index

# ---- transforms: each maps the other format's tensors (a list) to llmkit's (a list), and back

Reading = tuple[list[tuple[str, Index]], "Transform"]  # parts of their tensors, and what makes ours of them


class Transform(abc.ABC):
    """An invertible mapping between the other format's tensors and llmkit's tensors of one rule."""

    name = "transform"

    def part(self, theirs: tuple[str, ...], index: Index, shape: tuple[int, ...], output: int = 0) -> Reading | None:
        """How to read only the part `index` of our tensor number `output` (whole: `shape`) from the other format:
        which part of which of their tensors, and the transform that makes our part of them (one tensor). None: it
        needs all of theirs (the caller reads them whole and cuts)."""
        return None

    @abc.abstractmethod
    def to_ours(self, theirs: list[Tensor]) -> list[Tensor]:
        """The other format's tensors -> llmkit's."""

    @abc.abstractmethod
    def to_theirs(self, ours: list[Tensor]) -> list[Tensor]:
        """llmkit's tensors -> the other format's."""


class Identity(Transform):
    name = "identity"

    def part(self, theirs: tuple[str, ...], index: Index, shape: tuple[int, ...], output: int = 0) -> Reading | None:
        return [(theirs[0], index)], self

    def to_ours(self, theirs: list[Tensor]) -> list[Tensor]:
        return list(theirs)

    def to_theirs(self, ours: list[Tensor]) -> list[Tensor]:
        return list(ours)


class Transpose(Transform):
    """GPT-2's Conv1D stores weights (in, out); nn.Linear wants (out, in)."""

    name = "transpose"

    def part(self, theirs: tuple[str, ...], index: Index, shape: tuple[int, ...], output: int = 0) -> Reading | None:
        return ([(theirs[0], index[::-1])], self) if len(index) == 2 else None

    def to_ours(self, theirs: list[Tensor]) -> list[Tensor]:
        return [t.t().contiguous() for t in theirs]

    def to_theirs(self, ours: list[Tensor]) -> list[Tensor]:
        return [t.t().contiguous() for t in ours]


@dataclass
class Split(Transform):
    """One tensor of theirs holds several of ours side by side along `dim` (fused q/k/v): split / concatenate.
    `then` is applied to each part (e.g. a transpose)."""

    sizes: tuple[int, ...]
    dim: int = 0
    then: Transform = field(default_factory=Identity)
    name = "split"

    def part(self, theirs: tuple[str, ...], index: Index, shape: tuple[int, ...], output: int = 0) -> Reading | None:
        start = sum(self.sizes[:output])  # our tensor `output` is [start, start + size) of the fused one
        spans = list(index)
        a, b = spans[self.dim]
        spans[self.dim] = (start + a, start + b)
        fused = list(shape)
        fused[self.dim] = sum(self.sizes)
        return self.then.part(theirs, tuple(spans), tuple(fused))

    def to_ours(self, theirs: list[Tensor]) -> list[Tensor]:
        (fused,) = self.then.to_ours(theirs)
        return [part.contiguous() for part in fused.split(list(self.sizes), dim=self.dim)]

    def to_theirs(self, ours: list[Tensor]) -> list[Tensor]:
        return self.then.to_theirs([torch.cat(ours, dim=self.dim)])


class Stack(Transform):
    """Per-expert tensors of theirs (E of them) <-> one stacked (E, ...) tensor of ours."""

    name = "stack"

    def part(self, theirs: tuple[str, ...], index: Index, shape: tuple[int, ...], output: int = 0) -> Reading | None:
        (e0, e1), rest = index[0], index[1:]  # experts [e0, e1), each cut alike
        return [(theirs[e], rest) for e in range(e0, e1)], self

    def to_ours(self, theirs: list[Tensor]) -> list[Tensor]:
        return [torch.stack(theirs)]

    def to_theirs(self, ours: list[Tensor]) -> list[Tensor]:
        return [t.contiguous() for t in ours[0].unbind(0)]


@dataclass
class Reshape(Transform):
    """The same values in another shape (Marian's final_logits_bias is (1, V); ours is (V,))."""

    theirs_shape: tuple[int, ...]
    name = "reshape"

    def to_ours(self, theirs: list[Tensor]) -> list[Tensor]:
        return [theirs[0].reshape(-1)]

    def to_theirs(self, ours: list[Tensor]) -> list[Tensor]:
        return [ours[0].reshape(self.theirs_shape)]


@dataclass
class RopeToHalf(Transform):
    """Rows of a q or k projection stored for interleaved-pair RoPE (llama.cpp, Meta's original code) <-> the half
    layout (Hugging Face): per head, rows [a0 b0 a1 b1 ...] <-> [a0 a1 ... b0 b1 ...]."""

    n_heads: int
    name = "rope-permute"

    def part(self, theirs: tuple[str, ...], index: Index, shape: tuple[int, ...], output: int = 0) -> Reading | None:
        (a, b), per_head = index[0], shape[0] // self.n_heads
        if a % per_head or b % per_head:
            return None  # the permutation runs within a head: a part must hold whole heads
        return [(theirs[0], index)], RopeToHalf((b - a) // per_head)

    def to_ours(self, theirs: list[Tensor]) -> list[Tensor]:
        w = theirs[0]
        rows = w.shape[0]
        rest = w.shape[1:]
        half = rows // self.n_heads // 2
        return [w.reshape(self.n_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()]

    def to_theirs(self, ours: list[Tensor]) -> list[Tensor]:
        w = ours[0]
        rows = w.shape[0]
        rest = w.shape[1:]
        half = rows // self.n_heads // 2
        return [w.reshape(self.n_heads, 2, half, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()]


IDENTITY = Identity()

# ---- rules


Where = str  # "global", "layers", "dense", "moe", "mtp", "encoder", "decoder"


def layer_indices(cfg: ModelConfig, where: Where) -> list[int]:
    """The layer indices a rule with scope `where` expands over."""
    if where == "layers" or where == "decoder":
        return list(range(cfg.n_layers))
    if where == "encoder":
        return list(range(cfg.encoder.n_layers if cfg.encoder else 0))
    if where == "dense":
        return [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]
    if where == "moe":
        return [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    if where == "mtp":
        return list(range(cfg.mtp_depth))
    return [-1]  # global: no {i}


@dataclass(frozen=True)
class Rule:
    """llmkit name template(s) <-> other-format name template(s), with a transform. `where` says which layers `{i}`
    runs over; `{e}` in the other format's names runs over experts; `when` gates the rule on the config; `offset`
    shifts the other format's layer index (DeepSeek stores MTP layer m as layer n_layers + m)."""

    ours: str | tuple[str, ...]
    theirs: str | tuple[str, ...]
    transform: Transform = IDENTITY
    where: Where = "global"
    when: Callable[[ModelConfig], bool] | None = None
    offset: Callable[[ModelConfig], int] | None = None


@dataclass(frozen=True)
class Concrete:
    """A rule expanded for one layer: exact names on both sides."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    transform: Transform


def as_tuple(names: str | tuple[str, ...]) -> tuple[str, ...]:
    """One name or several, as a tuple (a rule's sides, a config table's keys)."""
    return (names,) if isinstance(names, str) else names


def expand(rules: Iterable[Rule], cfg: ModelConfig) -> list[Concrete]:
    """Every rule instantiated for every layer (and expert) it applies to under `cfg`."""
    out = []
    n_experts = cfg.moe.n_experts if cfg.moe else 0
    for rule in rules:
        if rule.when is not None and not rule.when(cfg):
            continue
        shift = rule.offset(cfg) if rule.offset else 0
        for i in layer_indices(cfg, rule.where):
            ours = tuple(t.format(i=i) for t in as_tuple(rule.ours))
            theirs: list[str] = []
            for t in as_tuple(rule.theirs):
                if "{e}" in t:
                    theirs += [t.format(i=i + shift, e=e) for e in range(n_experts)]
                else:
                    theirs.append(t.format(i=i + shift))
            out.append(Concrete(ours, tuple(theirs), rule.transform))
    return out


class MappingError(LLMKitError, ValueError):
    """The other format's tensors do not fit the model the config describes (names the tensors)."""


def _shape(t: object) -> tuple[int, ...]:
    return tuple(getattr(t, "shape", ()))


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def expected_theirs(concrete: list[Concrete], ours_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shapes the other format's tensors must have, from llmkit's shapes run through each transform on the
    meta device (no memory)."""
    expected: dict[str, tuple[int, ...]] = {}
    for c in concrete:
        metas = [torch.empty(ours_shapes[n], device="meta") for n in c.ours]
        for name, t in zip(c.theirs, c.transform.to_theirs(metas), strict=True):
            expected[name] = tuple(t.shape)
    return expected


def check_against(
    concrete: list[Concrete],
    ours_shapes: Mapping[str, tuple[int, ...]],
    theirs_shapes: Mapping[str, tuple[int, ...]],
    ignored: Callable[[str], bool],
    where: str,
) -> None:
    """Raise MappingError naming missing, unexpected and misshapen tensors of the other format."""
    expected = expected_theirs(concrete, ours_shapes)
    missing = sorted(n for n in expected if n not in theirs_shapes)
    unexpected = sorted(n for n in theirs_shapes if n not in expected and not ignored(n))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    bad = [
        f"{n} has shape {list(theirs_shapes[n])} but the config implies {list(shape)}"
        for n, shape in expected.items()
        if n in theirs_shapes and tuple(theirs_shapes[n]) != tuple(shape)
    ]
    if bad:
        problems.append(
            "shape mismatch: " + "; ".join(bad[:8]) + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else "")
        )
    if problems:
        raise MappingError(f"{where} does not match its config: " + ". ".join(problems))


def convert_to_ours(
    concrete: list[Concrete],
    get: Callable[[str], Tensor],
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Yield llmkit (name, tensor) pairs, reading the other format's tensors one rule at a time (`get` may read lazily
    from disk), so that memory holds at most one rule's inputs besides the model."""
    for c in concrete:
        outs = c.transform.to_ours([get(n) for n in c.theirs])
        for name, t in zip(c.ours, outs, strict=True):
            yield name, (t.to(dtype) if dtype is not None and t.is_floating_point() else t)


def convert_to_theirs(concrete: list[Concrete], ours: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The other format's state dict from llmkit's."""
    out: dict[str, Tensor] = {}
    for c in concrete:
        for name, t in zip(c.theirs, c.transform.to_theirs([ours[n] for n in c.ours]), strict=True):
            out[name] = t
    return out
