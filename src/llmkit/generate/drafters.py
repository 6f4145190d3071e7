"""Drafters for speculative decoding: whatever proposes the next k tokens cheaply, behind one protocol.

    start(prefix, valid, hidden)          read the prompt (all but its last token) and the target's states there
    propose(cur, sampling, generator)     k draft tokens after `cur`, with the probabilities they were drawn from
                                          (greedy: the argmax tokens alone, no probabilities)
    settle(cur, drafts, accepted, hidden) the target kept `accepted` of them: catch up, forget the rest

Two drafters: a smaller model with the same tokenizer (`ModelDrafter`, Leviathan et al. 2023), and the target's own
first multi-token-prediction module (`MTPDrafter`, DeepSeek-V3 §2.2), which drafts one token from the target's
hidden state and keeps an attention cache of its own. A drafter holds one generation's state; what an MTP drafter
reads of the target (its head, its block's C++ step, their low-precision copies) is an `MTPDraft`, made once and
kept across generations. Shapes: B rows, k drafts, V vocabulary, C model dim.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.generate.prompts import pad
from llmkit.generate.sampling import Sampling, distribution, draw
from llmkit.generate.step import DecodeStep, choose_step
from llmkit.layers.mtp import MTPModule
from llmkit.layers.softcap import soft_cap
from llmkit.models import Cache, DecoderLM, SequenceState
from llmkit.quant.native_step import NativeDecoder


class Drafter(Protocol):
    """Proposes k tokens per round for the target to check."""

    k: int

    def start(self, prefix: Tensor, valid: Tensor, hidden: Tensor | None) -> None:
        """prefix (B, P) and valid (B, P): the prompts, left-padded, which the target has computed; hidden (B, P, C):
        the target's last-block states there. The first `propose` drafts after the token the target chose next."""

    def propose(
        self, cur: Tensor, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[Tensor | None, Tensor]:
        """(q (B, k, V), drafts (B, k)): draft tokens after cur (B,) and the distributions they were drawn from;
        q is None when sampling is greedy (the acceptance rule then needs only the tokens)."""
        ...

    def settle(self, cur: Tensor, drafts: Tensor, accepted: Tensor, hidden: Tensor) -> None:
        """The target accepted the first accepted[b] drafts of row b; hidden (B, k + 1, C): its states at cur,
        d1 .. dk."""


class ModelDrafter:
    """A smaller model drafting k tokens with its own cache, its steps run by `step` (choose_step's when None: in C++
    where it can). Rejected drafts are forgotten from its cache."""

    def __init__(self, model: DecoderLM, k: int, batch: int, room: int, step: DecodeStep | None = None) -> None:
        self.model, self.k = model, k
        self.step = step if step is not None else choose_step(model)
        self.cache = model.new_cache(batch, room)
        self.carry: list[list[int]] = [[] for _ in range(batch)]  # accepted drafts the cache has not seen yet

    def start(self, prefix: Tensor, valid: Tensor, hidden: Tensor | None) -> None:
        if prefix.shape[1]:
            self.step(prefix, self.cache, valid, last=True, given=True)

    def propose(
        self, cur: Tensor, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[Tensor | None, Tensor]:
        rows = [[*carry, c] for carry, c in zip(self.carry, cur.tolist(), strict=True)]
        tokens, valid = pad(rows, "left", device=cur.device)
        some_padded = any(len(r) != len(rows[0]) for r in rows)  # else every new token is real: no mask to apply
        logits, _ = self.step(tokens, self.cache, valid if some_padded else None, last=True)
        qs, ds = [], []
        for i in range(self.k):
            if sampling.greedy:
                nxt = logits[:, -1].argmax(dim=-1)  # (B,)
            else:
                probs = distribution(logits[:, -1], sampling)  # (B, V)
                nxt = draw(probs, False, generator)
                qs.append(probs)
            ds.append(nxt)
            if i < self.k - 1:
                logits, _ = self.step(nxt.unsqueeze(1), self.cache)
        return (torch.stack(qs, 1) if qs else None), torch.stack(ds, 1)

    def settle(self, cur: Tensor, drafts: Tensor, accepted: Tensor, hidden: Tensor) -> None:
        # the cache holds cur, d1 .. d(k-1): keep cur and the accepted ones; dk was never fed, so when every draft
        # was accepted it is fed (carried) with the next round's first token
        self.cache.state.discard((self.k - 1 - accepted).clamp(min=0), span=self.k - 1)
        last = drafts[:, -1].tolist()
        self.carry = [[last[b]] if a == self.k else [] for b, a in enumerate(accepted.tolist())]


def draft_head(target: DecoderLM, bits: int | None, native: NativeDecoder | None) -> Callable[[Tensor], Tensor]:
    """The output head an MTP drafter reads: the target's own (bits None; through the C++ product with `native`), or
    an int8 / int4 copy of it (bits 8 / 4), a quarter / an eighth of its bytes. At batch 1 the head is most of a
    draft's cost (SmolLM2: a 113 MB head after a 14 MB block), and the copy's rounding can only change which token
    is drafted, never the output: the target verifies every draft with its own head."""
    if bits is None:
        return native.logits if native is not None else target.logits
    if bits not in (4, 8):
        raise InputError(f"draft_head_bits={bits!r} must be 4, 8 or None (the target's own head)")
    from llmkit.quant.linear import Int4Linear, Int8Linear

    if target.head is not None and type(target.head) is not nn.Linear:  # already quantized: its own kernels
        return native.logits if native is not None else target.logits
    head: Tensor = target.embed.weight if target.head is None else cast(Tensor, target.head.weight)
    weight = head.detach()
    if weight.dtype != torch.float32 or weight.shape[1] % 32:
        return native.logits if native is not None else target.logits  # already low precision or quantized

    layer = (Int8Linear if bits == 8 else Int4Linear)(
        weight.shape[1], weight.shape[0], group_size=32, device=weight.device, dtype=weight.dtype
    )
    layer.load_weight(weight)
    bias, cap = target.head_bias, target.cfg.logit_softcap
    return lambda h: soft_cap(layer(h) if bias is None else layer(h) + bias, cap)


def draft_block(module: MTPModule, bits: int | None, native: NativeDecoder | None) -> Any | None:
    """The C++ step of the MTP module's block (None without `native`), reading an int8 / int4 copy of its weights
    with bits 8 / 4 (like the head's copy: cheaper drafts, the same output), or its own when they do not quantize."""
    if native is None:
        return None
    if bits in (4, 8):
        from llmkit.quant import quantize

        try:
            low = quantize(copy.deepcopy(module.block), "int8" if bits == 8 else "int4")
        except InputError:  # widths the int4 groups do not divide, or an already quantized block
            return native.block(module.block)
        step = native.block(low)
        if step is not None:
            return step
    return native.block(module.block)


class MTPDraft:
    """What an MTP drafter reads of `target`, made once (quantizing SmolLM2's int4 head and block copies took ~0.27
    s, 13% of a 128-token generation) and kept across generations: its first MTP module, the output head (the
    target's own, or with head_bits an int8 / int4 copy: draft_head) and the C++ step of the module's block (None
    without `native`, the target's C++ step: draft_block). The copies hold the weights as they were when it was
    made: make another after changing them."""

    def __init__(self, target: DecoderLM, native: NativeDecoder | None = None, head_bits: int | None = None) -> None:
        if not len(target.mtp):
            raise InputError("no draft model given and the target has no MTP module to draft with (mtp_depth 0)")
        module = target.mtp[0]
        assert isinstance(module, MTPModule)
        self.target, self.module, self.native = target, module, native
        self.head = draft_head(target, head_bits, native)
        self.block = draft_block(module, head_bits, native)


class MTPDrafter:
    """Drafts k tokens per round with the target's first multi-token-prediction module, applied in a chain.

    MTP module 1 at position j reads the main model's hidden state h_j and the embedding of token j + 1, and
    predicts token j + 2. To draft the token after `cur` (position n + 1), it needs its input at position n - 1:
    h_(n-1) and cur. Its normed output stands in for the target's normed state at n (a module trained to regress
    that state, as EAGLE's drafter is, keeps it close), so with k > 1 the module reads its own output and the first
    draft next, and so on: k cheap steps of one block and the head. Positions computed from drafted states are
    forgotten when the round settles; the accepted ones are redone from the target's true states, together with the
    next round's first step (one call). With a C++ step in `draft` (MTPDraft), the module's block runs as one."""

    def __init__(self, draft: MTPDraft, batch: int, room: int, k: int = 1) -> None:
        target, module = draft.target, draft.module
        self.target, self.module, self.native, self.k = target, module, draft.native, k
        self.block, self.head = draft.block, draft.head  # the block's C++ step (or None), the head
        device, dtype = target.device, target.dtype
        layer = module.block.attn.new_cache(batch, room, device, dtype)
        self.cache = Cache([layer], SequenceState.new(batch, room, device))
        self.last: Tensor | None = None  # (B, 1, C): the target's state before `cur`
        # accepted drafts whose positions the cache has not seen from true states yet: tokens (B, c), the target's
        # states before them (B, c, C), real (B, c) (rows accept different numbers: left-padded)
        self.carry: tuple[Tensor, Tensor, Tensor] | None = None
        self.chained = 0  # positions the last round computed from drafted states

    @classmethod
    def room(cls, prompt: int, max_new_tokens: int, k: int) -> int:
        """Cache slots a generation can use: each round writes up to k redone positions and k new ones."""
        return prompt + (max_new_tokens + 1) * (2 * k + 1)

    def run(self, tokens: Tensor, hidden: Tensor, valid: Tensor | None, normed: bool = False) -> Tensor:
        """MTP positions whose hidden states (B, T, C) and next tokens (B, T) are known -> normed outputs (B, T, C).
        hidden is the target's last-block output, or (normed) the module's own output standing in for it."""
        t, m = self.target, self.module
        step = self.cache.state.advance(tokens.shape[1], valid)
        emb = t.inputs(t.embed, tokens, step.positions)
        h = hidden if normed else t.norm(hidden)
        if self.native is not None and self.block is not None and self.native.applies(tokens, step, self.cache.layers):
            x = m.combine(h, emb)  # (B, T, C)
            return m.norm(self.native.run_blocks([self.block], x, step, self.cache.layers))
        return m(h, emb, t.attention_inputs(step), self.cache.layers[0])

    def start(self, prefix: Tensor, valid: Tensor, hidden: Tensor | None) -> None:
        if hidden is None or prefix.shape[1] == 0:
            return
        # MTP position j reads h_j and token j + 1: both must be real tokens (left padding)
        if prefix.shape[1] > 1:
            self.run(prefix[:, 1:], hidden[:, :-1], valid[:, :-1] & valid[:, 1:])
        self.last = hidden[:, -1:]

    def propose(
        self, cur: Tensor, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[Tensor | None, Tensor]:
        B = cur.shape[0]
        if self.last is None:  # no state to draft from (start had none). Propose token 0 with certainty (q is
            # one-hot, so the acceptance rule stays exact: accepted with probability p(0))
            q = torch.zeros(B, self.k, self.target.cfg.vocab_size, device=cur.device)
            q[:, :, 0] = 1.0
            self.chained = 0
            return q, torch.zeros(B, self.k, dtype=torch.long, device=cur.device)
        tokens, hidden, valid = cur.unsqueeze(1), self.last, None
        if self.carry is not None:  # the accepted positions, redone from true states, in the same call
            c_tokens, c_hidden, c_valid = self.carry
            tokens, hidden = torch.cat([c_tokens, tokens], 1), torch.cat([c_hidden, hidden], 1)
            valid = None if bool(c_valid.all()) else torch.cat([c_valid, c_valid.new_ones(B, 1)], 1)
            self.carry = None
        out = self.run(tokens, hidden, valid)[:, -1:]  # (B, 1, C)
        qs, ds = [], []
        for i in range(self.k):
            logits = self.head(out[:, -1])  # (B, V)
            if sampling.greedy:
                nxt = logits.argmax(dim=-1)
            else:
                probs = distribution(logits, sampling)
                nxt = draw(probs, False, generator)
                qs.append(probs)
            ds.append(nxt)
            if i < self.k - 1:
                out = self.run(nxt.unsqueeze(1), out, None, normed=True)  # the next position, from the draft
        self.chained = self.k - 1
        return (torch.stack(qs, 1) if qs else None), torch.stack(ds, 1)

    def settle(self, cur: Tensor, drafts: Tensor, accepted: Tensor, hidden: Tensor) -> None:
        B = drafts.shape[0]
        if self.chained:  # positions computed from drafted states: forgotten, whatever was accepted
            self.cache.state.discard(torch.full((B,), self.chained, dtype=torch.long), span=self.chained)
        self.chained = 0
        # accepted drafts d_1 .. d_a: MTP positions (target state at cur, d_1), .., (state at d_(a-1), d_a), left-padded
        most = int(accepted.max())
        if most:
            cols = torch.arange(most, device=drafts.device)  # (c,)
            take = (cols.unsqueeze(0) - most + accepted.unsqueeze(1)).clamp(min=0)  # (B, c): right-aligned
            real = cols.unsqueeze(0) >= most - accepted.unsqueeze(1)
            rows = torch.arange(B, device=drafts.device).unsqueeze(1)
            self.carry = (drafts.gather(1, take), hidden[rows, take], real)
        rows1 = torch.arange(B, device=hidden.device)
        self.last = hidden[rows1, accepted].unsqueeze(1)  # the state before the next round's cur
