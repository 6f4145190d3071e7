"""The request bodies of OpenAI's completions and chat-completions APIs, as far as llmkit serves them.

Each is a pydantic model that forbids unknown fields, so a misspelt or unsupported parameter is a 400 naming it
rather than something silently ignored. Parameters that other OpenAI-compatible servers accept as extensions
(top_k, min_p, repetition_penalty, ignore_eos) are accepted too.

Every number has a range and every list a length limit, checked here, before anything is tokenized or queued: a
value outside them is a 400 that names the field and the range. Text must be Unicode scalar values: JSON can carry
a lone surrogate ("\ud800"), which no tokenizer can encode, so it is refused here with the field's name.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from llmkit.serve.request import SamplingParams

INT64 = (-(2**63), 2**63 - 1)  # seeds: what torch.Generator.manual_seed takes (with room for seed + n)
MAX_INT = 2**31 - 1  # counts (max_tokens, top_k): far beyond any context, small enough for every kernel
MAX_PROMPTS = 256  # prompts in one completions request (each becomes n sequences)
MAX_MESSAGES = 4096  # messages in one chat request
MAX_PARTS = 256  # content parts in one message
MAX_LOGIT_BIAS = 1024  # tokens in one logit_bias map


def _scalar_values(text: str) -> str:
    """The text itself, unless it holds a lone surrogate (valid in JSON, not in Unicode text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise ValueError(
            f"holds a lone surrogate (U+{ord(bad):04X}) at character {e.start}, which is not a Unicode character"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_scalar_values)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_INT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: Text | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    @model_validator(mode="after")
    def _check_stops(self) -> _Sampling:
        if len(self.stops()) > 4 or any(not s for s in self.stops()):
            raise ValueError("stop: at most 4 non-empty strings")
        return self

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p if self.top_p < 1.0 else None,
            top_k=self.top_k if self.top_k > 0 else None,
            min_p=self.min_p if self.min_p > 0 else None,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=tuple(self.stops()),
            n=self.n,
            ignore_eos=self.ignore_eos,
            logit_bias=tuple((self.logit_bias or {}).items()),
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string, several, a list of token ids, or several such lists."""

    prompt: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
        | list[int]
        | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: the conversation is rendered with the checkpoint's chat template."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
