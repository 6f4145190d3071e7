"""A draft model distilled from its target on the target's own text (speculative decoding with `draft=`).

A draft trained from scratch on a CPU-sized budget guesses the target's next token rarely (12% for a 16M-parameter
SmolLM2-family draft after 10^5 tokens). This one starts from the target itself: its embedding, output head and a
few of its blocks (the first ones, which build the representation, and the last, which the head reads), the rest
dropped as layer-skipping drafts do (Draft & Verify, Zhang et al. 2024; LayerSkip, Elhoushi et al. 2024); then it
learns the target's next-token distributions on the target's own text (`mtp_graft.OwnText`: its continuations and
top-k logits, computed once), over the batch's candidate tokens as the MTP module does. Drafting with an int8 copy
of it (`llmkit.quant.quantize(draft, "int8", include_head=True)`) makes each of its steps about a tenth of the
target's. (On SmolLM2 an int4 copy of the distilled draft drafts nonsense, its logits moved by ~25 by the rounding,
where the int4 target is fine: not understood yet.)

    prune(model, keep)                       the model with blocks `keep` only (and its embedding, norm, head)
    distill_draft(draft, text, steps=...)    trains every weight of the draft; returns the held-out agreement
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.layers.softcap import soft_cap
from llmkit.models import DecoderLM, build_model
from llmkit.models.cache import whole_sequence
from llmkit.train.mtp_graft import DrafterReport, OwnText


def prune(model: DecoderLM, keep: Sequence[int]) -> DecoderLM:
    """A new model of `model`'s family with its blocks `keep` (in that order) and the rest of its weights (embedding,
    final norm, head), without MTP modules."""
    n = model.cfg.n_layers
    if not keep or len(set(keep)) != len(keep) or any(not 0 <= i < n for i in keep):
        raise InputError(f"keep={list(keep)} must name distinct blocks among the model's {n}")
    p = next(model.parameters())
    out = build_model(dataclasses.replace(model.cfg, n_layers=len(keep), mtp_depth=0), device=p.device, dtype=p.dtype)
    assert isinstance(out, DecoderLM)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("blocks.", "mtp."))}
    for j, i in enumerate(keep):
        state.update({f"blocks.{j}.{k}": v for k, v in model.blocks[i].state_dict().items()})
    out.load_state_dict(state)
    return out.eval()


@torch.no_grad()
def agreement(draft: DecoderLM, text: OwnText, k: int, skip: int = 0) -> tuple[float, float]:
    """(how often the draft's next token is the target's, the mean drafts a round of k accepts) on `text`, from
    position `skip` on, teacher-forced on the target's text (which is what an accepted chain reads)."""
    T = text.tokens.shape[1]
    logits = draft.logits(draft.norm(draft.run(text.tokens, whole_sequence(T, None, text.tokens.device))))
    hits = logits.argmax(-1)[:, skip:] == text.top_ids[:, skip:, 0].long()  # (N, T - skip)
    L = hits.shape[1] - k + 1
    run, accepted = torch.ones_like(hits[:, :L]), torch.zeros(hits[:, :L].shape)
    for d in range(k):
        run = run & hits[:, d : L + d]
        accepted += run.float()
    return float(hits.float().mean()), float(accepted.mean())


def distill_draft(
    draft: DecoderLM,
    text: OwnText,
    *,
    seconds: float | None = None,
    steps: int | None = None,
    held_out: OwnText | None = None,
    k: int = 4,
    batch: int = 8,
    lr: float = 3e-4,
    skip: int = 0,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> DrafterReport:
    """Train every weight of `draft` on the target's next-token distributions over `text` (its top-k logits,
    renormalised, against the draft's log-probabilities over the batch's candidate tokens) for `seconds` or
    `steps` (give one; AdamW, 20 steps of warm-up, then a cosine to zero). The report's agreement has one entry,
    and accepted_per_round is for rounds of k drafts."""
    if (seconds is None) == (steps is None):
        raise InputError("give exactly one of seconds and steps")
    if batch < 1 or (seconds is not None and seconds <= 0) or (steps is not None and steps < 1):
        raise InputError(f"batch={batch}, seconds={seconds} and steps={steps} must be positive")
    if len(text) < batch:
        raise InputError(f"{len(text)} sequences are fewer than a batch of {batch}")
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    T = text.tokens.shape[1]
    step_info = whole_sequence(T, None, text.tokens.device)
    draft.train()
    started, step, seen = time.perf_counter(), 0, 0

    def progress() -> float:
        return step / steps if steps is not None else (time.perf_counter() - started) / cast(float, seconds)

    try:
        while progress() < 1:
            order = torch.randperm(len(text), generator=generator)
            for b in range(0, len(text) - batch + 1, batch):
                done = progress()
                if done >= 1:
                    break
                for g in opt.param_groups:
                    g["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * done))
                rows = text.rows(order[b : b + batch])
                candidates, index = torch.unique(rows.top_ids.long(), return_inverse=True)  # (V',), (b, T, K)
                teacher = torch.softmax(rows.top_logits.float(), dim=-1)  # (b, T, K)
                head = draft.embed.weight if draft.head is None else draft.head.weight
                h = draft.norm(draft.run(rows.tokens, step_info))  # (b, T, C)
                logits = torch.nn.functional.linear(h, cast(Tensor, head)[candidates])  # (b, T, V')
                if draft.head_bias is not None:
                    logits = logits + draft.head_bias[candidates]
                logits = soft_cap(logits, draft.cfg.logit_softcap)
                logp = torch.log_softmax(logits, dim=-1)
                loss = -(teacher * logp.gather(-1, index)).sum(-1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step, seen = step + 1, seen + batch
                if step % 25 == 0:
                    log(f"draft step {step}: loss {float(loss.detach()):.3f}, {time.perf_counter() - started:.0f} s")
    finally:
        draft.eval()
    agree, accepted = agreement(draft, held_out, k, skip) if held_out is not None else (0.0, 0.0)
    return DrafterReport(step, seen, time.perf_counter() - started, [agree], accepted)
