"""The GPU's model runner: every row of a step in one forward whose attention reads the paged pools where they lie,
and decoding steps replayed from CUDA graphs.

    StepPlan ─► pack: tokens (1, n), positions, each row's table / first query / queries / first position (PagedRows)
             ─► model.run with KernelKV / KernelLatent views (llmkit.serve.paged): each layer writes its new keys
                into their blocks and calls the paged-attention kernel (llmkit.kernels.paged_attention), which reads
                every row's keys through its table: nothing is gathered and no mask is built
             ─► logits at each row's last token, or at its token and each of its drafts (verified in the same pass)

Decoding rows, prompt chunks and rows with drafts are all rows of some length to the kernel, so a step of any mix is
one forward: the scheduler's plan goes through as it is.

CUDA graphs (DecodeGraphs): a step of decoding rows only launches a few hundred small kernels, and on a GPU their
launches, not the bytes they read, bound it (llmkit decoded a 125M model at 1% of an H100's bandwidth eagerly). So
such a step is captured once per batch-size bucket, as vLLM and SGLang do, with every input in a static buffer (the
tokens, positions, block tables padded to the model's context, each token's block and offset) and replayed: the
rows are copied into the buffers, the bucket's spare rows point at the cache's scratch block. The kernel's grid is
sized by the bucket and the table's width, which the captured launch keeps, and a row's keys are cut into a fixed
number of runs by its own length, so the replay is right for any rows that fit. The model is not touched: capture is
applied from outside, as compilation is.

The batch-invariant mode (`invariant`): every sum a row takes part in is taken in an order that does not depend on
the other rows of the step nor on how its prompt was chunked: products and norms by llmkit.kernels.invariant's
kernels (installed around each step by a dispatch mode, the captured graphs included), attention in one pass over
each row's keys with one tile shape.

Shapes: B rows, n packed tokens, C model dim, V vocabulary, nb blocks per row.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.kernels.index_scores import index_scores, index_scores_reference
from llmkit.kernels.paged_attention import PagedRows, chunks_for, paged_attention, paged_attention_reference
from llmkit.layers.attention.mask import AttentionMask
from llmkit.layers.moe import MoE
from llmkit.models.cache import Step
from llmkit.models.decoder import DecoderLM
from llmkit.serve.forward import Forward, Row, prompt_logits
from llmkit.serve.paged import IndexScores, PagedAttention, PagedCache, Placement
from llmkit.serve.runner_base import StepPlan, TokenRunner

log = logging.getLogger("llmkit.serve")

# batch sizes captured as CUDA graphs: a step of B decoding rows replays the smallest bucket >= B
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# the batch-invariant mode's attention tiles: score rows per program, the same for decoding rows and prompt chunks
INVARIANT_TILE_ROWS = 64


@dataclass(frozen=True)
class Packed:
    """A step's rows packed for one forward: tokens and positions (1, n), where each goes (Placement), and how many
    tokens each row has (its token and drafts, or its chunk)."""

    tokens: Tensor
    positions: Tensor
    at: Placement
    lengths: list[int]


def pack(rows: list[Row], block_size: int, device: torch.device) -> Packed:
    """`rows` packed row after row, each row's drafts after its token."""
    ids = [[*r.tokens, *r.drafts] for r in rows]
    lengths = [len(t) for t in ids]
    nb = max(len(r.table) for r in rows)
    table = torch.tensor([r.table + r.table[:1] * (nb - len(r.table)) for r in rows])  # (B, nb), padded
    positions = torch.cat([torch.arange(r.start, r.start + n) for r, n in zip(rows, lengths, strict=True)])  # (n,)
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))  # (n,) each token's row
    block = table[row, positions // block_size]
    rows_ = PagedRows.of(table, [r.start for r in rows], lengths, device)
    at = Placement(rows_, block.to(device), (positions % block_size).to(device))
    tokens = torch.tensor([t for row_ids in ids for t in row_ids], device=device)[None]
    return Packed(tokens, positions.to(device)[None], at, lengths)


def outputs(model: DecoderLM, rows: list[Row], h: Tensor, lengths: list[int]) -> Forward:
    """Per row, from the packed states h (n, C): its states, its logits ((V,) after its last token; (1 + k, V) after
    its token and each of its k drafts) and the logits of its prompt tokens that were asked for."""
    hidden = list(h.split(lengths))
    wanted = [s[-(1 + len(r.drafts)) :] for r, s in zip(rows, hidden, strict=True)]
    logits = model.logits(model.norm(torch.cat(wanted))).split([len(w) for w in wanted])
    per_row = [x if r.drafts else x[0] for r, x in zip(rows, logits, strict=True)]
    return Forward(hidden, per_row, prompt_logits(model, hidden, [r.prompt_n for r in rows]))


class KernelRunner(TokenRunner):
    """Every row of a step in one forward over the pools read in place; drafts verified in the same forward;
    decoding steps from CUDA graphs where the cache has a scratch block and the device is a GPU (`graphs`).
    `kernel`: the Triton kernel (False: its PyTorch reference, which gathers: for checking this runner on a CPU).
    `invariant`: the batch-invariant mode (a row's bits do not depend on the rows beside it nor on how its prompt
    was cut into chunks): products and norms by llmkit.kernels.invariant's kernels, attention in one pass over a
    row's keys with one tile shape (no key splits, whose number follows the batch)."""

    def __init__(
        self,
        model: DecoderLM,
        cache: PagedCache,
        block_size: int,
        kernel: bool = True,
        graphs: bool = True,
        invariant: bool = False,
    ) -> None:
        super().__init__(model, cache, block_size)
        if invariant:
            _check_invariant(model)
        self.kernel, self.invariant = kernel, invariant
        self.kind = "the paged-attention kernels (Triton), decoding steps from CUDA graphs" + (
            "; batch-invariant products, norms and attention (Triton)" if invariant else ""
        )
        self.kv_heads = max(getattr(b.attn, "n_kv_heads", 1) for b in model.blocks)
        # programs that fill the GPU: two waves over its multiprocessors (an H100's 132 where there is none)
        dev = model.device
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        self.programs = 2 * sms
        # sparse attention's indexer scores: the kernel (its key tiles dealt out to fill the GPU), or the reference
        tiles = INVARIANT_TILE_ROWS if invariant else None
        self.index_scores: IndexScores = (
            functools.partial(index_scores, programs=self.programs, tile_rows=tiles)
            if kernel
            else index_scores_reference
        )
        self.graphs = DecodeGraphs(self) if graphs and kernel and model.device.type == "cuda" else None

    def groups(self, plan: StepPlan) -> list[list[int]]:
        return [list(range(len(plan.rows)))]

    def attention(self, rows: int, max_keys: int, max_queries: int = 1) -> PagedAttention:
        """The attention of a step of `rows` rows of up to `max_keys` keys and `max_queries` queries: the kernel,
        a step of decoding rows with its keys cut into runs where the rows alone would leave the GPU idle (a prompt
        chunk's query tiles fill it); in the batch-invariant mode one pass and one tile shape for every step."""
        if not self.kernel:
            return paged_attention_reference
        if self.invariant:
            return functools.partial(paged_attention, chunks=1, tile_rows=INVARIANT_TILE_ROWS)
        chunks = chunks_for(rows, self.kv_heads, max_keys, self.programs) if max_queries == 1 else 1
        return functools.partial(paged_attention, chunks=chunks)

    def products(self) -> contextlib.AbstractContextManager[object]:
        """Where the model's products and norms run: llmkit's batch-invariant kernels in that mode, else torch's."""
        if not self.invariant:
            return contextlib.nullcontext()
        from llmkit.kernels.invariant import BatchInvariant

        return BatchInvariant(self.model.device.type)

    def forward(self, rows: list[Row]) -> Forward:
        with self.products():
            if self.graphs is not None and self.graphs.takes(rows) and (replayed := self.graphs.run(rows)) is not None:
                return replayed
            return outputs(self.model, rows, self._states(rows), [len(r.tokens) + len(r.drafts) for r in rows])

    def token_states(self, tokens: Tensor, slots: Tensor, table: Tensor) -> Tensor:
        """Each token a row of one query; a sequence's tokens in the same call see each other's keys, since every
        layer writes the step's keys before it attends."""
        tables = table.tolist()
        rows = [Row([t], s, tb) for t, s, tb in zip(tokens.tolist(), slots.tolist(), tables, strict=True)]
        with self.products():
            return self._states(rows)

    def token_logits(self, h: Tensor, invariant: bool = True) -> Tensor:
        with self.products():
            return self.model.logits(self.model.norm(h))

    def _states(self, rows: list[Row]) -> Tensor:
        """The model over `rows` packed -> the last-block states of every token (n, C)."""
        p = pack(rows, self.block_size, self.model.device)
        attention = self.attention(len(rows), p.at.rows.max_keys, p.at.rows.max_q_len)
        views = self.cache.kernel_views(p.at, attention, self.index_scores)
        return self.model.run(p.tokens, Step(p.positions, AttentionMask(), p.positions), views)[0]  # (n, C)


def _check_invariant(model: DecoderLM) -> None:
    """Refuse, before the first request, the layers the batch-invariant mode has no kernels for."""
    from llmkit.quant.linear import QuantizedLinear

    for name, module in model.named_modules():
        if isinstance(module, MoE):
            raise InputError(
                f"the batch-invariant mode on a GPU does not take mixture-of-experts layers ({name}): their tokens "
                "are scattered back to the rows with atomic adds, whose order follows the batch"
            )
        if isinstance(module, QuantizedLinear):
            raise InputError(
                f"the batch-invariant mode on a GPU does not take quantized layers ({name}): serve the model in "
                "bf16 or fp16, or without --batch-invariant"
            )


class StaticStep:
    """A decoding step of `size` rows over static buffers: the inputs `fill` writes (tokens, positions, block
    tables `width` blocks wide, each token's block and offset) and the outputs `forward` computes (states (size, C),
    logits (size, V)). The rows past the real ones read and write the first slot of the `scratch` block. Captured as
    a CUDA graph by DecodeGraphs; it also runs as it is (which is how the tests check it without a GPU)."""

    def __init__(self, runner: KernelRunner, size: int, width: int, scratch: int) -> None:
        self.runner, self.scratch = runner, scratch
        dev, i32 = runner.model.device, torch.int32
        self.rows = PagedRows(
            torch.full((size, width), scratch, device=dev, dtype=i32),  # table
            torch.arange(size, device=dev, dtype=i32),  # q_start: one query a row
            torch.ones(size, device=dev, dtype=i32),  # q_len
            torch.zeros(size, device=dev, dtype=i32),  # start
            max_q_len=1,
            max_keys=width * runner.block_size,
        )
        self.tokens = torch.zeros(1, size, device=dev, dtype=torch.long)
        self.positions = torch.zeros(1, size, device=dev, dtype=torch.long)
        self.block = torch.full((size,), scratch, device=dev, dtype=torch.long)
        self.offset = torch.zeros(size, device=dev, dtype=torch.long)
        self.hidden = self.logits = torch.empty(0)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def fill(self, rows: list[Row]) -> None:
        """Copy `rows` (one token each) into the inputs; the spare rows go to the scratch block's first slot."""
        bs, S, B = self.runner.block_size, self.size, len(rows)
        nb = max(len(r.table) for r in rows)
        table = torch.full((S, nb), self.scratch, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r.table)] = torch.tensor(r.table, dtype=torch.int32)
        start = torch.tensor([r.start for r in rows] + [0] * (S - B))
        self.tokens.copy_(torch.tensor([r.tokens[0] for r in rows] + [0] * (S - B))[None], non_blocking=True)
        self.positions.copy_(start[None], non_blocking=True)
        self.rows.table[:, :nb].copy_(table, non_blocking=True)  # columns past nb are never read: keys stop at start
        self.rows.start.copy_(start.to(torch.int32), non_blocking=True)
        self.block.copy_(table[torch.arange(S), start // bs].long(), non_blocking=True)
        self.offset.copy_(start % bs, non_blocking=True)

    def forward(self) -> tuple[Tensor, Tensor]:
        """The model over the inputs -> states (size, C), logits (size, V)."""
        model, runner = self.runner.model, self.runner
        at = Placement(self.rows, self.block, self.offset)
        views = runner.cache.kernel_views(at, runner.attention(self.size, self.rows.max_keys), runner.index_scores)
        h = model.run(self.tokens, Step(self.positions, AttentionMask(), self.positions), views)[0]  # (size, C)
        return h, model.logits(model.norm(h))


class DecodeGraphs:
    """Steps of decoding rows replayed from CUDA graphs, one captured per bucket on first use (BUCKETS)."""

    def __init__(self, runner: KernelRunner) -> None:
        self.runner = runner
        self.width = -(-runner.model.max_seq_len // runner.block_size)  # table columns: the longest row's blocks
        self.scratch = runner.cache.scratch
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, StaticStep]] = {}
        self.failed: set[int] = set()  # buckets whose capture failed (a layer read back to the host): run eagerly
        self.memory = torch.cuda.graph_pool_handle()  # the graphs share one pool of memory

    def takes(self, rows: list[Row]) -> bool:
        """Whether a step of `rows` replays a graph: decoding rows only (one token, no drafts, no prompt logits), as
        many as the largest bucket, on a cache with a scratch block for the spare rows, where capturing works."""
        return (
            self.scratch is not None
            and len(rows) <= BUCKETS[-1]
            and self.bucket(len(rows)) not in self.failed
            and all(
                len(r.tokens) == 1 and not r.drafts and r.prompt_n == 0 and len(r.table) <= self.width for r in rows
            )
        )

    @staticmethod
    def bucket(rows: int) -> int:
        return next(b for b in BUCKETS if b >= rows)

    def run(self, rows: list[Row]) -> Forward | None:
        """The step of `rows` from its bucket's graph, or None where capturing it failed (then the runner steps
        of that bucket run eagerly from now on)."""
        B = len(rows)
        size = self.bucket(B)
        if size not in self.captured:
            try:
                self._capture(size)
            except Exception as e:  # (a forward that reads back to the host cannot be captured)
                log.warning("capturing the decoding step of %d rows as a CUDA graph failed (%s: %s); such steps run "
                            "eagerly", size, type(e).__name__, e)  # fmt: skip
                self.failed.add(size)
                return None
        graph, step = self.captured[size]
        step.fill(rows)
        graph.replay()
        h = step.hidden[:B].clone()  # (B, C): the buffers are overwritten by the next replay
        return Forward(list(h[:, None]), list(step.logits[:B].clone()), [None] * B)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, StaticStep]:
        """Capture the step of `size` rows: warm up on a side stream (Triton compiles its kernels on first call,
        which a capture must not see), then record one forward of spare rows."""
        assert self.scratch is not None
        step = StaticStep(self.runner, size, self.width, self.scratch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            step.hidden, step.logits = step.forward()
        log.info("captured the decoding step of %d rows as a CUDA graph", size)
        self.captured[size] = (graph, step)
        return graph, step
