"""A model's own text: what a drafter for the model learns from (`llmkit graft-mtp`, `llmkit distill-draft`).

A drafter trained on a corpus learns the corpus; as a drafter it is right only when it guesses what the *model* will
say, and a CPU-sized budget sees too little text for that (22% of drafts accepted on SmolLM2 after 10^5 tokens).
So it learns from what the model says, as EAGLE's drafter does (Li et al., 2024): the model's greedy continuations
of openings taken from a corpus, with its last-block states and its top-k next-token logits at every position,
computed once (the model is frozen while its drafter trains).

    collect_own_text(model, openings, folder)   the text of one split, written in chunks (an interrupted collection
                                                resumes) and described as a split of training data
    save_own_text(folder, text)                 the same for text at hand (model_states over tokens of one's own)
    read_own_text(folder, split)                the text back, as the training task reads it (tasks.OwnTextTask)

On disk (a work folder: it holds only its splits):

    WORK/train/own-000000-48-208.pt ...   chunks of OwnText (opening 48 tokens, 208 new ones)
    WORK/train/own_text.json              what the split holds: its chunks, the opening's length, top-k, vocabulary
    WORK/train/tokenizer.json             the model's tokenizer (what the drafter's checkpoints carry)
    WORK/val/...                          the held-out split, the same way

Shapes: N sequences of T tokens, C model width, K top-k.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.models import DecoderLM
from llmkit.models.cache import whole_sequence
from llmkit.outputs import torch_save
from llmkit.tokenizer import Tokenizer

META = "own_text.json"


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
        return OwnText(*self.tensors(device))

    def tensors(self, device: torch.device | None = None) -> tuple[Tensor, ...]:
        """(tokens, hidden, top_logits, top_ids), on `device` if given: a training batch."""
        out = (getattr(self, f.name) for f in dataclasses.fields(OwnText))
        return tuple(t if device is None else t.to(device, non_blocking=True) for t in out)

    @staticmethod
    def cat(parts: Sequence[OwnText]) -> OwnText:
        return OwnText(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(OwnText)))


@torch.no_grad()
def model_states(model: DecoderLM, tokens: Tensor, top_k: int = 8, batch: int = 8) -> OwnText:
    """The model's last-block states and top-k next-token logits over `tokens` (N, T)."""
    parts, device = [], model.device
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
    tokenizer: Tokenizer | None = None,
    log: Callable[[str], None] = print,
) -> OwnText:
    """Continue each opening greedily for `new_tokens` (with `writer`, e.g. a quantized copy of the model, which
    writes faster and nearly the same text; the model itself by default), then record the model's own states and
    top-k logits over the whole text. Written to `directory` a batch at a time: a second call with the same
    arguments reads what is there and does the rest. The folder is then a split of training data (`describe`;
    `tokenizer`: the model's, which the drafter's checkpoints carry)."""
    from llmkit.generate import generate

    if not openings or len({len(o) for o in openings}) != 1 or not len(openings[0]):
        raise InputError("openings must be a non-empty list of token lists of one (non-zero) length")
    if new_tokens < 2:
        raise InputError(f"new_tokens={new_tokens} must be at least 2")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    parts = []
    started = time.perf_counter()
    names = [f"own-{i:06d}-{len(openings[0])}-{new_tokens}.pt" for i in range(0, len(openings), batch)]
    for i, name in zip(range(0, len(openings), batch), names, strict=True):
        path = d / name
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
    text = OwnText.cat(parts)
    describe(d, names, text, opening=len(openings[0]), tokenizer=tokenizer)
    return text


def save_own_text(directory: str | Path, text: OwnText, *, opening: int, tokenizer: Tokenizer | None = None) -> None:
    """Write `text` (e.g. model_states over tokens of one's own) to `directory` as a split of training data."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch_save(dataclasses.asdict(text), d / "own-text.pt")
    describe(d, ["own-text.pt"], text, opening=opening, tokenizer=tokenizer)


def describe(
    directory: str | Path, files: list[str], text: OwnText, *, opening: int, tokenizer: Tokenizer | None
) -> None:
    """Make the split in `directory` (its `files`, which hold `text`) a data source for training: what it holds, and
    the tokenizer."""
    d = Path(directory)
    n, T = text.tokens.shape
    chars = sum(len(tokenizer.decode(row)) for row in text.tokens.tolist()) if tokenizer is not None else T * n
    meta: dict[str, Any] = {
        "files": files,
        "sequences": n,
        "tokens_per_sequence": T,
        "opening": opening,
        "top_k": int(text.top_ids.shape[-1]),
        "width": int(text.hidden.shape[-1]),
        "vocab_size": int(text.top_ids.max()) + 1 if tokenizer is None else tokenizer.vocab_size,
        "chars_per_token": chars / (n * T),
    }
    if tokenizer is not None:
        tokenizer.save(d)
    (d / META).write_text(json.dumps(meta, indent=2) + "\n")


def is_own_text(directory: str | Path) -> bool:
    """Whether `directory` is a work folder of own text (its train split described)."""
    return (Path(directory) / "train" / META).is_file()


def read_meta(directory: str | Path, split: str) -> dict[str, Any]:
    path = Path(directory) / split / META
    if not path.is_file():
        raise InputError(f"{path.parent} holds no collected own text ({META} is missing)")
    meta: dict[str, Any] = json.loads(path.read_text())
    return meta


def read_own_text(directory: str | Path, split: str) -> OwnText:
    """The split's text as `describe` recorded it."""
    d = Path(directory) / split
    parts = []
    for name in read_meta(directory, split)["files"]:
        if not (d / name).is_file():
            raise InputError(f"{d / name} is missing: collect the own text again (the command resumes)")
        parts.append(OwnText(**torch.load(d / name)))
    return OwnText.cat(parts)
