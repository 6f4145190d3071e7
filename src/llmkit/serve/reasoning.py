"""Reasoning output: a chat reply's thinking block apart from its answer, as `reasoning_content` (the field vLLM,
SGLang and llama.cpp's server return for DeepSeek-R1, Qwen3 and the other models whose chat templates have thinking
blocks).

    <think>The user wants the area: w times h.</think>\n\nThe area is 12.
    └─────────── reasoning_content ───────────┘      └── content ──┘

The model may open the block itself, or the template may have opened it at the end of the prompt (DeepSeek-R1's
generation prompt ends in "<think>\n"): then the reply starts inside it. Only a block at the start of the reply is
reasoning; a reply that never closes its block is all reasoning. A stream is split as it arrives: text that may be
the start of a tag is held back until it is clearly one or not, so no delta carries half a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK = ("<think>", "</think>")


def tags_of(template: str | None) -> tuple[str, str] | None:
    """The thinking tags a chat template uses (None: it has no thinking blocks)."""
    return THINK if template is not None and THINK[0] in template and THINK[1] in template else None


@dataclass(frozen=True)
class Reasoning:
    """How a reply's reasoning is found: its tags, and whether the prompt ended inside an open block."""

    start: str
    end: str
    inside: bool = False

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply -> (its reasoning, or None where it has no block; its answer)."""
        stream = ReasoningStream(self)
        reasoning, content = stream.push(text)
        more_reasoning, more_content = stream.end()
        found = stream.found
        return (reasoning + more_reasoning if found else None), content + more_content


class ReasoningStream:
    """A reply split as it arrives: push(delta) -> (reasoning, content) ready to send; end() -> what was held."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.r = reasoning
        self.state = "inside" if reasoning.inside else "start"  # start -> inside -> after
        self.found = reasoning.inside  # whether the reply has a reasoning block
        self.closed = False  # just past the block's closing tag
        self.held = ""

    def push(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        self.held += text
        while self.held:
            if self.state == "start":  # the reply's first characters: its opening tag, or none
                stripped = self.held.lstrip()
                if stripped.startswith(self.r.start):
                    self.held, self.state, self.found = stripped[len(self.r.start) :], "inside", True
                elif self.r.start.startswith(stripped):  # maybe the tag, not whole yet
                    break
                else:
                    self.state = "after"
            elif self.state == "inside":
                at = self.held.find(self.r.end)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state, self.closed = self.held[at + len(self.r.end) :], "after", True
                    continue
                keep = _partial(self.held, self.r.end)  # a suffix that may begin the closing tag
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            else:
                if self.closed:  # the newlines between the block and the answer belong to neither
                    self.held = self.held.lstrip("\n")
                    self.closed = not self.held
                content, self.held = content + self.held, ""
        return reasoning, content

    def end(self) -> tuple[str, str]:
        """What was held at the reply's end: an unclosed block's last reasoning, or text that was not a tag."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "inside" else ("", held)


def _partial(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkingBudget:
    """Ends a reply's thinking block once it has taken `budget` tokens, by forcing the tokens of `close` (the block's
    closing tag, after a newline) one a step: the engine lets a forced row take its forced token only (llama.cpp's
    reasoning budget and vLLM's thinking_token_budget work the same way). Tokens count from the reply's start while
    the block may open or is open; a reply that does not open one is never limited. A token forced in the middle of
    a character's UTF-8 bytes leaves that character broken in the reasoning text."""

    def __init__(self, reasoning: Reasoning, budget: int, close: list[int]) -> None:
        self.stream = ReasoningStream(reasoning)
        self.budget, self.close = budget, close
        self.used = 0  # tokens the reply spent before its block closed
        self.forcing: list[int] = []  # the closing tokens not given yet
        self.forced = False

    @property
    def thinking(self) -> bool:
        """Whether the reply may still be in its block (the budget may still force tokens)."""
        return self.stream.state != "after"

    def next_token(self) -> int | None:
        """The token the reply must take next, or None."""
        return self.forcing[0] if self.forcing else None

    def push(self, token: int, text: str) -> None:
        """The reply took `token`, whose text is `text`."""
        if self.forcing and token == self.forcing[0]:
            self.forcing.pop(0)
        if not self.thinking:
            return
        self.used += 1
        self.stream.push(text)
        if self.stream.state == "inside" and self.used >= self.budget and not self.forced:
            self.forced, self.forcing = True, list(self.close)
