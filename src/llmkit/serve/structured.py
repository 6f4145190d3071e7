"""Structured outputs: a JSON schema, a regular expression, a list of choices or a grammar, enforced while decoding.

    Constraint ─► Grammars.compile (once per constraint, off the event loop) ─► a matcher per sequence
    each step: matcher ─► the tokens it allows (a bit mask) ─► the sampler picks among them ─► matcher.consume

The grammar engine is llguidance (guidance-ai; Rust, also one of vLLM's and llama.cpp's backends). Its matcher,
given the tokens so far, computes which vocabulary entries may come next, lexing the tokenizer's byte strings
against the grammar, so the text generated always belongs to the language: JSON that parses and validates
against the schema, a string the regex matches in full, exactly one of the choices.

Why llguidance rather than xgrammar (both on PyPI, both vLLM backends), measured on this project's 2-core AMD EPYC
with SmolLM2's 49,152-token vocabulary and a nested schema (objects, an array of enums, a pattern): a schema
compiles in 1.5 ms (xgrammar 6.3 ms); a token mask takes a median 13 µs (xgrammar 2 µs), about 0.2% of one
decoding step of that model, so both are free at this scale; llguidance installs as one 3 MB wheel with no
dependencies, where xgrammar's wheel requires triton (286 MB) on Linux; and it reads grammars in Lark and in
llama.cpp's GBNF, regexes and JSON schemas with the widest coverage of the keywords real schemas use. Its
tokenizer is built from the checkpoint's own tokenizer.json (no transformers needed).

Errors in a constraint (a schema that is not JSON, a keyword llguidance does not implement, a regex or grammar
that does not parse) are InputErrors naming what is wrong, found when the constraint is compiled, before the
request is queued. So are the limits the grammar engine meets only while decoding, as far as the first token shows
them: compiling takes the first step on a copy of the matcher, so that a regex no text matches, an alternation of
more than 2,000 items in one rule (llguidance's row limit; `choice` lists are one lexeme, not such a rule) and a
rule that can only recur (a schema or grammar with no finite text: its forced tokens run past 50,000 parser items)
are refused with the engine's own words for the limit. A grammar that fails later, while decoding, ends its
sequence with an error that names it (Sequence.error). Error messages are llguidance's short ones
(`verbose_errors=False`: the grammar is never copied into them, nor into the log).
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from llmkit.errors import InputError
from llmkit.tokenizer import Tokenizer

Kind = Literal["json", "regex", "choice", "grammar"]
# JSON schemas nest at most this many levels: llguidance parses JSON up to 128 (serde_json's limit: "recursion limit
# exceeded"), and wraps a schema in a few levels of its own (a tool's parameters in a few more: tools.py)
MAX_SCHEMA_DEPTH = 100


def json_depth(value: Any) -> int:
    """How many levels of arrays and objects `value` nests (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_schema_depth(schema: Any) -> None:
    """InputError for a schema that nests deeper than MAX_SCHEMA_DEPTH levels."""
    if (depth := json_depth(schema)) > MAX_SCHEMA_DEPTH:
        raise InputError(
            f"the JSON schema nests {depth} levels deep; the grammar engine takes at most {MAX_SCHEMA_DEPTH}"
        )


@dataclass(frozen=True)
class Constraint:
    """What a sequence's text must be: `json` (text: a JSON schema), `regex` (the whole text matches it), `choice`
    (text: a JSON list of strings; the text is one of them) or `grammar` (Lark, or llama.cpp's GBNF). Hashable:
    compiled constraints are cached by content."""

    kind: Kind
    text: str
    whitespace: str | None = None  # JSON only: None, no whitespace but ", " and ": "; else a regex for whitespace

    @classmethod
    def json_schema(cls, schema: Any, whitespace: str | None = None) -> Constraint:
        """A JSON schema (a dict, or its JSON text); `{"type": "object"}` is OpenAI's json_object mode.

        By default the JSON comes out on one line as `{"a": 1, "b": [2, 3]}`: where any whitespace may go between
        tokens, a small model can fill its whole budget with newlines and indentation before the text is complete.
        `whitespace`, a regex (`[ \n\t]+`, say), allows runs of whitespace matching it between tokens instead."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InputError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InputError(f"a JSON schema is an object, got {type(schema).__name__}")
        check_schema_depth(schema)
        return cls("json", json.dumps(schema), whitespace)  # keys in the client's order: properties in schema order

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        if not options or not all(isinstance(o, str) for o in options):
            raise InputError("choice: give a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (raises InputError for a malformed one)."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json":
                spacing = (
                    {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                    if self.whitespace is None
                    else {"whitespace_flexible": True, "whitespace_pattern": self.whitespace}
                )
                return str(LLMatcher.grammar_from_json_schema(self.text, overrides=spacing))  # type: ignore[arg-type]
            if self.kind == "regex":
                return str(LLMatcher.grammar_from_regex(self.text))
            if self.kind == "choice":
                options = json.loads(self.text)
                # one terminal, the choices its literal alternatives (JSON's string syntax is Lark's): the lexer
                # takes them as one regular language, where a rule of 4,096 alternatives passes the parser's row limit
                terminal = " | ".join(map(json.dumps, options))
                return str(LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {terminal}"))
            from llguidance import grammar_from

            return str(grammar_from("grammar", self.text))  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise InputError(f"the {self.kind} cannot be compiled: {e}") from None


class Grammars:
    """Compiles constraints for one model's tokenizer and vocabulary, and hands out matchers.

    A constraint is compiled once (its grammar built and checked, lexer and parser tables made: milliseconds for a
    typical schema, up to a second for a huge grammar, with the GIL released) and kept, up to `cache_size`
    constraints; each sequence gets a copy of the compiled matcher, which costs microseconds. Safe to use from
    several threads (the HTTP server compiles in its worker threads, the engine copies in its own)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._ll: Any = None  # llguidance's tokenizer, built on first use (half a second for a 50k vocabulary)
        self.compiled = functools.lru_cache(maxsize=cache_size)(self._compile)

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                try:
                    from llguidance import LLTokenizer
                except ImportError:
                    raise InputError(
                        "structured outputs need llguidance: pip install 'llmkit[serve]' (or pip install llguidance)"
                    ) from None
                eos = self.tokenizer.eos_id
                try:
                    self._ll = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
                except (ValueError, RuntimeError) as e:
                    raise InputError(f"structured outputs cannot use this model's tokenizer: {e}") from None
            return self._ll

    def _compile(self, constraint: Constraint) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        grammar = constraint.grammar()
        tokenizer = self._ll_tokenizer()
        limits = LLParserLimits(verbose_errors=False)
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits)
        if failed:
            raise InputError(f"the {constraint.kind} cannot be used: {one_line(messages[0])}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise InputError(f"the {constraint.kind} cannot be used: {one_line(matcher.get_error())}")
        self._first_step(matcher, constraint.kind)
        return matcher

    def _first_step(self, matcher: Any, kind: Kind) -> None:
        """The first token's step, on copies: InputError where no text satisfies the constraint, or where taking the
        first or the last token it allows meets a limit of the grammar engine."""
        trial = matcher.deep_copy()
        allowed = allowed_tokens([trial], self.vocab_size)[0]
        eos = self.tokenizer.eos_id
        ids = [int(i) for i in np.flatnonzero(allowed) if i != eos]
        if trial.is_error() or (not ids and not trial.is_accepting()):
            why = f" ({one_line(trial.get_error())})" if trial.is_error() else ""
            raise InputError(f"no text satisfies the {kind}{why}")
        for token in sorted({ids[0], ids[-1]}) if ids else []:
            step = trial.deep_copy()
            if not step.consume_token(token):
                error = one_line(step.get_error())
                hint = ' (does every text of it end? a rule that can only recur, like start: "a" start, has none)'
                raise InputError(f"the {kind} cannot be decoded: {error}" + (hint if "ff_tokens" in error else ""))

    def compile(self, constraint: Constraint) -> None:
        """Compile `constraint` now (InputError if it cannot be used), so that `matcher` finds it ready."""
        self.compiled(constraint)

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for one sequence (llguidance's LLMatcher, at the start of the text)."""
        return self.compiled(constraint).deep_copy()


def one_line(message: str, limit: int = 500) -> str:
    """An llguidance message on one line, at most `limit` characters (its "<non-verbose/>" marker left out)."""
    message = " ".join(message.replace("<non-verbose/>", " ").split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def allowed_tokens(matchers: list[Any], vocab_size: int) -> np.ndarray:
    """The tokens each row may take next, (B, V) bool: a matcher's mask, or every token for a row without one
    (None). A matcher in an error state allows nothing, so its row fails in the sampler instead of going off-grammar.
    In NumPy, on one thread: torch's parallel elementwise kernels stall when the other cores are busy (unpacking 16
    masks of 49,152 tokens took 20-24 ms under load, NumPy 0.05 ms)."""
    words = (vocab_size + 31) // 32
    bits = np.full((len(matchers), words), -1, dtype=np.int32)  # all allowed
    for row, m in enumerate(matchers):
        if m is not None:
            m.unsafe_compute_mask_ptr(bits[row].ctypes.data, words * 4)
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)


def mask_logits(logits: Tensor, allowed: np.ndarray) -> Tensor:
    """A copy of logits (B, V) whose tokens `allowed` does not allow are -inf (in NumPy on the CPU, as above)."""
    if logits.device.type == "cpu":
        out = logits.clone()
        np.putmask(out.numpy(), ~allowed, -np.inf)
        return out
    return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
