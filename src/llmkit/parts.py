"""Parts of tensors: which slice of which whole tensor a tensor holds.

A tensor-parallel rank holds parts of the model's tensors (llmkit.parallel). Each part remembers where it lies: the
tensor's name in the whole model's state dict, and the [start, stop) of each of its dimensions there (an `Index`).
`mark_sources` names every tensor of a model before it is cut, `cut` keeps the record, and `parts_of` reads it back,
which is how a loader built on the meta device reads from a checkpoint only the slices a rank keeps
(llmkit.interop.weights) and a split checkpoint says what each of its tensors is.
"""

from __future__ import annotations

from torch import Tensor, nn

Index = tuple[tuple[int, int], ...]  # a part of a tensor: [start, stop) of each of its dimensions
SOURCE = "_llmkit_source"  # a tensor's attribute: (its name in the whole model's state dict, Index or None)


def own(t: Tensor) -> Tensor:
    """A copy with storage of its own (a view's whole storage can then be freed)."""
    return t.contiguous().clone()


def mark_sources(model: nn.Module) -> None:
    """Name every parameter and buffer of `model` (before it is cut) with its state-dict name, whole."""
    for name, t in model.state_dict(keep_vars=True).items():
        if getattr(t, SOURCE, None) is None:  # a tied weight keeps its first name
            setattr(t, SOURCE, (name, None))


def parts_of(model: nn.Module) -> dict[str, tuple[str, Index | None]]:
    """Every state-dict entry of a (cut) model: the whole tensor it came from and the part of it it holds (None:
    all of it). Tensors `mark_sources` did not see are their own source, whole."""
    return {name: getattr(t, SOURCE, None) or (name, None) for name, t in model.state_dict(keep_vars=True).items()}


def narrowed(t: Tensor, index: Index) -> Tensor:
    """The part `index` of a whole tensor `t` (a view)."""
    for dim, (a, b) in enumerate(index):
        t = t.narrow(dim, a, b - a)
    return t


def cut(t: Tensor, dim: int, a: int, b: int) -> Tensor:
    """[a, b) of dimension `dim` of `t`, as a tensor of its own that remembers which part of the whole it is."""
    part = own(t.detach().narrow(dim, a, b - a))
    if (source := getattr(t, SOURCE, None)) is not None:
        name, index = source
        spans = list(index or ((0, n) for n in t.shape))
        start = spans[dim][0]
        spans[dim] = (start + a, start + b)
        setattr(part, SOURCE, (name, tuple(spans)))
    return part


def cut_parameter(p: Tensor, dim: int, a: int, b: int) -> nn.Parameter:
    """cut() of a parameter, as a parameter (which keeps the record: nn.Parameter makes a new object)."""
    part = cut(p, dim, a, b)
    out = nn.Parameter(part, requires_grad=p.requires_grad)
    if (source := getattr(part, SOURCE, None)) is not None:
        setattr(out, SOURCE, source)
    return out
