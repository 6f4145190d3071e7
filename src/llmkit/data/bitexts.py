"""Prepared parallel data: sentence pairs (llmkit.data.pairs) -> BPE vocabularies and memory-mapped token arrays,
and the reader for a prepared folder.

    OUT/tokenizer.json                     the target (or shared) byte-level BPE, specials <pad> <s> </s>
    OUT/source_tokenizer/tokenizer.json    the source BPE, only with separate vocabularies
    OUT/{split}.{src,tgt}.bin              token ids of every sentence followed by </s>, concatenated (uint16/32)
    OUT/{split}.{src,tgt}.idx              int64 offsets: sentence i is bin[idx[i] : idx[i + 1]]
    OUT/{split}.{src,tgt}.txt              the sentences as text, one per line (references for BLEU)
    OUT/meta.json                          format "llmkit-parallel", the pair, counts, ids, licence
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.data.arrays import META, token_dtype, write_array
from llmkit.data.bpe import check_vocab_size, train_bpe
from llmkit.data.pairs import (
    BIBLES,
    DEFAULT,
    SPLITS,
    Corpus,
    Pair,
    bible_pairs,
    file_pairs,
    load_pairs,
    parse_pair,
    split_of,
    split_pairs,
)
from llmkit.errors import InputError
from llmkit.outputs import building, claim
from llmkit.tokenizer import Tokenizer

# the corpus readers and the split live in llmkit.data.pairs; importable from here too
__all__ = [
    "BIBLES",
    "DEFAULT",
    "FORMAT",
    "SPLITS",
    "Corpus",
    "Pair",
    "ParallelData",
    "Side",
    "bible_pairs",
    "file_pairs",
    "is_parallel",
    "load_pairs",
    "parse_pair",
    "prepare_parallel",
    "split_of",
    "split_pairs",
]

FORMAT = "llmkit-parallel"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SIDES = ("src", "tgt")
SOURCE_TOKENIZER = "source_tokenizer"


def _train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """<pad> <s> </s> as ids 0, 1, 2, and a leading space on every word (the first included), so that a word has
    one spelling wherever it stands in a sentence."""
    return train_bpe(texts, vocab_size, pad=PAD, bos=BOS, eos=EOS, add_prefix_space=True)


def _write_side(tok: Tokenizer, texts: list[str], out: Path, name: str, dtype: type) -> int:
    """One side of one split: NAME.bin, NAME.idx and NAME.txt; returns its number of tokens."""
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
    write_array(flat.astype(dtype), out / (name + ".bin"))
    write_array(offsets, out / (name + ".idx"))
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
    overwrite: bool = False,
) -> dict[str, Any]:
    """Prepare a parallel corpus into `out` (built beside it and renamed into place when complete; an existing data
    folder is replaced only with `overwrite`, never a checkpoint, a run or the corpus); returns the metadata written
    to meta.json."""
    check_vocab_size(vocab_size, 3)  # before reading the corpus: <pad> <s> </s>
    output = claim(out, "data", inputs=[source], overwrite=overwrite)
    start = time.time()
    corpus = load_pairs(source, src_field, tgt_field)
    splits = split_pairs(corpus.pairs, val_fraction, test_fraction)
    if not splits["train"]:
        raise InputError(f"{source}: no pairs left for training after the split")
    with building(output) as out_dir:
        train = splits["train"]
        if shared_vocab:
            target_tok = source_tok = _train_tokenizer(
                [p.source for p in train] + [p.target for p in train], vocab_size
            )
        else:
            source_tok = _train_tokenizer([p.source for p in train], vocab_size)
            target_tok = _train_tokenizer([p.target for p in train], vocab_size)
            source_tok.save(out_dir / SOURCE_TOKENIZER)
        target_tok.save(out_dir)
        dtype = token_dtype(max(source_tok.vocab_size, target_tok.vocab_size))
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
