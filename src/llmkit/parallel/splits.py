"""How each kind of layer is split across tensor-parallel ranks, and why a split would not work. tensor.py decides
which layers to split (the plan); this file knows the layers.

    GroupedQueryAttention  by heads: wq, wk, wv keep their heads' rows, wo their columns; one all-reduce after wo
    MultiHeadLatentAttention (and sparse attention, which extends it)  by heads: wq_b (or wq) and wkv_b keep their
                           heads' rows, wo their columns; the latent projections (wq_a, wkv_a and their norms) are
                           small and stay whole on every rank, so every rank holds the whole latent cache
    MLP, SwiGLU            by hidden units: w1 (w3) rows, w2 columns; one all-reduce after w2
    MoE                    by experts (expert parallelism): rank r keeps experts [E r/N, E (r+1)/N); the router
                           stays whole, so every rank routes every token the same way and runs the assignments its
                           experts received; shared experts split by hidden units; one all-reduce sums it all
    embedding, head        by vocabulary (see `split_vocab`)

Every rank holds the same tokens, so a mixture's tokens need not travel to their experts: the all-reduce that ends
the layer is the exchange. (An all-to-all dispatch pays off when ranks hold different tokens, i.e. with data-parallel
attention, which llmkit does not do.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.layers.attention.mla import MultiHeadLatentAttention
from llmkit.layers.attention.sparse import DeepSeekSparseAttention
from llmkit.layers.mlp import MLP, SwiGLU
from llmkit.layers.moe import MoE, Routing
from llmkit.models.decoder import DecoderLM
from llmkit.parallel.collectives import TensorParallel, copy_in, gather, sum_out, summed_grads
from llmkit.parallel.shard import span, take_columns, take_embedding_rows, take_rows
from llmkit.parts import cut_parameter
from llmkit.quant.embedding import BlockEmbedding, QuantizedEmbedding
from llmkit.quant.experts import QuantizedExperts
from llmkit.quant.linear import QuantizedLinear

STYLES = ("heads", "ffn", "vocab")

# ---- why a split would not work


def problem(name: str, module: nn.Module, style: str, world: int) -> str | None:
    """Why `module` cannot be split `world` ways in `style` (None: it can)."""
    if style == "heads":
        if isinstance(module, MultiHeadLatentAttention):
            H = module.n_heads
            return f"{name} has {H} heads" if H % world else _groups(name, module.wo, H * module.dv // world)
        if not isinstance(module, GroupedQueryAttention):
            return f"{name} is {type(module).__name__}: not split by heads"
        H, K, D = module.n_heads, module.n_kv_heads, module.head_dim
        if H % world:
            return f"{name} has {H} query heads"
        if K % world and world % K:
            return f"{name} has {K} key/value heads (the ranks must divide them or be a multiple of them)"
        return _groups(name, module.wo, H * D // world)
    if style == "ffn":
        if isinstance(module, MoE):
            E = module.cfg.n_experts
            if E % world:
                return f"{name} has {E} experts"
            return _dense_problem(f"{name}.shared", module.shared, world) if module.shared is not None else None
        return _dense_problem(name, module, world)
    if style == "vocab":
        return None  # any vocabulary: the parts may differ by one row
    return f"{name}: unknown style {style!r} (one of {', '.join(STYLES)})"


def _dense_problem(name: str, ffn: nn.Module, world: int) -> str | None:
    if not isinstance(ffn, (MLP, SwiGLU)):
        return f"{name} is {type(ffn).__name__}: not split by hidden units"
    hidden = ffn.w1.out_features
    return f"{name} has {hidden} hidden units" if hidden % world else _groups(name, ffn.w2, hidden // world)


def _groups(name: str, layer: nn.Module, width: int) -> str | None:
    g = getattr(layer, "group_size", None)
    return f"{name}'s quantized groups of {g} inputs" if g is not None and width % g else None


# ---- the splits


def split(module: nn.Module, style: str, tp: TensorParallel) -> None:
    """Split one module in place (its problem() must be None)."""
    if style == "heads" and isinstance(module, MultiHeadLatentAttention):
        _latent_heads(module, tp)
    elif style == "heads":
        _heads(module, tp)  # type: ignore[arg-type]
    elif isinstance(module, MoE):
        _experts(module, tp)
    else:
        assert isinstance(module, (MLP, SwiGLU))
        _hidden(module, tp)
        module.w2.register_forward_hook(lambda _, __, y: sum_out(y, tp))


def _copied_in(module: nn.Module, tp: TensorParallel) -> None:
    module.register_forward_pre_hook(lambda _, args: (copy_in(args[0], tp), *args[1:]))


def _heads(attn: GroupedQueryAttention, tp: TensorParallel) -> None:
    H, K, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q0, q1 = tp.span(H)
    if K % tp.world == 0:
        k0, k1 = tp.span(K)
    else:  # fewer key/value heads than ranks: the one this rank's query heads read (H/K of them share it)
        k0 = q0 // (H // K)
        k1 = k0 + 1
    take_rows(attn.wq, q0 * D, q1 * D)
    take_rows(attn.wk, k0 * D, k1 * D)
    take_rows(attn.wv, k0 * D, k1 * D)
    take_columns(attn.wo, q0 * D, q1 * D, keep_bias=tp.rank == 0)
    attn.n_heads, attn.n_kv_heads = q1 - q0, k1 - k0
    _whole_summed(attn, (attn.wq, attn.wk, attn.wv, attn.wo), tp)  # q/k norms
    if K % tp.world:  # ranks holding the same key/value head each contribute their query heads' gradient
        sharing = [r for r in range(tp.world) if span(H, r, tp.world)[0] // (H // K) == k0]
        kv = [f"{layer}.{n}" for layer in ("wk", "wv") for n, _ in getattr(attn, layer).named_parameters()]
        summed_grads(attn, kv, tp, among=sharing)
    _copied_in(attn, tp)
    attn.wo.register_forward_hook(lambda _, __, y: sum_out(y, tp))


def _latent_heads(attn: MultiHeadLatentAttention, tp: TensorParallel) -> None:
    q0, q1 = tp.span(attn.n_heads)
    per_q, per_kv = attn.dn + attn.dr, attn.dn + attn.dv
    take_rows(attn.wq_b if attn.q_lora_rank is not None else attn.wq, q0 * per_q, q1 * per_q)
    take_rows(attn.wkv_b, q0 * per_kv, q1 * per_kv)
    take_columns(attn.wo, q0 * attn.dv, q1 * attn.dv, keep_bias=tp.rank == 0)
    attn.n_heads = q1 - q0
    not_summed: tuple[nn.Module, ...] = (attn.wq_b if attn.q_lora_rank is not None else attn.wq, attn.wkv_b, attn.wo)
    if isinstance(attn, DeepSeekSparseAttention):  # the indexer learns from its own loss only, refused below
        not_summed += (attn.indexer,)
        attn.register_forward_pre_hook(_no_indexer_training)
    _whole_summed(attn, not_summed, tp)  # wq_a, wkv_a and their norms
    _copied_in(attn, tp)
    attn.wo.register_forward_hook(lambda _, __, y: sum_out(y, tp))


def _whole_summed(module: nn.Module, apart: tuple[nn.Module, ...], tp: TensorParallel) -> None:
    """The parameters of `module` outside its layers `apart` (the split ones) are whole on every rank, and each
    rank's heads use them: their gradients are summed over the ranks."""
    cut = {id(p) for layer in apart for p in layer.parameters()}
    summed_grads(module, [n for n, p in module.named_parameters() if id(p) not in cut], tp)


def _no_indexer_training(attn: nn.Module, args: tuple[Any, ...]) -> None:
    extras = args[3] if len(args) > 3 else None
    if attn.training and extras is not None and extras.indexer != "off":
        raise InputError("sparse attention's indexer does not train split across ranks yet: its loss needs every "
                         "head's attention weights")  # fmt: skip


def _hidden(ffn: MLP | SwiGLU, tp: TensorParallel) -> None:
    """w1 (w3) keep this rank's hidden units, w2 their columns; the caller sums w2's outputs."""
    a, b = tp.span(ffn.w1.out_features)
    take_rows(ffn.w1, a, b)
    if isinstance(ffn, SwiGLU):
        take_rows(ffn.w3, a, b)
    take_columns(ffn.w2, a, b, keep_bias=tp.rank == 0)
    _copied_in(ffn, tp)


def _experts(moe: MoE, tp: TensorParallel) -> None:
    e0, e1 = tp.span(moe.cfg.n_experts)
    experts = moe.experts
    if isinstance(experts, QuantizedExperts):  # stacks of E * out rows: expert e is rows [e out, (e + 1) out)
        _, hidden, dim = experts.shape
        for q, out in ((experts.q1, hidden), (experts.q3, hidden), (experts.q2, dim)):
            if q is not None:
                take_rows(q, e0 * out, e1 * out)
        experts.shape = (e1 - e0, hidden, dim)
    else:
        for name in ("w1", "w2", "w3"):
            w = getattr(experts, name)
            if w is not None:
                setattr(experts, name, cut_parameter(w, 0, e0, e1))
    rows: list[tuple[int, int, int]] = []

    def local(_: nn.Module, args: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, counts = args  # (M, C) sorted by expert, (E,): this rank's experts' rows are one slice of x
        x = copy_in(x, tp)  # each rank's gradient covers its own rows: summed, it covers them all
        ends = counts.cumsum(0)
        a, b = (int(ends[e0 - 1]) if e0 else 0), int(ends[e1 - 1])
        rows.append((x.shape[0], a, b))
        return x[a:b], counts[e0:e1]

    def placed(_: nn.Module, __: Any, y: Tensor) -> Tensor:
        M, a, b = rows.pop()
        return F.pad(y, (0, 0, a, M - b))  # zeros for the rows other ranks' experts compute

    experts.register_forward_pre_hook(local)
    experts.register_forward_hook(placed)
    # the gates scale only this rank's rows: copy_in sums their gradient, so the router (whole everywhere, its
    # balance losses computed alike on every rank) gets the same, whole gradient on every rank
    moe.router.register_forward_hook(
        lambda _, __, r: dataclasses.replace(r, weights=copy_in(r.weights, tp)) if isinstance(r, Routing) else r
    )
    if moe.shared is not None:
        _hidden(moe.shared, tp)  # type: ignore[arg-type]
    if moe.shared_gate is not None:  # sigmoid(x . w) scales this rank's part of the shared experts
        moe.shared_gate.register_forward_hook(lambda _, __, g: copy_in(g, tp))
    moe.register_forward_hook(lambda _, __, y: sum_out(y, tp))


# ---- the vocabulary


class VocabParallelHead(nn.Module):
    """The output head split by vocabulary: this rank's rows of the projection (and of the bias), its logits
    gathered with the other ranks'. h (..., C) -> logits (..., V)."""

    def __init__(self, layer: nn.Module, tp: TensorParallel, vocab: int) -> None:
        super().__init__()
        self.layer, self.tp, self.vocab = layer, tp, vocab

    def forward(self, h: Tensor) -> Tensor:
        return gather(self.layer(copy_in(h, self.tp)), self.tp, self.vocab)  # (..., V_r) -> (..., V)


def split_vocab(model: DecoderLM, tp: TensorParallel) -> None:
    """Embedding and head split by vocabulary: a rank looks up the tokens in its range (zeros elsewhere) and an
    all-reduce completes every row; its logits are its tokens', gathered. A tied head keeps sharing the embedding's
    rows."""
    V = model.cfg.vocab_size
    a, b = tp.span(V)
    embed, head = model.embed, model.head
    if head is not None and not isinstance(head, (nn.Linear, QuantizedLinear)):
        raise InputError(f"the output head is {type(head).__name__}: not split by vocabulary")
    if isinstance(embed, QuantizedEmbedding):  # rows read from the (quantized) head: splitting the head splits both
        assert head is not None
        take_rows(head, a, b)
    elif isinstance(embed, (nn.Embedding, BlockEmbedding)):
        take_embedding_rows(embed, a, b)
        if head is not None:
            take_rows(head, a, b)
    else:
        raise InputError(f"the embedding is {type(embed).__name__}: not split by vocabulary")
    if head is None:  # tied: a linear layer over the embedding's own rows
        head = nn.Linear(model.cfg.d_model, b - a, bias=False, device="meta")
        head.weight = embed.weight
    if model.head_bias is not None:  # the bias's rows go with the head's
        head.bias = cut_parameter(model.head_bias, 0, a, b)
        model.head_bias = None
    model.head = VocabParallelHead(head, tp, V)

    held: list[Tensor] = []

    def local_ids(_: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        ids = args[0]
        held[:] = [(ids < a) | (ids >= b)]  # tokens of other ranks: looked up as row 0, zeroed after
        return ((ids - a).clamp(0, b - a - 1), *args[1:])

    def completed(_: nn.Module, __: Any, rows: Tensor) -> Tensor:
        return sum_out(rows.masked_fill(held.pop()[..., None], 0.0), tp)

    embed.register_forward_pre_hook(local_ids)
    embed.register_forward_hook(completed)
