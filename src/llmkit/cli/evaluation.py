"""The evaluation command: `llmkit eval` scores a checkpoint on lm-evaluation-harness tasks, and its perplexity on a
text (against a reference model: the KL divergence of what quantizing or merging changed)."""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from llmkit.cli.common import DType, load_decoder
from llmkit.errors import InputError

if TYPE_CHECKING:
    from llmkit.models import DecoderLM
    from llmkit.tokenizer import Tokenizer


@dataclass(frozen=True)
class TaskOptions:
    """lm-evaluation-harness tasks (--tasks): multiple choice, generation, rolling log-likelihood.

    tasks: comma-separated task or group names: llmkit's offline tasks (llmkit_offline, llmkit_shakespeare_next_line,
        llmkit_bible_de_en), any task of lm-evaluation-harness whose data is reachable, or YAML task files.
    limit: score only the first N documents of each task (a number below 1: that fraction of them).
    num_fewshot: examples put before each question (default: the task's own setting).
    include_path: a folder of YAML task files to add to the registry (repeatable).
    list_tasks: print the task and group names that --tasks accepts, then stop.
    """

    tasks: str | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    include_path: list[str] | None = None
    list_tasks: bool = False


@dataclass(frozen=True)
class PerplexityOptions:
    """Perplexity and bits per byte on a text, in sliding windows (--perplexity).

    perplexity: 'shakespeare' (the held-out tenth of each play), a prepared data folder (its validation split), or a
        UTF-8 text file.
    reference: also score a reference model (same tokenizer) on the same windows: KL(reference || model) per token
        (mean, median, percentiles, maximum), top-1 agreement and the change in perplexity.
    reference_dtype: the reference's precision (default: its checkpoint's; a GGUF file loads dequantized in fp32).
    window: tokens per window (at most the model's context length).
    stride: tokens between window starts (default: half the window): each token is scored with at least
        window - stride tokens before it.
    max_tokens: score only the text's first N tokens.
    kv_dtype: auto (the model's dtype), int8 or fp8: keep the model's keys and values as `llmkit serve --kv-dtype`
        does; without --reference, the reference is the same model with its own cache (loaded once), so the KL
        and top-1 agreement are what that cache costs.
    """

    perplexity: str | None = None
    reference: str | None = None
    reference_dtype: DType | None = None
    window: int = 1024
    stride: int | None = None
    max_tokens: int | None = None
    kv_dtype: Literal["auto", "int8", "fp8"] = "auto"


def eval_(
    checkpoint: str | None = None,
    *,
    harness: TaskOptions = TaskOptions(),
    text: PerplexityOptions = PerplexityOptions(),
    batch_size: int = 32,
    output: str | None = None,
    overwrite: bool = False,
    seed: int = 0,
    dtype: DType | None = None,
    device: str | None = None,
    no_verify: bool = False,
) -> int:
    """Score a model: its accuracy on lm-evaluation-harness tasks (--tasks), its perplexity on a text
    (--perplexity), or both. Any checkpoint llmkit loads: a training run, an llmkit checkpoint (quantized, LoRA),
    a Hugging Face directory, a GGUF file (kept quantized unless --dtype is given).

    checkpoint: the model to score.
    batch_size: continuations scored, or prompts continued, per forward pass.
    output: write the results, settings and versions to this JSON file.
    overwrite: replace an existing --output file.
    seed: seeds the harness's few-shot sampling and any sampled generation.
    dtype: load the weights in this precision (default: the checkpoint's; a bf16 / fp16 checkpoint on the CPU
        keeps its weights at that width, read by llmkit's kernels, with fp32 activations).
    device: cpu, cuda, cuda:1, ... (default: the CPU); a reference goes to the same device.
    no_verify: load an llmkit checkpoint without checking its files against the checksums saved with them.
    """
    if harness.list_tasks:
        return _list_tasks(harness.include_path or [])
    if checkpoint is None:
        raise InputError("give the checkpoint to score: llmkit eval CHECKPOINT --tasks NAMES | --perplexity TEXT")
    _check(harness, text, batch_size)
    # what can be refused without the model is checked first: task names, the text, the output file
    manager = _task_manager(harness) if harness.tasks is not None else None
    source = None
    if text.perplexity is not None:
        from llmkit.evaluate.texts import read_text

        source = read_text(text.perplexity)
    out = None
    if output is not None:
        from llmkit.outputs import claim

        out = claim(output, "file", inputs=[checkpoint, text.reference], overwrite=overwrite)
    started = time.time()
    model, tok = load_decoder(checkpoint, dtype, device, verify=not no_verify)
    report: dict[str, Any] = {"checkpoint": checkpoint, "settings": _settings(harness, text, batch_size, seed, dtype)}
    if source is not None:
        report["perplexity"] = _perplexity(model, tok, source, text, device, not no_verify)
    if manager is not None:
        report.update(_tasks(model, tok, manager, harness, batch_size, seed))
    report["seconds"] = round(time.time() - started, 1)
    report["versions"] = _versions()
    if out is not None:
        from llmkit.outputs import building

        with building(out) as tmp:
            tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"wrote {out.path}", file=sys.stderr)
    return 0


def _check(harness: TaskOptions, text: PerplexityOptions, batch_size: int) -> None:
    if text.reference is not None and text.perplexity is None:
        raise InputError("--reference is compared on the --perplexity text: give --perplexity too")
    if harness.tasks is None and text.perplexity is None:
        raise InputError("nothing to score: give --tasks NAMES, --perplexity TEXT, or both (--list-tasks lists tasks)")
    if harness.tasks is not None and not [t for t in harness.tasks.split(",") if t.strip()]:
        raise InputError("--tasks is empty: give task names separated by commas")
    if batch_size < 1:
        raise InputError(f"--batch-size {batch_size} is out of range: it must be at least 1")
    if harness.limit is not None and (harness.limit <= 0 or (harness.limit > 1 and harness.limit % 1)):
        raise InputError(
            f"--limit {harness.limit} is out of range: give a number of documents (1, 2, ...) or a fraction of them "
            "(above 0, below 1)"
        )
    if harness.num_fewshot is not None and harness.num_fewshot < 0:
        raise InputError(f"--num-fewshot {harness.num_fewshot} is out of range: it must be at least 0")
    if text.window < 2:
        raise InputError(f"--window {text.window} is out of range: it must be at least 2")
    if text.stride is not None and not 0 < text.stride <= text.window:
        raise InputError(f"--stride {text.stride} is out of range: it must be between 1 and --window ({text.window})")
    if text.max_tokens is not None and text.max_tokens < 1:
        raise InputError(f"--max-tokens {text.max_tokens} is out of range: it must be at least 1")


def _settings(harness: TaskOptions, text: PerplexityOptions, batch_size: int, seed: int, dtype: str | None) -> Any:
    return {**asdict(harness), **asdict(text), "batch_size": batch_size, "seed": seed, "dtype": dtype}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "machine": platform.processor() or platform.machine()}
    for package in ("llmkit", "torch", "lm_eval", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def _harness() -> Any:
    """llmkit.evaluate.harness, or an InputError saying how to install lm-evaluation-harness."""
    try:
        from llmkit.evaluate import harness
    except ImportError as e:
        raise InputError(
            f"tasks need lm-evaluation-harness ({e.name} is missing): pip install 'llmkit[eval]'"
        ) from None
    return harness


def _list_tasks(include_path: list[str]) -> int:
    manager = _harness().task_names(include_path)
    for name in sorted(set(manager.all_subtasks) | set(manager.all_groups)):
        print(name)
    return 0


def _names(harness: TaskOptions) -> list[str]:
    return [t.strip() for t in (harness.tasks or "").split(",") if t.strip()]


def _task_manager(options: TaskOptions) -> Any:
    """The harness's task registry with llmkit's offline tasks and --include-path, the --tasks names checked."""
    harness = _harness()
    manager = harness.task_names(options.include_path or [])
    harness.check_tasks(manager, _names(options), options.include_path or [])
    return manager


def _tasks(
    model: DecoderLM, tok: Tokenizer, manager: Any, options: TaskOptions, batch_size: int, seed: int
) -> dict[str, Any]:
    """The harness's results for --tasks, printed as its table."""
    from lm_eval.utils import make_table

    harness = _harness()
    limit = None if options.limit is None else (int(options.limit) if options.limit >= 1 else options.limit)
    results = harness.run_tasks(
        harness.HarnessModel(model, tok, batch_size=batch_size, seed=seed),
        _names(options),
        manager=manager,
        limit=limit,
        num_fewshot=options.num_fewshot,
        seed=seed,
        on_loaded=lambda loaded: print(f"tasks: {', '.join(loaded)}", file=sys.stderr, flush=True),
    )
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    return {key: results[key] for key in ("results", "groups", "n-samples", "versions") if key in results}


def _perplexity(
    model: DecoderLM, tok: Tokenizer, text: str, options: PerplexityOptions, device: str | None, verify: bool
) -> dict[str, Any]:
    """Perplexity on the --perplexity text, and the divergence from --reference: printed, and returned."""
    from tqdm import tqdm

    from llmkit.evaluate.perplexity import check_same_vocabulary, divergence, perplexity, text_tokens
    from llmkit.evaluate.texts import first_tokens

    window = min(options.window, model.cfg.position.max_seq_len)
    stride = options.stride or max(1, window // 2)
    if options.max_tokens is not None:
        text = first_tokens(tok, text, options.max_tokens)
    total = len(text_tokens(tok, text)) - 1
    kv_dtype = None if options.kv_dtype == "auto" else options.kv_dtype
    reference = model if kv_dtype is not None else None  # without --reference: the model with its own cache
    if options.reference is not None:
        reference, ref_tok = load_decoder(options.reference, options.reference_dtype, device, verify=verify)
        check_same_vocabulary(tok, ref_tok)
    with tqdm(total=total, desc="perplexity", unit=" tokens", file=sys.stderr) as bar:
        if reference is None:
            result = perplexity(model, tok, text, window=window, stride=stride, progress=bar.update, kv_dtype=kv_dtype)
            report: dict[str, Any] = {"perplexity": result.perplexity, "bits_per_byte": result.bits_per_byte}
        else:
            d = divergence(
                model, reference, tok, text, window=window, stride=stride, progress=bar.update, kv_dtype=kv_dtype
            )
            result = d.model
            report = {"bits_per_byte": result.bits_per_byte, **d.summary()}
    report.update(tokens=result.tokens, bytes=result.bytes, window=window, stride=stride, text=options.perplexity)
    if kv_dtype is not None:
        report["kv_dtype"] = kv_dtype
    width = max(len(k) for k in report)
    for key, value in report.items():
        print(f"{key:<{width}}  {value:.6g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    return report
