"""The texts `llmkit eval --perplexity` reads: Shakespeare's held-out text, a prepared corpus's validation split, or a
text file; and a text cut to its first tokens."""

from __future__ import annotations

import json
from pathlib import Path

from llmkit.errors import InputError
from llmkit.tokenizer import Tokenizer

SHAKESPEARE_VAL = 0.1  # llmkit prepare's default validation share of a text corpus: the last tenth of each play


def first_tokens(tok: Tokenizer, text: str, n: int) -> str:
    """The text cut after its first n tokens (at a token boundary, as the tokenizer decodes them)."""
    ids = tok.encode(text, add_bos=False)
    return text if len(ids) <= n else tok.decode(ids[:n])


def read_text(source: str) -> str:
    """The text --perplexity names: 'shakespeare', a prepared data folder's validation split, or a text file."""
    if source == "shakespeare":
        from llmkit.data.corpus import shakespeare
        from llmkit.data.prepare import split_document

        return "\n".join(split_document(doc.text, SHAKESPEARE_VAL)[1] for doc in shakespeare())
    path = Path(source)
    if path.is_dir() and (path / "meta.json").is_file():
        return prepared_val(path)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path} is not UTF-8 text (byte {e.start}): --perplexity reads text") from None
    raise InputError(
        f"--perplexity {source!r} is neither 'shakespeare', a prepared data folder (with meta.json) nor a text file"
    )


def prepared_val(folder: Path) -> str:
    """A prepared text corpus's validation split, decoded with the folder's own tokenizer, documents one after
    the other."""
    import numpy as np

    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    val = meta.get("splits", {}).get("val")
    tok = Tokenizer.from_dir(folder)
    if meta.get("format") != "llmkit-tokens" or not val or tok is None:
        raise InputError(f"{folder} is not a prepared text corpus with a validation split (llmkit prepare)")
    ids = np.concatenate([np.fromfile(folder / f, dtype=meta["dtype"]) for f in val["files"]])
    documents = np.split(ids, np.flatnonzero(ids == meta["eot_id"]) + 1)
    return "\n".join(tok.decode(d.tolist()) for d in documents if len(d))
