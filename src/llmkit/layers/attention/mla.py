"""Multi-head latent attention (MLA, DeepSeek-V2 §2.1, used by DeepSeek-V3).

Keys and values are not projected from x per head; x is first compressed to one small latent c (kv_lora_rank dims,
RMS-normalised), and every head's key and value are linear functions of it:

    c_t = norm(x_t W_dkv)                       (B, T, r)      the only thing to cache ...
    k_t^h = [c_t W_uk^h , R_t x_t W_kr]         (nope | rope)  ... plus one rope key shared by all heads
    v_t^h = c_t W_uv^h
    q_t^h = [c'_t W_uq^h , R_t c'_t W_qr^h]     c'_t = norm(x_t W_dq): queries are low-rank too

RoPE is position dependent, so it cannot sit inside W_uk (R_(t-s) would land between W_uq and W_uk). Hence the
decoupled rope dims: a few extra dims per head that carry RoPE, with a key shared across heads.

Two mathematically equal paths:
- explicit (training): rebuild per-head k, v from c and run ordinary attention;
- absorbed (inference): since q^h . k^h_nope = (q^h W_uk^h^T) . c, fold W_uk into the query and W_uv into the output,
  and attend directly over the cached latents. This is MQA with one key of r + d_rope dims (576 at V3 sizes):
        q_lat^h = q_nope^h W_uk^h^T          (B, H, T, r)
        o^h     = softmax(q_lat^h . c + q_pe^h . k_pe) c  W_uv^h

Shapes: B batch, T new tokens, S key slots, C model dim, H heads, r kv_lora_rank, dn nope dims, dr rope dims, dv value
dims, n selected keys (sparse attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.config import Layout, MLAConfig, ModelConfig
from llmkit.errors import check_features
from llmkit.layers.attention.base import AttentionInputs, SelfAttention, record_weights, wants_weights
from llmkit.layers.attention.cache import LatentCache, LatentInPlace
from llmkit.layers.attention.core import attend, attend_selected
from llmkit.layers.extras import Extras
from llmkit.layers.norm import RMSNorm
from llmkit.layers.rope import apply_rope, yarn_mscale


@dataclass(frozen=True)
class Selection:
    """The keys each query attends to in sparse attention: index (B, T, n) key slots, valid (B, T, n) bool."""

    index: Tensor
    valid: Tensor


@dataclass(frozen=True)
class Latents:
    """What both attention paths start from: queries split into their nope and (rotated) rope parts, and the keys'
    latents and shared (rotated) rope key, over every key slot."""

    q_nope: Tensor  # (B, T, H, dn)
    q_pe: Tensor  # (B, T, H, dr)
    c_kv: Tensor  # (B, S, r)
    k_pe: Tensor  # (B, S, dr)


@dataclass(frozen=True)
class MLAResult:
    """One call of latent attention: the output and what was computed on the way."""

    out: Tensor  # (B, T, C)
    weights: Tensor | None  # (B, H, T, S) attention weights, when asked for
    selection: Selection | None = None  # sparse attention: the keys each query attended to (None: all)
    index_scores: Tensor | None = None  # sparse attention: the indexer's scores (B, T, S)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(dn + dr), times YaRN's mscale^2 when RoPE is YaRN-scaled with mscale_all_dim (DeepSeek-V3): the rope
    dims are a small part of each head, so the temperature correction goes on the whole score."""
    scale = cfg.head_dim**-0.5
    s = cfg.position.scaling
    if s is not None and s.kind == "yarn" and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


class MultiHeadLatentAttention(SelfAttention):
    """MLA. x (B, T, C) -> (B, T, C). `absorb`: None picks, when there is a cache, whichever path costs fewer
    multiply-adds (absorbed for decoding, explicit for a long prefill), and the explicit path without one (training);
    True / False always take one."""

    attends_in_place = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mla: MLAConfig,
        softmax_scale: float | None = None,
        dropout: float = 0.0,
        rope_layout: Layout = "interleaved",
        qkv_bias: bool = False,
        out_bias: bool = False,
        norm_eps: float = 1e-6,
        absorb: bool | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.dropout, self.rope_layout = n_heads, dropout, rope_layout
        self.r, self.dn, self.dr, self.dv = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.q_lora_rank = mla.q_lora_rank
        self.scale = softmax_scale if softmax_scale is not None else (self.dn + self.dr) ** -0.5
        self.absorb = absorb
        qk = n_heads * (self.dn + self.dr)
        if mla.q_lora_rank is not None:  # low-rank query path: C -> q_lora -> norm -> H * (dn + dr)
            self.wq_a = nn.Linear(d_model, mla.q_lora_rank, bias=qkv_bias)
            self.q_norm = RMSNorm(mla.q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, qk, bias=False)
        else:  # DeepSeek-V2-Lite: queries projected directly
            self.wq = nn.Linear(d_model, qk, bias=False)
        self.wkv_a = nn.Linear(d_model, self.r + self.dr, bias=qkv_bias)  # latent c and the shared rope key
        self.kv_norm = RMSNorm(self.r, norm_eps)
        self.wkv_b = nn.Linear(self.r, n_heads * (self.dn + self.dv), bias=False)  # W_uk and W_uv, stacked per head
        self.wo = nn.Linear(n_heads * self.dv, d_model, bias=out_bias)

    @staticmethod
    def config_args(cfg: ModelConfig) -> dict[str, Any]:
        """Constructor arguments from a model config (shared with sparse attention, which extends MLA)."""
        a = cfg.attention
        assert a.mla is not None
        return dict(
            d_model=cfg.d_model,
            n_heads=a.n_heads,
            mla=a.mla,
            softmax_scale=mla_softmax_scale(cfg),
            dropout=a.dropout,
            rope_layout=cfg.position.layout,
            qkv_bias=a.qkv_bias,
            out_bias=a.out_bias,
            norm_eps=cfg.norm.eps,
        )

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer: int = 0) -> MultiHeadLatentAttention:
        return cls(**cls.config_args(cfg))

    # ---- projections

    def project_queries(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) -> q (B, T, H, dn + dr) and the normalised query latent (B, T, q_lora) or None."""
        B, T, _ = x.shape
        if self.q_lora_rank is not None:
            q_latent = self.q_norm(self.wq_a(x))
            q = self.wq_b(q_latent)
        else:
            q_latent, q = None, self.wq(x)
        return q.view(B, T, self.n_heads, self.dn + self.dr), q_latent

    def project_latent(self, x: Tensor, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
        """x (B, T, C) -> normalised latent c_kv (B, T, r) and rotated shared rope key k_pe (B, T, dr)."""
        c_kv, k_pe = self.wkv_a(x).split([self.r, self.dr], dim=-1)
        c_kv = self.kv_norm(c_kv)
        if inputs.rope is not None:
            k_pe = apply_rope(k_pe.unsqueeze(2), inputs.rope, self.rope_layout).squeeze(2)  # one head, shared
        return c_kv, k_pe

    # ---- forward

    def forward(
        self, x: Tensor, inputs: AttentionInputs, cache: LatentCache | None = None, extras: Extras | None = None
    ) -> Tensor:
        result = self.attention(x, inputs, cache, need_weights=wants_weights(extras))
        record_weights(extras, result.weights)
        return result.out

    def attention(
        self,
        x: Tensor,
        inputs: AttentionInputs,
        cache: LatentCache | None = None,
        need_weights: bool = False,
        dense: bool = False,
    ) -> MLAResult:
        """The whole computation, with what it produced on the way. `dense` keeps every allowed key even where
        sparse attention would select (its indexer's warm-up)."""
        check_features(x, self.wkv_a.in_features, type(self).__name__)
        q, q_latent = self.project_queries(x)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)  # (B, T, H, dn), (B, T, H, dr)
        if inputs.rope is not None:
            q_pe = apply_rope(q_pe, inputs.rope, self.rope_layout)
        c_kv, k_pe = self.project_latent(x, inputs)
        if isinstance(cache, LatentInPlace):  # a paged pool whose kernel reads the latents where they lie
            q_abs = self.absorb_queries(q_nope, q_pe)  # (B, T, H, r + dr)
            out = self.expand_values(self.attend_in_place(cache, x, q_latent, inputs, q_abs, c_kv, k_pe))
            return MLAResult(self.wo(out), None, None, None)
        if cache is not None:
            assert inputs.slots is not None, "a cached call needs the slots its tokens go to"
            c_kv, k_pe = cache.update(inputs.slots, c_kv, k_pe)  # (B, S_max, r), (B, S_max, dr)
        selection, scores = self.select(x, q_latent, inputs, cache, dense)
        S = c_kv.shape[1]
        absorbed = self.absorb if self.absorb is not None else cache is not None and self.absorb_cheaper(x.shape[1], S)
        attend_fn = self.attend_absorbed if absorbed else self.attend_explicit
        out, weights = attend_fn(Latents(q_nope, q_pe, c_kv, k_pe), inputs, selection, need_weights)
        return MLAResult(self.wo(out), weights, selection, scores)

    def attend_in_place(
        self,
        cache: LatentInPlace,
        x: Tensor,
        q_latent: Tensor | None,
        inputs: AttentionInputs,
        q_abs: Tensor,
        c_kv: Tensor,
        k_pe: Tensor,
    ) -> Tensor:
        """The absorbed queries (B, T, H, r + dr) over a cache that attends itself, every key -> (B, T, H, r).
        (Sparse attention hands it its indexer's queries too.)"""
        return cache.attend_latent(q_abs, c_kv, k_pe, self.scale)

    def absorb_cheaper(self, T: int, S: int) -> bool:
        """Whether the absorbed path costs fewer multiply-adds than the explicit one for T queries over S keys.
        Explicit pays to expand every key (S r (dn + dv) per head) and then attends with small heads; absorbed pays
        per query (T r (dn + dv)) and attends with wide ones (2 r + dr). Decoding (T = 1) favours absorbed by
        far; a long prefill (T = S) favours explicit."""
        explicit = S * self.r * (self.dn + self.dv) + T * S * (self.dn + self.dr + self.dv)
        absorbed = T * self.r * (self.dn + self.dv) + T * S * (2 * self.r + self.dr)
        return absorbed < explicit

    def select(
        self, x: Tensor, q_latent: Tensor | None, inputs: AttentionInputs, cache: LatentCache | None, dense: bool
    ) -> tuple[Selection | None, Tensor | None]:
        """Which keys each query attends to, and the scores that chose them: (None, None) is every allowed key
        (dense MLA). Sparse attention overrides this."""
        return None, None

    def _run(
        self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, selection: Selection | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Attention, dense or over the selection -> (out, weights (B, H, T, S) over every key slot or None)."""
        dropout = self.dropout if self.training else 0.0
        if selection is None:
            return attend(q, k, v, inputs.mask, self.scale, dropout, need_weights=need_weights)
        out, sel_weights = attend_selected(q, k, v, selection.index, selection.valid, self.scale, dropout)
        if not need_weights:
            return out, None
        B, H, T, _ = sel_weights.shape  # scatter the weights over the selected keys back to every key slot
        dense = sel_weights.new_zeros(B, H, T, k.shape[2])
        return out, dense.scatter(-1, selection.index.unsqueeze(1).expand(B, H, T, -1), sel_weights)

    def attend_explicit(
        self, p: Latents, inputs: AttentionInputs, selection: Selection | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Rebuild per-head keys and values from the latent, then attend. -> ((B, T, H * dv), weights)."""
        B, T, H, _ = p.q_nope.shape
        S = p.c_kv.shape[1]
        kv = self.wkv_b(p.c_kv).view(B, S, H, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)  # (B, S, H, dn), (B, S, H, dv)
        k = torch.cat((k_nope, p.k_pe.unsqueeze(2).expand(B, S, H, self.dr)), dim=-1)  # (B, S, H, dn + dr)
        q = torch.cat((p.q_nope, p.q_pe), dim=-1)  # (B, T, H, dn + dr)
        out, weights = self._run(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), inputs, selection, need_weights
        )  # (B, H, T, dv)
        return out.transpose(1, 2).reshape(B, T, H * self.dv), weights

    def absorb_queries(self, q_nope: Tensor, q_pe: Tensor) -> Tensor:
        """W_uk folded into the queries: q_nope (B, T, H, dn), q_pe (B, T, H, dr) -> (B, T, H, r + dr), which score
        against the cached [c_kv | k_pe] as they stand (q_nope . W_uk c = (W_uk^T q_nope) . c)."""
        w_uk = self.wkv_b.weight.view(self.n_heads, self.dn + self.dv, self.r)[:, : self.dn]  # (H, dn, r)
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)  # (B, T, H, r)
        return torch.cat((q_lat, q_pe), dim=-1)

    def expand_values(self, out_lat: Tensor) -> Tensor:
        """W_uv applied after attending over the latents: (B, T, H, r) -> (B, T, H * dv)."""
        B, T, H, _ = out_lat.shape
        w_uv = self.wkv_b.weight.view(H, self.dn + self.dv, self.r)[:, self.dn :]  # (H, dv, r)
        return torch.einsum("bthr,hvr->bthv", out_lat, w_uv).reshape(B, T, H * self.dv)

    def attend_absorbed(
        self, p: Latents, inputs: AttentionInputs, selection: Selection | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Attend over the latents with W_uk folded into the queries and W_uv into the output.
        -> ((B, T, H * dv), weights)."""
        q = self.absorb_queries(p.q_nope, p.q_pe).transpose(1, 2)  # (B, H, T, r + dr)
        k = torch.cat((p.c_kv, p.k_pe), dim=-1).unsqueeze(1)  # (B, 1, S, r + dr): one key head, as in MQA
        v = p.c_kv.unsqueeze(1)  # (B, 1, S, r)
        out_lat, weights = self._run(q, k, v, inputs, selection, need_weights)  # (B, H, T, r)
        return self.expand_values(out_lat.transpose(1, 2)), weights

    def new_cache(
        self, batch: int, max_len: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> LatentCache:
        return LatentCache(batch, max_len, self.r, self.dr, device=device, dtype=dtype)

    def cache_elements_per_token(self) -> int:
        return self.r + self.dr

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, kv_lora_rank={self.r}, q_lora_rank={self.q_lora_rank}, dn={self.dn}, "
            f"dr={self.dr}, dv={self.dv}"
        )
