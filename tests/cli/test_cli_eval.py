"""`llmkit eval` end to end: offline tasks and perplexity on a tiny Hugging Face model, the JSON it writes, and a
one-line error (exit status 2, no traceback) for each mistake a user can make."""

from __future__ import annotations

import json

import pytest
from helpers import TEXT, save_tiny

from llmkit.cli import main

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"), "llama", context=512)  # room for a Bible question


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LLMKIT_TASKS", str(tmp_path_factory.getbasetemp() / "llmkit-tasks"))  # written once


def test_offline_tasks_and_perplexity_into_one_json(model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 4, encoding="utf-8")
    out = tmp_path / "results.json"
    args = ["eval", str(model_dir), "--tasks", "llmkit_offline", "--limit", "3", "--batch-size", "4"]
    assert main([*args, "--perplexity", str(text), "--window", "64", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "llmkit_shakespeare_next_line" in printed and "bits_per_byte" in printed
    report = json.loads(out.read_text())
    for task in ("llmkit_shakespeare_next_line", "llmkit_bible_de_en"):
        assert 0 <= report["results"][task]["acc,none"] <= 1
        assert report["n-samples"][task]["effective"] == 3
    assert report["perplexity"]["tokens"] > 64 and report["perplexity"]["perplexity"] > 1
    assert report["settings"]["limit"] == 3 and report["versions"]["lm_eval"]
    assert main([*args, "--output", str(out)]) == 2  # an existing file is kept without --overwrite
    assert "--overwrite" in capsys.readouterr().err


def test_kl_of_a_model_against_itself_is_zero(model_dir, tmp_path, capsys):
    out = tmp_path / "kl.json"
    args = ["eval", str(model_dir), "--perplexity", "shakespeare", "--max-tokens", "300", "--window", "64"]
    assert main([*args, "--reference", str(model_dir), "--output", str(out)]) == 0
    report = json.loads(out.read_text())["perplexity"]
    assert report["kl_mean"] == 0 and report["kl_max"] == 0 and report["same_top1"] == 1
    assert report["perplexity"] == report["reference_perplexity"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "llmkit_shakespeare_nextline"], "the nearest names: llmkit_shakespeare_next_line"),
        (["--tasks", "arc_easy"], "could not load its data set 'allenai/ai2_arc' ('ARC-Easy')"),
        (["--perplexity", "TEXT"], "shorter than one window of 512: give a longer text or a smaller --window"),
        (["--perplexity", "TEXT", "--window", "8", "--reference", "OTHER"], "tokenizer is not the model's"),
        (["--reference", "OTHER"], "--reference is compared on the --perplexity text: give --perplexity too"),
        ([], "nothing to score"),
        (["--tasks", ",", "--limit", "1"], "--tasks is empty"),
        (["--perplexity", "no/such/file"], "is neither 'shakespeare', a prepared data folder"),
        (["--tasks", "llmkit_offline", "--limit", "1.5"], "--limit 1.5 is out of range: give a number of documents"),
        (["--tasks", "llmkit_offline", "--num-fewshot", "-1"], "--num-fewshot -1 is out of range"),
        # task files the harness skipped without a word ("no task is called 'badtask'"), or failed on (a traceback)
        (["--tasks", "badtask", "--include-path", "TASKS"], "badtask.yaml cannot be used: it is not valid YAML: "),
        (["--tasks", "bintask", "--include-path", "TASKS"], "bintask.yaml cannot be used: it is not UTF-8 text"),
        (["--tasks", "TASKS/badtask.yaml"], "the task file cannot be used: it is not valid YAML: expected ','"),
    ],
)
def test_mistakes_are_one_line_errors(model_dir, tmp_path, capsys, args, message):
    text = tmp_path / "short.txt"
    text.write_text("To be, or not to be", encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "badtask.yaml").write_text("task: badtask\ndataset_path: [unclosed\n  foo: : :\n", encoding="utf-8")
    (tasks / "bintask.yaml").write_bytes(bytes(range(128, 256)) * 2)
    other = save_tiny(tmp_path / "other", "qwen2", context=512) if "OTHER" in args else None
    if other is not None:  # another tokenizer: the same model with a vocabulary of its own
        from helpers import tiny_tokenizer

        tiny_tokenizer().save(other)
    argv = [{"TEXT": str(text), "OTHER": str(other), "TASKS": str(tasks)}.get(a, a) for a in args]
    argv = [a.replace("TASKS/", f"{tasks}/") for a in argv]
    assert main(["eval", str(model_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_list_tasks_names_the_offline_tasks(capsys):
    assert main(["eval", "--list-tasks"]) == 0
    names = capsys.readouterr().out.split()
    assert {"llmkit_offline", "llmkit_bible_de_en", "llmkit_shakespeare_next_line", "arc_easy"} <= set(names)


def test_prepare_tasks_writes_them_where_asked(tmp_path, capsys):
    out = tmp_path / "tasks"
    assert main(["prepare", "tasks", "--out", str(out)]) == 0
    assert f"--include-path {out}" in capsys.readouterr().out
    assert {"llmkit_offline.yaml", "llmkit_bible_de_en.jsonl", "meta.json"} <= {p.name for p in out.iterdir()}
    assert main(["prepare", "tasks", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_perplexity_on_a_prepared_folder_reads_its_validation_split(model_dir, tmp_path, capsys):
    from llmkit.evaluate.texts import read_text

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([TEXT] * 12), encoding="utf-8")
    data = tmp_path / "data"
    assert main(["prepare", str(corpus), "--out", str(data), "--tokenizer", str(model_dir)]) == 0
    val = read_text(str(data))
    assert val.strip() and val in corpus.read_text(encoding="utf-8")  # the corpus's last tenth, decoded back
    out = tmp_path / "p.json"
    assert main(["eval", str(model_dir), "--perplexity", str(data), "--window", "32", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["perplexity"]["bytes"] == len(val.encode("utf-8"))
