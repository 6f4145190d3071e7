"""Tool calling: function definitions into the prompt, the model's calls out of its text.

    tools + messages ─► conversation (the template's own tool support, or a system message we write) ─► prompt
    generated text ─► ToolText (streams the prose, holds what may be a call) ─► content + tool_calls

Two formats of call, by what the checkpoint's chat template shows it was trained on:
- **hermes**: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Qwen2.5, Qwen3,
  Hermes and most templates that take `tools`);
- **llama3**: the reply is one JSON object `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or not
  (Llama 3.1 - 3.3).
A template that takes `tools=` (transformers' convention) renders the definitions, the assistant's earlier calls
and the tools' results itself. One that does not (SmolLM2's) gets them as llama.cpp's generic handler does: a system
message that lists the functions and asks for hermes blocks, earlier calls written as those blocks, and results as
user turns in `<tool_response>` tags.

With `tool_choice` `required` or a named function the reply is constrained by the grammar engine
(serve/structured.py): exactly the call blocks, each naming a function of `tools` with arguments valid for its
`parameters` schema, so they always parse and validate. With `auto` the model decides and its text is parsed: a
block that does not parse as a call stays in the text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from llmkit.serve.structured import Constraint

Format = Literal["hermes", "llama3"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# the JSON inside a constrained call: one line, as serve/structured.py writes JSON
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments object

    def definition(self) -> dict[str, Any]:
        """As OpenAI's request carries it (and as chat templates take it)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def template_format(template: str | None) -> tuple[bool, Format]:
    """(whether the chat template renders `tools` itself, the format its model calls in)."""
    template = template or ""
    takes_tools = re.search(r"\btools\b", template) is not None
    if PYTHON_TAG in template or ("ipython" in template and OPEN not in template):
        return takes_tools, "llama3"
    return takes_tools, "hermes"


def _generic_instructions(functions: list[Function]) -> str:
    listing = "\n".join(json.dumps(f.definition()) for f in functions)
    return (
        "You can call functions to help answer. Their definitions, one JSON object per line:\n"
        f"{listing}\n\n"
        f"To call one, reply with {OPEN} on a line of its own, then one line of JSON of the form "
        '{"name": <the function\'s name>, "arguments": <an object of its arguments>}, then '
        f"{CLOSE} on a line of its own; one such block per call. Without a call, reply in plain text."
    )


def _block(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def _arguments(text: str) -> Any:
    """An earlier call's arguments (JSON text) as the object templates expect, or the text if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def conversation(
    messages: list[dict[str, Any]], functions: list[Function] | None, takes_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the chat template renders them, and what else it is given (`tools`).

    messages: dicts with role, content (text) and, for an assistant, `tool_calls` (ToolCall) or, for a tool's
    result, `tool_call_id` / `name`. A template that takes tools gets them as transformers passes them (calls'
    arguments as objects); otherwise calls become hermes blocks, results user turns and the definitions a system
    message (after the checkpoint's own system message, if the conversation has one)."""
    if takes_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                    for c in m["tool_calls"]
                ]
            out.append(m)
        return out, ({"tools": [f.definition() for f in functions]} if functions else {})
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [_block(c.name, _arguments(c.arguments)) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([m["content"], *blocks] if m["content"] else blocks)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if functions:
        instructions = _generic_instructions(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, {}


def call_constraint(functions: list[Function], fmt: Format, several: bool) -> Constraint:
    """The grammar of a reply that is only calls (one, or `several`), each to one of `functions` with arguments
    valid for its schema. Each function's `parameters` sits under the call schema's `$defs` (as `f0`, `f1`, ...),
    its own references ("#/$defs/...", "#") moved with it, and its arguments are an object whatever it says."""
    key = "parameters" if fmt == "llama3" else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, key: {"$ref": f"#/$defs/f{i}", "type": "object"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for i, f in enumerate(functions)
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    defs = {f"f{i}": _moved(f.parameters, f"/$defs/f{i}") for i, f in enumerate(functions)}
    schema = {**schema, "$defs": defs, "x-guidance": _COMPACT}
    if fmt == "llama3":  # one call: the reply is its JSON
        return Constraint("grammar", f"start: %json {json.dumps(schema)}")
    repeat = ' ("\\n" call)*' if several else ""
    lark = f'start: call{repeat}\ncall: "{OPEN}\\n" args "\\n{CLOSE}"\nargs: %json {json.dumps(schema)}'
    return Constraint("grammar", lark)


# keywords whose values are data, not schemas: a {"$ref": ...} inside them is not a reference; and those whose values
# map names to schemas (a property called "enum" is a schema)
_DATA = {"const", "enum", "default", "examples"}
_NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def _moved(schema: Any, at: str) -> Any:
    """`schema` with its document-local references ("#" and "#/...") rewritten for its new place `at` (a JSON
    pointer) in a larger schema."""
    if isinstance(schema, list):
        return [_moved(v, at) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + at + v[1:]
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: _moved(sub, at) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA else _moved(v, at)
    return out


def parse(text: str, fmt: Format, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """A reply -> (its prose, or None when it is only calls; the calls to functions in `names`). What does not
    parse as a call to a known function stays in the prose."""
    if fmt == "llama3":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        call = _call(body, names, "parameters")
        return (None, [call]) if call is not None else (text, [])
    calls, prose, at = [], [], 0
    for m in re.finditer(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), text, re.DOTALL):
        call = _call(m.group(1), names, "arguments")
        if call is None:
            continue
        prose.append(text[at : m.start()])
        calls.append(call)
        at = m.end()
    prose.append(text[at:])
    content = "".join(prose).strip() if calls else text
    return (content or None), calls


def _call(body: str, names: set[str], key: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get(key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments), new_call_id())


class ToolText:
    """One choice's text as it streams, when the model may call: prose is given out as it comes, and from where a
    call may begin (`<tool_call>`, or a llama3 reply's opening `{`) the text is held until the reply ends and is
    then parsed. Only what was held can hold calls."""

    def __init__(self, fmt: Format, names: set[str]) -> None:
        self.fmt, self.names = fmt, names
        self.held = ""
        self.holding = False  # a call may have begun: keep everything until the end

    def push(self, text: str) -> str:
        """New text -> the prose that can be given out now."""
        pending = self.held + text
        if self.holding:
            self.held = pending
            return ""
        if self.fmt == "llama3":
            stripped = pending.lstrip()
            if not stripped:
                self.held = pending
                return ""
            if stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped):
                self.holding, self.held = True, pending
                return ""
            self.held = ""
            return pending
        at = pending.find(OPEN)
        if at >= 0:
            self.holding, self.held = True, pending[at:]
            return pending[:at]
        keep = next((n for n in range(min(len(OPEN) - 1, len(pending)), 0, -1) if pending.endswith(OPEN[:n])), 0)
        self.held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: (the rest of the prose, the calls in what was held)."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        content, calls = parse(held, self.fmt, self.names)
        if not calls:
            return held, []
        return content or "", calls


@dataclass(frozen=True)
class ToolUse:
    """How one chat request's replies are read: the format, the functions offered, the mode ('auto', 'required'
    or a function's name), whether several calls may come at once, and the constraint of a forced call."""

    fmt: Format
    names: set[str]
    mode: str
    several: bool
    constraint: Constraint | None = None

    def reply(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse(text, self.fmt, self.names)
        return content, self._allowed(calls)

    def stream(self) -> ToolText:
        return ToolText(self.fmt, self.names)

    def end(self, stream: ToolText) -> tuple[str, list[ToolCall]]:
        """A streamed reply ended: the rest of its prose and its calls."""
        rest, calls = stream.finish()
        return rest, self._allowed(calls)

    def _allowed(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.several else calls[:1]  # parallel_tool_calls false: the first call only

    def finish_reason(self, calls: list[ToolCall], reason: str | None) -> str | None:
        """OpenAI's: 'tool_calls' when the model chose to call, 'stop' when the call was forced by name."""
        return "tool_calls" if calls and reason == "stop" and self.mode in ("auto", "required") else reason
