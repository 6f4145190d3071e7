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
rolled back (`SequenceState.discard`), so every row keeps one shared slot layout and the batch stays a batch. The
drafters are in drafters.py: `draft=small_model`, or `draft=None` for a model trained with multi-token prediction
(or an MTPDraft of it, kept across calls). The target's and the draft model's steps run on the backends (step.py)
passed in, or chosen once per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.generate.decode import Generation, seeded
from llmkit.generate.drafters import Drafter, ModelDrafter, MTPDraft, MTPDrafter
from llmkit.generate.prompts import prepare_prompts
from llmkit.generate.sampling import Sampling, check_finite, distribution, draw
from llmkit.generate.step import DecodeStep, choose_step
from llmkit.generate.stops import Rows, StopRule
from llmkit.models import DecoderLM


@dataclass
class SpeculativeGeneration(Generation):
    """A Generation plus what the speculation achieved."""

    drafted: int = 0  # draft tokens proposed (over all rows)
    accepted: int = 0  # draft tokens accepted
    target_passes: int = 0  # target forward calls after the prompt

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


def accept(
    drafts: Tensor, q: Tensor, p: Tensor, greedy: bool, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """The acceptance rule for every row at once: (drafts accepted (B,), the token drawn after them (B,)).
    drafts (B, k), q (B, k, V) the drafter's distributions, p (B, k + 1, V) the target's."""
    B, k = drafts.shape
    p_d = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # (B, k): p_i(d_i)
    if greedy:
        ok = p[:, :k].argmax(dim=-1) == drafts
    else:
        q_d = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # (B, k): q_i(d_i)
        u = torch.rand(B, k, generator=generator, device=p.device)
        ok = u < (p_d / q_d.clamp(min=1e-30)).clamp(max=1.0)
    n = ok.long().cumprod(dim=1).sum(dim=1)  # (B,) drafts accepted before the first rejection
    # the next token: from the residual max(0, p_n - q_n) at the first rejection; from p_(k+1) when all were
    # accepted (q there is zero, so the residual is p itself)
    rows = torch.arange(B, device=p.device)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n]  # (B, V)
    p_next = p[rows, n]  # (B, V)
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    return n, draw(residual, greedy, generator)


def accept_greedy(drafts: Tensor, choice: Tensor) -> tuple[Tensor, Tensor]:
    """`accept` for one-hot p and q, from tokens alone: drafts (B, k), choice (B, k + 1) the target's argmax after cur
    and each draft -> (drafts accepted (B,), the target's token after them (B,))."""
    k = drafts.shape[1]
    n = (choice[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)  # (B,)
    return n, choice.gather(1, n.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def _checked(
    target: DecoderLM,
    draft: DecoderLM | MTPDraft | None,
    k: int | None,
    sampling: Sampling | None,
    draft_head_bits: int | None,
) -> tuple[int, Sampling]:
    """speculative_generate's arguments checked (InputError naming what is wrong): its k and sampling."""
    if draft is None and not len(target.mtp):
        raise InputError("no draft model given and the target has no MTP module to draft with (mtp_depth 0)")
    if isinstance(draft, MTPDraft) and (draft.target is not target or draft_head_bits is not None):
        raise InputError("an MTPDraft drafts for the target it was made of, with the head_bits it was made with")
    if isinstance(draft, DecoderLM) and draft.cfg.vocab_size != target.cfg.vocab_size:
        raise InputError(
            f"the draft's vocabulary ({draft.cfg.vocab_size}) differs from the target's ({target.cfg.vocab_size}): "
            "they must share a tokenizer"
        )
    k = (1 if draft is None else 4) if k is None else k
    if not isinstance(k, int) or k < 1:
        raise InputError(f"k={k!r} must be an int >= 1")
    sampling = sampling or Sampling()
    if sampling.repetition_penalty != 1.0:
        raise InputError("speculative decoding does not support a repetition penalty; use generate for it")
    return k, sampling


def speculative_generate(
    target: DecoderLM,
    prompts: Tensor | Sequence[Sequence[int]],
    *,
    draft: DecoderLM | MTPDraft | None = None,
    max_new_tokens: int,
    k: int | None = None,
    padding_mask: Tensor | None = None,
    sampling: Sampling | None = None,
    eos_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    step: DecodeStep | None = None,
    draft_step: DecodeStep | None = None,
    draft_head_bits: int | None = None,
) -> SpeculativeGeneration:
    """Generate with the target's exact distribution, drafting k tokens per round with `draft` (a smaller model with
    the same tokenizer; k 4 by default), or with the target's first MTP module when draft is None (k 1 by default;
    k > 1 chains the module on its own outputs, which pays only for a module trained for it: see
    llmkit.train.drafting and `llmkit graft-mtp`). `sampling`: greedy by default; a repetition penalty is not
    supported (it would make the target's distribution depend on the drafts). draft_head_bits (8 or 4): the MTP
    drafter reads an int8 / int4 copy of the output head and, in its C++ step, of its block (drafters.py's
    draft_head and draft_block): cheaper drafts, the same output; an MTPDraft as `draft` holds such copies made
    once. `step` and `draft_step`: the target's and the draft model's decoding backends (step.py; choose_step's
    when None)."""
    k, sampling = _checked(target, draft, k, sampling, draft_head_bits)
    tokens, mask = prepare_prompts(target, prompts, padding_mask, max_new_tokens)
    B, T = tokens.shape
    generator = seeded(seed, tokens.device)
    room = T + (max_new_tokens + 1) * (k + 3)  # rejected slots stay used: room for every round's worst case
    cache = target.new_cache(B, room)
    step = step if step is not None else choose_step(target)  # with C++ blocks: the verifying steps' (and head)
    drafter: Drafter
    if isinstance(draft, DecoderLM):
        drafter = ModelDrafter(draft, k, B, room, draft_step)
    else:
        parts = draft if draft is not None else MTPDraft(target, step.native, draft_head_bits)
        drafter = MTPDrafter(parts, B, MTPDrafter.room(T, max_new_tokens, k), k)
    # the whole prompt, as `generate` prefills it: the first token comes from the same logits, and later tokens are
    # computed by the same kind of step (with the C++ step, a verifying step's rows get the same bits as decoding's)
    logits, hidden = step(tokens, cache, mask, last=True, given=True)
    check_finite(logits, 0)
    drafter.start(tokens, mask, hidden)
    rows = Rows(StopRule.of(eos_id, max_new_tokens=max_new_tokens), B)
    result = SpeculativeGeneration(tokens.cpu(), rows.tokens)
    cur = draw(distribution(logits[:, -1], sampling), sampling.greedy, generator)  # (B,)
    if max_new_tokens:
        for b, token in enumerate(cur.tolist()):
            rows.push(b, token)
    while max_new_tokens and not rows.finished:
        q, drafts = drafter.propose(cur, sampling, generator)  # (B, k, V), (B, k)
        logits, hidden = step(torch.cat([cur.unsqueeze(1), drafts], 1), cache)
        result.target_passes += 1
        check_finite(logits, result.target_passes)
        if q is None:  # greedy: keep the drafts while they are the target's choice, then take its token
            n, extra = accept_greedy(drafts, logits.argmax(dim=-1))
        else:
            n, extra = accept(drafts, q, distribution(logits, sampling), sampling.greedy, generator)
        cache.state.discard(k - n, span=k)  # forget the target's slots of the rejected drafts
        drafter.settle(cur, drafts, n, hidden)
        for b, (a, row, nxt) in enumerate(zip(n.tolist(), drafts.tolist(), extra.tolist(), strict=True)):
            if not rows.done[b]:
                result.drafted += k
                result.accepted += a
                for token in [*row[:a], nxt]:
                    if not rows.push(b, token):
                        break
        cur = extra
    result.tokens = torch.cat([tokens.cpu(), _columns(rows.tokens)], dim=1)
    return result


def _columns(rows: list[list[int]]) -> Tensor:
    """Rows of tokens -> (B, longest), each row padded with its last token."""
    out = torch.zeros(len(rows), max((len(r) for r in rows), default=0), dtype=torch.long)
    for b, r in enumerate(rows):
        if r:
            out[b] = torch.tensor(r + [r[-1]] * (out.shape[1] - len(r)))
    return out
