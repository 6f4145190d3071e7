"""Mixture of experts: many feed-forward "experts", of which a router picks a few per token.

    x ──► router ──► scores s (E) ──► top-k experts, gate weights g
     │                                    │
     ├──► expert e1 ──► * g1 ─┐           │     y = sum_i g_i FFN_ei(x)  (+ shared experts, always on)
     └──► expert e2 ──► * g2 ─┴──► + ──►  y

Variants, all by configuration:
- Switch Transformer (Fedus et al. 2021): top-1, softmax, gate = the chosen expert's probability.
- GShard (Lepikhin et al. 2020) / Mixtral: top-2, softmax, the two gates renormalised to sum to 1.
- DeepSeek-V3: sigmoid scores; experts split into groups and only the `topk_groups` best groups (ranked by the sum of
  each group's two best scores) are eligible; a per-expert score-correction bias that changes which experts are
  chosen but not their gates (auxiliary-loss-free balancing); gates renormalised and multiplied by `routed_scale`;
  shared experts that every token uses.
- DeepSeek-V2: softmax scores, groups ranked by their single best score, gates not renormalised, routed_scale.
- Qwen2-MoE: softmax top-k plus one wide shared expert whose output is scaled per token by sigmoid(x . w_gate).
- capacity factor (Switch / GShard): each expert takes at most ceil(capacity_factor * N * k / E) assignments; first
  choices are served before second choices, then in token order; the rest are dropped (the residual path carries
  those tokens through unchanged).

Dispatch groups tokens by expert: sort the N*k assignments by expert, gather the tokens (index_select), run every
expert on its contiguous slice in one grouped matmul (`F.grouped_mm`, which takes the slice boundaries as a tensor,
so nothing is read back from the device and shapes do not depend on the routing), and scatter-add the weighted
outputs back (index_add). No Python loop over tokens. An assignment beyond an expert's capacity is computed with a
gate of zero, which keeps every shape fixed.

Shapes: N tokens (B*T flattened), C model dim, E experts, k experts per token, I expert hidden dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.config import Activation, FFNKind, MoEConfig
from llmkit.errors import check_features
from llmkit.layers.extras import Extras, MoEStats
from llmkit.layers.mlp import ACTIVATIONS, build_ffn
from llmkit.layers.precision import FP32Buffers

_GROUPED_MM = hasattr(F, "grouped_mm")  # torch >= 2.9; older versions run the experts one by one
GATHER_LIMIT = 1 << 26  # elements of expert weights a compiled step may gather per call (256 MB in fp32)


def grouped_mm_applies(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm serves this call: every dtype on the CPU (bf16 only under torch.compile, whose shape
    functions accept nothing else), bf16 on CUDA from compute capability 9.0."""
    if not _GROUPED_MM:
        return False
    if x.device.type == "cpu":
        return dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return x.device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


def traced() -> bool:
    """Whether this forward is being compiled or captured as a CUDA graph: then nothing may be read back to the host."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return torch.compiler.is_compiling() or capturing


@dataclass(frozen=True)
class Routing:
    """A router's decision for N tokens."""

    weights: Tensor  # (N, k) gate weights, in the order of `experts`
    experts: Tensor  # (N, k) long, the chosen experts
    probs: Tensor  # (N, E) fp32 scores normalised to sum to 1 per token (for the balance loss)
    logits: Tensor  # (N, E) fp32 raw router logits (for the z-loss)


def sequence_aux_loss(probs: Tensor, experts: Tensor, n_experts: int) -> Tensor:
    """DeepSeek-V2/V3 sequence-wise balance loss: per sequence, sum_i f_i P_i with f_i = E / (k T) * (assignments
    to expert i) and P_i = mean router probability of expert i; averaged over sequences. Minimised (value 1) by
    uniform routing within every sequence. probs (B, T, E), experts (B, T, k)."""
    B, T, k = experts.shape
    counts = torch.zeros(B, n_experts, device=probs.device).scatter_add_(
        1, experts.reshape(B, T * k), torch.ones(B, T * k, device=probs.device)
    )  # (B, E)
    f = counts * n_experts / (k * T)
    return (f * probs.mean(dim=1)).sum(dim=1).mean()


def switch_aux_loss(probs: Tensor, experts: Tensor, n_experts: int) -> Tensor:
    """Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4): E * sum_i f_i * P_i.

    f_i = (assignments to expert i) / N, the fraction of tokens dispatched to it (summing to k over experts for
    top-k); P_i = mean router probability of expert i. Minimised (value k) by uniform routing. probs (N, E),
    experts (N, k)."""
    N = probs.shape[0]
    f = expert_counts(experts, n_experts).float() / N  # (E,)
    return n_experts * torch.sum(f * probs.mean(dim=0))


def expert_counts(experts: Tensor, n_experts: int) -> Tensor:
    """Assignments per expert: experts (..., k) long -> (E,) long (a fixed shape, unlike bincount's)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2, which keeps router
    logits small and the softmax numerically stable. logits (N, E)."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


class Router(FP32Buffers):
    """Scores the E experts for each token and chooses k. x (N, C) -> Routing."""

    fp32_buffers = ("score_bias",)

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, dim))
        self.score_bias: Tensor | None
        if cfg.score_bias:  # DeepSeek-V3's e_score_correction_bias: updated by update_router_bias, not by SGD
            self.register_buffer("score_bias", torch.zeros(cfg.n_experts))
        else:
            self.score_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # nothing to fill (and the fill imports torch._dynamo there: tables.token_table)
            nn.init.normal_(self.weight, 0.0, self.weight.shape[1] ** -0.5)

    def forward(self, x: Tensor) -> Routing:
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # (N, E), routing in fp32
        scores = logits.softmax(dim=-1) if cfg.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.score_bias is None else scores + self.score_bias  # bias: selection only
        if cfg.n_groups > 1:  # keep only the topk_groups best groups of experts
            N = choice.shape[0]
            grouped = choice.view(N, cfg.n_groups, -1)  # (N, G, E/G)
            if cfg.group_score == "max":  # DeepSeek-V2: a group ranks by its best expert
                top = grouped.amax(dim=-1)  # (N, G)
            else:  # DeepSeek-V3: by the sum of its two best
                top = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (N, G)
            keep = torch.zeros_like(top, dtype=torch.bool).scatter(1, top.topk(cfg.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, -1)
        experts = choice.topk(cfg.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, experts)  # gates from the unbiased scores
        if cfg.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scale
        probs = scores if cfg.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return Routing(weights, experts, probs, logits)


class GroupedExperts(nn.Module):
    """E feed-forward experts stored as stacked weights w1, w3 (E, I, C) and w2 (E, C, I).

    forward(x (M, C) sorted by expert, counts (E,) assignments per expert) -> (M, C): each expert runs on its
    slice."""

    def __init__(self, n_experts: int, dim: int, hidden: int, kind: FFNKind, activation: Activation) -> None:
        super().__init__()
        self.kind, self.activation = kind, activation
        self.act = ACTIVATIONS[activation]
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3: nn.Parameter | None = nn.Parameter(torch.empty(n_experts, hidden, dim)) if kind == "swiglu" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised like nn.Linear: uniform within 1/sqrt(fan_in)."""
        for w in (self.w1, self.w2, self.w3):
            if w is not None and not w.is_meta:  # nothing to fill on the meta device (Router.reset_parameters)
                bound = w.shape[2] ** -0.5
                nn.init.uniform_(w, -bound, bound)

    def expert_elements(self) -> int:
        """Weights of one expert (w1, w2 and w3)."""
        return sum(w[0].numel() for w in (self.w1, self.w2, self.w3) if w is not None)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e on its tokens x (n, C) -> (n, C)."""
        h = self.act(F.linear(x, self.w1[e]))
        if self.w3 is not None:
            h = h * F.linear(x, self.w3[e])
        return F.linear(h, self.w2[e])

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        if not grouped_mm_applies(x, dtype):
            # a few assignments (decoding): each with its own expert's weights; many: one matmul per expert, which
            # reads the counts back to the host, so a compiled or captured step gathers while the copies stay small
            few = x.shape[0] <= self.w1.shape[0]
            if few or (traced() and x.shape[0] * self.expert_elements() <= GATHER_LIMIT):
                return self._gathered(x, counts)
            return self._one_by_one(x, counts)
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) where each expert's slice ends
        x = x.to(dtype)

        def matmul(inp: Tensor, w: Tensor) -> Tensor:  # (M, in) @ per-expert (E, out, in)^T -> (M, out)
            return F.grouped_mm(inp, w.to(dtype).transpose(1, 2), offs=offsets)

        h = self.act(matmul(x, self.w1))
        if self.w3 is not None:
            h = h * matmul(x, self.w3)
        return matmul(h, self.w2)

    def _gathered(self, x: Tensor, counts: Tensor) -> Tensor:
        """Each of the M rows times its own expert's weights (gathered: M matrices read), no host read-back."""
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])

        def matmul(inp: Tensor, w: Tensor) -> Tensor:  # (M, in), per-row (M, out, in) -> (M, out)
            return torch.bmm(w[expert], inp.unsqueeze(-1)).squeeze(-1)

        h = self.act(matmul(x, self.w1))
        if self.w3 is not None:
            h = h * matmul(x, self.w3)
        return matmul(h, self.w2)

    def _one_by_one(self, x: Tensor, counts: Tensor) -> Tensor:
        """One matmul per expert that received tokens (reads the counts back to the host)."""
        outputs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                outputs.append(self.expert(e, x[start : start + n]))
            start += n
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])

    def extra_repr(self) -> str:
        E, I, C = self.w1.shape
        return f"n_experts={E}, dim={C}, hidden={I}, kind={self.kind}, activation={self.activation}"


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer. x (B, T, C) or (N, C) -> same shape.

    With an `extras`, appends the layer's MoEStats (balance and z losses, assignments per expert); `layer` is the
    index it reports them under."""

    def __init__(self, dim: int, cfg: MoEConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(cfg.n_experts, dim, cfg.expert_hidden_dim, cfg.expert_kind, cfg.activation)
        self.shared: nn.Module | None = (
            build_ffn(cfg.expert_kind, dim, cfg.expert_hidden_dim * cfg.n_shared_experts, cfg.activation, False)
            if cfg.n_shared_experts
            else None
        )
        # Qwen2-MoE: the shared experts' output scaled per token by sigmoid(x . w), w (1, C)
        self.shared_gate = nn.Linear(dim, 1, bias=False) if cfg.shared_gate else None

    def capacity(self, n_tokens: int) -> int | None:
        """Assignments each expert may take, or None without a capacity factor."""
        f = self.cfg.capacity_factor
        return None if f is None else math.ceil(f * n_tokens * self.cfg.top_k / self.cfg.n_experts)

    def forward(self, x: Tensor, extras: Extras | None = None) -> Tensor:
        check_features(x, self.router.weight.shape[1], "MoE", ndim=None)
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # (N, C)
        N, E, k = xf.shape[0], self.cfg.n_experts, self.cfg.top_k
        routing = self.router(xf)
        # the N*k assignments, rank-major: all first choices, then all second choices, ...
        flat_expert = routing.experts.t().reshape(-1)  # (k*N,)
        flat_token = torch.arange(N, device=x.device).repeat(k)  # (k*N,)
        order = torch.argsort(flat_expert, stable=True)  # expert-major; first choices before second, then token
        counts = expert_counts(flat_expert, E)  # (E,)
        gates = routing.weights.t().reshape(-1)[order]  # (k*N,) in expert order
        kept = counts
        capacity = self.capacity(N)
        if capacity is not None:  # each expert serves its first `capacity` assignments in that order
            position = torch.arange(order.numel(), device=x.device) - (counts.cumsum(0) - counts)[flat_expert[order]]
            gates = gates * (position < capacity)
            kept = counts.clamp(max=capacity)
        tokens = flat_token[order]
        y_sorted = self.experts(xf.index_select(0, tokens), counts)  # (k*N, C) grouped by expert
        y_sorted = y_sorted * gates.unsqueeze(-1).to(y_sorted.dtype)
        y = torch.zeros_like(xf).index_add_(0, tokens, y_sorted.to(xf.dtype))  # scatter-add back to the tokens
        if self.shared is not None:
            shared = self.shared(xf)  # (N, C)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(xf)) * shared
            y = y + shared
        if extras is not None:
            extras.moe.append(self.stats(routing, counts, kept, shape[0] if len(shape) == 3 else 1))
        return y.view(shape)

    def stats(self, routing: Routing, counts: Tensor, kept: Tensor, batch: int) -> MoEStats:
        """What this call measured: the balance loss of the configured kind, the z-loss, and the load."""
        E, k = self.cfg.n_experts, self.cfg.top_k
        if self.cfg.aux_loss_kind == "sequence":
            probs, experts = routing.probs.view(batch, -1, E), routing.experts.view(batch, -1, k)
            aux = sequence_aux_loss(probs, experts, E)
        else:
            aux = switch_aux_loss(routing.probs, routing.experts, E)
        assigned = routing.experts.numel()
        return MoEStats(
            layer=self.layer,
            aux_loss=aux,
            z_loss=router_z_loss(routing.logits),
            counts=counts.detach().float(),
            dropped=1.0 - kept.sum().float() / max(assigned, 1),
        )


@torch.no_grad()
def update_router_bias(model: nn.Module, load: dict[int, Tensor], rate: float = 1e-3) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2), called by the trainer after each optimizer step.

    For every MoE layer with a score bias: b_i += rate * sign(mean load - load_i), with `load` the assignments per
    expert each layer received since the last update (layer index -> (E,), e.g. `Extras.expert_load()`);
    overloaded experts become less likely to be chosen, underloaded ones more. Gates are unchanged."""
    for module in model.modules():
        if isinstance(module, MoE) and module.router.score_bias is not None and module.layer in load:
            layer_load = load[module.layer].to(module.router.score_bias)
            if layer_load.sum() > 0:
                module.router.score_bias += rate * torch.sign(layer_load.mean() - layer_load)
