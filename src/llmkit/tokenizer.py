"""Text <-> token ids: a thin wrapper around a Hugging Face `tokenizers.Tokenizer` (the Rust BPE implementation),
carrying the special token ids and chat template a checkpoint brings.

Sources: a checkpoint directory (tokenizer.json + tokenizer_config.json), or a GGUF file's tokenizer metadata
(byte-level BPE vocabularies: GPT-2 style, as SmolLM2, Llama-3 and Qwen2 use). Saved as tokenizer.json +
tokenizer_config.json, which transformers' AutoTokenizer also reads.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from llmkit.errors import ConfigError, InputError, os_error_in

# how GGUF files name the pre-tokenizer split of their vocabulary -> the split regex (published with the models)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def _byte_alphabet_inverse() -> dict[str, int]:
    return {c: b for b, c in byte_alphabet().items()}


def read_backend(path: Path) -> Backend:
    """The tokenizers library's tokenizer from a tokenizer.json file; an InputError (or the OSError) naming the file
    when it cannot be read or parsed."""
    try:
        return Backend.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception, for a file it cannot read or parse
        raise os_error_in(e, path) or InputError(f"{path} is not a valid tokenizer file: {e}") from None


class Tokenizer:
    """Encodes text to ids and back. bos_id / eos_id / pad_id may be None; add_bos prepends bos on encode."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"encode expects a str, got {type(text).__name__}")
        try:
            # encode_batch, not encode: it releases the GIL while it works (encode holds it, 3.3 s for 5 MB of text
            # here), so a server's event loop goes on while a worker thread tokenizes; same pipeline, same ids
            ids = list(self.backend.encode_batch([text], add_special_tokens=False)[0].ids)
        except TypeError:  # the backend takes Unicode scalar values only: say which character is not one
            raise InputError(unencodable(text)) from None
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special))

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, which its text alone cannot always show: a byte-level BPE token may hold
        part of a character's UTF-8 bytes (decoded alone, U+FFFD). Byte-level vocabularies spell bytes in GPT-2's
        alphabet; SentencePiece ones write a space as U+2581 and a byte as <0xAB>; special and added tokens are
        their own text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if type(self.backend.decoder).__name__ == "ByteLevel":
            inverse = _byte_alphabet_inverse()
            if all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
            return piece.encode("utf-8")  # a special or added token, stored as plain text
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    # ---- files

    def save(self, directory: str | os.PathLike[str]) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        config = self.config()
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def config(self) -> dict[str, Any]:
        """Its settings as Hugging Face's tokenizer_config.json holds them (special tokens by their text)."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos}
        for key, ident in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id)):
            if ident is not None:
                config[key] = self.backend.id_to_token(ident)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        return config

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            return None
        backend = read_backend(d / "tokenizer.json")
        config: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            try:
                config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
            except ValueError as e:  # JSON or UTF-8
                raise InputError(f"{d / 'tokenizer_config.json'} is not valid JSON: {e}") from None
            if not isinstance(config, dict):
                raise InputError(f"{d / 'tokenizer_config.json'} must hold a JSON object")

        def ident(key: str) -> int | None:
            token = config.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        template = config.get("chat_template")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        template = template if isinstance(template, str) else None
        bos, eos, pad = (ident(f"{name}_token") for name in ("bos", "eos", "pad"))
        add_bos = bool(config.get("add_bos_token", False))
        return cls(backend, bos_id=bos, eos_id=eos, pad_id=pad, add_bos=add_bos, chat_template=template or None)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF `tokenizer.ggml.*` metadata (byte-level BPE: tokenizer.ggml.model == 'gpt2')."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ConfigError(
                f"GGUF tokenizer model {kind!r} is not supported; llmkit reads byte-level BPE vocabularies ('gpt2')"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        alphabet = set(byte_alphabet().values())
        table = byte_alphabet()

        def spell(token: str) -> str:  # some files write tokens in plain UTF-8 rather than the byte alphabet
            return token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))

        vocab = {spell(t): i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = str(meta.get("tokenizer.ggml.pre"))
        split = GGUF_SPLITS.get(pre)
        if pre == "smollm":  # digits one by one, then GPT-2's split (SmolLM's tokenizer.json says so)
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
            )
        elif split is not None:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(False, use_regex=False),
                ]
            )
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=False) if k == 3]
        user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=False) if k == 4]
        backend.add_special_tokens([t for t in control if set(t.content) <= alphabet])
        backend.add_tokens(user)

        def ident(key: str) -> int | None:
            v = meta.get(key)
            return int(v) if v is not None else None

        bos, eos, pad = (ident(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "padding"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        return cls(
            backend,
            bos_id=bos,
            eos_id=eos,
            pad_id=pad,
            add_bos=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
        )


def unencodable(text: str) -> str:
    """Why `text` cannot be tokenized: the first lone surrogate in it (what Python makes of undecodable bytes, e.g.
    in a command-line argument), which has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"the text holds {text[e.start]!r} at index {e.start}: a lone surrogate (undecodable bytes?), which is "
            "not a Unicode character and has no UTF-8 form"
        )
    return "the tokenizer cannot encode this text"


class IncrementalDecoder:
    """Text from token ids that arrive one at a time, each piece given out once it is complete.

    push(id) returns the new text, finish() what is left. Decoding each token on its own goes wrong twice over: a
    byte-level token may hold part of a character's UTF-8 bytes (alone it decodes to U+FFFD), and decoders that
    drop the space before a text's first word (SentencePiece's Metaspace) would drop it before every token. So push()
    decodes a window, the tokens not given out yet after those given out last (for context), and gives out what they
    add to the context's text unless it ends in U+FFFD, an unfinished character. vLLM's detokenizer and transformers'
    TextStreamer work this way.

    With byte-level BPE the pieces add up to decode(ids); after a prompt, decode(prompt) followed by them is
    decode(prompt + ids).
    """

    CONTEXT = 5  # prompt tokens decoded with the first new ones

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int] = (), *, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids = list(prompt)
        self.context = max(len(self.ids) - self.CONTEXT, 0)  # ids[context:done] only give context
        self.done = len(self.ids)  # ids[:done] have been given out

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that is now complete (often "", or more than this token's text)."""
        self.ids.append(token_id)
        return self._release(hold_incomplete=True)

    def finish(self) -> str:
        """The text still held back (an unfinished character comes out as U+FFFD, as decode() gives it)."""
        return self._release(hold_incomplete=False)

    def _release(self, *, hold_incomplete: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.context : self.done], skip_special=self.skip_special)
        text = decode(self.ids[self.context :], skip_special=self.skip_special)
        if len(text) <= len(before) or (hold_incomplete and text.endswith("\ufffd")):
            return ""
        self.context, self.done = self.done, len(self.ids)
        return text[len(before) :]


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    variables: dict[str, Any] | None = None,
) -> str:
    """The prompt text for a conversation, from the tokenizer's Jinja chat template (rendered in a sandbox); tools:
    function definitions, for templates that render them (transformers' convention); variables: more for the
    template (Qwen3's enable_thinking, ...)."""
    if not tokenizer.chat_template:
        raise ConfigError("the tokenizer has no chat template")
    token = tokenizer.backend.id_to_token
    return _compiled_template(tokenizer.chat_template).render(
        **(variables or {}),
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=token(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
        eos_token=token(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
    )


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    """A chat template compiled once (compiling takes milliseconds, rendering microseconds)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InputError(f"chat template: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
        # as transformers renders templates: plain JSON (Jinja's own filter escapes <, > and & for HTML)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(source)
