"""Corpora and `llmkit prepare`: plays to speaker lines, splits at line boundaries, deterministic preparation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmkit.data.corpus import play_to_text, shakespeare
from llmkit.data.prepare import prepare, split_document
from llmkit.errors import InputError
from llmkit.train.data import TokenData


def test_play_markdown_becomes_speaker_lines():
    md = "# Title\n\n## ACT I\n\n_Enter ROMEO_\n\n**ROMEO**  \nBut, soft!  \nWhat light?\n\n**JULIET**  \nAy me!\n"
    assert play_to_text(md) == "ROMEO:\nBut, soft!\nWhat light?\n\nJULIET:\nAy me!\n"


def test_default_corpus_is_the_38_plays():
    docs = shakespeare()
    assert len(docs) == 38 and all(d.text.strip() for d in docs)
    assert any("ROMEO:" in d.text for d in docs)


def test_split_cuts_at_a_line_boundary():
    train, val = split_document("a\nbb\nccc\ndddd\n", 0.3)
    assert train + val == "a\nbb\nccc\ndddd\n"
    assert train == "a\nbb\nccc\n" and val == "dddd\n"  # the cut at 70% moves back to its line's start
    assert split_document("one line only", 0.5) == ("one line only", "")


def test_prepare_is_deterministic_and_counts_characters(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("天地玄黄，宇宙洪荒。\n日月盈昃，辰宿列张。\n" * 50)
    (src / "b.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 80)
    m1 = prepare(src, tmp_path / "p1", vocab_size=300, progress=False)
    prepare(src, tmp_path / "p2", vocab_size=300, progress=False)
    for f in ("train_000.bin", "val_000.bin", "tokenizer.json"):
        assert (tmp_path / "p1" / f).read_bytes() == (tmp_path / "p2" / f).read_bytes()
    chars = sum(len(p.read_text()) for p in src.iterdir())
    assert m1["splits"]["train"]["chars"] + m1["splits"]["val"]["chars"] == chars
    assert m1["splits"]["train"]["bytes"] > m1["splits"]["train"]["chars"]  # Chinese: 3 bytes per character
    data = TokenData(tmp_path / "p1")
    from llmkit.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tmp_path / "p1")
    assert tok is not None
    text = tok.decode(np.asarray(data.split("train").tokens[:40]).tolist())
    assert "天地玄黄" in text
    assert m1["eot_id"] == tok.eos_id and data.split("train").tokens[-1] == m1["eot_id"]


def test_jsonl_source_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"record {i} " * 20}) for i in range(30)) + "\n")
    meta = prepare(path, tmp_path / "p", vocab_size=280, text_field="body", progress=False)
    assert meta["splits"]["train"]["documents"] == 30
    with pytest.raises(InputError, match="has no string field 'text'"):
        prepare(path, tmp_path / "q", progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2: not valid JSON"):
        prepare(bad, tmp_path / "q", progress=False)
    with pytest.raises(InputError, match="does not exist"):
        prepare(tmp_path / "nothing.txt", tmp_path / "q", progress=False)
    with pytest.raises(InputError, match="vocab_size=100 is out of range: byte-level BPE here takes 257 to 1,048,576"):
        prepare(path, tmp_path / "q", vocab_size=100, text_field="body", progress=False)
    # far too large: refused before the corpus is read (the tokenizer library would abort for want of memory)
    with pytest.raises(InputError, match="vocab_size=1000000000 is out of range"):
        prepare(tmp_path / "nothing.txt", tmp_path / "q", vocab_size=10**9, progress=False)
