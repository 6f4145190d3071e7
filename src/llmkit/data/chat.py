"""`llmkit prepare chat FILE.jsonl`: conversations -> token ids, the tokens a model learns to say, and example bounds.

Each line of the input is an OpenAI-style conversation:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

It is rendered with the checkpoint's chat template (the text the model will see when it is served) and tokenized
once. The loss of supervised fine-tuning counts only what the assistant says: for the k-th assistant message, the
characters between the template's rendering of the conversation before it (with the generation prompt, e.g.
"<|im_start|>assistant\\n") and its rendering including it (the content and the end-of-turn marker, e.g.
"...<|im_end|>\\n") are targets, and so are the tokens that start inside them.

    OUT/tokenizer.json, tokenizer_config.json    the checkpoint's tokenizer and chat template
    OUT/{split}_tokens.bin                       uint16 / uint32 token ids of all examples, one after another
    OUT/{split}_targets.bin                      uint8, 1 where the token is one the model learns to predict
    OUT/{split}_offsets.bin                      int64, example k is tokens[offsets[k] : offsets[k + 1]]
    OUT/meta.json                                format "llmkit-chat", counts per split

The split is by a hash of each line, so the same file always gives the same split, whatever the order of lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.data.arrays import META, token_dtype, write_array
from llmkit.errors import ConfigError, InputError
from llmkit.outputs import building, claim
from llmkit.tokenizer import Tokenizer, render_chat

FORMAT = "llmkit-chat"
ROLES = ("system", "user", "assistant", "tool")


def is_chat(path: str | os.PathLike[str]) -> bool:
    """Whether a prepared data folder holds chat examples."""
    meta = Path(path) / META
    return meta.is_file() and json.loads(meta.read_text()).get("format") == FORMAT


def parse_line(line: str, where: str) -> list[dict[str, str]]:
    """The messages of one JSON line, checked: a list of {role, content} with at least one assistant message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InputError(f'{where}: expected an object with a non-empty "messages" list')
    checked = check_messages(messages, where, "messages", ROLES)
    if not any(m["role"] == "assistant" for m in checked):
        raise InputError(f"{where}: no assistant message, so nothing to learn from this conversation")
    return checked


def check_messages(value: list[Any], where: str, field: str, roles: tuple[str, ...]) -> list[dict[str, str]]:
    """A list of {role, content} messages, checked (string fields, a role of `roles`), with only those two keys."""
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f'{where}: {field}[{k}] must be an object with string "role" and "content"')
        if m["role"] not in roles:
            raise InputError(f"{where}: {field}[{k}].role {m['role']!r} is not one of {', '.join(roles)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def assistant_spans(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) of what the assistant says in it."""
    text = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:k], add_generation_prompt=True) if k else ""
        through = render_chat(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ConfigError(
                "the chat template renders a conversation differently from its beginning (a later message changes "
                "earlier text), so the assistant's tokens cannot be told apart from the prompt's"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode_example(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(token ids, target flags, target characters) of one conversation: a token is a target when its first
    character lies in an assistant span."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    starts = np.array([a for a, _ in enc.offsets], dtype=np.int64)
    targets = np.zeros(len(enc.ids), dtype=np.uint8)
    for a, b in spans:
        targets[(starts >= a) & (starts < b)] = 1
    return np.asarray(enc.ids, dtype=np.int64), targets, sum(b - a for a, b in spans)


def _in_val(line: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(line.encode("utf-8")).digest()[:8], "little")
    return h / 2**64 < val_fraction


def prepare_chat(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str],
    val_fraction: float = 0.05,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Prepare a .jsonl file of conversations into `out` with the chat template of `tokenizer` (a checkpoint);
    returns the metadata written to meta.json. `out` is built beside itself and renamed into place when complete
    (an existing data folder is replaced only with `overwrite`; never a checkpoint, a run or an input)."""
    from tqdm import tqdm

    from llmkit.data.prepare import load_tokenizer

    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"val_fraction={val_fraction} must be in [0, 1)")
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{path} does not exist (expected a .jsonl file of conversations)")
    output = claim(out, "data", inputs=[source, tokenizer], overwrite=overwrite)
    start = time.time()
    tok = load_tokenizer(tokenizer)
    if not tok.chat_template:
        raise ConfigError(f"{tokenizer} has no chat template to render conversations with")
    parts: dict[str, dict[str, list[Any]]] = {s: {"ids": [], "targets": [], "chars": []} for s in ("train", "val")}
    with path.open(encoding="utf-8") as f:
        lines = f.readlines()
    for n, line in enumerate(tqdm(lines, desc="render chat", unit="line", disable=not progress), start=1):
        if not line.strip():
            continue
        messages = parse_line(line, f"{path}:{n}")
        ids, targets, chars = encode_example(tok, messages)
        if not targets[1:].any():  # the first token has no prediction: at least one later target is needed
            raise InputError(f"{path}:{n}: the assistant's messages are empty, so nothing to learn")
        part = parts["val" if _in_val(line.strip(), val_fraction) else "train"]
        part["ids"].append(ids)
        part["targets"].append(targets)
        part["chars"].append(chars)
    if not parts["train"]["ids"]:
        raise InputError(f"{path} holds no training conversations")
    with building(output) as out_dir:
        tok.save(out_dir)
        splits: dict[str, Any] = {}
        for name, part in parts.items():
            split = write_split(out_dir, name, part["ids"], part["targets"], token_dtype(tok.vocab_size))
            splits[name] = {**split.meta, "target_chars": int(sum(part["chars"]))}
        meta = {**common_meta(FORMAT, source, tok, val_fraction), "splits": splits}
        (out_dir / META).write_text(json.dumps(meta, indent=2) + "\n")
    meta["seconds"] = time.time() - start
    return meta


@dataclass(frozen=True)
class Written:
    """A split as write_split wrote it: its arrays and its entry of meta.json (file names and counts)."""

    ids: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray
    meta: dict[str, Any]


def write_split(out_dir: Path, name: str, ids: list[np.ndarray], targets: list[np.ndarray], dtype: Any) -> Written:
    """One split's examples (token ids and target flags, an array each) as the chat layout's three arrays."""
    lengths = [len(x) for x in ids]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    flat = np.concatenate(ids) if lengths else np.zeros(0, np.int64)
    flags = np.concatenate(targets) if lengths else np.zeros(0, np.uint8)
    files = {kind: f"{name}_{kind}.bin" for kind in ("tokens", "targets", "offsets")}
    write_array(flat.astype(dtype), out_dir / files["tokens"])
    write_array(flags, out_dir / files["targets"])
    write_array(offsets, out_dir / files["offsets"])
    meta = {
        "files": files,
        "examples": len(lengths),
        "tokens": int(offsets[-1]),
        "target_tokens": int(flags.sum()),
        "longest": max(lengths, default=0),
    }
    return Written(flat, flags, offsets, meta)


def common_meta(kind: str, source: object, tok: Tokenizer, val_fraction: float) -> dict[str, Any]:
    """meta.json's fields shared by the chat layout's formats."""
    return {
        "format": kind,
        "version": 1,
        "source": str(source),
        "tokenizer": "tokenizer.json",
        "vocab_size": tok.vocab_size,
        "eot_id": int(tok.eos_id if tok.eos_id is not None else 0),
        "dtype": np.dtype(token_dtype(tok.vocab_size)).name,
        "val_fraction": val_fraction,
    }


@dataclass(frozen=True)
class ChatSplit:
    tokens: np.ndarray  # (N,) token ids
    targets: np.ndarray  # (N,) uint8: 1 where the token is predicted
    offsets: np.ndarray  # (examples + 1,)
    target_chars: int

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class ChatData:
    """A prepared chat folder, memory-mapped."""

    format = FORMAT

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.dir = Path(path)
        meta_path = self.dir / META
        if not meta_path.is_file():
            raise InputError(f"{self.dir} has no {META}: run `llmkit prepare chat FILE.jsonl --tokenizer CKPT`")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != self.format:
            raise InputError(f"{self.dir} holds {self.meta.get('format')!r} data, not {self.format!r}")
        self.vocab_size = int(self.meta["vocab_size"])
        self.pad_id = int(self.meta["eot_id"])
        dtype = np.dtype(self.meta["dtype"])
        self.splits: dict[str, ChatSplit] = {}
        for name, info in self.meta["splits"].items():
            arrays = {}
            for kind, kind_dtype in (("tokens", dtype), ("targets", np.uint8), ("offsets", np.int64)):
                file = self.dir / info["files"][kind]
                if not file.is_file():
                    raise InputError(f"{file} is missing: the data folder is incomplete, run `llmkit prepare` again")
                arrays[kind] = (
                    np.memmap(file, dtype=kind_dtype, mode="r") if file.stat().st_size else np.zeros(0, kind_dtype)
                )
            if len(arrays["offsets"]) == 0:
                arrays["offsets"] = np.zeros(1, np.int64)
            split = ChatSplit(arrays["tokens"], arrays["targets"], arrays["offsets"], int(info["target_chars"]))
            if len(split) != info["examples"] or int(split.offsets[-1]) != info["tokens"]:
                raise InputError(f"{self.dir}: the {name} split does not match {META}; run `llmkit prepare` again")
            self.splits[name] = split
        if not len(self.splits.get("train", ())):
            raise InputError(f"{meta_path} has no training examples")

    def split(self, name: str) -> ChatSplit:
        if name not in self.splits or not len(self.splits[name]):
            raise InputError(f"{self.dir} has no {name} examples")
        return self.splits[name]


def pack(lengths: np.ndarray, order: np.ndarray, seq_len: int, packing: bool) -> list[list[int]]:
    """Rows of examples in `order`: each example gives min(length - 1, seq_len) (input, target) pairs, and a row
    holds up to seq_len of them. Packing fills a row with the next examples while they fit (next fit); without it,
    each row holds one example."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for k in order.tolist():
        n = min(int(lengths[k]) - 1, seq_len)
        if n < 1:
            continue
        if row and (not packing or used + n > seq_len):
            rows.append(row)
            row, used = [], 0
        row.append(k)
        used += n
    if row:
        rows.append(row)
    return rows


def row_arrays(
    split: ChatSplit, rows: list[list[int]], seq_len: int, pad_id: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, segments) int64 arrays (len(rows), width) for rows of examples: inputs are each example's
    tokens but the last, targets the next tokens where they are assistant tokens (-100 elsewhere), segments the
    example's place in its row (-1 on padding). An example longer than seq_len + 1 tokens is cut to its first
    seq_len + 1. width defaults to seq_len."""
    width = seq_len if width is None else width
    inputs = np.full((len(rows), width), pad_id, dtype=np.int64)
    targets = np.full((len(rows), width), -100, dtype=np.int64)
    segments = np.full((len(rows), width), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for s, k in enumerate(row):
            a, b = int(split.offsets[k]), int(split.offsets[k + 1])
            n = min(b - a - 1, seq_len)
            ids = np.asarray(split.tokens[a : a + n + 1], dtype=np.int64)
            flags = np.asarray(split.targets[a + 1 : a + n + 1], dtype=bool)
            inputs[r, at : at + n] = ids[:-1]
            targets[r, at : at + n] = np.where(flags, ids[1:], -100)
            segments[r, at : at + n] = s
            at += n
    return inputs, targets, segments
