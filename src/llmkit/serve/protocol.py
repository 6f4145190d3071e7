"""The request bodies of OpenAI's completions and chat-completions APIs.

Every field OpenAI defines for the two endpoints is a field here, so a client that sends them all with their
defaults or nulls (LangChain sends `"logprobs": null` on every call) is served. A field llmkit does not implement
is accepted only at its default: any other value is a 400 naming the field and saying it is not supported, never
something silently ignored. Unknown fields are forbidden, so a misspelt parameter is a 400 naming it too.
Parameters that other OpenAI-compatible servers accept as extensions (top_k, min_p, repetition_penalty,
ignore_eos, vLLM's `priority` and `structured_outputs`: json, regex, choice, grammar) are accepted.

Every number has a range and every list a length limit, checked here, before anything is tokenized or queued: a
value outside them is a 400 that names the field and the range. Text must be Unicode scalar values: JSON can carry
a lone surrogate ("\ud800"), which no tokenizer can encode, so it is refused here with the field's name.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from llmkit.errors import InputError
from llmkit.serve.request import MAX_TOP_LOGPROBS, SamplingParams
from llmkit.serve.structured import Constraint, check_schema_depth
from llmkit.serve.tools import Function, ToolCall

INT64 = (-(2**63), 2**63 - 1)  # seeds: what torch.Generator.manual_seed takes (with room for seed + n)
MAX_INT = 2**31 - 1  # counts (max_tokens, top_k): far beyond any context, small enough for every kernel
MAX_PROMPTS = 256  # prompts in one completions request (each becomes n sequences)
MAX_MESSAGES = 4096  # messages in one chat request
MAX_PARTS = 256  # content parts in one message
MAX_LOGIT_BIAS = 1024  # tokens in one logit_bias map


def _several(limit: int, what: str) -> BeforeValidator:
    """Checked before the shapes are tried: a list of more than `limit` strings or token lists is refused at once
    (each shape that fails on a list of 800,000 strings gives one error an item, seconds of work on the event loop);
    one list of token ids is one prompt, whatever its length."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit and not isinstance(value[0], int):
            raise ValueError(f"at most {limit} {what} in one request, got {len(value)}")
        return value

    return BeforeValidator(check)


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


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the reply must validate against. The output always does, strict or
    not (it is enforced while decoding); name and description are the client's labels."""

    model_config = ConfigDict(extra="forbid")
    name: Text = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON that validates against a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint.json_schema({"type": "object"})
        if self.json_schema is not None:
            return Constraint.json_schema(self.json_schema.schema_ or {"type": "object"})
        return None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a JSON schema), regex (the whole output matches it), choice
    (the output is one of the strings), grammar (Lark or llama.cpp's GBNF) or json_object (any JSON object)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=4096)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None  # one grammar engine here: nothing to fall back from
    # JSON's whitespace: by default none but ", " and ": " (disable_any_whitespace true or null); false allows any
    # run of whitespace between tokens, whitespace_pattern runs matching a regex
    disable_any_whitespace: bool | None = None
    whitespace_pattern: Text | None = None
    disable_additional_properties: Annotated[bool | None, _only(None, False)] = None
    structural_tag: Unsupported = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [self.json_ is not None, self.regex is not None, self.choice is not None, self.grammar is not None]
        if sum(given) + bool(self.json_object) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        return self

    def constraint(self) -> Constraint:
        whitespace = self.whitespace_pattern
        if whitespace is None and self.disable_any_whitespace is False:
            whitespace = r"[\x20\x0A\x0D\x09]+"
        if self.json_ is not None:
            return Constraint.json_schema(self.json_, whitespace)
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.choice is not None:
            return Constraint.choice(self.choice)
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return Constraint.json_schema({"type": "object"}, whitespace)


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
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # vLLM's extension: lower runs first
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: Text | None = None
    # hints that change no output: a key for routing to a cache (llmkit's prefix cache needs none), an end user's id
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    service_tier: Annotated[str | None, _only(None, "auto", "default")] = None
    # what the output must be: OpenAI's response_format, or vLLM's structured_outputs (one of the two)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    @model_validator(mode="after")
    def _check_stops(self) -> _Sampling:
        if len(self.stops()) > 4 or any(not s for s in self.stops()):
            raise ValueError("stop: at most 4 non-empty strings")
        formatted = self.response_format is not None and self.response_format.type != "text"
        if self.structured_outputs is not None and formatted:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    @property
    def constraint_field(self) -> str:
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def constraint(self) -> Constraint | None:
        """What the output must be (InputError for a schema that is not JSON); constraint_field names the field."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format is not None else None

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
            priority=self.priority,
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string, several, a list of token ids, or several such lists."""

    prompt: Annotated[
        Text
        | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
        | list[int]
        | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)],
        _several(MAX_PROMPTS, "prompts"),
    ]
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


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text  # JSON text of the arguments object, as the model wrote it


class CallModel(BaseModel):
    """An assistant turn's tool call, as OpenAI returned it."""

    model_config = ConfigDict(extra="forbid")
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction

    def call(self) -> ToolCall:
        return ToolCall(self.function.name, self.function.arguments, self.id)


class Message(BaseModel):
    """One turn. `developer` is OpenAI's newer name for `system` and is rendered as one; an assistant turn may hold
    tool calls (and no content), a `tool` turn holds one call's result."""

    model_config = ConfigDict(extra="forbid")
    role: Annotated[
        Literal["developer", "system", "user", "assistant", "tool", "function"],
        _only("developer", "system", "user", "assistant", "tool", why="give a function's result as a 'tool' message"),
    ]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None
    name: Text | None = None
    refusal: Text | None = None  # an assistant turn's refusal, as OpenAI returns it; not shown to the model
    tool_calls: Annotated[list[CallModel], Field(max_length=128)] | None = None
    tool_call_id: Text | None = None
    function_call: Unsupported = None
    audio: Unsupported = None

    @model_validator(mode="after")
    def _content_given(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant turn with tool_calls may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant turn has tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    def turn(self) -> dict[str, Any]:
        """The turn as serve/tools.py's conversation() takes it."""
        turn: dict[str, Any] = {"role": self.template_role, "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = [c.call() for c in self.tool_calls]
        if self.role == "tool":
            turn |= {"tool_call_id": self.tool_call_id, **({"name": self.name} if self.name else {})}
        return turn


def check_function_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A function's arguments are an object (OpenAI's and Anthropic's rule): a schema of another type could force a
    call that is no call. ValueError (for pydantic) otherwise, or when the schema nests too deep."""
    kind = (schema or {}).get("type", "object")  # (a type that is no type name is the schema's error)
    if (isinstance(kind, str) and kind != "object") or (isinstance(kind, list) and "object" not in kind):
        raise ValueError(f'the arguments\' schema is that of an object (type "object"), not of type {json.dumps(kind)}')
    try:
        check_schema_depth(schema)
    except InputError as e:
        raise ValueError(str(e)) from None
    return schema


class FunctionModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # the arguments of a forced call always validate; those of a free one are parsed

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_function_schema(parameters)


class ToolModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionModel


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: the reply is one call to it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: the conversation is rendered with the checkpoint's chat template."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool | None = False  # each generated token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and this many alternatives
    tools: Annotated[list[ToolModel], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # null: auto with tools
    parallel_tool_calls: bool | None = None  # false: one call at most
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
    # vLLM's extensions: variables for the chat template (Qwen3's enable_thinking, ...), and the most tokens the
    # reply's thinking block may take before its closing tag is forced
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=16)
    thinking_token_budget: int | None = Field(None, ge=1, le=MAX_INT)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the server, not by chat_template_kwargs")
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("tools")
    @classmethod
    def _unique(cls, tools: list[ToolModel] | None) -> list[ToolModel] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _offered(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if choice == "required" and not names:
            raise ValueError("'required' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names {choice.function.name!r}, which is not a function in tools")
        return choice

    @model_validator(mode="after")
    def _one_constraint(self) -> ChatRequest:
        if self.tool_mode() not in ("none", "auto") and self.constraint() is not None:
            raise ValueError("a forced tool call and a response_format or structured_outputs cannot both hold")
        return self

    def tool_mode(self) -> str:
        """'none' (no tools offered), 'auto' (the model decides), 'required', or the name of the function to call."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def offered(self) -> list[Function]:
        """The functions offered to the model (none with tool_choice 'none')."""
        if self.tool_mode() == "none":
            return []
        return [
            Function(f.name, f.description, f.parameters or {"type": "object", "properties": {}})
            for f in (t.function for t in self.tools or [])
        ]

    def sampling(self, max_tokens: int) -> SamplingParams:
        params = super().sampling(max_tokens)
        return replace(params, top_logprobs=self.top_logprobs or 0, reasoning_budget=self.thinking_token_budget)

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
    input: Annotated[
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)],
        _several(MAX_PROMPTS, "inputs"),
    ]
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


class LoadAdapter(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's shape): a PEFT adapter folder on the server's disk, served as `lora_name`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: Text = Field(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$")
    lora_path: Text = Field(min_length=1, max_length=4096)


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Text
    lora_int_id: int | None = None  # (vLLM's clients may send it; the name decides)
