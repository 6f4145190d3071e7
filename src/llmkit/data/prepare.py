"""`llmkit prepare`: a corpus -> a tokenizer and memory-mapped token shards with a train/validation split.

    OUT/tokenizer.json, tokenizer_config.json     byte-level BPE trained on the training split (or a given one)
    OUT/train_000.bin, val_000.bin, ...           uint16 (vocab <= 65536) or uint32 token ids, one stream per split,
                                                  each document followed by the end-of-text token
    OUT/meta.json                                 counts (documents, characters, UTF-8 bytes, tokens), dtype, ids

The split is deterministic: the last `val_fraction` of every document (cut at a line boundary) is validation text,
so both splits cover every document. Characters are counted so that losses can be reported in bits per character,
which compares models across tokenizers. The same input always gives byte-identical shards. OUT is built in a
temporary folder beside it and renamed into place when complete (llmkit.outputs).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.data.arrays import META, token_dtype, write_array
from llmkit.data.bpe import check_vocab_size, train_bpe
from llmkit.data.corpus import Document, load_corpus
from llmkit.errors import InputError
from llmkit.outputs import building, claim
from llmkit.tokenizer import Tokenizer, read_backend

EOT = "<|endoftext|>"
SHARD_TOKENS = 100_000_000
CHUNK_CHARS = 1 << 16


def split_document(text: str, val_fraction: float) -> tuple[str, str]:
    """(train, val) parts of one document: at least its last `val_fraction`, starting at the beginning of a line
    (a document of one line stays whole in train)."""
    if val_fraction <= 0:
        return text, ""
    cut = int(len(text) * (1 - val_fraction))
    cut = text.rfind("\n", 0, cut) + 1  # back to the start of the line the cut falls in (0 if none)
    return (text, "") if cut == 0 else (text[:cut], text[cut:])


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A tokenizer from a checkpoint (a directory with tokenizer.json: Hugging Face, llmkit, a training run's latest
    checkpoint), a GGUF file's metadata, or a tokenizer.json file: the data a run that starts from that checkpoint
    trains on must be prepared with it."""
    from llmkit.runs import resolve_checkpoint

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from llmkit.interop.gguf import load_gguf_tokenizer

        gguf_tok = load_gguf_tokenizer(p)
        if gguf_tok is None:
            raise InputError(f"{p} holds no tokenizer")
        return gguf_tok
    if p.is_file():
        return Tokenizer(read_backend(p))
    tok = Tokenizer.from_dir(resolve_checkpoint(p))
    if tok is None:
        raise InputError(f"{p} has no tokenizer.json")
    return tok


def _chunks(text: str) -> Iterator[str]:
    """Pieces of about CHUNK_CHARS ending at line boundaries: byte-level BPE never merges across a newline split
    this way, so encoding the pieces gives exactly the tokens of the whole."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def encode_split(tokenizer: Tokenizer, texts: list[str], eot: int, progress: bool, label: str) -> np.ndarray:
    """Token ids of documents, each followed by `eot`. Encodes chunks in parallel batches (the tokenizers library
    spreads a batch over all cores) with a progress bar."""
    from tqdm import tqdm

    pieces: list[tuple[int, str]] = [(d, c) for d, t in enumerate(texts) for c in _chunks(t)]
    ids: list[np.ndarray] = []
    batch = 64
    last_doc = -1
    bar = tqdm(
        total=sum(len(c) for _, c in pieces),
        unit="char",
        unit_scale=True,
        desc=f"tokenize {label}",
        disable=not progress,
    )
    for i in range(0, len(pieces), batch):
        group = pieces[i : i + batch]
        encoded = tokenizer.backend.encode_batch([c for _, c in group], add_special_tokens=False)
        for (doc, chunk), enc in zip(group, encoded, strict=True):
            if doc != last_doc and last_doc >= 0:
                ids.append(np.array([eot], dtype=np.int64))
            last_doc = doc
            ids.append(np.asarray(enc.ids, dtype=np.int64))
            bar.update(len(chunk))
    bar.close()
    if last_doc >= 0:
        ids.append(np.array([eot], dtype=np.int64))
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)


def write_shards(tokens: np.ndarray, out: Path, split: str, dtype: type) -> list[str]:
    names = []
    for k, start in enumerate(range(0, max(len(tokens), 1), SHARD_TOKENS)):
        name = f"{split}_{k:03d}.bin"
        write_array(tokens[start : start + SHARD_TOKENS].astype(dtype), out / name)
        names.append(name)
    return names


def prepare(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    vocab_size: int = 4096,
    tokenizer: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.1,
    text_field: str = "text",
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Prepare `source` into `out` (built beside it and renamed into place when complete; an existing data folder
    is replaced only with `overwrite`, never a checkpoint, a run or the source); returns the metadata written to
    meta.json."""
    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"val_fraction={val_fraction} must be in [0, 1)")
    if tokenizer is None:
        check_vocab_size(vocab_size, 1)  # before reading the corpus: one end-of-text token
    output = claim(out, "data", inputs=[source, tokenizer], overwrite=overwrite)
    start = time.time()
    docs: list[Document] = load_corpus(source, text_field)
    parts = [split_document(d.text, val_fraction) for d in docs]
    train_texts = [t for t, _ in parts if t]
    val_texts = [v for _, v in parts if v]
    if not train_texts:
        raise InputError(f"corpus {str(source)!r} is empty")
    # trained: one end-of-text token, both the start and the end of a document (GPT-2's convention)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else train_bpe(train_texts, vocab_size, bos=EOT, eos=EOT)
    eot = tok.eos_id if tok.eos_id is not None else tok.token_id(EOT)
    if eot is None:
        raise InputError("the tokenizer has no end-of-text token (eos_token, or <|endoftext|>) to separate documents")
    with building(output) as out_dir:
        tok.save(out_dir)
        dtype = token_dtype(tok.vocab_size)
        splits: dict[str, Any] = {}
        for split, texts in (("train", train_texts), ("val", val_texts)):
            tokens = encode_split(tok, texts, eot, progress, split)
            splits[split] = {
                "files": write_shards(tokens, out_dir, split, dtype),
                "documents": len(texts),
                "tokens": len(tokens),
                "chars": sum(len(t) for t in texts),
                "bytes": sum(len(t.encode("utf-8")) for t in texts),
            }
        train = splits["train"]
        meta = {
            "format": "llmkit-tokens",
            "version": 1,
            "source": str(source),
            "tokenizer": "tokenizer.json",
            "vocab_size": tok.vocab_size,
            "eot_id": int(eot),
            "dtype": np.dtype(dtype).name,
            "val_fraction": val_fraction,
            "splits": splits,
            "chars_per_token": train["chars"] / max(train["tokens"], 1),
            "bytes_per_token": train["bytes"] / max(train["tokens"], 1),
        }
        (out_dir / META).write_text(json.dumps(meta, indent=2) + "\n")
    meta["seconds"] = time.time() - start
    return meta
