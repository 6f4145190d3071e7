"""The model's part of a serving step, as vLLM v1's model runner: a frozen plan in, typed logits out.

    StepPlan (each row: its new tokens, first slot, cache blocks, drafts) ─► ModelRunner.execute ─► RunnerOutput
                                                                 (logits per row, verified drafts apart, states)

A runner is made once, with its backend (`model_runner`), from what the model, its cache and the engine's settings
allow; nothing here is decided again per step:

- TorchRunner: every row through the PyTorch forward (forward.run_rows). Rows of different lengths go through as
  one packed row (1, N) where every block's attention takes it (grouped-query attention: AttentionMask.ragged);
  otherwise the decoding rows go together and each prompt chunk alone (latent attention's paths size their work
  by the queries' batch).
- NativeRunner: the decoding rows in one C++ call that reads the paged pools in place (NativeDecoder.run_paged);
  prompt chunks through PyTorch. Putting the decoding rows into the chunks' PyTorch forward instead made SmolLM2's
  steps with long contexts 1.6x slower (487 against 309 ms), since each layer then gathers every row's keys. Rows
  with drafts go token by token through the C++ step (run_tokens), each token a row of its own, so that a verified
  token has the bits a plain decoding row gives it.
- InvariantRunner: every token, prompt tokens too, as a row of its own through the C++ step, the head in
  row-invariant pieces: a row's bits do not depend on the rows beside it (EngineConfig.batch_invariant).
- LockstepRunner: a TorchRunner whose forwards every rank of a tensor-parallel model runs (lockstep.py).
- KernelRunner (kernel_runner.py), on a GPU: every row of a step in one forward whose attention reads the pools in
  place (a Triton kernel), drafts verified in it, decoding steps replayed from CUDA graphs; batch-invariant on
  request, with llmkit's own products and norms (llmkit.kernels.invariant).

When a group of rows' forward raises (out of memory, a kernel refusing a shape), its rows are computed one by one, so
that the failure is pinned on the rows that cause it: those are missing from the output. Shapes: B rows, V
vocabulary, C model dim, k a row's drafts.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.backend import resolve
from llmkit.kernels import triton_usable
from llmkit.layers.attention.base import SelfAttention
from llmkit.models.decoder import DecoderLM
from llmkit.quant.native_step import NativeDecoder
from llmkit.serve.adapters import LowRankStep
from llmkit.serve.forward import Forward, Row, prompt_logits, run_rows
from llmkit.serve.kernel_runner import KernelRunner
from llmkit.serve.lockstep import Lockstep, forward_step
from llmkit.serve.paged import PagedCache
from llmkit.serve.runner_base import ModelRunner, StepPlan, TokenRunner


class TorchRunner(ModelRunner):
    """Every row through the PyTorch forward (forward.run_rows)."""

    def __init__(self, model: DecoderLM, cache: PagedCache, block_size: int) -> None:
        super().__init__(model, cache, block_size)
        # whether rows of different lengths can go through the model as one packed row (AttentionMask.ragged)
        self.packs = all(isinstance(b.attn, SelfAttention) and b.attn.packs_rows for b in model.blocks)

    def groups(self, plan: StepPlan) -> list[list[int]]:
        if self.packs:
            return [list(range(len(plan.rows)))]
        return [plan.decoding] + [[i] for i in plan.chunks]

    def forward(self, rows: list[Row]) -> Forward:
        return run_rows(self.model, self.cache, self.block_size, rows)


class LockstepRunner(TorchRunner):
    """A TorchRunner over this rank's part of a tensor-parallel model: every rank runs each forward with the same
    rows (lockstep.py), since each holds part of every layer."""

    kind = "PyTorch on every rank"

    def __init__(self, model: DecoderLM, cache: PagedCache, block_size: int, lockstep: Lockstep) -> None:
        super().__init__(model, cache, block_size)
        self.lockstep = lockstep

    def forward(self, rows: list[Row]) -> Forward:
        return self.lockstep.run(forward_step, self, self.block_size, rows)


class NativeRunner(TorchRunner, TokenRunner):
    """The decoding rows through llmkit's C++ step over the paged pools; prompt chunks through PyTorch; rows with
    drafts token by token through the C++ step."""

    kind = "llmkit's C++ decode step (prompt chunks in PyTorch)"

    def __init__(self, model: DecoderLM, cache: PagedCache, block_size: int, native: NativeDecoder) -> None:
        super().__init__(model, cache, block_size)
        self.native = native
        pools = cache.grouped_query() or []
        self.keys, self.values = [p.k for p in pools], [p.v for p in pools]
        # an int8 cache's scales (K, N, bs), passed with its codes
        kept = [p.scales for p in pools if p.scales is not None]
        self.scales = ([k for k, _ in kept], [v for _, v in kept]) if kept else None

    def groups(self, plan: StepPlan) -> list[list[int]]:
        return [plan.decoding, plan.chunks]

    def takes_adapters(self, rows: list[Row]) -> bool:
        """Decoding rows keep the C++ step with their adapters (prompt chunks take the PyTorch hooks)."""
        return all(len(r.tokens) == 1 and not r.drafts for r in rows) and self._in_cpp_step(rows)

    def _in_cpp_step(self, rows: list[Row]) -> bool:
        return self.adapters is not None and self.adapters.in_cpp_step([r.adapter for r in rows])

    def _low_rank(self, rows: list[Row], counts: list[int] | None = None) -> LowRankStep | None:
        """The rows' adapters for the C++ step (None where no row chose one; _tokens and forward only see rows
        whose adapters takes_adapters allowed)."""
        if self.adapters is None or all(r.adapter is None for r in rows):
            return None
        return self.adapters.low_rank([r.adapter for r in rows], counts or [len(r.tokens) for r in rows])

    def forward(self, rows: list[Row]) -> Forward:
        if any(r.drafts for r in rows):
            return self._tokens(rows)
        if any(len(r.tokens) > 1 for r in rows):
            return super().forward(rows)
        dev = self.model.device
        table, filled = self._tables(rows)
        starts = torch.tensor([r.start for r in rows], device=dev)
        tokens = torch.tensor([r.tokens for r in rows], device=dev)  # (B, 1)
        h = self.native.run_paged(
            tokens,
            positions=starts[:, None],
            table=table,
            slots=starts,
            allowed=filled,
            keys=self.keys,
            values=self.values,
            scales=self.scales,
            adapters=self._low_rank(rows),
        )  # fmt: skip  (B, 1, C)
        hidden = list(h)
        logits = self.model.logits(self.model.norm(h[:, -1]))  # (B, V)
        return Forward(hidden, list(logits), prompt_logits(self.model, hidden, [r.prompt_n for r in rows]))

    def token_states(self, tokens: Tensor, slots: Tensor, table: Tensor) -> Tensor:
        dev, S = self.model.device, table.shape[1] * self.block_size
        allowed = torch.arange(S, device=dev)[None] <= slots.to(dev)[:, None]  # (N, S)
        return self.native.run_tokens(
            tokens.to(dev), positions=slots.to(dev), table=table.to(dev), allowed=allowed, keys=self.keys,
            values=self.values, scales=self.scales,
        )  # fmt: skip

    def token_logits(self, h: Tensor, invariant: bool = True) -> Tensor:
        return self.native.logits(self.model.norm(h), invariant=invariant)

    def _tables(self, rows: list[Row]) -> tuple[Tensor, Tensor]:
        """Each row's block table (B, nb), padded with its first block, and the slots it may attend to when its
        last token (or draft) is in place (B, nb * block_size)."""
        dev, bs = self.model.device, self.block_size
        nb = max(len(r.table) for r in rows)
        table = torch.tensor([r.table + r.table[:1] * (nb - len(r.table)) for r in rows], device=dev)
        ends = torch.tensor([r.start + len(r.tokens) + len(r.drafts) for r in rows], device=dev)
        return table, torch.arange(nb * bs, device=dev) < ends[:, None]

    def _tokens(self, rows: list[Row]) -> Forward:
        """Every token of the rows (drafts included) through the C++ step as a row of its own (the row's table and
        slots repeated for each of its tokens), the given ones after the generated ones (run_tokens multiplies them
        in panels), the head through row-invariant products. Logits: (1 + k, V) at the token and each draft of a row
        with k drafts; (V,) at the last token of the others."""
        dev = self.model.device
        table, filled = self._tables(rows)
        ids = [list(r.tokens) + list(r.drafts) for r in rows]
        counts = [len(t) for t in ids]
        tokens = torch.tensor([t for row in ids for t in row], device=dev)
        spans = list(zip(rows, counts, strict=True))
        positions = torch.cat([torch.arange(r.start, r.start + n, device=dev) for r, n in spans])
        row = torch.repeat_interleave(torch.arange(len(rows), device=dev), torch.tensor(counts, device=dev))
        given = torch.cat([torch.arange(n, device=dev) < r.given for r, n in spans])  # (N,)
        order = torch.cat([(~given).nonzero()[:, 0], given.nonzero()[:, 0]])  # generated tokens first
        low_rank = self._low_rank(rows, counts)
        if low_rank is not None:  # each token's adapter, in the order the tokens go
            low_rank = dataclasses.replace(low_rank, which=low_rank.which[order.cpu()])
        h = torch.empty(len(tokens), self.model.cfg.d_model, device=dev)
        h[order] = self.native.run_tokens(
            tokens[order],
            positions=positions[order],
            table=table[row[order]].contiguous(),
            allowed=filled[row[order]],
            keys=self.keys,
            values=self.values,
            given_from=len(tokens) - int(given.sum()),
            scales=self.scales,
            adapters=low_rank,
        )  # fmt: skip  (N, C)
        hidden = list(h.split(counts))
        wanted = [s if r.drafts else s[-1:] for r, s in zip(rows, hidden, strict=True)]
        logits = self.native.logits(self.model.norm(torch.cat(wanted)), invariant=True)  # (rows wanted, V)
        out = logits.split([len(s) for s in wanted])
        per_row = [x if r.drafts else x[0] for r, x in zip(rows, out, strict=True)]
        # a prompt's log-probabilities through the same row-invariant head: a text scored as a prompt gets the bits
        # it gets when its tokens are generated
        head = lambda x: self.native.logits(x, invariant=True)  # noqa: E731
        return Forward(hidden, per_row, prompt_logits(self.model, hidden, [r.prompt_n for r in rows], head))


class InvariantRunner(NativeRunner):
    """Every token through the C++ step as a row of its own, the head in row-invariant pieces: a row's bits do not
    depend on the rows beside it. Given and generated tokens are multiplied differently (run_tokens), so only the
    blocks of prompts go to the prefix cache."""

    kind = "llmkit's C++ decode step, every token a row of its own"
    shares_generated = False
    invariant = True

    def groups(self, plan: StepPlan) -> list[list[int]]:
        return [list(range(len(plan.rows)))]

    def takes_adapters(self, rows: list[Row]) -> bool:
        return self._in_cpp_step(rows)

    def forward(self, rows: list[Row]) -> Forward:
        return self._tokens(rows)


def model_runner(
    model: DecoderLM, cache: PagedCache, block_size: int, invariant: bool | None, lockstep: Lockstep | None
) -> ModelRunner:
    """The runner for `model` over `cache`. On a GPU, the paged-attention kernels' (KernelRunner) where every layer
    takes them and Triton is installed, batch-invariant when `invariant` is True. Else the backend
    `resolve` decides (llmkit.generate.backend: the C++ step, batch-invariant unless `invariant` is False, where the
    model lowers to it), where the C++ step also reads the pools (fp32 or int8 caches); else PyTorch, where
    `invariant` must not be True; a model split across ranks (`lockstep`) runs in PyTorch on every rank. An fp8
    cache is read by the kernels only, on a GPU that converts fp8 (compute capability 8.9 or later)."""
    if lockstep is not None:
        if invariant:
            raise InputError("a model split across ranks is served without the batch-invariant mode")
        return LockstepRunner(model, cache, block_size, lockstep)
    kernels = model.device.type == "cuda" and attends_in_place(model) and triton_usable(model.device)
    if cache.kv_dtype == "fp8" and not (kernels and _converts_fp8(model.device)):
        raise InputError(
            "an fp8 KV cache is read by llmkit's paged-attention kernels on an NVIDIA GPU of compute capability 8.9 or "
            "later (Ada, Hopper) with Triton installed; elsewhere --kv-dtype int8 takes the same memory (on a CPU the "
            "C++ step reads it in place)"
        )
    if kernels:
        return KernelRunner(model, cache, block_size, invariant=bool(invariant))
    if invariant and model.device.type == "cuda":
        raise InputError(
            "on a GPU the batch-invariant mode runs on llmkit's Triton kernels, which need Triton installed"
        )
    backend = resolve(model, invariant=invariant)
    pools = cache.grouped_query()
    with torch.no_grad():
        if backend.native is not None and pools is not None and backend.native.applies_paged(1, [p.k for p in pools]):
            runner = InvariantRunner if backend.invariant else NativeRunner
            return runner(model, cache, block_size, backend.native)
    if backend.required:
        raise InputError(
            "the batch-invariant mode runs tokens through llmkit's C++ decode step, which reads fp32 caches"
        )
    return TorchRunner(model, cache, block_size)


def _converts_fp8(device: torch.device) -> bool:
    """Whether Triton converts fp8 E4M3 on `device`: NVIDIA from compute capability 8.9 (ROCm's numbering differs)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


def attends_in_place(model: DecoderLM) -> bool:
    """Whether every layer's attention can be handed a pool that attends in place (GQA, MLA and DSA do)."""
    return all(isinstance(b.attn, SelfAttention) and b.attn.attends_in_place for b in model.blocks)
