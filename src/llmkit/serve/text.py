"""A sequence's text as it is given out: tokens detokenized one at a time, with stop strings held back.

A stop string may arrive split over several tokens ("\\n\\n" as "\\n" then "\\n"), so text that could be the start of
one is held back until the next piece shows whether it is. The output ends just before the first stop string found,
and never contains it (OpenAI's convention).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmkit.tokenizer import IncrementalDecoder


class TextStops:
    """The stop strings of one request."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)

    def release(self, pending: str, final: bool = False) -> tuple[str, str, str | None]:
        """pending: text not given out yet. Returns (text to give out now, text to keep holding, the stop string
        that ended it or None). With `final` nothing is held back (the sequence ends)."""
        hits = [(i, s) for i, s in ((pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, stop = min(hits, key=lambda hit: hit[0])  # the first to occur (the first given, at a tie)
            return pending[:at], "", stop
        if final or not self.stops:
            return pending, "", None
        keep = self._partial(pending)
        return pending[: len(pending) - keep], pending[len(pending) - keep :], None

    def _partial(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class TextOutput:
    """One sequence's detokenizer and the text it holds back for its stop strings. Without a tokenizer (a
    Python caller working in token ids) every piece is empty."""

    def __init__(self, decoder: IncrementalDecoder | None, stops: Sequence[str]) -> None:
        self.decoder, self.stops = decoder, TextStops(stops)
        self.held = ""  # decoded text not given out yet: it may be the start of a stop string
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, token: int | None, final: bool = False) -> tuple[str, bool]:
        """Add a token (None: only end, as at an end-of-sequence token, whose text is never shown); returns the
        text to give out now and whether a stop string ended it. With `final` nothing is held back."""
        piece = self.decoder.push(token) if self.decoder is not None and token is not None else ""
        if final and self.decoder is not None:
            piece += self.decoder.finish()
        text, self.held, self.matched = self.stops.release(self.held + piece, final)
        return text, self.matched is not None
