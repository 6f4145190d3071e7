"""Speculative decoding: a cheap drafter proposes k tokens, the target model checks them all in one forward pass.

    draft  d1 ~ q1, d2 ~ q2, ..., dk ~ qk         k cheap steps (a small model, or the target's own MTP module)
    target p1 .. p(k+1) = target(cur, d1 .. dk)  one pass over k + 1 tokens, as in training: in parallel

Acceptance (Leviathan et al. 2023; Chen et al. 2023): for i = 1..k, accept d_i with probability min(1, p_i(d_i) /
q_i(d_i)); at the first rejection, draw the replacement from the residual norm(max(0, p_i - q_i)) and stop; if all k
are accepted, draw one more token from p(k+1). Every token is then distributed exactly as the target would have drawn
it, so the output distribution is the target's, whatever the drafter. With greedy decoding (one-hot p and q) this
reduces to: keep drafts while they equal the target's argmax, then take the target's token, so the output is token
for token the target's greedy output. Each round yields 1 to k + 1 tokens for one target pass.

Rows of a batch accept different numbers of tokens. Rejected tokens' cache slots are marked invalid rather than
rolled back (`SequenceState.discard`), so every row keeps one shared slot layout and the batch stays a batch.

Drafters: `speculative_generate(target, draft=small_model)`, or `draft=None` for a model trained with multi-token
prediction, whose first MTP module drafts one token per round from the target's own hidden state (DeepSeek-V3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.decode import Generation, prepare_prompts
from llmkit.generate.sampling import Sampling, distribution
from llmkit.generate.step import decode_step
from llmkit.layers.attention import AttentionInputs
from llmkit.layers.mtp import MTPModule
from llmkit.models import DecoderLM
from llmkit.models.common import SequenceState


@dataclass
class SpeculativeGeneration(Generation):
    """A Generation plus what the speculation achieved."""

    drafted: int = 0  # draft tokens proposed (over all rows)
    accepted: int = 0  # draft tokens accepted
    target_passes: int = 0  # target forward calls after the prompt

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


def _left_pad(rows: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        if r:
            tokens[b, width - len(r) :] = torch.tensor(r, device=device)
            valid[b, width - len(r) :] = True
    return tokens, valid


def _accept(
    drafts: Tensor, q: Tensor, p: Tensor, greedy: bool, generator: torch.Generator | None
) -> tuple[list[int], list[int]]:
    """Per row: (number of drafts accepted, the token drawn after them). drafts (B, k), q (B, k, V), p (B, k+1, V)."""
    B, k = drafts.shape
    accepted, extra = [], []
    for b in range(B):
        n = 0
        token = -1
        for i in range(k):
            d = int(drafts[b, i])
            if greedy:
                ok = int(p[b, i].argmax()) == d
            else:
                ratio = float(p[b, i, d]) / max(float(q[b, i, d]), 1e-30)
                ok = float(torch.rand((), generator=generator, device=p.device)) < min(1.0, ratio)
            if not ok:
                if greedy:
                    token = int(p[b, i].argmax())
                else:
                    residual = (p[b, i] - q[b, i]).clamp(min=0)
                    residual = residual / residual.sum() if float(residual.sum()) > 0 else p[b, i]
                    token = int(torch.multinomial(residual, 1, generator=generator))
                break
            n += 1
        if n == k:
            last = p[b, k]
            token = int(last.argmax()) if greedy else int(torch.multinomial(last, 1, generator=generator))
        accepted.append(n)
        extra.append(token)
    return accepted, extra


@torch.no_grad()
def speculative_generate(
    target: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    *,
    draft: DecoderLM | None = None,
    max_new_tokens: int,
    k: int = 4,
    padding_mask: Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    compiled: bool = False,
) -> SpeculativeGeneration:
    """Generate with the target's exact distribution, drafting k tokens per round with `draft` (a smaller model with
    the same tokenizer), or with the target's first MTP module when draft is None (then k is 1)."""
    if draft is None:
        if not len(target.mtp):
            raise InputError("no draft model given and the target has no MTP module to draft with (mtp_depth 0)")
        k = 1
    elif draft.cfg.vocab_size != target.cfg.vocab_size:
        raise InputError(f"the draft's vocabulary ({draft.cfg.vocab_size}) differs from the target's "
                         f"({target.cfg.vocab_size}): they must share a tokenizer")  # fmt: skip
    if not isinstance(k, int) or k < 1:
        raise InputError(f"k={k!r} must be an int >= 1")
    sampling = Sampling(temperature, top_k, top_p)
    tokens, mask = prepare_prompts(target, prompts, padding_mask, max_new_tokens)
    B, T = tokens.shape
    device = tokens.device
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    room = T + (max_new_tokens + 1) * (k + 3)  # rejected slots stay used: room for every round's worst case
    t_cache = target.new_cache(B, room)
    d_cache = draft.new_cache(B, room) if draft is not None else None
    prefix, cur = tokens[:, :-1], tokens[:, -1].tolist()
    prefix_valid = mask[:, :-1]
    hidden_last: Tensor | None = None
    mtp = _MTPDrafter(target, B, room) if draft is None else None
    if prefix.shape[1]:
        _, h = decode_step(target, prefix, t_cache, prefix_valid, compiled)
        if d_cache is not None and draft is not None:
            decode_step(draft, prefix, d_cache, prefix_valid, compiled)
        hidden_last = h
        if mtp is not None:
            # MTP position j reads h_j and token j + 1: both must be real tokens (left padding)
            mtp.feed(target, prefix[:, 1:], h[:, :-1], prefix_valid[:, :-1] & prefix_valid[:, 1:])
    pending_d = [[c] for c in cur]
    new: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    result = SpeculativeGeneration(tokens.cpu(), new)
    while not all(done):
        # ---- draft k tokens per row
        if mtp is not None:
            assert hidden_last is not None or prefix.shape[1] == 0
            q_logits, drafts = mtp.draft(target, cur, hidden_last, sampling, generator)
            q = q_logits.unsqueeze(1)  # (B, 1, V)
            d = drafts.unsqueeze(1)  # (B, 1)
        else:
            assert draft is not None and d_cache is not None
            feed, valid = _left_pad(pending_d, device)
            logits, _ = decode_step(draft, feed, d_cache, valid if not bool(valid.all()) else None, compiled)
            qs, ds = [], []
            for i in range(k):
                probs = distribution(logits[:, -1], sampling)
                nxt = probs.argmax(-1) if sampling.greedy else torch.multinomial(probs, 1, generator=generator)[:, 0]
                qs.append(probs)
                ds.append(nxt)
                if i < k - 1:
                    logits, _ = decode_step(draft, nxt.unsqueeze(1), d_cache, compiled=compiled)
            q, d = torch.stack(qs, 1), torch.stack(ds, 1)  # (B, k, V), (B, k)
        # ---- verify with the target: cur, d1 .. dk
        verify = torch.cat([torch.tensor(cur, device=device).unsqueeze(1), d], dim=1)  # (B, k + 1)
        logits, h = decode_step(target, verify, t_cache, compiled=compiled)
        result.target_passes += 1
        p = torch.stack([distribution(logits[:, i], sampling) for i in range(logits.shape[1])], 1)  # (B, k + 1, V)
        accepted, extra = _accept(d, q, p, sampling.greedy, generator)
        # ---- keep what was accepted; forget the rest of both caches
        acc = torch.tensor(accepted, device=device)
        t_cache.state.discard(k - acc)
        if d_cache is not None:
            d_cache.state.discard((k - 1 - acc).clamp(min=0))
        hidden_last = h
        for b in range(B):
            if done[b]:
                continue
            produced = [int(x) for x in d[b, : accepted[b]].tolist()] + [extra[b]]
            result.drafted += k
            result.accepted += accepted[b]
            for t in produced:
                new[b].append(t)
                if t in eos or len(new[b]) >= max_new_tokens:
                    done[b] = True
                    break
        if mtp is not None:
            # catch the MTP module up: positions whose next token is now known (cur, and accepted drafts)
            mtp.catch_up(target, cur, d, accepted, h)
        # the next round starts from the token drawn after the accepted drafts
        pending_d = [([int(d[b, k - 1])] if accepted[b] == k else []) + [extra[b]] for b in range(B)]
        cur = extra
        hidden_last = torch.stack([h[b, accepted[b]] for b in range(B)]).unsqueeze(1)  # (B, 1, C): state at cur's
        # predecessor, the input of the MTP drafter
    columns_len = max(len(r) for r in new)
    out = torch.zeros(B, columns_len, dtype=torch.long)
    for b, r in enumerate(new):
        if r:
            out[b, : len(r)] = torch.tensor(r)
            out[b, len(r) :] = r[-1]
    result.tokens = torch.cat([tokens.cpu(), out], dim=1)
    return result


class _MTPDrafter:
    """Drafts with the target's first multi-token-prediction module, which keeps its own attention cache.

    MTP module 1 at position j reads the main model's hidden state h_j and the embedding of token j + 1, and predicts
    token j + 2. To draft the token after `cur` (position n + 1), it needs its input at position n: h_n and cur."""

    def __init__(self, target: DecoderLM, batch: int, room: int) -> None:
        module = target.mtp[0]
        assert isinstance(module, MTPModule)
        device = target.embed.weight.device
        self.module = module
        self.cache = module.block.attn.new_cache(batch, room, device, target.embed.weight.dtype)
        self.state = SequenceState.new(batch, room, device)

    def _run(self, target: DecoderLM, tokens: Tensor, hidden: Tensor, valid: Tensor | None) -> Tensor:
        start, positions, mask = self.state.advance(tokens.shape[1], valid)
        rope = target.rope(positions) if target.rope is not None else None
        emb = target.inputs(target.embed, tokens, positions)
        inputs = AttentionInputs(mask=mask, rope=rope, cache_start=start)
        return self.module(target.norm(hidden), emb, inputs, self.cache)  # (B, T, C), normed

    def feed(self, target: DecoderLM, next_tokens: Tensor, hidden: Tensor, valid: Tensor | None) -> None:
        """Add MTP positions whose hidden states and next tokens are known (no drafting)."""
        if next_tokens.shape[1]:
            self._run(target, next_tokens, hidden, valid if valid is not None and not bool(valid.all()) else None)

    def draft(
        self, target: DecoderLM, cur: list[int], hidden: Tensor | None, s: Sampling, g: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """(q (B, V), draft token (B,)) for the token after `cur`."""
        device = target.embed.weight.device
        tokens = torch.tensor(cur, device=device).unsqueeze(1)
        if hidden is None:  # a one-token prompt: no state to draft from yet. Propose token 0 with certainty (q is
            # one-hot, so the acceptance rule stays exact: accepted with probability p(0))
            q = torch.zeros(len(cur), target.cfg.vocab_size, device=device)
            q[:, 0] = 1.0
            return q, torch.zeros(len(cur), dtype=torch.long, device=device)
        out = self._run(target, tokens, hidden[:, -1:], None)
        q = distribution(target.logits(out[:, -1]), s)
        return q, (q.argmax(-1) if s.greedy else torch.multinomial(q, 1, generator=g)[:, 0])

    def catch_up(self, target: DecoderLM, cur: list[int], drafts: Tensor, accepted: list[int], h: Tensor) -> None:
        """After verification, add the MTP positions of the accepted drafts: position of `cur` (h[:, 0], next token
        d1) when d1 was accepted. The drafting call already added the position before `cur`."""
        valid = torch.tensor([a >= 1 for a in accepted], device=h.device).unsqueeze(1)  # (B, 1)
        if bool(valid.any()):
            self._run(target, drafts[:, :1], h[:, :1], valid if not bool(valid.all()) else None)
