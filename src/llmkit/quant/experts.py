"""MoE experts with quantized weights: GroupedExperts' computation over weights held as int8 or int4 codes.

The stacked expert weights (E, out, in) are quantized row by row, each stack as one (E * out, in) quantized matrix,
so every expert row gets its own scales exactly as a linear layer's rows do, and expert e is rows [e out, (e + 1) out)
of each stack. The forward pass runs one product per expert that received tokens, on that expert's rows only
(`QuantizedLinear.rows_product`: llmkit's AVX2 kernel on the codes, or those rows dequantized), so a step reads the
chosen experts and never dequantizes a whole stack; decoding steps on an AVX2 CPU go further and run in C++
(llmkit/quant/cpu_moe.cpp). `w1`, `w2`, `w3` read back the dequantized stacks, which torch.compile's traced paths
(GroupedExperts' grouped and gathered products) use.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.layers.moe import ACTIVATIONS, GroupedExperts
from llmkit.quant.kernels import Kernel
from llmkit.quant.linear import LAYERS, Int4Linear, QuantizedLinear


def _stack(method: str, rows: int, cols: int, group: int | None, device: torch.device | str | None) -> QuantizedLinear:
    if method == "int4":
        return Int4Linear(cols, rows, False, group or 32, kernel="dequant", device=device)
    return LAYERS[method](cols, rows, False, group, kernel="dequant", device=device)


class QuantizedExperts(GroupedExperts):
    """GroupedExperts whose w1, w3 (E, I, C) and w2 (E, C, I) are stored quantized (q1, q3, q2). `kernel`: "auto"
    lets an expert's product run llmkit's AVX2 kernel where it can (it rounds x to 8 bits per block); "dequant"
    always multiplies by the dequantized rows (exact, as QuantizedLinear's "dequant")."""

    def __init__(
        self,
        experts: GroupedExperts,
        method: str,
        group: int | None,
        device: torch.device | str | None,
        kernel: Kernel = "auto",
    ):
        nn.Module.__init__(self)  # GroupedExperts' own __init__ would allocate the float stacks
        if kernel not in ("auto", "dequant"):
            raise InputError(f"quantized experts take kernel='auto' or 'dequant', not {kernel!r}")
        self.kernel: Kernel = kernel
        self.kind, self.activation = experts.kind, experts.activation
        self.act = ACTIVATIONS[experts.activation]
        E, hidden, dim = experts.w1.shape
        self.shape = (E, hidden, dim)
        self.q1 = _stack(method, E * hidden, dim, group, device)
        self.q2 = _stack(method, E * dim, hidden, group, device)
        self.q3 = _stack(method, E * hidden, dim, group, device) if experts.w3 is not None else None

    @classmethod
    @torch.no_grad()
    def from_experts(
        cls, experts: GroupedExperts, method: str, group: int | None, kernel: Kernel = "auto"
    ) -> QuantizedExperts:
        out = cls(experts, method, group, experts.w1.device, kernel)
        for q, w in ((out.q1, experts.w1), (out.q2, experts.w2), (out.q3, experts.w3)):
            if q is not None and w is not None:
                q.load_weight(w.detach().reshape(-1, w.shape[2]))
                q.to(w.dtype)
        return out

    @classmethod
    def empty(
        cls, experts: GroupedExperts, method: str, group: int | None, device: torch.device | str | None
    ) -> QuantizedExperts:
        return cls(experts, method, group, device)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (M, C) sorted by expert, counts (E,) -> (M, C): each expert that received rows on its own rows of the
        stacks (reads the counts back to the host); under torch.compile, GroupedExperts' traced paths."""
        if torch.compiler.is_compiling():
            return super().forward(x, counts)
        return self._one_by_one(x, counts)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e on its tokens x (n, C) -> (n, C), reading only its rows of each stack."""
        _, hidden, dim = self.shape
        native = self.kernel == "auto"
        h = self.act(self.q1.rows_product(x, e * hidden, (e + 1) * hidden, native))
        if self.q3 is not None:
            h = h * self.q3.rows_product(x, e * hidden, (e + 1) * hidden, native)
        return self.q2.rows_product(h, e * dim, (e + 1) * dim, native)

    def _stacked(self, q: QuantizedLinear, out: int, inp: int) -> Tensor:
        return q.dequantize(q.compute_dtype).view(self.shape[0], out, inp)

    @property
    def w1(self) -> Tensor:  # type: ignore[override]
        _, hidden, dim = self.shape
        return self._stacked(self.q1, hidden, dim)

    @property
    def w2(self) -> Tensor:  # type: ignore[override]
        _, hidden, dim = self.shape
        return self._stacked(self.q2, dim, hidden)

    @property
    def w3(self) -> Tensor | None:  # type: ignore[override]
        _, hidden, dim = self.shape
        return self._stacked(self.q3, hidden, dim) if self.q3 is not None else None

    def extra_repr(self) -> str:
        E, hidden, dim = self.shape
        return f"n_experts={E}, dim={dim}, hidden={hidden}, kind={self.kind}, {self.q1.method}, kernel={self.kernel}"
