"""The serving engine's drafters (the policy, the drafting loop and the verdicts are speculation.py's Speculator).

MTPSpeculator drafts with the model's own first multi-token-prediction module (DeepSeek-V3 §2.2, as `llmkit
generate --mtp` does for one generation). Where its state lives, beside the engine's pools and under the same
block tables:

    hidden   (N, bs, C)      the target's last-block state of every slot, written by every forward (prompt chunks,
                             decoding, verifying): an MTP input can be read for any slot, a prefix-cached one too
    keys     (KH, N, bs, D)  the MTP block's keys and values. MTP position j reads h_j and token j + 1 and is kept in
    values                   slot j + 1, so a block's MTP keys depend only on the tokens up to its end (as its
                             target keys do): sequences sharing a cached block write the same values into it

ModelSpeculator drafts with a smaller model that shares the tokenizer (Leviathan et al. 2023; `llmkit generate
--draft`), run by a model runner of its own (the C++ step's on a CPU, the paged-attention kernels' on a GPU) over
pools of its own under the same block tables: its keys in slot i depend on the tokens up to i, so prefix sharing and
preemption need nothing more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.backend import NATIVE_NEEDS
from llmkit.generate.drafters import MTPDraft
from llmkit.kernels.paged_rows import PagedRows
from llmkit.layers.attention.cache import KVCache
from llmkit.layers.attention.mask import AttentionMask
from llmkit.models.cache import Step
from llmkit.models.decoder import DecoderLM
from llmkit.quant.native_step import NativeDecoder
from llmkit.serve.config import EngineConfig
from llmkit.serve.kernel_runner import KernelRunner
from llmkit.serve.kv_manager import KVCacheManager
from llmkit.serve.model_runner import NativeRunner
from llmkit.serve.paged import KernelKV, KernelLatent, KVPool, LatentPool, PagedCache, Placement
from llmkit.serve.runner_base import ModelRunner, TokenRunner
from llmkit.serve.scheduler import Work
from llmkit.serve.speculation import Costs, ModelDrafting, Speculator


class MTPSpeculator(ModelDrafting):
    """Drafts with `model`'s first MTP module for the engine's decoding rows. head_bits 8 / 4: draft through an
    int8 / int4 copy of the head and of the module's block (cheaper drafts, the same output)."""

    def __init__(
        self, model: DecoderLM, target: TokenRunner, kv: KVCacheManager, k: int, head_bits: int | None = None
    ) -> None:
        """target: the engine's runner (the C++ step's, or the GPU's kernel runner), its pools' blocks all free yet
        (Costs.measure writes into block 0)."""
        if not len(model.mtp):
            raise InputError(
                "speculative serving drafts with the model's multi-token-prediction module, and this model has none "
                "(graft one with `llmkit graft-mtp`)"
            )
        super().__init__(model, target, kv, k)
        n_blocks, block_size = target.cache.n_blocks, target.block_size
        # the module's block runs on the C++ step beside a C++ runner, else through the GPU runner's kernel
        self.native = target.native if isinstance(target, NativeRunner) else None
        self.kernels = target if isinstance(target, KernelRunner) else None
        if self.native is None and self.kernels is None:
            raise InputError(
                f"the MTP module's block runs on the C++ step or the GPU runner, not {type(target).__name__}"
            )
        self.draft = MTPDraft(model, self.native, head_bits)
        if self.native is not None and self.draft.block is None:
            raise InputError(
                "the MTP module's block does not run in llmkit's C++ step, which speculative serving needs"
            )
        device, dtype = model.device, model.dtype
        cache = self.draft.module.block.attn.new_cache(n_blocks, block_size, device, dtype)
        if not isinstance(cache, KVCache) and self.native is not None:  # (the C++ step runs grouped-query blocks)
            raise InputError(
                "the MTP module's block has latent attention, which llmkit's C++ step does not run: speculative "
                "serving with it needs the GPU runner"
            )
        # the module's own pool: keys and values (KH, N, bs, D), or latent attention's latents (N, bs, r) ...
        self.pool = KVPool.of(cache) if isinstance(cache, KVCache) else LatentPool.of(cache)
        self.hidden = torch.zeros(n_blocks, block_size, model.cfg.d_model, device=device, dtype=dtype)
        with torch.no_grad():
            self.costs = Costs.measure(self)  # what steps and drafts cost here

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes + self.hidden.numel() * self.hidden.element_size()

    def _record(self, rows: list[Work], hidden: list[Tensor], counts: list[int]) -> None:
        """The target's states into the hidden pool at the rows' slots (MTP slot i reads h_(i-1))."""
        blocks: list[int] = []
        offsets: list[int] = []
        bs = self.bs
        for w, n in zip(rows, counts, strict=True):
            table = self.kv.table(w.seq)
            blocks += [table[s // bs] for s in range(w.start, w.start + n)]
            offsets += [s % bs for s in range(w.start, w.start + n)]
        dev = self.hidden.device
        where = (torch.tensor(blocks, device=dev), torch.tensor(offsets, device=dev))
        self.hidden[where] = torch.cat([h[:n] for h, n in zip(hidden, counts, strict=True)]).to(self.hidden.dtype)

    def head(self, out: Tensor) -> Tensor:
        return self.draft.head(out)

    def _step(self, works: list[Work], slots: Tensor, ids: Tensor, out: Tensor) -> Tensor:
        return self._mtp(works, slots, ids, out)  # the module reads its own output for the target's state

    def draft_scratch(self, slots: Tensor, table: Tensor, allowed: Tensor) -> Tensor:
        x = torch.zeros(slots.shape[0], self.model.cfg.d_model, device=self.hidden.device, dtype=self.hidden.dtype)
        return self.draft.head(self.draft.module.norm(self.block_rows(x, slots, table)))

    def _catch_up(self, rows: list[Work]) -> Tensor:
        """MTP over every row's slots from its mtp_next to its cur (slot w.start), from the target's true states;
        returns the normed output at each row's cur (R, C)."""
        works, slots, last = self._spans(rows)
        ids = [w.seq.tokens[s] for w, s in zip(works, slots, strict=True)]
        slot = torch.tensor(slots)
        hidden = self._hidden(works, slot - 1)  # h_(i-1): the target's state one slot before
        out = self._mtp(works, slot, torch.tensor(ids), self.model.norm(hidden))
        return out[torch.tensor(last)]

    def _hidden(self, works: list[Work], slots: Tensor) -> Tensor:
        """The target's states at slots (M,) of the works' sequences (M, C)."""
        bs, dev = self.bs, self.hidden.device
        blocks = [self.kv.table(w.seq)[s // bs] for w, s in zip(works, slots.tolist(), strict=True)]
        return self.hidden[torch.tensor(blocks, device=dev), (slots % bs).to(dev)]

    def _mtp(self, works: list[Work], slots: Tensor, ids: Tensor, h: Tensor) -> Tensor:
        """The MTP module at slots (M,) of the works' sequences (one row each), reading tokens ids (M,) and states h
        (M, C) (normed: the target's with the final norm, or the module's own output) -> its normed outputs (M, C).
        Writes each slot's keys and values; a slot sees its sequence's MTP slots 1 .. itself."""
        model, module = self.model, self.draft.module
        dev = self.hidden.device
        slots, ids = slots.to(dev), ids.to(dev)
        emb = model.inputs(model.embed, ids[:, None], slots[:, None])[:, 0]  # (M, C): token j + 1 at its own position
        x = module.combine(h.to(emb.dtype), emb).contiguous()
        return module.norm(self.block_rows(x, slots, self._tables(works, dev)))

    def block_rows(self, x: Tensor, slots: Tensor, table: Tensor) -> Tensor:
        """The MTP block over rows x (M, C), row m into its slots[m] through table[m] (M, nb), seeing its sequence's
        MTP slots 1 .. slots[m], at RoPE position slots[m] - 1 -> (M, C): on the C++ step, or as one-query rows of
        the GPU runner's kernel over the module's pool."""
        dev, bs = x.device, self.bs
        slots, table = slots.to(dev).contiguous(), table.to(dev)
        positions = slots - 1  # MTP position j lives in slot j + 1 (and attends at j, as in training)
        if self.native is not None:
            s = torch.arange(table.shape[1] * bs, device=dev)
            allowed = (s[None] <= slots[:, None]) & (s[None] >= 1)  # (M, S)
            rope = self.native._rope(positions[:, None])
            ext = self.native.ext
            assert isinstance(self.pool, KVPool)
            return ext.decode_paged([self.draft.block], x, [self.pool.k], [self.pool.v], table, slots, allowed, *rope)
        assert self.kernels is not None
        M = len(slots)
        one = torch.ones(M, device=dev, dtype=torch.int32)
        first = torch.arange(M, device=dev, dtype=torch.int32)  # each row's query
        rows = PagedRows(table.int(), first, one, slots.int(), 1, table.shape[1] * bs, first_key=1)
        at = Placement(rows, table.gather(1, (slots // bs)[:, None])[:, 0], slots % bs)
        attention = self.kernels.attention(M, rows.max_keys)
        view: KernelKV | KernelLatent = (
            KernelKV(self.pool, at, attention)
            if isinstance(self.pool, KVPool)
            else KernelLatent(self.pool, at, attention, self.kernels.index_scores)
        )
        inputs = self.model.attention_inputs(Step(positions[None], AttentionMask(), slots[None]))
        return self.draft.module.block(x[None], inputs, view)[0]


class ModelSpeculator(ModelDrafting):
    """Drafts with `draft`, a smaller model with the target's vocabulary, run by a model runner of its own over paged
    pools of its own (its keys in slot i: token i's, as the target's), under the engine's block tables."""

    first_slot = 0

    def __init__(self, model: DecoderLM, target: TokenRunner, kv: KVCacheManager, k: int, draft: DecoderLM) -> None:
        """target: the engine's runner, its pools' blocks all free yet."""
        if draft.cfg.vocab_size != model.cfg.vocab_size:
            raise InputError(
                f"the draft's vocabulary ({draft.cfg.vocab_size}) differs from the model's ({model.cfg.vocab_size}): "
                "they must share a tokenizer"
            )
        super().__init__(model, target, kv, k)
        self.draft = draft.eval()
        self.runner = draft_runner(draft, target)
        with torch.no_grad():
            self.costs = Costs.measure(self)

    @property
    def nbytes(self) -> int:
        return self.runner.cache.nbytes

    def head(self, out: Tensor) -> Tensor:
        return self.runner.token_logits(out, invariant=False)  # (a draft's rounding changes nothing it yields)

    def _catch_up(self, rows: list[Work]) -> Tensor:
        works, slots, last = self._spans(rows)
        ids = [w.seq.tokens[s] for w, s in zip(works, slots, strict=True)]
        out = self._run(works, torch.tensor(slots), torch.tensor(ids))
        return out[torch.tensor(last)]

    def _record(self, rows: list[Work], hidden: list[Tensor], counts: list[int]) -> None:
        return  # a draft model reads tokens only, never the target's states

    def _step(self, works: list[Work], slots: Tensor, ids: Tensor, out: Tensor) -> Tensor:
        return self._run(works, slots, ids)  # (a model drafts from its own keys: the state before is not needed)

    def _run(self, works: list[Work], slots: Tensor, ids: Tensor) -> Tensor:
        """The draft model over tokens ids (M,) in slots (M,) of the works' sequences, one row each, writing its keys
        -> its last-block states (M, C')."""
        return self.runner.token_states(ids, slots, self._tables(works, self.draft.device))

    def draft_scratch(self, slots: Tensor, table: Tensor, allowed: Tensor) -> Tensor:
        return self.head(self.runner.token_states(torch.zeros_like(slots), slots, table))


def draft_runner(draft: DecoderLM, target: TokenRunner) -> TokenRunner:
    """A runner for the draft model over pools of its own with the target's blocks: the paged-attention kernels'
    beside a GPU runner, else the C++ step's."""
    n_blocks, bs = target.cache.n_blocks, target.block_size
    cache = PagedCache(draft, n_blocks, bs, draft.device, draft.dtype)
    if isinstance(target, KernelRunner):
        return KernelRunner(draft, cache, bs, kernel=target.kernel, graphs=False)
    step = NativeDecoder.of(draft)
    pooled = cache.grouped_query()
    with torch.no_grad():  # (how the engine's steps run)
        runs = step is not None and pooled is not None and step.applies_paged(1, [p.k for p in pooled])
    if step is None or not runs:
        raise InputError(
            "the draft model does not run in llmkit's C++ step, which speculative serving on a CPU needs (a "
            "grouped-query decoder in fp32 or int4/int8 on an x86 CPU)"
        )
    return NativeRunner(draft, cache, bs, step)


def speculator(
    model: DecoderLM, target: ModelRunner, kv: KVCacheManager, config: EngineConfig, draft: DecoderLM | None
) -> Speculator:
    """The engine's drafter of config.draft_tokens (> 0) drafts a step: `draft` when given, the sequences' own text
    with config.ngram, else the model's MTP module. target: the engine's runner, which verifies the drafts: one that
    runs tokens as rows (TokenRunner)."""
    if not isinstance(target, TokenRunner):
        raise InputError(
            "speculation verifies drafts in llmkit's C++ decode step or its GPU runner: it needs a CUDA GPU, or "
            f"{NATIVE_NEEDS}, fp32 caches"
        )
    if draft is not None and config.ngram:
        raise InputError("a draft model and n-gram drafting are two drafters: give one")
    if draft is not None:
        return ModelSpeculator(model, target, kv, config.draft_tokens, draft)
    if config.ngram:
        from llmkit.serve.ngram import NgramSpeculator

        return NgramSpeculator(model, target, kv, config.draft_tokens)
    return MTPSpeculator(model, target, kv, config.draft_tokens, config.draft_head_bits)
