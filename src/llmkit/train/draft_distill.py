"""A draft model distilled from its target on the target's own text (speculative decoding with `draft=`).

A draft trained from scratch on a CPU-sized budget guesses the target's next token rarely (12% for a 16M-parameter
SmolLM2-family draft after 10^5 tokens). This one starts from the target itself: its embedding, output head and a
few of its blocks (the first ones, which build the representation, and the last, which the head reads), the rest
dropped as layer-skipping drafts do (Draft & Verify, Zhang et al. 2024; LayerSkip, Elhoushi et al. 2024); then it
learns the target's next-token distributions on the target's own text (`mtp_graft.OwnText`: its continuations and
top-k logits, computed once), over the batch's candidate tokens as the MTP module does. Drafting with an int8 copy
of it (`llmkit.quant.quantize(draft, "int8", include_head=True)`) makes each of its steps about a tenth of the
target's. (Not int4: on SmolLM2 the distilled last block, reading block 3's output where it used to read block
28's, amplifies any change of its input, and int4 rounding anywhere before it leaves the draft agreeing with its float
self 3% of the time; BENCHMARKS.md.) `llmkit distill-draft` runs it all from the command line.

    prune(model, keep)                       the model with blocks `keep` only (and its embedding, norm, head)
    distill_draft(draft, text, steps=...)    trains every weight of the draft; returns the held-out agreement
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.models import DecoderLM, build_model
from llmkit.models.cache import whole_sequence
from llmkit.train.mtp_graft import DrafterReport, OwnText, fit, teacher_ce


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
    text = text.to(draft.embed.weight.device)
    T = text.tokens.shape[1]
    logits = draft.logits(draft.norm(draft.run(text.tokens, whole_sequence(T, None, text.tokens.device))))
    hits = logits.argmax(-1)[:, skip:] == text.top_ids[:, skip:, 0].long()  # (N, T - skip)
    L = hits.shape[1] - k + 1
    run, accepted = torch.ones_like(hits[:, :L]), torch.zeros(hits[:, :L].shape, device=hits.device)
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
    `steps` (give one; see mtp_graft.fit). The report's agreement has one entry, and accepted_per_round is for
    rounds of k drafts."""
    params = [p for p in draft.parameters() if p.requires_grad]
    device = draft.embed.weight.device
    positions = whole_sequence(text.tokens.shape[1], None, device)

    def loss_of(rows: OwnText) -> Tensor:
        rows = rows.to(device)
        h = draft.norm(draft.run(rows.tokens, positions))  # (b, T, C): position i predicts token i + 1
        return teacher_ce(draft, h, rows.top_ids, rows.top_logits)

    draft.train()
    try:
        step, seen, seconds_taken = fit(
            params, text, loss_of, seconds=seconds, steps=steps, batch=batch, lr=lr, seed=seed, log=log, name="draft"
        )
    finally:
        draft.eval()
    agree, accepted = agreement(draft, held_out, k, skip) if held_out is not None else (0.0, 0.0)
    return DrafterReport(step, seen, seconds_taken, [agree], accepted)
