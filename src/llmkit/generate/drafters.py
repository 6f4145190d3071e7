"""Drafters for speculative decoding: whatever proposes the next k tokens cheaply, behind one protocol.

    start(prefix, valid, hidden)          read the prompt (all but its last token) and the target's states there
    propose(cur, sampling, generator)     k draft tokens after `cur`, with the probabilities they were drawn from
                                          (greedy: the argmax tokens alone, no probabilities)
    settle(cur, drafts, accepted, hidden) the target kept `accepted` of them: catch up, forget the rest

Two drafters: a smaller model with the same tokenizer (`ModelDrafter`, Leviathan et al. 2023), and the target's own
first multi-token-prediction module (`MTPDrafter`, DeepSeek-V3 §2.2), which drafts one token from the target's
hidden state and keeps an attention cache of its own. Shapes: B rows, k drafts, V vocabulary, C model dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
from torch import Tensor, nn

from llmkit.errors import InputError
from llmkit.generate.native import NativeDecoder
from llmkit.generate.prompts import pad
from llmkit.generate.sampling import Sampling, distribution, draw
from llmkit.generate.step import decode_step
from llmkit.layers.mtp import MTPModule
from llmkit.layers.softcap import soft_cap
from llmkit.models import Cache, DecoderLM, SequenceState


class Drafter(Protocol):
    """Proposes k tokens per round for the target to check."""

    k: int

    def start(self, prefix: Tensor, valid: Tensor, hidden: Tensor | None) -> None:
        """prefix (B, P) and valid (B, P): the prompts but their last tokens, left-padded (P may be 0); hidden
        (B, P, C): the target's last-block states there (None when P is 0)."""

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
    """A smaller model drafting k tokens with its own cache. Rejected drafts are forgotten from its cache."""

    def __init__(self, model: DecoderLM, k: int, batch: int, room: int, compiled: bool = False) -> None:
        self.model, self.k, self.compiled = model, k, compiled
        self.native = None if compiled else NativeDecoder.of(model)  # its single-token steps, in C++ where it can
        self.cache = model.new_cache(batch, room)
        self.carry: list[list[int]] = [[] for _ in range(batch)]  # accepted drafts the cache has not seen yet

    def start(self, prefix: Tensor, valid: Tensor, hidden: Tensor | None) -> None:
        if prefix.shape[1]:
            decode_step(self.model, prefix, self.cache, valid, self.compiled, last=True)

    def propose(
        self, cur: Tensor, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[Tensor | None, Tensor]:
        rows = [[*carry, c] for carry, c in zip(self.carry, cur.tolist(), strict=True)]
        tokens, valid = pad(rows, "left", device=cur.device)
        some_padded = any(len(r) != len(rows[0]) for r in rows)  # else every new token is real: no mask to apply
        logits, _ = decode_step(
            self.model, tokens, self.cache, valid if some_padded else None, self.compiled, self.native, last=True
        )
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
                logits, _ = decode_step(self.model, nxt.unsqueeze(1), self.cache, None, self.compiled, self.native)
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


class MTPDrafter:
    """Drafts one token per round with the target's first multi-token-prediction module.

    MTP module 1 at position j reads the main model's hidden state h_j and the embedding of token j + 1, and
    predicts token j + 2. To draft the token after `cur` (position n + 1), it needs its input at position n - 1:
    h_(n-1) and cur. With `native`, the module's block runs as a C++ step too."""

    k = 1

    def __init__(
        self,
        target: DecoderLM,
        batch: int,
        room: int,
        native: NativeDecoder | None = None,
        head_bits: int | None = None,
    ) -> None:
        module = target.mtp[0]
        assert isinstance(module, MTPModule)
        self.target, self.module, self.native = target, module, native
        self.block = native.block(module.block) if native is not None else None  # its C++ step, or None
        self.head = draft_head(target, head_bits, native)
        device, dtype = target.embed.weight.device, target.embed.weight.dtype
        layer = module.block.attn.new_cache(batch, room, device, dtype)
        self.cache = Cache([layer], SequenceState.new(batch, room, device))
        self.last: Tensor | None = None  # (B, 1, C): the target's state before `cur`

    def run(self, tokens: Tensor, hidden: Tensor, valid: Tensor | None) -> Tensor:
        """MTP positions whose hidden states (B, T, C) and next tokens (B, T) are known -> normed outputs (B, T, C)."""
        t, m = self.target, self.module
        step = self.cache.state.advance(tokens.shape[1], valid)
        emb = t.inputs(t.embed, tokens, step.positions)
        if self.native is not None and self.block is not None and self.native.applies(tokens, step, self.cache.layers):
            x = m.combine(t.norm(hidden), emb)  # (B, T, C)
            return m.norm(self.native.run_blocks([self.block], x, step, self.cache.layers))
        return m(t.norm(hidden), emb, t.attention_inputs(step), self.cache.layers[0])

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
        if self.last is None:  # a one-token prompt: no state to draft from yet. Propose token 0 with certainty (q is
            # one-hot, so the acceptance rule stays exact: accepted with probability p(0))
            q = torch.zeros(cur.shape[0], 1, self.target.cfg.vocab_size, device=cur.device)
            q[:, :, 0] = 1.0
            return q, torch.zeros(cur.shape[0], 1, dtype=torch.long, device=cur.device)
        out = self.run(cur.unsqueeze(1), self.last, None)  # (B, 1, C)
        if sampling.greedy:
            return None, self.head(out[:, -1]).argmax(dim=-1, keepdim=True)
        q = distribution(self.head(out[:, -1]), sampling)  # (B, V)
        return q.unsqueeze(1), draw(q, False, generator).unsqueeze(1)

    def settle(self, cur: Tensor, drafts: Tensor, accepted: Tensor, hidden: Tensor) -> None:
        # the position of `cur` (its state hidden[:, 0], next token d1) once d1 is known to be right
        took = (accepted >= 1).unsqueeze(1)  # (B, 1)
        if bool(took.any()):
            self.run(drafts[:, :1], hidden[:, :1], took)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        self.last = hidden[rows, accepted].unsqueeze(1)  # the state before the next round's cur
