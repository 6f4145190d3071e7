"""The `llmkit` command line. Each subcommand is a typed function: its signature becomes the flags and its docstring
the help (parameters before `*` are positional; `name_` becomes `--name`).

    llmkit presets                          list the named presets
    llmkit inspect PRESET_OR_CONFIG [--json] [--seq-len N] [--dtype fp32|bf16|fp16]
    llmkit inspect --compare llama2-7b,mixtral-8x7b,deepseek-v3
"""

from __future__ import annotations

import argparse
import inspect as pyinspect
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError

COMMANDS: dict[str, Callable[..., int]] = {}


def command(fn: Callable[..., int]) -> Callable[..., int]:
    """Register a function as a subcommand named after it."""
    COMMANDS[fn.__name__.rstrip("_").replace("_", "-")] = fn
    return fn


# ---- commands


def _load_config(spec: str) -> tuple[str, ModelConfig]:
    from llmkit.presets import get_preset

    if spec.endswith(".json") or Path(spec).is_file():
        return Path(spec).stem, ModelConfig.from_json(Path(spec))
    return spec, get_preset(spec)


@command
def presets(*, json_: bool = False) -> int:
    """List the named presets with their parameter counts and sources.

    json_: print a JSON list instead of a table.
    """
    from llmkit.analysis import analyze, human
    from llmkit.presets import PRESETS

    rows: list[dict[str, Any]] = []
    for name, p in PRESETS.items():
        report = analyze(p.config, name)
        rows.append(
            {
                "name": name,
                "params_total": report.params_total,
                "params_active": report.params_active,
                "architecture": report.architecture,
                "attention": p.config.attention.kind,
                "source": p.source,
            }
        )
    if json_:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'preset':<{width}}  {'total':>8}  {'active':>8}  {'attention':<9}  source")
    for r in rows:
        print(
            f"{r['name']:<{width}}  {human(r['params_total']):>8}  {human(r['params_active']):>8}  "
            f"{r['attention']:<9}  {r['source']}"
        )
    return 0


@command
def inspect(
    model: str | None = None,
    *,
    json_: bool = False,
    seq_len: int | None = None,
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16",
    compare: str | None = None,
) -> int:
    """Parameters (total, active, by component), weight memory, KV cache and FLOPs of a preset or config file.

    model: a preset name (see `llmkit presets`) or a ModelConfig JSON file.
    json_: print one JSON object (with --compare, a list).
    seq_len: context length for the KV-cache size and FLOPs (default: the model's max_seq_len; 4096 with --compare).
    dtype: element type for weight and cache bytes.
    compare: comma-separated presets or config files to show side by side.
    """
    from llmkit.analysis import analyze, format_compare, format_report

    if compare is None and model is None:
        raise LLMKitError("give a preset or config file to inspect, or --compare A,B,...")
    if compare is not None:
        specs = [s.strip() for s in compare.split(",") if s.strip()]
        if model is not None:
            specs.insert(0, model)
        if not specs:
            raise LLMKitError(f"--compare {compare!r} names no model; give comma-separated presets or config files")
        length = 4096 if seq_len is None else seq_len
        reports = [analyze(cfg, name, length, dtype) for name, cfg in map(_load_config, specs)]
        print(json.dumps([r.to_dict() for r in reports], indent=2) if json_ else format_compare(reports))
        return 0
    assert model is not None
    name, cfg = _load_config(model)
    report = analyze(cfg, name, seq_len, dtype)
    print(json.dumps(report.to_dict(), indent=2) if json_ else format_report(report))
    return 0


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype(name: str | None) -> Any:
    import torch

    return getattr(torch, _DTYPES[name]) if name else None


@command
def convert(
    source: str,
    target: str,
    *,
    to: Literal["hf", "llmkit"] | None = None,
    dtype: Literal["fp32", "bf16", "fp16"] | None = None,
    model_type: str | None = None,
) -> int:
    """Convert a checkpoint between Hugging Face, GGUF and llmkit formats.

    source: a Hugging Face directory, a .gguf file, or an llmkit checkpoint directory.
    target: the directory to write.
    to: output format (default: llmkit for Hugging Face and GGUF sources, hf for llmkit sources).
    dtype: cast the floating-point weights (default: keep the source's; GGUF is dequantized to fp32).
    model_type: the Hugging Face model_type to write (default: the source's, or the one the architecture matches).
    """
    from llmkit.analysis import human
    from llmkit.interop.checkpoint import load_model, save_llmkit
    from llmkit.interop.hf import save_hf
    from llmkit.models import RNNSeq2Seq

    loaded = load_model(source, dtype=_dtype(dtype))
    fmt = to or ("hf" if loaded.source == "llmkit" else "llmkit")
    if fmt == "hf" and isinstance(loaded.model, RNNSeq2Seq):
        raise LLMKitError("the RNN encoder-decoder has no Hugging Face counterpart to convert to")
    source_dir = Path(source) if Path(source).is_dir() else None
    if fmt == "hf":
        out = save_hf(
            loaded.model,  # type: ignore[arg-type]
            target,
            model_type=model_type or loaded.hf_model_type,
            hf_config=loaded.hf_config,
            generation_config=loaded.generation_config,
            tokenizer_dir=source_dir,
        )
        if source_dir is None and loaded.tokenizer is not None:
            loaded.tokenizer.save(out)
    else:
        out = save_llmkit(
            loaded.model,
            target,
            tokenizer=loaded.tokenizer,
            tokenizer_dir=source_dir,
            hf_model_type=model_type or loaded.hf_model_type,
            hf_config=loaded.hf_config,
            generation_config=loaded.generation_config,
        )
    n = sum(p.numel() for p in loaded.model.parameters())
    print(f"{loaded.source} {source} -> {fmt} {out} ({human(n)} parameters)")
    return 0


@command
def compare(path: str, *, json_: bool = False, prompt: str | None = None) -> int:
    """Run one input through transformers and llmkit and report where they differ, layer by layer.

    path: a Hugging Face checkpoint directory or a .gguf file.
    json_: print one JSON object (with logits_max_abs_diff and top1_agreement).
    prompt: the text to run (default: a fixed English sentence).
    """
    from llmkit.interop.compare import compare as run_compare
    from llmkit.interop.compare import format_compare_report

    report = run_compare(path, prompt)
    print(json.dumps(report, indent=2) if json_ else format_compare_report(report))
    return 0


@command
def prepare(
    source: str = "shakespeare",
    *,
    out: str | None = None,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    val_fraction: float | None = None,
    text_field: str = "text",
    parallel: bool = False,
    separate_vocab: bool = False,
    test_fraction: float = 0.02,
    src_field: str = "source",
    tgt_field: str = "target",
) -> int:
    """Turn a corpus into a tokenizer and memory-mapped token arrays with a deterministic split: a text corpus for
    language models, or sentence pairs for translation.

    source: 'shakespeare' (the default corpus), a text file, a folder of text files or a .jsonl file; for translation
        'bible:SRC-TGT' (e.g. bible:de-en, the default parallel corpus) or, with --parallel, a .tsv / .jsonl file.
    out: the folder to write (default runs/data/shakespeare, or runs/data/bible-SRC-TGT for the Bible).
    vocab_size: size of the byte-level BPE vocabulary to train (default 4096; 8000 for sentence pairs).
    tokenizer: language models: reuse this tokenizer (a folder with tokenizer.json) instead of training one.
    val_fraction: language models: the share of every document, at its end, kept for validation (0.1);
        sentence pairs: the share of pairs, chosen by a hash of the source sentence (0.01).
    text_field: the field holding the text in a .jsonl file.
    parallel: the source is a file of sentence pairs (implied by bible:...).
    separate_vocab: sentence pairs: one vocabulary per side instead of a shared one.
    test_fraction: sentence pairs: the share of pairs held out for the test split (BLEU).
    src_field: sentence pairs: the source field of a .jsonl file, or column of a .tsv file with a header.
    tgt_field: sentence pairs: the target field or column.
    """
    if parallel or source == "bible" or source.startswith("bible:"):
        from llmkit.data.parallel import DEFAULT, prepare_parallel

        name = DEFAULT if source == "bible" else source
        target = out or ("runs/data/" + name.replace(":", "-") if name.startswith("bible:") else "runs/data/pairs")
        meta = prepare_parallel(name, target, vocab_size=vocab_size or 8000, shared_vocab=not separate_vocab,
                                val_fraction=0.01 if val_fraction is None else val_fraction,
                                test_fraction=test_fraction, src_field=src_field, tgt_field=tgt_field)  # fmt: skip
        sp = meta["splits"]
        print(
            f"prepared {meta['source']} -> {target}: {sum(v['pairs'] for v in sp.values()):,} pairs "
            f"(train {sp['train']['pairs']:,}, val {sp['val']['pairs']:,}, test {sp['test']['pairs']:,}), "
            f"{'shared' if meta['shared_vocab'] else 'separate'} vocab {meta['vocab_size']}, "
            f"train {sp['train']['src_tokens']:,} source + {sp['train']['tgt_tokens']:,} target tokens, "
            f"{meta['seconds']:.1f} s\nlicence: {meta['licence']}"
        )
        return 0
    from llmkit.data.prepare import prepare as run_prepare

    target = out or "runs/data/shakespeare"
    meta = run_prepare(source, target, vocab_size=vocab_size or 4096, tokenizer=tokenizer,
                       val_fraction=0.1 if val_fraction is None else val_fraction, text_field=text_field)  # fmt: skip
    s = meta["splits"]
    print(
        f"prepared {source} -> {target}: vocab {meta['vocab_size']}, train {s['train']['tokens']:,} tokens "
        f"({s['train']['chars']:,} chars), val {s['val']['tokens']:,} tokens, "
        f"{meta['chars_per_token']:.2f} chars/token, {meta['seconds']:.1f} s"
    )
    return 0


@command
def train(
    config: str | None = None,
    *,
    set_: list[str] | None = None,
    resume: bool = False,
    parallel: Literal["none", "ddp", "fsdp"] | None = None,
) -> int:
    """Train a model on prepared data: progress bar, metrics, loss plot, checkpoints.

    config: a YAML training config (sections model, data, optim, schedule, train, loss); defaults if omitted.
    set_: override a config value, e.g. --set optim.lr=3e-4 --set model.n_layers=6 (repeatable).
    resume: continue from the latest checkpoint in train.out, exactly where it stopped.
    parallel: data parallelism under torchrun: ddp or fsdp (the same as --set train.parallel=...).
    """
    from llmkit.train.config import load_train_config
    from llmkit.train.loop import train as run_train

    overrides = list(set_ or [])
    if parallel is not None:
        overrides.append(f"train.parallel={parallel}")
    cfg = load_train_config(config, overrides)
    result = run_train(cfg, resume=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        state = "interrupted; resume with --resume" if result.interrupted else "done"
        bpc = f", val bits/char {result.val_bpc:.4f}" if result.val_bpc is not None else ""
        loss = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        print(f"{state}: {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s{loss}{bpc}")
        if result.checkpoint is not None:
            print(f"checkpoint: {result.checkpoint}")
        if result.test_scores is not None:
            print(f"test scores: {Path(cfg.train.out) / 'test_scores.json'}")
        print(f"loss plot: {Path(cfg.train.out) / 'loss.png'}")
    return 0


@command
def translate(
    checkpoint: str,
    text: str | None = None,
    *,
    file: str | None = None,
    output: str | None = None,
    beams: int = 4,
    length_penalty: float = 0.6,
    batch_size: int = 32,
    plot_attention: str | None = None,
    score_test: str | None = None,
    test_pairs: int = 0,
    dtype: Literal["fp32", "bf16", "fp16"] | None = None,
) -> int:
    """Translate with an encoder-decoder model: a training run folder (its averaged checkpoint if any, else the
    latest), an llmkit checkpoint or a Hugging Face Marian directory.

    checkpoint: the translation model.
    text: a sentence to translate.
    file: translate this file instead, one sentence per line (a progress bar shows on standard error).
    output: with --file, write the translations here, one per line (default: standard output).
    beams: beam size (1: greedy decoding; the paper used 4).
    length_penalty: beam search: log-probability / length ** penalty ranks hypotheses (the paper used 0.6).
    batch_size: sentences decoded together.
    plot_attention: save the cross-attention heat map of the sentence (source words against target words) here.
    score_test: translate the test split of this prepared parallel data folder and print BLEU and chrF.
    test_pairs: with --score-test, only the first N test pairs (0: all).
    dtype: load the weights in this precision.
    """
    from llmkit.translate import Translator
    from llmkit.translate import score_test as run_score

    given = [x for x in (text, file, score_test) if x is not None]
    if len(given) != 1:
        raise LLMKitError("give exactly one of: a sentence, --file FILE, or --score-test DATA_DIR")
    if plot_attention is not None and text is None:
        raise LLMKitError("--plot-attention draws one sentence: give the sentence as the text argument")
    if output is not None and file is None:
        raise LLMKitError("--output goes with --file")
    if score_test is not None:
        run_path = Path(checkpoint)
        out = run_path if (run_path / "checkpoints").is_dir() else None
        run_score(checkpoint, score_test, out=out, beams=beams, length_penalty=length_penalty, limit=test_pairs,
                  batch_size=batch_size)  # fmt: skip
        return 0
    translator = Translator.load(checkpoint, dtype=_dtype(dtype))
    if text is not None:
        result = translator.translate([text], beams=beams, length_penalty=length_penalty)[0]
        print(result.text)
        if plot_attention is not None:
            from llmkit.translate.plot import plot_attention as draw

            amap = translator.attention(text, result.tokens)
            print(f"attention map: {draw(amap, plot_attention, title=f'cross-attention: {Path(checkpoint).name}')}",
                  file=sys.stderr)  # fmt: skip
        return 0
    assert file is not None
    path = Path(file)
    if not path.is_file():
        raise LLMKitError(f"{path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (" ..." if len(empty) > 10 else "")
        raise LLMKitError(f"{path}: line(s) {shown} are empty; give one sentence per line")
    if not lines:
        raise LLMKitError(f"{path} is empty")
    results = translator.translate(lines, beams=beams, length_penalty=length_penalty, batch_size=batch_size,
                                   progress=True)  # fmt: skip
    text_out = "".join(r.text + "\n" for r in results)
    if output is not None:
        Path(output).write_text(text_out, encoding="utf-8")
        print(f"{len(results)} sentences -> {output}", file=sys.stderr)
    else:
        sys.stdout.write(text_out)
    return 0


@command
def average(run: str, *, last: int = 5, out: str | None = None) -> int:
    """Average the weights of a run's last checkpoints (as the paper did for its base models).

    run: a training run folder.
    last: how many of its newest checkpoints to average.
    out: where to write the averaged checkpoint (default RUN/averaged).
    """
    from llmkit.train.average import average_run

    path = average_run(run, last, out)
    print(f"averaged the last {last} checkpoints of {run} -> {path}")
    return 0


def _load_for_generation(checkpoint: str, dtype: str | None) -> Any:
    from llmkit.interop.checkpoint import load_model
    from llmkit.models import DecoderLM
    from llmkit.train.checkpoint import latest_checkpoint

    path = Path(checkpoint)
    run_latest = latest_checkpoint(path) if path.is_dir() else None
    loaded = load_model(run_latest or path, dtype=_dtype(dtype))
    if loaded.tokenizer is None:
        raise LLMKitError(f"{path} has no tokenizer to turn text into tokens")
    if not isinstance(loaded.model, DecoderLM):
        raise LLMKitError(f"{path} is an encoder-decoder model; `llmkit generate` continues decoder-only models")
    loaded.model.eval()
    return loaded


def _unescape(text: str) -> str:
    """Read the escapes a shell passes through literally: \\n, \\t and \\\\."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@command
def generate(
    checkpoint: str,
    *,
    prompt: str = "",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    samples: int = 1,
    stop: list[str] | None = None,
    stream: bool = False,
    beams: int = 1,
    length_penalty: float = 1.0,
    draft: str | None = None,
    mtp: bool = False,
    speculate: int = 4,
    compile: bool = False,
    dtype: Literal["fp32", "bf16", "fp16"] | None = None,
) -> int:
    """Generate text from a training run folder (its latest checkpoint), an llmkit checkpoint, a Hugging Face
    directory or a GGUF file.

    checkpoint: the model to load.
    prompt: the text to continue (empty: start from the beginning-of-text token).
    max_new_tokens: how many tokens to generate at most.
    temperature: 0 for greedy decoding; higher is more random.
    top_k: sample among the k most likely tokens (0 for no limit).
    top_p: sample among the most likely tokens whose probabilities add up to p.
    min_p: sample among tokens at least min_p times as likely as the most likely one.
    repetition_penalty: above 1 discourages tokens already in the text.
    seed: makes sampling repeatable.
    samples: how many continuations to generate (a batch).
    stop: stop a continuation at this text (repeatable; \\n and \\t are read as newline and tab).
    stream: print tokens as they are generated.
    beams: beam search with this many beams (deterministic; ignores the sampling options).
    length_penalty: beam search: length ** penalty divides a hypothesis' log-probability.
    draft: speculative decoding with this smaller model (same tokenizer) drafting tokens.
    mtp: speculative decoding drafting with the model's own multi-token-prediction module.
    speculate: tokens the draft model proposes per round.
    compile: decode through torch.compile (a one-time compilation, then faster steps).
    dtype: load the weights in this precision (bf16 halves the memory read per token).
    """
    from llmkit.generate import Sampling
    from llmkit.generate import generate as run_generate
    from llmkit.generate import stream as run_stream
    from llmkit.generate.beam import beam_search
    from llmkit.generate.speculative import speculative_generate

    if beams > 1 and (draft is not None or mtp):
        raise LLMKitError("--beams cannot be combined with --draft or --mtp: choose beam search or speculation")
    if draft is not None and mtp:
        raise LLMKitError("--draft and --mtp both choose the drafter: give one of them")
    if (beams > 1 or draft is not None or mtp) and (stream or stop):
        raise LLMKitError("--stream and --stop apply to plain decoding, not to --beams, --draft or --mtp")
    stop = [_unescape(s) for s in stop or ()]
    loaded = _load_for_generation(checkpoint, dtype)
    tok, model = loaded.tokenizer, loaded.model
    ids = tok.encode(prompt) if prompt else []
    if not ids:
        start = tok.bos_id if tok.bos_id is not None else tok.eos_id
        if start is None:
            raise LLMKitError("the prompt is empty and the tokenizer has no beginning-of-text token to start from")
        ids = [start]
    eos = tok.eos_id if prompt else None
    prompts = [ids] * samples
    sampling = Sampling(temperature, top_k or None, top_p, min_p, repetition_penalty)
    if beams > 1:
        result = beam_search(model, prompts, num_beams=beams, max_new_tokens=max_new_tokens,
                             length_penalty=length_penalty, eos_id=eos)  # fmt: skip
        for i, row in enumerate(result.sequences):
            _print_sample(i, samples, tok.decode(ids + row))
        return 0
    if draft is not None or mtp:
        draft_model = _load_for_generation(draft, dtype).model if draft is not None else None
        out = speculative_generate(model, prompts, draft=draft_model, max_new_tokens=max_new_tokens, k=speculate,
                                   temperature=temperature, top_k=top_k or None, top_p=top_p, eos_id=eos, seed=seed,
                                   compiled=compile)  # fmt: skip
        for i, row in enumerate(out.new_tokens):
            _print_sample(i, samples, tok.decode(ids + row))
        print(f"[speculative: {out.accepted}/{out.drafted} drafted tokens accepted "
              f"({100 * out.acceptance_rate:.0f}%), {out.target_passes} target passes]", file=sys.stderr)  # fmt: skip
        return 0
    if stream:
        for i in range(samples):
            printed = ""
            new: list[int] = []
            if samples > 1:
                print(f"--- sample {i + 1}")
            print(tok.decode(ids), end="", flush=True)
            for step in run_stream(model, [ids], max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos,
                                   stop_strings=stop or (), tokenizer=tok, seed=None if seed is None else seed + i,
                                   compiled=compile):  # fmt: skip
                if step[0] is None:
                    break
                new.append(step[0])
                text = tok.decode(new)
                print(text[len(printed) :], end="", flush=True)
                printed = text
            print()
        return 0
    out_gen = run_generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k or None, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                           eos_id=eos, stop_strings=stop or (), tokenizer=tok, seed=seed, compiled=compile)  # fmt: skip
    for i, row in enumerate(out_gen.new_tokens):
        _print_sample(i, samples, tok.decode(ids + row))
    return 0


def _print_sample(i: int, n: int, text: str) -> None:
    if n > 1:
        print(f"--- sample {i + 1}")
    print(text)


@command
def chat(
    checkpoint: str,
    *,
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    top_p: float | None = 0.9,
    seed: int | None = None,
    dtype: Literal["fp32", "bf16", "fp16"] | None = None,
) -> int:
    """Chat with a model through its chat template (from its tokenizer files or GGUF metadata). One message per line
    on standard input; the answers stream out. Ctrl-D ends the conversation.

    checkpoint: a model with a chat template (e.g. SmolLM2-135M-Instruct).
    system: an optional system message.
    max_new_tokens: the longest answer.
    temperature: 0 for greedy decoding.
    top_p: sample among the most likely tokens whose probabilities add up to p.
    seed: makes the answers repeatable.
    dtype: load the weights in this precision.
    """
    from llmkit.generate import Sampling
    from llmkit.generate import stream as run_stream
    from llmkit.tokenizer import render_chat

    loaded = _load_for_generation(checkpoint, dtype)
    tok, model = loaded.tokenizer, loaded.model
    if not tok.chat_template:
        raise LLMKitError(f"{checkpoint} has no chat template; use `llmkit generate` for plain continuation")
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    sampling = Sampling(temperature, None, top_p)
    turn = 0
    for line in sys.stdin:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = tok.encode(render_chat(tok, messages), add_bos=False)
        answer: list[int] = []
        printed = ""
        for step in run_stream(model, [ids], max_new_tokens=max_new_tokens, sampling=sampling, eos_id=tok.eos_id,
                               seed=None if seed is None else seed + turn):  # fmt: skip
            if step[0] is None or step[0] == tok.eos_id:
                break
            answer.append(step[0])
            shown = tok.decode(answer)
            print(shown[len(printed) :], end="", flush=True)
            printed = shown
        print(flush=True)
        messages.append({"role": "assistant", "content": tok.decode(answer)})
        turn += 1
    return 0


# ---- signature -> argparse


def _param_docs(doc: str) -> tuple[str, dict[str, str]]:
    """Summary paragraph and `name: help` lines of a docstring."""
    summary, helps = [], {}
    for line in pyinspect.cleandoc(doc or "").splitlines():
        head, sep, rest = line.partition(":")
        if sep and head.strip().isidentifier() and " " not in head.strip():
            helps[head.strip()] = rest.strip()
        elif not helps:
            summary.append(line)
    return "\n".join(summary).strip(), helps


def _scalar(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional) of an annotation like `int | None`."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(get_args(tp))
    return tp, False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmkit", description="The Transformer family, readable and tested.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in COMMANDS.items():
        summary, helps = _param_docs(fn.__doc__ or "")
        p = sub.add_parser(name, help=summary.splitlines()[0] if summary else "", description=summary)
        hints = get_type_hints(fn)
        for pname, param in pyinspect.signature(fn).parameters.items():
            tp, _ = _scalar(hints[pname])
            help_text = helps.get(pname, "")
            kwargs: dict[str, Any] = {"help": help_text}
            if get_origin(tp) is Literal:
                kwargs["choices"] = list(get_args(tp))
            elif tp in (int, float, str):
                kwargs["type"] = tp
            elif get_origin(tp) is list:  # a repeatable flag
                kwargs["action"] = "append"
                kwargs["type"] = get_args(tp)[0]
            if param.kind is param.POSITIONAL_OR_KEYWORD:
                if param.default is not param.empty:
                    kwargs["nargs"] = "?"
                    kwargs["default"] = param.default
                p.add_argument(pname, **kwargs)
                continue
            flag = "--" + pname.rstrip("_").replace("_", "-")
            if tp is bool:
                p.add_argument(flag, dest=pname, action="store_true", default=param.default, help=help_text)
            else:
                p.add_argument(flag, dest=pname, default=param.default, **kwargs)
        p.set_defaults(_fn=fn)
    return parser


def main(argv: typing.Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fn = args._fn
    kwargs = {k: v for k, v in vars(args).items() if k not in ("_fn", "command")}
    try:
        return fn(**kwargs)
    except LLMKitError as e:
        print(f"llmkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
