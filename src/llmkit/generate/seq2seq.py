"""Greedy decoding for encoder-decoder models (the Transformer or the RNN): encode once, then one cached decoder
step per token, from the start token until every row has produced its end token."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.models import EncoderDecoder, RNNSeq2Seq


@torch.no_grad()
def greedy_seq2seq(
    model: EncoderDecoder | RNNSeq2Seq,
    source: Tensor,
    *,
    start_id: int,
    eos_id: int,
    max_new_tokens: int = 64,
    source_mask: Tensor | None = None,
    suppress_ids: Sequence[int] = (),
) -> list[list[int]]:
    """source (B, S) -> per row the generated tokens, up to and including its end token (or max_new_tokens)."""
    if not 0 <= start_id < model.cfg.vocab_size:
        raise InputError(f"start_id={start_id} is outside the vocabulary [0, {model.cfg.vocab_size})")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 1")
    memory = model.encode(source, source_mask)
    B = source.shape[0]
    smask = None if source_mask is None else source_mask.bool()
    cache = model.new_cache(B, max_new_tokens + 1)
    banned = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=memory.device)
    token = torch.full((B, 1), start_id, dtype=torch.long, device=memory.device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=memory.device)
    for _ in range(max_new_tokens):
        logits = model.decode(token, memory, source_mask=smask, cache=cache)[:, -1]  # type: ignore[arg-type]
        if len(banned):
            logits = logits.index_fill(-1, banned, float("-inf"))
        nxt = logits.argmax(-1)  # (B,)
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                out[b].append(t)
        done |= nxt == eos_id
        if bool(done.all()):
            break
        token = nxt.unsqueeze(1)
    return out
