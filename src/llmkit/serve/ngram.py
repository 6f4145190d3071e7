"""Drafts without a draft model: prompt lookup (Saxena 2023, "Prompt lookup decoding"; vLLM's and llama.cpp's n-gram
drafting). When a sequence's last few tokens occurred earlier in its own text (prompt or output), the tokens that
followed them then are a guess at what follows now:

    text   ... def area(self): return self.w * self.h ... def area(self): return
                                  ^^^^^^^^^^^^^^^^^^^^^^^                      the last n = 4 tokens, seen before
    drafts                                               self.w * self.h      what followed them: up to k tokens

Code being edited, a document being summarised or quoted, a retrieved passage being restated: the output copies long
runs of the prompt, and each run costs one verifying step instead of one step a token. The drafts go through the
same batched verification as a model's (speculation.py), so greedy output is the plain engine's token for token, and
a sampled row's drafts are proposals with all their mass on one token (q one-hot in the acceptance rule), which keeps
the model's distribution. No model runs to draft, so a draft costs a dictionary lookup; how many drafts a step gets
is set, as for the other drafters, by what the verifying step costs and how often the drafts are kept.

NgramIndex holds, per sequence, where each of its n-grams (MIN_N .. MAX_N tokens) last ended, extended with the
tokens that arrived since the last lookup; the longest n-gram ending the text that occurred before wins, and its
latest occurrence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.models.decoder import DecoderLM
from llmkit.serve.kv_manager import KVCacheManager
from llmkit.serve.request import Sequence
from llmkit.serve.runner_base import TokenRunner
from llmkit.serve.scheduler import Work
from llmkit.serve.speculation import Costs, Drafts, Speculator

MIN_N, MAX_N = 2, 4  # n-gram lengths matched, longest first (a single token matches too often to be worth a row)


class NgramIndex:
    """Where each n-gram of a text last ended: grams[(t_i, .., t_j)] = j + 1, the position of what followed it."""

    def __init__(self) -> None:
        self.grams: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `grams`

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram ending `tokens` (the
        text so far: it only ever grows), or [] where none occurred before."""
        end = len(tokens) - 1  # the n-grams ending at the last token are looked up before they are indexed
        for j in range(self.indexed, end):
            for n in range(MIN_N, MAX_N + 1):
                if j + 1 >= n:
                    self.grams[tuple(tokens[j + 1 - n : j + 1])] = j + 1
        self.indexed = max(self.indexed, end)
        for n in range(MAX_N, MIN_N - 1, -1):
            follows = self.grams.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if follows is not None:
                return tokens[follows : follows + k]
        return []


class NgramSpeculator(Speculator):
    """Drafts each decoding sequence's next tokens from its own text (prompt lookup), verified by the engine's
    runner as a model's drafts are."""

    def __init__(self, model: DecoderLM, target: TokenRunner, kv: KVCacheManager, k: int) -> None:
        super().__init__(model, target, kv, k)
        self.indexes: dict[tuple[str, int], NgramIndex] = {}
        # per sequence: how often its drafts are kept (a running mean from 1: a new sequence drafts in full), which
        # caps its drafts below the step's k where its text is not being copied
        self.kept: dict[tuple[str, int], float] = {}
        self._found: dict[tuple[str, int], list[int]] = {}  # this step's continuations, from _available to _draft
        with torch.no_grad():
            self.costs = Costs.measure(self)  # the verifying step's (drafting costs nothing measurable)

    def _available(self, w: Work, k: int) -> int:
        seq = w.seq
        text = seq.tokens[: w.start + 1]  # up to cur, the newest token
        found = self.indexes.setdefault(seq.key, NgramIndex()).continuation(text, self._depth(seq, k))
        self._found[seq.key] = found
        return len(found)

    def _draft(self, chosen: list[tuple[Work, int]]) -> list[Drafts]:
        drafts = []
        for w, k in chosen:
            tokens = torch.tensor(self._found.pop(w.seq.key)[:k])
            greedy = w.seq.request.params.sampling.greedy
            # a sampled row's proposal puts all its mass on the draft (q one-hot): kept with the model's probability
            q = None if greedy else torch.nn.functional.one_hot(tokens, self.model.cfg.vocab_size).float()
            drafts.append(Drafts(tokens, q))
        self._found.clear()
        return drafts

    def _depth(self, seq: Sequence, k: int) -> int:
        """The drafts worth verifying for `seq`: while the chance that all of them are kept, its keep rate to the
        power of their number, stays above 1 in 3 (at least one, to keep measuring it)."""
        rate = self.kept.get(seq.key, 1.0)
        depth = 1
        while depth < k and rate ** (depth + 1) > 1 / 3:
            depth += 1
        return depth

    def record(self, drafted: int, accepted: int, seq: Sequence | None = None) -> None:
        super().record(drafted, accepted, seq)
        if seq is not None and drafted:
            self.kept[seq.key] = 0.7 * self.kept.get(seq.key, 1.0) + 0.3 * accepted / drafted

    def _record(self, rows: list[Work], hidden: list[Tensor], counts: list[int]) -> None:
        return  # the drafts come from the text, never from the target's states

    def forget(self, seq: Sequence) -> None:
        super().forget(seq)
        self.indexes.pop(seq.key, None)
        self.kept.pop(seq.key, None)
