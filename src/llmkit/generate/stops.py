"""When a generated row is finished: one rule set for every generator.

A row stops at an end token (any of several ids), at a stop sequence of token ids, at a stop string (read through
a tokenizer), or after max_new_tokens. Finished rows keep their place in the batch and emit nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmkit.errors import InputError
from llmkit.tokenizer import Tokenizer


def eos_ids(eos_id: int | Sequence[int] | None) -> frozenset[int]:
    """The end-token ids, from one id, several, or None."""
    if eos_id is None:
        return frozenset()
    return frozenset([eos_id] if isinstance(eos_id, int) else eos_id)


@dataclass(frozen=True)
class StopRule:
    """What ends a row. max_new_tokens None: only the other rules (the caller bounds the steps)."""

    eos: frozenset[int] = frozenset()
    sequences: tuple[tuple[int, ...], ...] = ()
    strings: tuple[str, ...] = ()
    tokenizer: Tokenizer | None = None
    max_new_tokens: int | None = None

    @classmethod
    def of(
        cls,
        eos_id: int | Sequence[int] | None = None,
        stop_sequences: Sequence[Sequence[int]] = (),
        stop_strings: Sequence[str] = (),
        tokenizer: Tokenizer | None = None,
        max_new_tokens: int | None = None,
    ) -> StopRule:
        if stop_strings and tokenizer is None:
            raise InputError("stop_strings need a tokenizer to read the generated text")
        sequences = tuple(tuple(s) for s in stop_sequences if len(s))
        return cls(eos_ids(eos_id), sequences, tuple(stop_strings), tokenizer, max_new_tokens)

    def ends(self, row: Sequence[int]) -> bool:
        """Whether a row whose newest token is row[-1] is finished."""
        if row and row[-1] in self.eos:
            return True
        if self.max_new_tokens is not None and len(row) >= self.max_new_tokens:
            return True
        if any(len(row) >= len(s) and tuple(row[-len(s) :]) == s for s in self.sequences):
            return True
        return self.tokenizer is not None and any(x in self.tokenizer.decode(list(row)) for x in self.strings)

    def cut(self, row: list[int]) -> list[int]:
        """Drop the tokens that complete a stop string (the text before it is kept)."""
        if not self.strings or self.tokenizer is None:
            return row
        for n in range(len(row) + 1):
            if any(s in self.tokenizer.decode(row[:n]) for s in self.strings):
                return row[: n - 1]
        return row


@dataclass
class Rows:
    """Each row's generated tokens and whether it has finished, under a StopRule."""

    rule: StopRule
    batch: int
    tokens: list[list[int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.batch)]
        self.done = [False] * self.batch

    def push(self, b: int, token: int) -> bool:
        """Give row b its next token unless it has finished; returns whether the token was taken."""
        if self.done[b]:
            return False
        self.tokens[b].append(token)
        self.done[b] = self.rule.ends(self.tokens[b])
        return True

    def push_all(self, tokens: Sequence[int]) -> list[int | None]:
        """One token per row; returns what each row took (None for finished rows)."""
        return [t if self.push(b, t) else None for b, t in enumerate(tokens)]

    @property
    def finished(self) -> bool:
        return all(self.done)
