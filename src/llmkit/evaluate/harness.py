"""lm-evaluation-harness backed by llmkit: its tasks, scored by any model llmkit loads.

    lm = HarnessModel(model, tokenizer, batch_size=32)
    results = run_tasks(lm, ["llmkit_shakespeare_next_line"], limit=100)

`HarnessModel` is an lm-evaluation-harness model class (`TemplateLM`: the harness tokenizes, this class scores):

    loglikelihood          log p(continuation | context): scoring.score, each distinct context computed once
    loglikelihood_rolling  a whole text's log-likelihood in the harness's disjoint windows of max_length tokens
    generate_until         llmkit's cached decoding (greedy unless the task samples), cut at the task's stop texts

Tokenization follows the harness's `hf` model: the tokenizer adds its beginning-of-text token when its configuration
says so, an empty context becomes that token (else the end-of-text token), and a context's trailing spaces move to
its continuation. `run_tasks` adds what a command line needs: unknown task names and data that cannot be reached
are errors that say what to do, and llmkit's own offline tasks (tasks.py) are written when first asked for.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from llmkit.errors import InputError
from llmkit.evaluate.scoring import score
from llmkit.generate import Sampling, StopRule, choose_step, stream
from llmkit.generate.decode import collect
from llmkit.models import DecoderLM
from llmkit.tokenizer import Tokenizer

MAX_GEN_TOKS = 256  # the harness's default for a task that does not say


@register_model("llmkit")
class HarnessModel(TemplateLM):
    """An llmkit decoder and its tokenizer as an lm-evaluation-harness model. batch_size: continuations scored (or
    prompts continued) per forward; max_length: the window (default: the model's context length); seed: of the
    generator that sampled generation (a task with do_sample) draws from."""

    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 32,
        max_length: int | None = None,
        seed: int = 1234,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if tokenizer.eos_id is None and tokenizer.bos_id is None:
            raise InputError("the tokenizer has no beginning- or end-of-text token: the harness needs one")
        self.model, self.tok = model.eval(), tokenizer
        self.batch_size_per_gpu = batch_size
        self._max_length = max_length or model.cfg.position.max_seq_len
        self.step = choose_step(model)
        self.seed, self.progress = seed, progress

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> HarnessModel:
        """`lm_eval --model llmkit --model_args checkpoint=PATH,dtype=bf16,batch_size=16` (after importing this
        module): any checkpoint llmkit loads."""
        from lm_eval.utils import simple_parse_args_string

        given = simple_parse_args_string(arg_string)  # the user's model_args win over the harness's defaults
        args = {**{k: v for k, v in (additional_config or {}).items() if v is not None}, **given}
        if "checkpoint" not in args:
            raise InputError("the llmkit model needs checkpoint=PATH in --model_args")
        model, tok = load_for_evaluation(str(args["checkpoint"]), args.get("dtype"), args.get("device"))
        size = args.get("batch_size")
        return cls(
            model,
            tok,
            batch_size=int(size) if isinstance(size, int | str) and str(size).isdigit() else 32,
            max_length=int(args["max_length"]) if args.get("max_length") else None,
        )

    # ---- what the harness asks of a model

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id if self.tok.eos_id is not None else self.prefix_token_id

    @property
    def prefix_token_id(self) -> int:
        start = self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id
        assert start is not None
        return start

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids; None: its own beginning-of-text rule, unless the text already starts with that token."""
        bos = self.tok.bos_id
        if add_special_tokens is None and bos is not None:
            add_special_tokens = False if string.startswith(self.tok.decode([bos], skip_special=False)) else None
        return self.tok.encode(string, add_bos=add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        with self._bar(len(pairs), "log-likelihoods", disable_tqdm) as bar:
            scored = score(
                self.model, pairs, max_length=self.max_length, batch_size=self.batch_size_per_gpu,
                step=self.step, progress=bar.update,
            )  # fmt: skip
        results = [(s.logprob, s.greedy) for s in scored]
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood: its tokens after the start token, in disjoint windows of max_length."""
        windows: list[tuple[int, tuple[Any, list[int], list[int]]]] = []
        for r, (text,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1,
            )  # fmt: skip
            windows += [(r, (None, *make_disjoint_window(w))) for w in rolling]  # no cache entry per window
        scored = self._loglikelihood_tokens([w for _, w in windows], disable_tqdm)
        totals = [0.0] * len(requests)
        for (r, _), (logprob, _) in zip(windows, scored, strict=True):
            totals[r] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Continuations, batch_size prompts at a time (longest first) among requests with the same settings."""
        out = [""] * len(requests)
        by_settings: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_settings.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        with self._bar(len(requests), "generations", disable_tqdm) as bar:
            for indices in by_settings.values():
                settings = requests[indices[0]].args[1]
                prompts = {i: self.tok_encode(requests[i].args[0]) for i in indices}
                indices = sorted(indices, key=lambda i: -len(prompts[i]))
                for a in range(0, len(indices), self.batch_size_per_gpu):
                    chunk = indices[a : a + self.batch_size_per_gpu]
                    for i, text in zip(chunk, self._continue([prompts[i] for i in chunk], settings), strict=True):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(chunk))
        return out

    def _continue(self, prompts: list[list[int]], settings: dict[str, Any]) -> list[str]:
        """One batch of prompts continued under the harness's generation settings (normalized as its `hf` model
        does), each text cut at the first of the task's stop texts and the end-of-text token's."""
        kwargs = normalize_gen_kwargs(dict(settings), MAX_GEN_TOKS)
        until = handle_stop_sequences(
            kwargs.pop("until", None), eos=self.tok.decode([self.eot_token_id], skip_special=False)
        )
        new = int(kwargs.pop("max_gen_toks"))
        if new >= self.max_length:
            raise InputError(
                f"the task asks for up to {new} new tokens, and the model's window is {self.max_length}: "
                "no room is left for the prompt"
            )
        ids = [p[-(self.max_length - new) :] or [self.prefix_token_id] for p in prompts]
        rule = StopRule.of(self.tok.eos_id, stop_strings=[s for s in until if s], tokenizer=self.tok)
        steps = stream(
            self.model, ids, max_new_tokens=new, sampling=_sampling(kwargs), stop=rule, seed=self.seed, step=self.step
        )
        rows, _ = collect(list(steps), len(ids))  # every token, the one that completes a stop text included
        return [postprocess_generated_text(self.tok.decode(row), until, None) for row in rows]

    def _bar(self, total: int, what: str, disabled: bool) -> tqdm[Any]:
        return tqdm(total=total, desc=what, unit=" requests", disable=disabled or not self.progress)


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"} | {n: n for n in ("float32", "bfloat16", "float16")}


def load_for_evaluation(checkpoint: str, dtype: str | None, device: str | None) -> tuple[DecoderLM, Tokenizer]:
    """A decoder-only model and its tokenizer from any checkpoint llmkit loads (a run gives its latest checkpoint);
    dtype: fp32, bf16, fp16 (or torch's names), None for the checkpoint's own (bf16 / fp16 weights on the CPU held at
        their width with fp32 activations: load_model's own_width)."""
    from llmkit.interop.load import load_model
    from llmkit.runs import resolve_checkpoint

    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    precision = getattr(torch, DTYPES[dtype]) if dtype is not None else None
    loaded = load_model(resolve_checkpoint(checkpoint, averaged=False), dtype=precision, device=device, own_width=True)
    if loaded.tokenizer is None or not isinstance(loaded.model, DecoderLM):
        raise InputError(f"{checkpoint}: evaluation needs a decoder-only model with a tokenizer")
    return loaded.model.eval(), loaded.tokenizer


def _sampling(settings: dict[str, Any]) -> Sampling:
    """The harness's generation settings as llmkit's sampling rule: greedy unless do_sample (or a temperature above
    zero without do_sample: False)."""
    temperature = float(settings.get("temperature", 0.0) or 0.0)
    sample = bool(settings.get("do_sample", temperature > 0))
    if not sample:
        return Sampling(0.0, None, None, None, 1.0)
    top_k = settings.get("top_k")
    top_p = settings.get("top_p")
    return Sampling(temperature or 1.0, int(top_k) if top_k else None, float(top_p) if top_p else None, None, 1.0)


def task_names(include_path: Sequence[str | Path] = ()) -> Any:
    """The harness's TaskManager over its registry, llmkit's offline tasks and `include_path`."""
    from lm_eval.tasks import TaskManager

    from llmkit.evaluate.tasks import tasks_folder

    return TaskManager(include_path=[str(tasks_folder()), *map(str, include_path)])


def check_tasks(manager: Any, tasks: Sequence[str], include_path: Sequence[str | Path] = ()) -> None:
    """An InputError for the first name the registry does not know, with the nearest names it does; for a task
    file (given as a path, or a file of `include_path` that the registry skipped) that cannot be read as YAML."""
    known = set(manager.all_subtasks) | set(manager.all_groups) | set(manager.all_tags)
    for name in tasks:
        if Path(name).is_file():
            if (why := task_file_error(Path(name))) is not None:
                raise InputError(f"{name}: the task file cannot be used: {why}")
        elif name not in known:
            from llmkit.evaluate.tasks import missing_task

            if (why := missing_task(name)) is not None:
                raise InputError(f"the offline task {name!r} cannot be written: {why}")
            for path, why in _unreadable_task_files(include_path):  # what the registry skipped without a word
                if path.stem == name or name in path.read_bytes().decode("utf-8", "replace"):
                    raise InputError(f"no task is called {name!r}: the task file {path} cannot be used: {why}")
            near = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
            hint = f"; the nearest names: {', '.join(near)}" if near else "; `llmkit eval --list-tasks` lists them"
            raise InputError(f"no task is called {name!r}{hint}")


def task_file_error(path: Path) -> str | None:
    """Why a task file cannot be read as the harness reads it (YAML whose `!function` tags name Python code), or
    None."""
    import yaml

    class Tagged(yaml.SafeLoader):
        """YAML with any `!tag` read as nothing (the harness resolves its tags itself)."""

    Tagged.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=Tagged)  # (a SafeLoader)
    except UnicodeDecodeError:
        return "it is not UTF-8 text"
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    except yaml.MarkedYAMLError as e:
        where = f" (line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1})" if e.problem_mark else ""
        return f"it is not valid YAML: {e.problem}{where}"
    except yaml.YAMLError as e:
        return "it is not valid YAML: " + " ".join(str(e).split())
    if not isinstance(data, dict):
        return "it is not a YAML mapping of a task's settings"
    return None


def _unreadable_task_files(include_path: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """The YAML files under the folders of `include_path` that cannot be read, and why."""
    found = []
    for folder in map(Path, include_path):
        for path in sorted([*folder.rglob("*.yaml"), *folder.rglob("*.yml")]):
            if (why := task_file_error(path)) is not None:
                found.append((path, why))
    return found


def load_tasks(manager: Any, tasks: Sequence[str]) -> dict[str, Any]:
    """The harness's task objects by name (a group's tasks in its place), each task's data loaded. An InputError
    names the data set of a task whose data cannot be reached (no network, nothing in the local cache) and says how
    to give it locally."""
    loaded: dict[str, Any] = {}
    for name in tasks:
        try:
            loaded.update(manager.load([name])["tasks"])
        except (ConnectionError, OSError) as e:  # what datasets raises offline (FileNotFoundError is an OSError)
            raise InputError(_unreachable(manager, name, e)) from None
    return loaded


def _unreachable(manager: Any, name: str, error: Exception) -> str:
    """What to say when a task's data did not load."""
    dataset = "its data set"
    config = getattr(manager.task_index.get(name), "cfg", None) or {}
    if config.get("dataset_path"):
        dataset = f"its data set {config['dataset_path']!r}" + (
            f" ({config['dataset_name']!r})" if config.get("dataset_name") else ""
        )
    first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    return (
        f"the task {name!r} could not load {dataset}: {first}. Offline, give the data locally: download it once "
        "where there is a network (it is then read from the Hugging Face datasets cache, HF_DATASETS_CACHE), or "
        "write the task as a YAML file over local files (dataset_path: json, dataset_kwargs: {data_files: ...}) and "
        "pass its folder with --include-path"
    )


def run_tasks(
    lm: HarnessModel,
    tasks: Sequence[str],
    *,
    manager: Any = None,
    include_path: Sequence[str | Path] = (),
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    log_samples: bool = False,
    on_loaded: Callable[[list[str]], None] | None = None,
) -> dict[str, Any]:
    """lm-evaluation-harness's results for `tasks` (names in its registry, llmkit's offline tasks, or YAML files
    and folders in include_path): its `simple_evaluate` dictionary. manager: a registry from task_names (built from
    include_path when None). Standard errors are not bootstrapped (bootstrap_iters=0): they print as N/A."""
    import lm_eval

    manager = manager if manager is not None else task_names(include_path)
    check_tasks(manager, tasks, include_path)
    loaded = load_tasks(manager, tasks)
    if on_loaded is not None:
        on_loaded(sorted(loaded))
    torch.manual_seed(seed)
    return dict(
        lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            bootstrap_iters=0,
        )
        or {}
    )
