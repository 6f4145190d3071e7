"""Log-probabilities in the shapes OpenAI's two APIs return them.

    completions   {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
                   "text_offset": [int]}                       one entry per token; with echo the prompt's first
    chat          {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                   "refusal": null}

The values are the model's own (serve/request.py says which distribution). A token is named by its own text,
decoded alone with special tokens shown, so a byte-level token holding part of a character shows U+FFFD, as vLLM
shows it; `bytes` are the bytes the token stands for (Tokenizer.token_bytes), as OpenAI gives them, so that a client
joining a reply's tokens' bytes gets its text, every character whole. A completions `top_logprobs` entry holds the k
most likely tokens and the chosen one (OpenAI's "up to logprobs + 1"); `text_offset` counts characters from the start
of the prompt's text, as OpenAI counts them, echo or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmkit.serve.request import TokenLogprob, Top
from llmkit.tokenizer import IncrementalDecoder, Tokenizer


class TokenNames:
    """The text each token id is reported under (cached: the same ids come back step after step)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._names: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token: int) -> str:
        name = self._names.get(token)
        if name is None:
            tok = self.tokenizer
            name = tok.decode([token], skip_special=False) if tok is not None else f"<{token}>"
            self._names[token] = name
        return name

    def bytes(self, token: int) -> list[int]:
        """The bytes `token` stands for, as a list of ints (chat's `bytes`)."""
        raw = self._bytes.get(token)
        if raw is None:
            tok = self.tokenizer
            raw = list(tok.token_bytes(token)) if tok is not None else list(self(token).encode("utf-8"))
            self._bytes[token] = raw
        return raw

    def text(self, ids: list[int]) -> str:
        """The text of a whole prompt given as token ids (what echo returns for it)."""
        return self.tokenizer.decode(ids, skip_special=False) if self.tokenizer is not None else ""

    def pieces(self, ids: list[int]) -> list[str]:
        """The text each of `ids` adds to the text before it (summing to the decoded text), for offsets."""
        if self.tokenizer is None:
            return ["" for _ in ids]
        decoder = IncrementalDecoder(self.tokenizer, skip_special=False)
        return [decoder.push(t) for t in ids[:-1]] + ([decoder.push(ids[-1]) + decoder.finish()] if ids else [])


@dataclass
class CompletionLogprobs:
    """One completions choice's log-probabilities, built token by token (streamed or all at once)."""

    names: TokenNames
    offset: int = 0  # characters of text before the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token: int, logprob: float | None, top: Top | None, piece: str) -> None:
        """One token: its log-probability (None for a prompt's first token), its alternatives, and the text it
        adds to what the client reads."""
        name = self.names(token)
        self.tokens.append(name)
        self.token_logprobs.append(logprob)
        if top is None or logprob is None:
            self.top_logprobs.append(None)
        else:
            self.top_logprobs.append({self.names(t): v for t, v in top} | {name: logprob})
        self.text_offset.append(self.offset)
        self.offset += len(piece)

    def add_prompt(self, ids: list[int], logprobs: list[TokenLogprob | None]) -> None:
        for token, entry, piece in zip(ids, logprobs, self.names.pieces(ids), strict=True):
            self.add(token, entry[0] if entry else None, entry[1] if entry else None, piece)

    def take(self) -> dict[str, Any]:
        """What was added since the last take, as OpenAI's object (a stream sends each token's once)."""
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(names: TokenNames, ids: list[int], logprobs: list[float], tops: list[Top]) -> dict[str, Any]:
    """Chat's `logprobs` for generated tokens."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        name = names(token)
        return {"token": name, "logprob": logprob, "bytes": names.bytes(token)}

    content = [
        entry(t, v) | {"top_logprobs": [entry(a, w) for a, w in top]}
        for t, v, top in zip(ids, logprobs, tops, strict=True)
    ]
    return {"content": content, "refusal": None}
