"""What each rank of a tensor-parallel split holds and sends, measured on the split model itself: the model is built
on the meta device (no memory) and split for every rank as `parallelize` splits it, and its parameters and caches
are counted. What `llmkit inspect MODEL --tp N` reports.

    weights / rank          the parameters (and quantized buffers) the rank keeps: its heads, hidden units,
                            experts and vocabulary rows, plus what every rank holds whole (norms, routers, latent
                            projections, a key/value head shared by several ranks)
    KV cache / token        the rank's own key/value heads; latent attention's one latent a token, whole
    activations / token     the residual stream plus the widest layer's outputs on the rank (inference)
    all-reduce / token      one sum of (C,) after every split attention and feed-forward and after the embedding:
                            (2 L + 1) C elements; a ring all-reduce sends 2 (N - 1) / N of that from each rank
    gather / token          the logits of a sampled token, V elements (each rank contributes V / N)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from llmkit.analysis import DTYPE_BYTES, human
from llmkit.config import ModelConfig
from llmkit.layers.attention.base import SelfAttention
from llmkit.layers.moe import MoE
from llmkit.models import build_model
from llmkit.models.decoder import DecoderLM
from llmkit.parallel.collectives import TensorParallel
from llmkit.parallel.tensor import check, split_model


@dataclass(frozen=True)
class RankCosts:
    """Per-rank sizes of a model split `tp` ways (bytes in `dtype`; the lists are by rank)."""

    tp: int
    dtype: str
    weight_bytes: list[int]
    weight_bytes_whole: int
    mtp_weight_bytes: list[int]  # the multi-token-prediction module's own, apart as in `llmkit inspect`
    kv_cache_bytes_per_token: list[int]
    kv_cache_bytes_per_token_whole: int
    activation_bytes_per_token: int
    all_reduces_per_token: int
    all_reduce_bytes_per_token: int
    ring_bytes_sent_per_token: float
    gather_bytes_per_token: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _elements(model: nn.Module, mtp: bool = False) -> int:
    """Elements of the distinct parameters and buffers (a tied head counted once): the main model's, or with `mtp`
    its multi-token-prediction module's too."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    seen = {id(t): t.numel() for n, t in tensors if mtp or not n.startswith("mtp.")}
    return sum(seen.values())


def _main(model: nn.Module, kind: type) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kind) and not n.startswith("mtp.")]


def _widest(model: DecoderLM, tp: int) -> int:
    """The widest layer's outputs per token (elements) on one rank of a split model."""
    widths = []
    for _, attn in _main(model, SelfAttention):
        widths.append(sum(m.out_features for m in attn.children() if isinstance(m, nn.Linear)))
    for name, module in model.named_modules():
        if name.startswith("mtp.") or not name.endswith(".ffn"):
            continue
        if isinstance(module, MoE):  # top_k assignments a token, 1/N of them on each rank on average
            hidden = module.cfg.expert_hidden_dim * (2 if module.cfg.expert_kind == "swiglu" else 1)
            shared = _width(module.shared) if module.shared is not None else 0
            widths.append(module.cfg.top_k * hidden // tp + shared)
        else:
            widths.append(_width(module))
    V = model.cfg.vocab_size
    widths.append(-(-V // tp) + V)  # this rank's logits and the gathered ones
    return model.cfg.d_model + max(widths)


def _width(ffn: nn.Module) -> int:
    """A dense feed-forward's hidden outputs per token: w1's (and w3's)."""
    return sum(m.out_features for name, m in ffn.named_children() if isinstance(m, nn.Linear) and name != "w2")


def rank_costs(cfg: ModelConfig, tp: int, dtype: str = "bf16") -> RankCosts:
    """Split `cfg`'s model `tp` ways on the meta device, once per rank, and count what each rank holds."""
    nbytes = DTYPE_BYTES[dtype]
    whole = build_model(cfg, device="meta")
    check(whole, tp)  # the sizes that would, before any work
    assert isinstance(whole, DecoderLM)
    whole_kv = sum(m.cache_elements_per_token() for _, m in _main(whole, SelfAttention))
    weights, mtp, kv, widest = [], [], [], 0
    for rank in range(tp):
        model = split_model(build_model(cfg, device="meta"), TensorParallel(rank, tp))  # type: ignore[arg-type]
        weights.append(_elements(model) * nbytes)
        mtp.append((_elements(model, mtp=True) - _elements(model)) * nbytes)
        kv.append(sum(m.cache_elements_per_token() for _, m in _main(model, SelfAttention)) * nbytes)
        widest = max(widest, _widest(model, tp))
    sums = len(_main(whole, SelfAttention)) + sum(
        1 for n, _ in whole.named_modules() if n.endswith(".ffn") and not n.startswith("mtp.")
    )
    sums += 1  # the embedding's rows
    payload = sums * cfg.d_model * nbytes
    return RankCosts(
        tp=tp,
        dtype=dtype,
        weight_bytes=weights,
        weight_bytes_whole=_elements(whole) * nbytes,
        mtp_weight_bytes=mtp,
        kv_cache_bytes_per_token=kv,
        kv_cache_bytes_per_token_whole=whole_kv * nbytes,
        activation_bytes_per_token=widest * nbytes,
        all_reduces_per_token=sums,
        all_reduce_bytes_per_token=payload,
        ring_bytes_sent_per_token=payload * 2 * (tp - 1) / tp,
        gather_bytes_per_token=cfg.vocab_size * nbytes,
    )


def format_costs(c: RankCosts, seq_len: int) -> str:
    """The per-rank lines `llmkit inspect --tp` prints under the model's report."""
    heaviest = max(c.weight_bytes)
    kv = max(c.kv_cache_bytes_per_token)
    rows = [
        ("weights / rank", f"{human(heaviest, 'B')} ({100 * heaviest / max(c.weight_bytes_whole, 1):.1f}% of "
                           f"{human(c.weight_bytes_whole, 'B')}; lightest rank {human(min(c.weight_bytes), 'B')})"),
        ("KV cache / token / rank", f"{human(kv, 'B')} (whole model {human(c.kv_cache_bytes_per_token_whole, 'B')})"),
        ("KV cache @ context / rank", human(kv * seq_len, "B")),
        ("activations / token / rank", human(c.activation_bytes_per_token, "B")),
        ("all-reduce / token", f"{c.all_reduces_per_token} sums, {human(c.all_reduce_bytes_per_token, 'B')} "
                               f"(ring: {human(c.ring_bytes_sent_per_token, 'B')} sent by each rank)"),
        ("logits gathered / token", human(c.gather_bytes_per_token, "B")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(
        [f"  split {c.tp} ways (tensor parallelism), {c.dtype}:"] + [f"    {k:<{width}}  {v}" for k, v in rows]
    )
