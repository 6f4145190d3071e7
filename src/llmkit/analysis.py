"""What a model costs: parameters by component, active parameters, weight memory, KV-cache size and FLOPs.

Counts come from building the model on the meta device (no memory, exact for llmkit's implementation) and reading
each parameter's shape. Conventions:

- params_total: the main model. DeepSeek's multi-token-prediction module is reported apart (params_mtp), as
  DeepSeek itself counts "671B": it is used only for training and speculative decoding.
- params_active: params_total minus the routed experts a token does not use ((E - k) / E of them per MoE layer).
- params_embedding: lookup tables (token embedding not shared with the output head, learned positions). A lookup
  reads one row per token and costs no FLOPs; DeepSeek's "activated parameters" exclude it, Mistral's include it.
- kv_cache_bytes_per_token: what each generated token adds to the cache, summed over layers, in `dtype`. GQA caches
  2 * K * D elements per layer, MLA only kv_lora_rank + rope dims (576 for DeepSeek-V3), DSA adds the indexer key.
- flops_per_token: forward FLOPs per token, 2 per multiply-accumulate, over matmuls: 2 * active matmul weights plus
  attention scores and weighted sums, averaged over a causal sequence of `seq_len` tokens (a query at position t
  attends t + 1 keys; with sparse attention min(t + 1, topk), plus the indexer's scores over all t + 1 keys). For an
  encoder-decoder: per target token, with a source of the same length. Training costs about 3x this.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.layers.attention import SelfAttention
from llmkit.layers.moe import MoE
from llmkit.models import build_model

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# (prefix or fragment, component) rules over llmkit's own parameter names, first match wins
_COMPONENT_RULES: list[tuple[str, str]] = [
    ("mtp.", "mtp"),
    (".attn.indexer.", "indexer"),
    (".cross.", "cross-attention"),
    (".attn.", "attention"),
    (".ffn.router.", "router"),
    (".ffn.experts.", "experts (routed)"),
    (".ffn.shared.", "experts (shared)"),
    (".ffn.shared_gate.", "experts (shared)"),
    (".ffn.", "feed-forward"),
    ("_residual.norm.", "norms"),
    ("inputs.positions.", "positions"),
    ("embed.", "embedding"),
    ("src_embed.", "embedding"),
    ("head", "head"),
    ("norm.", "norms"),
]


def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers (DeepSeek's router score bias is state, kept by the trainer's update rule
    rather than by gradients): every tensor a checkpoint stores. Tied tensors appear once."""
    yield from model.named_parameters()
    for mname, module in model.named_modules():
        for bname, buf in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), buf


def component_of(param_name: str) -> str:
    """The component a parameter belongs to, from its name in an llmkit model."""
    dotted = "." + param_name
    for fragment, component in _COMPONENT_RULES:
        if fragment in dotted:
            return component
    return "other"


@dataclass(frozen=True)
class Report:
    """Sizes and costs of one model config. See the module docstring for the conventions."""

    name: str
    architecture: str
    dtype: str
    seq_len: int
    params_total: int
    params_active: int
    params_embedding: int
    params_active_non_embedding: int
    params_mtp: int
    params_by_component: dict[str, int]
    active_by_component: dict[str, int]
    weight_bytes: int
    kv_cache_elements_per_token_per_layer: int
    kv_cache_bytes_per_token: int
    kv_cache_bytes: int
    cross_kv_cache_bytes_per_source_token: int
    flops_per_token: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _attention_flops(cfg: ModelConfig, L: int) -> tuple[float, float]:
    """(self-attention FLOPs per query summed over decoder layers averaged over a causal length-L sequence,
    the same for a non-causal pass over L keys) — scores and weighted sums only, not projections."""
    a = cfg.attention
    avg_keys = (L + 1) / 2  # a causal query at position t sees t + 1 keys
    if a.kind == "gqa":
        per_key = 2 * a.n_heads * (2 * cfg.head_dim)  # q.k and w*v, D each
        return cfg.n_layers * per_key * avg_keys, per_key * L
    assert a.mla is not None
    m = a.mla
    per_key = 2 * a.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)  # explicit (training) path
    if a.kind == "mla":
        return cfg.n_layers * per_key * avg_keys, per_key * L
    assert a.indexer is not None
    n = a.indexer.topk
    # mean over t = 0..L-1 of min(t + 1, n)
    selected = (sum(range(1, min(L, n) + 1)) + max(0, L - n) * n) / L
    index_per_key = 2 * a.indexer.n_heads * a.indexer.head_dim
    return cfg.n_layers * (per_key * selected + index_per_key * avg_keys), per_key * L


def analyze(cfg: ModelConfig, name: str = "", seq_len: int | None = None, dtype: str = "bf16") -> Report:
    """Parameters, memory, KV cache and FLOPs of `cfg` (built on the meta device: no memory is used)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    L = seq_len if seq_len is not None else cfg.position.max_seq_len
    if L < 1:
        raise ConfigError(f"seq_len={L} must be >= 1")
    nbytes = DTYPE_BYTES[dtype]
    model = build_model(cfg, device="meta")

    by_component: dict[str, int] = defaultdict(int)
    for pname, p in named_weights(model):
        by_component[component_of(pname)] += p.numel()
    params_mtp = by_component.pop("mtp", 0)
    params_total = sum(by_component.values())

    # routed experts a token does not use
    inactive = 0
    for mname, module in model.named_modules():
        if isinstance(module, MoE) and not mname.startswith("mtp."):
            n_expert_params = sum(p.numel() for p in module.experts.parameters())
            inactive += n_expert_params * (module.cfg.n_experts - module.cfg.top_k) // module.cfg.n_experts
    active_by_component = dict(by_component)
    if inactive:
        active_by_component["experts (routed)"] -= inactive
    params_active = params_total - inactive

    lookup = by_component.get("positions", 0)
    src_embed = getattr(model, "src_embed", None)
    if src_embed is not None:
        lookup += src_embed.weight.numel()
    if not cfg.tie_embeddings:
        lookup += model.embed.weight.numel()
    # matmul weights actually used per token: >= 2-D tensors that are not lookups
    matmul = 0
    for pname, p in model.named_parameters():
        comp = component_of(pname)
        if p.dim() >= 2 and comp not in ("mtp", "positions") and not pname.startswith("src_embed."):
            if comp == "embedding" and not cfg.tie_embeddings:
                continue
            matmul += p.numel()
    matmul -= inactive

    causal_attn, full_attn = _attention_flops(cfg, L)
    if cfg.encoder is not None:
        # per target token, with a source of equal length: encoder matmuls + non-causal self-attention per source
        # token, decoder matmuls + causal self-attention + cross-attention over L source tokens
        enc_layers = cfg.encoder.n_layers
        flops = 2.0 * matmul + causal_attn + enc_layers * full_attn + cfg.n_layers * full_attn
    else:
        flops = 2.0 * matmul + causal_attn

    attns = [m for n, m in model.named_modules() if isinstance(m, SelfAttention) and not n.startswith("mtp.")]
    if cfg.encoder is not None:
        attns = [m for n, m in model.named_modules() if isinstance(m, SelfAttention) and n.startswith("decoder.")]
    elements = sum(m.cache_elements_per_token() for m in attns)
    cross_bytes = 0
    if cfg.encoder is not None:
        cross_bytes = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * nbytes
    per_layer = attns[0].cache_elements_per_token() if attns else 0
    return Report(
        name=name,
        architecture="encoder-decoder" if cfg.encoder is not None else "decoder",
        dtype=dtype,
        seq_len=L,
        params_total=params_total,
        params_active=params_active,
        params_embedding=lookup,
        params_active_non_embedding=params_active - lookup,
        params_mtp=params_mtp,
        params_by_component=dict(by_component),
        active_by_component=active_by_component,
        weight_bytes=(params_total + params_mtp) * nbytes,
        kv_cache_elements_per_token_per_layer=per_layer,
        kv_cache_bytes_per_token=elements * nbytes,
        kv_cache_bytes=elements * nbytes * L,
        cross_kv_cache_bytes_per_source_token=cross_bytes,
        flops_per_token=flops,
        extra={"attention": cfg.attention.kind, "n_layers": cfg.n_layers},
    )


# ---- human-readable output


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M'; with unit 'B' uses binary prefixes for bytes."""
    if unit == "B":
        for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
            if abs(n) < 1024 or prefix == "Ti":
                return f"{n:.0f} B" if prefix == "" else f"{n:.2f} {prefix}B"
            n /= 1024
    for prefix in ("", "K", "M", "B", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:.0f}" if prefix == "" else f"{n:.2f}{prefix}"
        n /= 1000
    return str(n)


def _rows(r: Report) -> list[tuple[str, str]]:
    rows = [
        ("architecture", r.architecture),
        ("layers / attention", f"{r.extra['n_layers']} / {r.extra['attention']}"),
        ("params total", f"{human(r.params_total)} ({r.params_total:,})"),
        ("params active / token", f"{human(r.params_active)} ({r.params_active:,})"),
        (
            "  without input lookups",
            f"{human(r.params_active_non_embedding)} ({r.params_active_non_embedding:,})",
        ),
    ]
    if r.params_mtp:
        rows.append(("params MTP module(s)", f"{human(r.params_mtp)} ({r.params_mtp:,})"))
    rows.append((f"weights ({r.dtype})", human(r.weight_bytes, "B")))
    rows.append(("KV cache elems/token/layer", f"{r.kv_cache_elements_per_token_per_layer:,}"))
    rows.append((f"KV cache / token ({r.dtype})", human(r.kv_cache_bytes_per_token, "B")))
    rows.append(("context (seq_len)", f"{r.seq_len:,}"))
    rows.append(("KV cache @ context", human(r.kv_cache_bytes, "B")))
    if r.cross_kv_cache_bytes_per_source_token:
        rows.append(("cross-attn cache / source token", human(r.cross_kv_cache_bytes_per_source_token, "B")))
    rows.append(("forward FLOPs / token", human(r.flops_per_token)))
    return rows


def format_report(r: Report) -> str:
    """A readable summary of one report, with parameters by component."""
    lines = [f"{r.name or 'model'}"]
    rows = _rows(r)
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    lines.append("  parameters by component (total / active):")
    for comp, n in sorted(r.params_by_component.items(), key=lambda kv: -kv[1]):
        act = r.active_by_component.get(comp, n)
        share = 100 * n / max(r.params_total, 1)
        lines.append(f"    {comp:<18} {human(n):>9} {human(act):>9}  {share:5.1f}%")
    return "\n".join(lines)


def format_compare(reports: list[Report]) -> str:
    """Reports side by side, one column per model."""
    keys = [k for k, _ in _rows(reports[0])]
    table = [[k] + [dict(_rows(r)).get(k, "") for r in reports] for k in keys]
    header = ["", *[r.name for r in reports]]
    # shorten the long "1.23M (1,234,567)" cells to their first word in the side-by-side view
    table = [[row[0]] + [cell.split(" (")[0] for cell in row[1:]] for row in table]
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    out = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True))]
    out += ["  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join(out)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of weights of a built model: parameters and persistent buffers, tied tensors counted once."""
    return sum(t.numel() for _, t in named_weights(model))
