"""The request bodies of OpenAI's completions and chat-completions APIs.

Every field OpenAI defines for the two endpoints is a field here, so a client that sends them all with their
defaults or nulls (LangChain sends `"logprobs": null` on every call) is served. A field llmkit does not implement
is accepted only at its default: any other value is a 400 naming the field and saying it is not supported, never
something silently ignored. Unknown fields are forbidden, so a misspelt parameter is a 400 naming it too.
Parameters that other OpenAI-compatible servers accept as extensions (top_k, min_p, repetition_penalty,
ignore_eos) are accepted.

Every number has a range and every list a length limit, checked here, before anything is tokenized or queued: a
value outside them is a 400 that names the field and the range. Text must be Unicode scalar values: JSON can carry
a lone surrogate ("\ud800"), which no tokenizer can encode, so it is refused here with the field's name.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from llmkit.serve.request import MAX_TOP_LOGPROBS, SamplingParams

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


def _only(*defaults: Any, why: str = "") -> AfterValidator:
    """A field llmkit does not implement: accepted at one of its default values only."""
    hint = why or f"leave it out or give {json.dumps(defaults[0])}"

    def check(value: Any) -> Any:
        if value not in defaults:
            what = f"{value!r} is" if isinstance(value, str) else "a value other than the default is"
            raise ValueError(f"{what} not supported by llmkit serve; {hint}")
        return value

    return AfterValidator(check)


Unsupported = Annotated[Any, _only(None)]  # anything but null is refused


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against side channels over the network; nothing to pad here


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
    # hints that change no output: a key for routing to a cache (llmkit's prefix cache needs none), an end user's id
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    service_tier: Annotated[str | None, _only(None, "auto", "default")] = None

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
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT)  # 0: only the prompt (with echo, its log-probabilities)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each token's, with this many alternatives
    echo: bool | None = False  # the prompt before the completion, with its log-probabilities when asked for
    best_of: Annotated[int | None, _only(None, 1)] = None
    suffix: Unsupported = None

    def sampling(self, max_tokens: int) -> SamplingParams:
        k = self.logprobs
        return replace(super().sampling(max_tokens), top_logprobs=k or 0, prompt_logprobs=k if self.echo else None)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    """A content part. OpenAI's other kinds (images, audio, files, refusals) are refused by name: the models llmkit
    serves read text."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind in ("image_url", "input_audio", "file", "refusal"):
            raise ValueError(f"{kind!r} parts are not supported by llmkit serve; the models it serves read text parts")
        return data


class Message(BaseModel):
    """One turn. `developer` is OpenAI's newer name for `system` and is rendered as one."""

    model_config = ConfigDict(extra="forbid")
    role: Annotated[
        Literal["developer", "system", "user", "assistant", "tool", "function"],
        _only("developer", "system", "user", "assistant", why="tool results need tools, which are not served yet"),
    ]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)]
    name: Text | None = None
    refusal: Text | None = None  # an assistant turn's refusal, as OpenAI returns it; not shown to the model
    tool_calls: Annotated[list[Any] | None, _only(None, [])] = None
    function_call: Unsupported = None
    audio: Unsupported = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Annotated[Literal["text", "json_object", "json_schema"], _only("text")]


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: the conversation is rendered with the checkpoint's chat template."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool | None = False  # each generated token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and this many alternatives
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Any] | None, _only(None, [])] = None
    tool_choice: Annotated[Any, _only(None, "none", "auto")] = None  # with no tools, "auto" calls none
    parallel_tool_calls: bool | None = None  # whether tool calls may come several at once: no tools, no calls
    functions: Annotated[list[Any] | None, _only(None, [])] = None  # the deprecated form of tools
    function_call: Annotated[Any, _only(None, "none", "auto")] = None
    modalities: Annotated[list[str] | None, _only(None, ["text"])] = None
    audio: Unsupported = None
    prediction: Unsupported = None
    reasoning_effort: Unsupported = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    store: Annotated[bool | None, _only(None, False)] = None
    metadata: dict[str, Text] | None = Field(None, max_length=16)  # labels for stored completions; none are stored

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    def sampling(self, max_tokens: int) -> SamplingParams:
        return replace(super().sampling(max_tokens), top_logprobs=self.top_logprobs or 0)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or a conversation rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[Message], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True  # a prompt's beginning-of-sequence token, where the tokenizer adds one
    add_generation_prompt: bool = True  # a conversation ends with the assistant's turn opened

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: strings or token-id lists, one embedding each."""

    model_config = ConfigDict(extra="forbid")
    model: Text
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Unsupported = None  # a shorter embedding: models trained for it only
    user: Text | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]
