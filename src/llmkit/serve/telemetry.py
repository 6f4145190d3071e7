"""What a serving step costs against the machine's limits ("speed of light"): the bytes of weights and KV cache it
read, and the FLOPs of its rows, over the memory bandwidth and matrix peak measured when the server starts.

A step reads its weights once, whatever its rows (they share the read), and each row reads its context from the
cache; its matrix products multiply every token it computes (a prompt chunk's tokens, a decoding row's token and its
drafts) by the weights, and its attention multiplies each of those queries by the keys and values before it:

    weight bytes   the blocks, final norm and output head as stored (codes and scales of a quantized layer); a
                   lookup table is read only at its tokens' rows (not counted); of a mixture of experts, the dense
                   parts and the experts the step's tokens are expected to reach under uniform routing (the router's
                   choices are not recorded: an estimate, exact when every expert is reached)
    KV bytes       for each row, every cached key and value its last query attends to (a sliding window's layers at
                   most their window, a sparse one's top-k, plus its indexer's keys for all), at the pool's bytes a
                   token (one-byte codes and their scales with --kv-dtype int8 or fp8)
    FLOPs          2 x the multiplied weights for each token (the output head only where logits are wanted: a row's
                   last token, each draft, each prompt token whose log-probabilities were asked for), plus attention's
                   2 x heads x (key + value widths) for each (query, key) pair it scores (latent attention: the
                   model's FLOPs as analysis.py counts them, on the unabsorbed widths, whichever form a step runs)

Not counted: a draft model's or an MTP module's own forwards, the adapters' low-rank products, and rows computed again
one by one after a failed step (their time is in the step's seconds, so the fractions come out low with them).

The bandwidth fraction is (weight + KV bytes) / step seconds / measured read bandwidth: near 1, decoding runs at the
speed of light. The matmul fraction is the step's FLOPs / seconds / measured matmul peak: what a prompt-bound step
is held to. `Limits.measure` takes about a second (machine/perf.py: a 256 MiB read, a matmul in the model's dtype).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch
from torch import nn

from llmkit.layers.attention import SelfAttention
from llmkit.layers.attention.gqa import GroupedQueryAttention
from llmkit.layers.attention.mla import MultiHeadLatentAttention
from llmkit.layers.attention.sparse import DeepSeekSparseAttention
from llmkit.layers.moe import MoE
from llmkit.models import build_model
from llmkit.models.decoder import DecoderLM
from llmkit.quant.apply import weight_bytes
from llmkit.serve.forward import Row
from llmkit.serve.paged import PagedCache


@dataclass(frozen=True)
class Limits:
    """The machine's memory read bandwidth (bytes/s) and matmul peak (FLOP/s, in `dtype`), measured at start-up."""

    bandwidth: float
    matmul: float
    dtype: str
    seconds: float  # what measuring them took

    @classmethod
    def measure(cls, device: torch.device, dtype: torch.dtype) -> Limits:
        from llmkit.machine.perf import matmul_flops, memory_bandwidth

        start = time.perf_counter()
        bandwidth = memory_bandwidth(device, mib=256, seconds=0.3)
        matmul = matmul_flops(dtype, device, n=1024, seconds=0.3)
        return cls(bandwidth, matmul, str(dtype).removeprefix("torch."), time.perf_counter() - start)

    def __str__(self) -> str:
        return (
            f"memory read {self.bandwidth / 1e9:.1f} GB/s, {self.dtype} matmul {self.matmul / 1e9:.0f} GFLOP/s "
            f"(measured in {self.seconds:.1f} s)"
        )


@dataclass(frozen=True)
class StepCost:
    """One step's rows and what they read and computed (see the module's docstring)."""

    decode_rows: int
    prompt_tokens: int
    drafts: int
    weight_bytes: float
    kv_bytes: float
    flops: float

    def fractions(self, seconds: float, limits: Limits) -> tuple[float, float]:
        """(bandwidth fraction, matmul fraction) of a step that took `seconds`."""
        seconds = max(seconds, 1e-9)
        return (self.weight_bytes + self.kv_bytes) / seconds / limits.bandwidth, self.flops / seconds / limits.matmul


@dataclass(frozen=True)
class _Experts:
    """A mixture of experts' routed experts: how many, how many a token takes, and the bytes of one."""

    n: int
    top_k: int
    bytes_each: float


@dataclass(frozen=True)
class _Layer:
    """One block's attention: FLOPs per (query, key) pair it attends to, the cache's bytes a token it reads for them,
    the window (None: all keys); a sparse one's (DSA) `topk` keys attended at most, chosen by an indexer that scores
    every key (`index_flops_per_pair`) from its own part of the cache (`index_bytes_per_token`)."""

    flops_per_pair: int
    kv_bytes_per_token: float
    window: int | None = None
    topk: int | None = None
    index_flops_per_pair: int = 0
    index_bytes_per_token: float = 0.0


class StepCosts:
    """The constants of a model and its paged cache, from which each step's cost follows from its rows."""

    def __init__(self, model: DecoderLM, cache: PagedCache) -> None:
        cfg = model.cfg
        self.head_params = cfg.d_model * cfg.vocab_size
        self.experts = [_Experts(m.cfg.n_experts, m.cfg.top_k, weight_bytes(m.experts) / m.cfg.n_experts)
                        for m in model.blocks.modules() if isinstance(m, MoE)]  # fmt: skip
        expert_bytes = sum(weight_bytes(m.experts) for m in model.blocks.modules() if isinstance(m, MoE))
        head = model.embed if model.head is None else model.head
        self.dense_bytes = weight_bytes(model.blocks) - expert_bytes + weight_bytes(model.norm) + weight_bytes(head)
        self.matmul_params = _multiplied_per_token(model)
        slots = (cache.n_blocks + (cache.scratch is not None)) * cache.block_size  # (a scratch block is in the pools)
        attns = [m for m in model.blocks.modules() if isinstance(m, SelfAttention)]  # one a block, in order
        # alike layers counted once, times their number (most models: one kind, or a local and a global one)
        pools = zip(attns, cache.layers, strict=True)
        self.layers = Counter(_layer(attn, pool.nbytes / slots) for attn, pool in pools)

    def of(self, rows: tuple[Row, ...] | list[Row]) -> StepCost:
        tokens = sum(len(r.tokens) + len(r.drafts) for r in rows)
        logits = sum(1 + len(r.drafts) + r.prompt_n for r in rows)
        flops = 2.0 * (tokens * self.matmul_params + logits * self.head_params)
        kv = 0.0
        for r in rows:
            end = r.start + len(r.tokens) + len(r.drafts)  # the keys the row's last query sees
            for layer, n in self.layers.items():
                seen = end if layer.window is None else min(end, layer.window)
                attended = seen if layer.topk is None else min(seen, layer.topk)
                kv += n * (layer.kv_bytes_per_token * attended + layer.index_bytes_per_token * seen)
                flops += n * layer.flops_per_pair * _pairs(r.start, end, layer.window, layer.topk)
                flops += n * layer.index_flops_per_pair * _pairs(r.start, end, layer.window)
        moved = self.dense_bytes + sum(e.bytes_each * _reached(e, tokens) for e in self.experts)
        return StepCost(
            decode_rows=sum(len(r.tokens) == 1 and r.given == 0 for r in rows),
            prompt_tokens=sum(r.given for r in rows),  # (generated tokens computed again after a preemption: neither)
            drafts=sum(len(r.drafts) for r in rows),
            weight_bytes=moved,
            kv_bytes=kv,
            flops=flops,
        )


def _pairs(start: int, end: int, window: int | None, limit: int | None = None) -> int:
    """(query, key) pairs that queries at positions start .. end - 1 score: the one at p sees p + 1 keys, at most
    `window` and at most `limit`, so the sum of min(q, cap) for q = start + 1 .. end."""
    caps = [c for c in (window, limit) if c is not None]
    cap = min(caps) if caps else None
    last = end if cap is None else min(end, cap)
    below = (start + 1 + last) * (last - start) // 2 if last > start else 0  # q up to the cap: q each
    return below + (0 if cap is None else max(0, end - max(start, cap)) * cap)  # beyond it: cap each


def _reached(e: _Experts, tokens: int) -> float:
    """Experts that `tokens` tokens reach, each taking top_k of n at random: n (1 - (1 - k/n)^tokens)."""
    return e.n * (1 - (1 - e.top_k / e.n) ** tokens)


def _multiplied_per_token(model: DecoderLM) -> int:
    """Weights a token multiplies in the blocks (the head apart): every matrix, a routed expert's only at the share
    k/n of the tokens that reach it, counted on the model's configuration (a quantized layer's out x in, whatever
    its storage)."""
    blocks = build_model(model.cfg, device="meta").get_submodule("blocks")
    share = {id(p): m.cfg.top_k / m.cfg.n_experts
             for m in blocks.modules() if isinstance(m, MoE) for p in m.experts.parameters()}  # fmt: skip
    total = sum((p.numel() * share.get(id(p), 1.0) for p in blocks.parameters() if p.dim() >= 2), 0.0)
    return round(total)


def _layer(attn: nn.Module, bytes_per_token: float) -> _Layer:
    """A block's attention as counted: grouped-query attention scores q.k and weighs v in every head (2 x heads x
    (head dim + head dim) a pair); latent attention as analysis.py counts the model's FLOPs, on the widths of the
    unabsorbed form (nope + rope for a score, dv for a value) whichever form the step computes; a sparse one's
    attention over its top-k keys, its indexer's scores (heads x index dim) over every key."""
    if isinstance(attn, GroupedQueryAttention):
        return _Layer(2 * attn.n_heads * 2 * attn.head_dim, bytes_per_token, attn.sliding_window)
    assert isinstance(attn, MultiHeadLatentAttention), f"no FLOP count for {type(attn).__name__}"
    pair = 2 * attn.n_heads * (attn.dn + attn.dr + attn.dv)
    if not isinstance(attn, DeepSeekSparseAttention):
        return _Layer(pair, bytes_per_token)
    ix = attn.indexer
    per_element = bytes_per_token / (attn.r + attn.dr + ix.head_dim)  # the latents, then the indexer's keys
    latents, index_keys = per_element * (attn.r + attn.dr), per_element * ix.head_dim
    return _Layer(pair, latents, None, attn.topk, 2 * ix.n_heads * ix.head_dim, index_keys)


class StepLog:
    """`llmkit serve --log-steps FILE`: one JSON line a step (flushed as written, so a stopped server loses none)."""

    def __init__(self, path: str | Path) -> None:
        self.file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115  (held for the server's life)

    def write(self, at: float, seconds: float, cost: StepCost, fractions: tuple[float, float] | None) -> None:
        line = {"time": at, "seconds": seconds, **asdict(cost)}
        if fractions is not None:
            line.update(bandwidth_fraction=fractions[0], matmul_fraction=fractions[1])
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class Telemetry:
    """The engine's record of what its steps cost: the last step's cost, seconds and fractions of the limits (when
    they were measured), totals since start, and a line a step in the step log when one is open. The engine tells
    it each step's rows when it plans them (`planned`) and the step's seconds when it ends (`finished`). Without
    `costs` (a model split across ranks, whose weights and cache each rank holds a share of) nothing is counted."""

    def __init__(self, costs: StepCosts | None, limits: Limits | None = None, log: StepLog | None = None) -> None:
        self.costs, self.limits, self.log = costs, limits, log
        self.steps = 0
        self.last: StepCost | None = None
        self.last_seconds = 0.0
        self.last_fractions: tuple[float, float] | None = None
        self.weight_bytes = self.kv_bytes = self.flops = self.seconds = 0.0  # since start
        self._pending: StepCost | None = None

    def begin(self) -> None:
        """A step starts: whatever a failed step planned is forgotten."""
        self._pending = None

    def planned(self, rows: tuple[Row, ...] | list[Row]) -> None:
        if self.costs is not None:
            self._pending = self.costs.of(rows)

    def finished(self, seconds: float, at: float) -> None:
        """The planned step took `seconds` (ending at time `at`, for the log)."""
        cost, self._pending = self._pending, None
        if cost is None:  # a step with no work
            return
        self.steps += 1
        self.last, self.last_seconds = cost, seconds
        self.weight_bytes += cost.weight_bytes
        self.kv_bytes += cost.kv_bytes
        self.flops += cost.flops
        self.seconds += seconds
        self.last_fractions = cost.fractions(seconds, self.limits) if self.limits is not None else None
        if self.log is not None:
            self.log.write(at, seconds, cost, self.last_fractions)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
