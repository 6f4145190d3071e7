"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA in which each query attends only to its top-k keys.

A lightning indexer scores every (query t, key s) pair cheaply with a few small heads and a ReLU:

    I(t, s) = sum_j  w(t, j) * ReLU(q(t, j) . k(s))          j over indexer heads; one key per token, shared

then each query keeps its `topk` highest-scoring allowed keys, and the main attention runs over those keys only. The
selected keys are gathered (B, T, topk, ...), never masked out of all S, so the attention cost grows with topk, not
with S. With topk >= S every key is selected and DSA is exactly MLA.

The indexer rotates the first qk_rope_head_dim dims of its queries and keys with RoPE in the half layout (unlike the
interleaved layout of V3's main attention). Its key is LayerNorm-ed; its head weights w(t, j) come from x.

Shapes: B batch, T new tokens, S key slots, C model dim, J indexer heads, Di indexer head dim, n = topk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.config import ModelConfig
from llmkit.layers.attention.base import AttentionInputs, record_weights, wants_weights
from llmkit.layers.attention.cache import IndexQueries, LatentCache, LatentInPlace, SelectedInPlace
from llmkit.layers.attention.gqa import rotate_prefix
from llmkit.layers.attention.mla import MLAResult, MultiHeadLatentAttention, Selection
from llmkit.layers.extras import Extras


class LightningIndexer(nn.Module):
    """Index scores I(t, s). x (B, T, C), query input (B, T, Cq) -> (B, T, S) fp32 over every key slot."""

    def __init__(self, d_model: int, q_in_dim: int, n_heads: int, head_dim: int, rope_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.wq = nn.Linear(q_in_dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.w_heads = nn.Linear(d_model, n_heads, bias=False)

    def keys(self, x: Tensor, inputs: AttentionInputs) -> Tensor:
        """x (B, T, C) -> rotated, normalised indexer keys (B, T, Di)."""
        k = self.k_norm(self.wk(x)).unsqueeze(2)  # (B, T, 1, Di)
        if inputs.rope is not None:
            k = rotate_prefix(k, inputs.rope, self.rope_dim, "half")
        return k.squeeze(2)

    def project(self, x: Tensor, q_in: Tensor, inputs: AttentionInputs, topk: int) -> IndexQueries:
        """The step's indexer queries (B, T, J, Di), keys (B, T, Di) and head weights (B, T, J), before any key is
        scored (what a cache that scores in place needs)."""
        B, T, _ = x.shape
        q = self.wq(q_in).view(B, T, self.n_heads, self.head_dim)  # (B, T, J, Di)
        if inputs.rope is not None:
            q = rotate_prefix(q, inputs.rope, self.rope_dim, "half")
        w = self.w_heads(x).float() * self.n_heads**-0.5  # (B, T, J)
        return IndexQueries(q, self.keys(x, inputs), w, self.head_dim**-0.5, topk)

    def forward(self, x: Tensor, q_in: Tensor, inputs: AttentionInputs, cache: LatentCache | None = None) -> Tensor:
        p = self.project(x, q_in, inputs, topk=0)
        k = p.k  # (B, T, Di)
        if cache is not None:
            assert inputs.slots is not None, "a cached call needs the slots its tokens go to"
            k = cache.update_index(inputs.slots, k)  # (B, S_max, Di)
        scores = F.relu(torch.einsum("btjd,bsd->btjs", p.q.float(), k.float())) * p.scale  # (B, T, J, S)
        return torch.einsum("btjs,btj->bts", scores, p.w)  # (B, T, S)


class DeepSeekSparseAttention(MultiHeadLatentAttention):
    """MLA whose queries each attend to the `topk` keys chosen by a lightning indexer. x (B, T, C) -> (B, T, C).

    Training the indexer (DeepSeek-V3.2 §2.1): its inputs are detached, so it learns only from its own loss, the KL
    divergence from the main attention's distribution (summed over heads, L1-normalised) to softmax(I). The caller
    asks for it with `Extras(indexer=...)` in training mode: "dense" (the warm-up) keeps attention dense and the KL
    covers every allowed key; "sparse" attends over the selection and the KL covers the selected keys. The loss goes
    to `extras.indexer_losses`."""

    attends_in_place = True  # given a cache that also scores and selects in place (SelectedInPlace)

    def __init__(self, cfg: ModelConfig, absorb: bool | None = None) -> None:
        a = cfg.attention
        assert a.mla is not None and a.indexer is not None
        super().__init__(**MultiHeadLatentAttention.config_args(cfg), absorb=absorb)
        q_in = a.mla.q_lora_rank if a.mla.q_lora_rank is not None else cfg.d_model
        self.topk = a.indexer.topk
        self.indexer = LightningIndexer(cfg.d_model, q_in, a.indexer.n_heads, a.indexer.head_dim, self.dr)

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer: int = 0) -> DeepSeekSparseAttention:
        return cls(cfg)

    def forward(
        self, x: Tensor, inputs: AttentionInputs, cache: LatentCache | None = None, extras: Extras | None = None
    ) -> Tensor:
        mode = extras.indexer if extras is not None and self.training else "off"
        train_indexer = mode != "off"  # the KL needs the attention weights
        result = self.attention(x, inputs, cache, wants_weights(extras) or train_indexer, dense=mode == "dense")
        record_weights(extras, result.weights)
        if extras is not None and train_indexer:
            extras.indexer_losses.append(self.indexer_kl(result, inputs))
        return result.out

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
        """Each query over its top-k keys, scored, chosen and attended where the cache lies -> (B, T, H, r)."""
        if not isinstance(cache, SelectedInPlace):
            raise TypeError(f"sparse attention needs a cache that selects keys in place, not {type(cache).__name__}")
        q_in = q_latent if q_latent is not None else x
        return cache.attend_selected(q_abs, c_kv, k_pe, self.scale, self.indexer.project(x, q_in, inputs, self.topk))

    def indexer_kl(self, result: MLAResult, inputs: AttentionInputs) -> Tensor:
        """KL(p || softmax(I)) over the keys attention used, averaged over queries. p (B, T, S) is the attention
        distribution summed over heads and normalised; it is a target, so no gradient flows into it."""
        assert result.weights is not None and result.index_scores is not None
        weights = result.weights.detach().float()  # (B, H, T, S)
        p = weights.sum(dim=1) / weights.shape[1]  # (B, T, S)
        scores = result.index_scores  # (B, T, S)
        B, T, S = scores.shape
        if result.selection is not None:
            support = torch.zeros(B, T, S, dtype=torch.bool, device=scores.device)
            support.scatter_(-1, result.selection.index, result.selection.valid)
        else:
            dense = inputs.mask.dense(T, S, scores.device)
            support = torch.ones_like(scores, dtype=torch.bool) if dense is None else dense[:, 0].expand(B, T, S)
        log_q = torch.log_softmax(scores.masked_fill(~support, float("-inf")), dim=-1)
        terms = torch.where(support, torch.xlogy(p, p) - p * log_q.masked_fill(~support, 0.0), 0.0)
        rows = support.any(dim=-1)  # queries with at least one key; the mean is over those
        return (terms.sum(dim=-1) * rows).sum() / rows.sum().clamp(min=1)

    def select(
        self, x: Tensor, q_latent: Tensor | None, inputs: AttentionInputs, cache: LatentCache | None, dense: bool
    ) -> tuple[Selection | None, Tensor | None]:
        # the indexer's inputs are detached: its scores only choose keys (top-k passes no gradient), and it learns
        # from its own loss, not from the language-model loss
        q_in = (q_latent if q_latent is not None else x).detach()
        scores = self.indexer(x.detach(), q_in, inputs, cache)  # (B, T, S): every key slot
        B, T, S = scores.shape
        if self.topk >= S or dense:
            return None, scores  # every key: dense attention (also the indexer's warm-up)
        allowed = inputs.mask.dense(T, S, x.device)
        if allowed is not None:
            allowed = allowed[:, 0].expand(B, T, S)  # (B, T, S)
            scores_for_choice = scores.masked_fill(~allowed, float("-inf"))
        else:
            scores_for_choice = scores
        # a stable sort, not topk: ReLU makes exact ties (often at 0) common, and they must be broken the same way
        # whatever the shape of the call (full pass or cached decoding): the earlier key wins
        index = scores_for_choice.sort(dim=-1, descending=True, stable=True).indices[..., : self.topk]  # (B, T, n)
        valid = allowed.gather(-1, index) if allowed is not None else torch.ones_like(index, dtype=torch.bool)
        return Selection(index, valid), scores

    def new_cache(
        self, batch: int, max_len: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> LatentCache:
        return LatentCache(batch, max_len, self.r, self.dr, self.indexer.head_dim, device, dtype)

    def cache_elements_per_token(self) -> int:
        return self.r + self.dr + self.indexer.head_dim
