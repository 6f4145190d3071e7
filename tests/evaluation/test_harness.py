"""llmkit's lm-evaluation-harness model against the harness's own `hf` model on the same tiny random Hugging Face
models: per-request log-likelihoods (fp32, within 1e-5), greediness, task accuracy, rolling log-likelihoods, and
generations equal to `llmkit generate`'s; and the claim behind its speed: each distinct context is fed once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from helpers import TEXT  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from llmkit.cli import main  # noqa: E402
from llmkit.cli.common import load_decoder  # noqa: E402
from llmkit.evaluate.harness import HarnessModel, run_tasks  # noqa: E402
from llmkit.evaluate.scoring import score  # noqa: E402
from llmkit.generate import DecodeStep  # noqa: E402

pytestmark = pytest.mark.slow

REQUESTS = [
    ("Now is the winter of", " our discontent"),
    ("Now is the winter of", " our summer"),
    ("Now is the winter of", " York"),
    ("To be, or not to be, that is ", "the question."),  # a trailing space moves to the continuation
    ("", "Now is the winter"),  # an empty context: the start token stands for it
    ("the deep bosom", " of the ocean buried"),
    (TEXT * 2, " and all the clouds"),  # longer than the window: the context loses tokens at its left
]
MAX_LENGTH = 64


def _instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def pair(tiny_hf):
    from lm_eval.models.huggingface import HFLM

    model, tok = load_decoder(str(tiny_hf), "fp32")
    ours = HarnessModel(model, tok, batch_size=3, max_length=MAX_LENGTH, progress=False)
    theirs = HFLM(pretrained=str(tiny_hf), dtype="float32", device="cpu", batch_size=3, max_length=MAX_LENGTH)
    return ours, theirs


def test_loglikelihoods_equal_the_harness_hf_model(pair):
    ours, theirs = pair
    mine = ours.loglikelihood(_instances("loglikelihood", REQUESTS), disable_tqdm=True)
    reference = theirs.loglikelihood(_instances("loglikelihood", REQUESTS), disable_tqdm=True)
    assert [g for _, g in mine] == [g for _, g in reference]
    assert [lp for lp, _ in mine] == pytest.approx([lp for lp, _ in reference], abs=1e-5, rel=1e-6)


def test_rolling_loglikelihood_is_the_perplexity_computed_directly(pair):
    ours, theirs = pair
    text = TEXT[:150]
    [rolled] = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    ids = [ours.prefix_token_id, *ours.tok.encode(text)]
    assert len(ids) <= MAX_LENGTH + 1  # one window: the direct computation below is one forward
    with torch.no_grad():
        logp = ours.model(torch.tensor([ids[:-1]])).float().log_softmax(-1)[0]
    direct = float(logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum())
    assert rolled == pytest.approx(direct, abs=1e-4, rel=1e-6)
    long = TEXT * 3  # several windows
    mine = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(long,)]), disable_tqdm=True)
    reference = theirs.loglikelihood_rolling(_instances("loglikelihood_rolling", [(long,)]), disable_tqdm=True)
    assert mine == pytest.approx(reference, abs=1e-4, rel=1e-6)


def test_generate_until_equals_llmkit_generate(pair, tiny_hf, capsys):
    ours, theirs = pair
    settings = {"until": ["."], "max_gen_toks": 12, "do_sample": False}
    prompts = ["Now is the winter", "To be, or not", "the deep", "In the deep bosom of the ocean", "and all"]
    # five prompts, batches of three: the settings hold for the second batch too
    mine = ours.generate_until(_instances("generate_until", [(p, dict(settings)) for p in prompts]), disable_tqdm=True)
    for prompt, text in list(zip(prompts, mine, strict=True))[:2]:
        capsys.readouterr()
        args = ["generate", str(tiny_hf), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
        assert main([*args, "--stop", ".", "--dtype", "fp32"]) == 0
        assert capsys.readouterr().out == prompt + text + "\n"
    reference = theirs.generate_until(_instances("generate_until", [(p, dict(settings)) for p in prompts]))
    assert mine == reference
    # a stop text of several tokens, and the harness's other name for the length: cut where hf cuts
    other = {"until": ["the ocean", "our"], "max_new_tokens": 20, "do_sample": False}
    args = [(p, dict(other)) for p in prompts]
    mine = ours.generate_until(_instances("generate_until", args), disable_tqdm=True)
    assert mine == theirs.generate_until(_instances("generate_until", args))


def _task(folder: Path) -> Path:
    """A local multiple-choice task over TEXT's phrases."""
    folder.mkdir(exist_ok=True)
    words = TEXT.replace(",", "").replace(";", "").replace(".", "").split()
    rows = [
        {"question": " ".join(words[i : i + 4]), "choices": [" " + w for w in words[i + 4 : i + 7]], "answer": i % 3}
        for i in range(0, len(words) - 7, 2)
    ]
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return folder


def test_a_local_task_scores_as_the_hf_model_scores_it(pair, tiny_hf, tmp_path):
    ours, theirs = pair
    tasks = _task(tmp_path / "tasks")
    mine = run_tasks(ours, ["tiny_mc"], include_path=[tasks], log_samples=True)
    from lm_eval.tasks import TaskManager

    def harness(model, **kwargs):
        manager = TaskManager(include_path=str(tasks))
        return lm_eval.simple_evaluate(model=model, tasks=["tiny_mc"], task_manager=manager, **kwargs)

    reference = harness(theirs, bootstrap_iters=0)
    by_name = harness("llmkit", model_args=f"checkpoint={tiny_hf},dtype=fp32,max_length={MAX_LENGTH}", batch_size=2)
    for metric in ("acc,none", "acc_norm,none"):
        assert mine["results"]["tiny_mc"][metric] == reference["results"]["tiny_mc"][metric]
        assert by_name["results"]["tiny_mc"][metric] == reference["results"]["tiny_mc"][metric]
    scores = [float(r[0]) for s in mine["samples"]["tiny_mc"] for r in s["filtered_resps"]]
    expected = [float(r[0]) for s in reference["samples"]["tiny_mc"] for r in s["filtered_resps"]]
    assert scores == pytest.approx(expected, abs=1e-5, rel=1e-6)


class CountingStep(DecodeStep):
    """The eager step, counting the token positions it is fed."""

    fed = 0

    def __call__(self, tokens, cache, valid=None, last=False, given=False):
        self.fed += int(tokens.numel() if valid is None else valid.sum())
        return super().__call__(tokens, cache, valid, last, given)


def test_a_context_shared_by_the_choices_is_computed_once(tiny_hf):
    model, tok = load_decoder(str(tiny_hf), "fp32")
    context = tok.encode(TEXT[:120])
    choices = [tok.encode(c) for c in (" York", " the ocean", " our house", " summer by this sun")]
    step = CountingStep(model)
    together = score(model, [(context, c) for c in choices], max_length=MAX_LENGTH * 2, step=step)
    assert step.fed == len(context) + sum(len(c) - 1 for c in choices)  # not len(choices) * len(context)
    alone = [score(model, [(context, c)], max_length=MAX_LENGTH * 2)[0] for c in choices]
    assert [s.logprob for s in together] == pytest.approx([s.logprob for s in alone], abs=1e-5)
    split = score(model, [(context, c) for c in choices], max_length=MAX_LENGTH * 2, batch_size=3)  # over 2 batches
    assert [s.logprob for s in split] == pytest.approx([s.logprob for s in together], abs=1e-5)
