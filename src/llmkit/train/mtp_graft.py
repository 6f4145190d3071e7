"""Teaching a grafted multi-token-prediction module to draft for its own model (self-speculative decoding).

A module grafted onto a pretrained model and trained on text learns the text; as a drafter it is right only when it
guesses what the *model* will say, and a CPU-sized budget sees too little text for that (22% of drafts accepted on
SmolLM2 after 10^5 tokens). This trains it on what the model says, as EAGLE trains its drafter (Li et al., 2024):

    data     the model's own greedy continuations of openings taken from a corpus, with its last-block states and
             its top-k next-token logits at every position, computed once (the trunk is frozen): `OwnText`
    loss     MTP position i reads the model's state h_i and token i + 1, and predicts token i + 2: cross-entropy
             against the model's own distribution of that token (its top-k logits, renormalised), over the
             candidate tokens of the batch (every position's top-k) rather than the whole vocabulary, whose output
             head would cost more than the module; plus smooth-L1 from the module's normed output to the model's
             normed state at i + 1, which that output stands in for when the drafter chains (drafters.MTPDrafter)
    unroll   the module is applied again to its own outputs (depths 2 .. unroll) so chained drafts stay on course

    graft(model)                         the model with one new MTP module: its block a copy of the last block,
                                         its projection reading the model's state alone at first
    collect_own_text(model, openings)    the data, written in chunks to a folder (an interrupted run resumes)
    train_drafter(model, text, seconds)  trains model.mtp[0] alone; returns the held-out acceptance estimate
    teacher_ce, fit                      the loss over candidate tokens and the training loop, which
                                         draft_distill.py's pruned draft shares

Shapes: N sequences of T tokens, C model width, K top-k.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.errors import InputError
from llmkit.layers.mtp import MTPModule
from llmkit.layers.softcap import soft_cap
from llmkit.models import DecoderLM, build_model
from llmkit.models.cache import whole_sequence
from llmkit.outputs import torch_save


def graft(model: DecoderLM) -> DecoderLM:
    """A copy of `model` (no MTP modules) with one new MTP module. Its block starts as a copy of the last block (a
    block that already reads this model's states) and its projection as [0 ; I]: at first the block sees the
    model's normed state alone, and learns how much of the next token's embedding to mix in."""
    if len(model.mtp):
        raise InputError(f"the model already has {len(model.mtp)} MTP module(s): graft onto one without")
    p = next(model.parameters())
    out = build_model(dataclasses.replace(model.cfg, mtp_depth=1), device=p.device, dtype=p.dtype)
    assert isinstance(out, DecoderLM)
    out.load_state_dict(model.state_dict(), strict=False)
    module = cast_module(out)
    module.block.load_state_dict(model.blocks[-1].state_dict())
    with torch.no_grad():
        C = model.cfg.d_model
        module.proj.weight.zero_()
        module.proj.weight[:, C:] = torch.eye(C, device=p.device, dtype=p.dtype)
    return out.eval()


def cast_module(model: DecoderLM) -> MTPModule:
    module = model.mtp[0]
    assert isinstance(module, MTPModule)
    return module


@dataclass
class OwnText:
    """The model's own text: tokens (N, T), its last-block states (N, T, C, bf16), its top-k next-token logits
    (N, T, K, bf16) and their token ids (N, T, K)."""

    tokens: Tensor
    hidden: Tensor
    top_logits: Tensor
    top_ids: Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: Tensor | slice) -> OwnText:
        return OwnText(self.tokens[index], self.hidden[index], self.top_logits[index], self.top_ids[index])

    def to(self, device: torch.device) -> OwnText:
        """The same text on `device` (it is kept on the CPU; a model on a GPU reads it there)."""
        return OwnText(*(getattr(self, f.name).to(device) for f in dataclasses.fields(OwnText)))

    @staticmethod
    def cat(parts: Sequence[OwnText]) -> OwnText:
        return OwnText(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(OwnText)))


@torch.no_grad()
def model_states(model: DecoderLM, tokens: Tensor, top_k: int = 8, batch: int = 8) -> OwnText:
    """The model's last-block states and top-k next-token logits over `tokens` (N, T)."""
    parts, device = [], model.embed.weight.device
    for i in range(0, tokens.shape[0], batch):
        rows = tokens[i : i + batch].to(device)
        h = model.run(rows, whole_sequence(rows.shape[1], None, rows.device))  # (b, T, C), before the final norm
        values, ids = model.logits(model.norm(h)).topk(top_k, dim=-1)  # (b, T, K)
        parts.append(OwnText(rows.cpu(), h.bfloat16().cpu(), values.bfloat16().cpu(), ids.int().cpu()))
    return OwnText.cat(parts)


@torch.no_grad()
def collect_own_text(
    model: DecoderLM,
    openings: Sequence[Sequence[int]],
    directory: str | Path,
    *,
    new_tokens: int,
    writer: DecoderLM | None = None,
    batch: int = 16,
    top_k: int = 8,
    log: Callable[[str], None] = print,
) -> OwnText:
    """Continue each opening greedily for `new_tokens` (with `writer`, e.g. a quantized copy of the model, which
    writes faster and nearly the same text; the model itself by default), then record the model's own states and
    top-k logits over the whole text. Written to `directory` a batch at a time: a second call with the same
    arguments reads what is there and does the rest."""
    from llmkit.generate import generate

    if not openings or len({len(o) for o in openings}) != 1 or not len(openings[0]):
        raise InputError("openings must be a non-empty list of token lists of one (non-zero) length")
    if new_tokens < 2:
        raise InputError(f"new_tokens={new_tokens} must be at least 2")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    parts = []
    started = time.perf_counter()
    for i in range(0, len(openings), batch):
        path = d / f"own-{i:06d}-{len(openings[0])}-{new_tokens}.pt"
        if path.is_file():
            parts.append(OwnText(**torch.load(path)))
            continue
        rows = [list(o) for o in openings[i : i + batch]]
        out = generate(writer if writer is not None else model, rows, max_new_tokens=new_tokens)
        tokens = torch.tensor([r + list(n) for r, n in zip(rows, out.new_tokens, strict=True)])  # (b, T)
        part = model_states(model, tokens, top_k)
        torch_save(dataclasses.asdict(part), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)  # whole or absent
        parts.append(part)
        done = min(i + batch, len(openings))
        log(f"own text: {done}/{len(openings)} sequences, {time.perf_counter() - started:.0f} s")
    return OwnText.cat(parts)


@dataclass
class DrafterReport:
    """What training reached: steps, sequences seen, seconds; on held-out text, how often depth d's draft is the
    model's token (`agreement`, d = 1 .. len) and the mean number of drafts a round of k = len would accept."""

    steps: int
    sequences: int
    seconds: float
    agreement: list[float]
    accepted_per_round: float


def _depths(model: DecoderLM, text: OwnText, depths: int, noise: float = 0.0) -> list[Tensor]:
    """The module's normed outputs (N, T - 1, C) at depths 1 .. `depths`: depth 1 at position i reads the model's
    state h_i and token i + 1; depth d reads depth d - 1's output at i - 1 instead of h_i (what a chain of drafts
    reads). Position i of every depth predicts the model's token at i + 1 (token i + 2)."""
    module = cast_module(model)
    text = text.to(model.embed.weight.device)
    T = text.tokens.shape[1]
    step = whole_sequence(T - 1, None, text.tokens.device)
    inputs = model.attention_inputs(step)
    emb = model.inputs(model.embed, text.tokens[:, 1:], step.positions)  # (N, T - 1, C): tokens i + 1
    first = model.norm(text.hidden[:, :-1].float())
    h = first + noise * (torch.rand_like(first) - 0.5) if noise else first
    outs = []
    for _ in range(depths):
        out = module(h, emb, inputs)
        outs.append(out)
        h = torch.cat([first[:, :1], out[:, :-1]], dim=1)  # position 0 has no earlier output: the model's state
    return outs


@torch.no_grad()
def evaluate_drafter(model: DecoderLM, text: OwnText, depths: int, skip: int = 0) -> tuple[list[float], float]:
    """(agreement per depth, mean drafts accepted per round of k = depths) on `text`, from position `skip` on
    (past the openings, which are the corpus's text rather than the model's)."""
    text = text.to(model.embed.weight.device)
    want = text.top_ids[:, 1:, 0].long()  # (N, T - 1): the model's token at i + 1
    hits = [model.logits(o).argmax(-1) == want for o in _depths(model, text, depths)]  # (N, T - 1) each
    agree = [float(h[:, skip:].float().mean()) for h in hits]
    L = want.shape[1] - depths + 1
    run = torch.ones_like(hits[0][:, skip:L])
    accepted = torch.zeros(run.shape, device=run.device)
    for d, h in enumerate(hits):  # a chain from position s: depth d + 1's draft sits at s + d
        run = run & h[:, skip + d : L + d]
        accepted += run.float()
    return agree, float(accepted.mean())


def teacher_ce(model: DecoderLM, h: Tensor, top_ids: Tensor, top_logits: Tensor) -> Tensor:
    """Cross-entropy of the model's head on normed states h (b, T, C) against a teacher's top-k distributions
    (top_ids, top_logits (b, T, K), renormalised), over the batch's candidate tokens (every position's top-k) rather
    than the whole vocabulary: the head's 49,152 rows would cost more than what is trained."""
    candidates, index = torch.unique(top_ids.long(), return_inverse=True)  # (V',), (b, T, K)
    head = cast(Tensor, model.embed.weight if model.head is None else model.head.weight)  # (V, C)
    bias = None if model.head_bias is None else model.head_bias[candidates]
    logits = soft_cap(F.linear(h, head[candidates], bias), model.cfg.logit_softcap)  # (b, T, V')
    teacher = torch.softmax(top_logits.float(), dim=-1)  # (b, T, K)
    return -(teacher * torch.log_softmax(logits, dim=-1).gather(-1, index)).sum(-1).mean()


def fit(
    params: Sequence[Tensor],
    text: OwnText,
    loss_of: Callable[[OwnText], Tensor],
    *,
    seconds: float | None,
    steps: int | None,
    batch: int,
    lr: float,
    seed: int,
    log: Callable[[str], None],
    name: str,
) -> tuple[int, int, float]:
    """Train `params` on loss_of(rows of `text`) for `seconds` or `steps` of `batch` rows (give one): AdamW, 20
    steps of warm-up, then a cosine to zero over the time or the steps, gradients clipped to norm 1. Returns
    (steps, sequences seen, seconds)."""
    if (seconds is None) == (steps is None):
        raise InputError("give exactly one of seconds and steps")
    if batch < 1 or (seconds is not None and seconds <= 0) or (steps is not None and steps < 1):
        raise InputError(f"batch={batch}, seconds={seconds} and steps={steps} must be positive")
    if len(text) < batch:
        raise InputError(f"{len(text)} sequences are fewer than a batch of {batch}")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    started, step, seen = time.perf_counter(), 0, 0

    def progress() -> float:
        return step / steps if steps is not None else (time.perf_counter() - started) / cast(float, seconds)

    while progress() < 1:
        order = torch.randperm(len(text), generator=generator)
        for b in range(0, len(text) - batch + 1, batch):
            done = progress()
            if done >= 1:
                break
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * done))
            loss = loss_of(text.rows(order[b : b + batch]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step, seen = step + 1, seen + batch
            if step % 25 == 0:
                log(f"{name} step {step}: loss {float(loss.detach()):.3f}, {time.perf_counter() - started:.0f} s")
    return step, seen, time.perf_counter() - started


def train_drafter(
    model: DecoderLM,
    text: OwnText,
    *,
    seconds: float | None = None,
    steps: int | None = None,
    held_out: OwnText | None = None,
    batch: int = 16,
    lr: float = 2e-3,
    unroll: int = 3,
    feature_weight: float = 1.0,
    skip: int = 0,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> DrafterReport:
    """Train model.mtp[0] alone on `text` for `seconds` or for `steps` of `batch` rows (give one; see `fit`). The
    rest of the model is left untouched (its gradients are not computed). `skip`: positions at the start of each
    row that are not the model's text (the openings), left out of the held-out estimate."""
    if not len(model.mtp):
        raise InputError("the model has no MTP module to train: graft one first (llmkit.train.mtp_graft.graft)")
    if unroll < 1:
        raise InputError(f"unroll={unroll} must be positive")
    module = cast_module(model)
    own = {id(p) for p in module.parameters()}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in own]
    for p in frozen:
        p.requires_grad_(False)
    params = list(module.parameters())
    for p in params:
        p.requires_grad_(True)

    def loss_of(rows: OwnText) -> Tensor:
        # position i predicts the model's token i + 2: its top-k at i + 1; and stands in for its state at i + 1
        rows = rows.to(model.embed.weight.device)
        target = model.norm(rows.hidden[:, 1:].float()).detach()  # (b, T - 1, C)
        loss = torch.zeros((), device=target.device)
        for out in _depths(model, rows, unroll):
            ce = teacher_ce(model, out, rows.top_ids[:, 1:], rows.top_logits[:, 1:])
            loss = loss + ce + feature_weight * F.smooth_l1_loss(out, target)
        return loss / unroll

    model.train()
    try:
        step, seen, seconds_taken = fit(
            params, text, loss_of, seconds=seconds, steps=steps, batch=batch, lr=lr, seed=seed, log=log, name="drafter"
        )
    finally:
        model.eval()
        for p in frozen:
            p.requires_grad_(True)
    agree, accepted = evaluate_drafter(model, held_out, unroll, skip) if held_out is not None else ([], 0.0)
    return DrafterReport(step, seen, seconds_taken, agree, accepted)
