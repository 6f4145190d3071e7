"""Commands about models: the presets, their sizes and costs, and checkpoints converted and compared."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llmkit.cli.common import DType, torch_dtype
from llmkit.errors import LLMKitError

IMATRIX_CHUNKS = 32  # chunks of calibration text an importance matrix is computed from, by default
IMATRIX_CONTEXT = 512  # tokens a chunk

if TYPE_CHECKING:
    from llmkit.config import ModelConfig
    from llmkit.interop.imatrix import ImportanceMatrix


def presets(*, json_: bool = False) -> int:
    """List the named presets with their parameter counts and sources.

    json_: print a JSON list instead of a table.
    """
    from llmkit.analysis import analyze, human
    from llmkit.config.presets import PRESETS

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
        total, active = human(r["params_total"]), human(r["params_active"])
        print(f"{r['name']:<{width}}  {total:>8}  {active:>8}  {r['attention']:<9}  {r['source']}")
    return 0


def _checkpoint(spec: str, verify: bool) -> Any:
    """The loaded checkpoint when `spec` is one (a GGUF file, an llmkit or Hugging Face directory), else None."""
    from llmkit.interop.load import detect_format, load_model
    from llmkit.interop.safetensors_io import CheckpointError

    p = Path(spec)
    if not p.exists() or p.suffix == ".json":
        return None
    try:
        detect_format(p)
    except CheckpointError:
        return None
    from llmkit.config import ModelConfig

    loaded = load_model(p, verify=verify)
    _print_notes(loaded.notes)
    if not isinstance(loaded.model.cfg, ModelConfig):
        raise LLMKitError(f"{spec}: inspect reports Transformer configs; this is an RNN checkpoint")
    return loaded


def _load_config(spec: str) -> tuple[str, ModelConfig]:
    """A preset name or a ModelConfig JSON file -> (its name, its config)."""
    from llmkit.config import ModelConfig
    from llmkit.config.presets import get_preset

    if spec.endswith(".json") or Path(spec).is_file():
        return Path(spec).stem, ModelConfig.from_json(Path(spec))
    return spec, get_preset(spec)


def inspect(
    model: str | None = None,
    *,
    json_: bool = False,
    seq_len: int | None = None,
    dtype: DType = "bf16",
    compare: str | None = None,
    no_verify: bool = False,
    tp: int = 1,
) -> int:
    """Parameters (total, active, by component), weight memory, KV cache and FLOPs of a preset, config file or
    checkpoint (whose weights in memory are reported as loaded: quantized layers at their own size); with --tp N,
    what each of N tensor-parallel ranks holds and sends.

    model: a preset name (see `llmkit presets`), a ModelConfig JSON file, or a checkpoint (llmkit, Hugging Face, GGUF).
    json_: print one JSON object (with --compare, a list).
    seq_len: context length for the KV-cache size and FLOPs (default: the model's max_seq_len; 4096 with --compare).
    dtype: element type for weight and cache bytes.
    compare: comma-separated presets or config files to show side by side.
    no_verify: load an llmkit checkpoint without checking it against its manifest.
    tp: split the model this many ways (tensor parallelism, measured on the model split on the meta device): weights,
      KV cache and activations per rank, and the bytes all-reduced per token (see docs/parallelism.md).
    """
    from llmkit.analysis import analyze, format_compare, format_report

    if tp < 1:
        raise LLMKitError(f"--tp must be at least 1, got {tp}")
    if compare is None:
        if model is None:
            raise LLMKitError("give a preset or config file to inspect, or --compare A,B,...")
        loaded = _checkpoint(model, verify=not no_verify)
        name, cfg = (Path(model).name, loaded.model.cfg) if loaded is not None else _load_config(model)
        report = analyze(cfg, name, seq_len, dtype)
        if loaded is None and tp > 1:
            from llmkit.parallel.costs import format_costs, rank_costs

            costs = rank_costs(cfg, tp, dtype)
            if json_:
                print(json.dumps({**report.to_dict(), "tensor_parallel": costs.to_dict()}, indent=2))
            else:
                print(format_report(report) + "\n" + format_costs(costs, report.seq_len))
            return 0
        if loaded is None:
            print(json.dumps(report.to_dict(), indent=2) if json_ else format_report(report))
            return 0
        if tp > 1:
            raise LLMKitError("--tp reports a preset or config file's split; inspect the checkpoint's config instead")
        from llmkit.quant import describe, quantized_spec, weight_bytes

        spec = quantized_spec(loaded.model)
        extra = {
            "format": loaded.source,
            "weight_bytes_loaded": weight_bytes(loaded.model),
            "weights_loaded": describe(loaded.model),
            "quantization": spec.to_dict() if spec is not None else None,
        }
        if json_:
            print(json.dumps({**report.to_dict(), **extra}, indent=2))
        else:
            print(format_report(report))
            print(f"  loaded ({loaded.source})  {extra['weights_loaded']}")
        return 0
    if tp > 1:
        raise LLMKitError("--tp reports one model, not --compare")
    specs = [s.strip() for s in compare.split(",") if s.strip()]
    if model is not None:
        specs.insert(0, model)
    if not specs:
        raise LLMKitError(f"--compare {compare!r} names no model; give comma-separated presets or config files")
    length = 4096 if seq_len is None else seq_len
    reports = [analyze(cfg, name, length, dtype) for name, cfg in map(_load_config, specs)]
    print(json.dumps([r.to_dict() for r in reports], indent=2) if json_ else format_compare(reports))
    return 0


def convert(
    source: str,
    target: str,
    *,
    to: Literal["hf", "llmkit", "gguf"] | None = None,
    dtype: DType | None = None,
    quant: str | None = None,
    model_type: str | None = None,
    imatrix: str | None = None,
    imatrix_chunks: int = IMATRIX_CHUNKS,
    overwrite: bool = False,
    no_verify: bool = False,
) -> int:
    """Convert a checkpoint between Hugging Face, GGUF and llmkit formats.

    source: a Hugging Face directory, a .gguf file, or an llmkit checkpoint directory.
    target: the directory to write, or for --to gguf the .gguf file (built beside it and renamed into place when
        complete).
    to: output format (default: llmkit for Hugging Face and GGUF sources, hf for llmkit sources); gguf writes a file
        llama.cpp loads (llama, qwen2 and qwen3 architectures), with the tokenizer and chat template.
    dtype: cast the floating-point weights (default: keep the source's; GGUF is dequantized to fp32, except for
        --to gguf, which keeps a GGUF source's blocks as they are).
    quant: for --to gguf, quantize the float weights first: a mixture (q4_k_m, q4_k_s, q5_k_m, q5_k_s, q3_k_m,
        q3_k_s, q3_k_l, q2_k, iq4_xs, iq4_nl) or a block type (q8_0, q6_k, q5_k, q4_k, q4_0, ...; the output head
        too), by llama.cpp's rules.
    model_type: the Hugging Face model_type to write (default: the source's, or the one the architecture matches).
    imatrix: with --quant, an importance matrix (a file, or calibration text to compute one from; see quantize).
    imatrix_chunks: with calibration text, the most chunks of 512 tokens it is cut into.
    overwrite: replace an existing checkpoint at the target (never the source itself).
    no_verify: load an llmkit source without checking it against its manifest (a checkpoint saved before llmkit
        wrote one: the copy written is verified from then on).
    """
    from llmkit.analysis import human
    from llmkit.interop.load import load_model
    from llmkit.models import RNNSeq2Seq
    from llmkit.outputs import building, claim

    if imatrix is not None and quant is None:
        raise LLMKitError("--imatrix weighs the quantization of --quant: give --quant too")
    if to == "gguf":
        importance = None
        if imatrix is not None:
            importance = _importance(source, imatrix, imatrix_chunks, no_verify)
        return _convert_to_gguf(source, target, dtype, quant, overwrite, no_verify, importance)
    if quant is not None:
        raise LLMKitError("--quant is for --to gguf (an llmkit checkpoint is quantized by llmkit quantize)")
    output = claim(target, "checkpoint", inputs=[source], overwrite=overwrite)
    loaded = load_model(source, dtype=torch_dtype(dtype), quantized=False, verify=not no_verify)
    _print_notes(loaded.notes)
    fmt = to or ("hf" if loaded.source == "llmkit" else "llmkit")
    source_dir = Path(source) if Path(source).is_dir() else None
    if fmt == "hf" and isinstance(loaded.model, RNNSeq2Seq):
        raise LLMKitError("the RNN encoder-decoder has no Hugging Face counterpart to convert to")
    with building(output) as tmp:
        _write(loaded, fmt, tmp, source_dir, model_type)
    n = sum(p.numel() for p in loaded.model.parameters())
    print(f"{loaded.source} {source} -> {fmt} {target} ({human(n)} parameters)")
    return 0


def _print_notes(notes: list[str]) -> None:
    """What loading changed or could not check (a checkpoint loaded unverified, GGUF tensors dequantized)."""
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


def _write(loaded: Any, fmt: str, out: Path, source_dir: Path | None, model_type: str | None) -> None:
    """`convert`'s output: the loaded model in Hugging Face's format or llmkit's, with its tokenizer."""
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.interop.hf import save_hf
    from llmkit.models import RNNSeq2Seq

    if fmt == "hf":
        assert not isinstance(loaded.model, RNNSeq2Seq)
        save_hf(
            loaded.model,
            out,
            model_type=model_type or loaded.hf_model_type,
            hf_config=loaded.hf_config,
            generation_config=loaded.generation_config,
            tokenizer_dir=source_dir,
        )
        if source_dir is None and loaded.tokenizer is not None:
            loaded.tokenizer.save(out)
    else:
        save_llmkit(
            loaded.model,
            out,
            tokenizer=loaded.tokenizer,
            tokenizer_dir=source_dir,
            hf_model_type=model_type or loaded.hf_model_type,
            hf_config=loaded.hf_config,
            generation_config=loaded.generation_config,
        )


def _convert_to_gguf(
    source: str,
    target: str,
    dtype: DType | None,
    quant: str | None,
    overwrite: bool,
    no_verify: bool,
    importance: ImportanceMatrix | None = None,
) -> int:
    """convert --to gguf: the model (quantized first with --quant) and its tokenizer as one GGUF file."""
    from llmkit.interop.gguf_write import save_gguf
    from llmkit.interop.load import load_model
    from llmkit.outputs import building, claim
    from llmkit.quant import describe
    from llmkit.quant.blocks import TYPES
    from llmkit.quant.mixtures import MIXTURES

    method = quant.upper() if quant is not None else None
    if method is not None and method not in MIXTURES and method not in TYPES:
        raise LLMKitError(f"--quant {quant}: not one of {', '.join(m.lower() for m in (*MIXTURES, *TYPES))}")
    output = claim(target, "file", inputs=[source], overwrite=overwrite)
    # a GGUF source keeps its blocks as stored unless it is quantized anew, layer by layer as its floats are read
    loaded = load_model(
        source,
        dtype=torch_dtype(dtype),
        quantized=method is None,
        verify=not no_verify,
        quantize=method,
        importance=importance,
    )
    _print_notes(loaded.notes)
    with building(output) as tmp:
        notes = save_gguf(
            loaded.model,
            tmp,
            tokenizer=loaded.tokenizer,
            name=Path(target).name.split(".")[0],
            mixture=method if method in MIXTURES else None,
        )
    _print_notes(notes)
    print(f"{loaded.source} {source} -> gguf {target} ({describe(loaded.model)})")
    return 0


# what `llmkit quantize --to` takes: llmkit's group formats, then llama.cpp's mixtures and block types
QuantTarget = Literal[
    "int8", "int4", "fp8", "q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q3_k_m", "q3_k_s", "q3_k_l", "q2_k", "iq4_xs",
    "iq4_nl", "q8_0", "q6_k", "q5_k", "q4_k", "q3_k", "q4_0", "q4_1", "q5_0", "q5_1", "bf16", "f16",
]  # fmt: skip


def quantize(
    checkpoint: str,
    out: str,
    *,
    to: QuantTarget,
    group_size: int | None = None,
    include_head: bool = False,
    imatrix: str | None = None,
    imatrix_chunks: int = IMATRIX_CHUNKS,
    overwrite: bool = False,
    no_verify: bool = False,
) -> int:
    """Quantize a checkpoint's weights and write an llmkit checkpoint that every command loads.

    checkpoint: a Hugging Face directory, a .gguf file (dequantized first), an llmkit checkpoint or a run folder.
    out: the directory to write (built beside it and renamed into place when complete).
    to: int8 (one scale per output row, or per group with --group-size), int4 (groups, default 32), fp8 (E4M3
        numbers, one scale per output row or per group: read by llmkit's Triton kernel on a GPU), or one of
        llama.cpp's block types (q8_0, q6_k, q4_k, q4_0, ...: llama.cpp's quantization rules, the bytes its
        llama-quantize writes; bf16 / f16: the weights rounded to that width and held by llmkit's kernels), or one
        of its mixtures (q4_k_m, q4_k_s, q5_k_m, q5_k_s, q3_k_m, q3_k_s, q3_k_l, q2_k, iq4_xs, iq4_nl: each layer,
        the output head and the embedding table in the block type llama.cpp gives them).
    group_size: inputs per scale for int8 / int4 / fp8: 32, 64, 128 or 256 (must divide every layer's input width).
    include_head: quantize the output head too (a tied head gets a quantized copy of the embedding); a mixture
        always does.
    imatrix: weigh each layer's quantization by how large its inputs are on real text, as llama-quantize --imatrix
        does: an importance-matrix file (llmkit imatrix's or llama-imatrix's), or calibration text ('shakespeare', a
        text file or folder, .jsonl) to compute one from first (the float model run over it). For the block types and
        mixtures (Q8_0 ignores it).
    imatrix_chunks: with calibration text, the most chunks of 512 tokens it is cut into.
    overwrite: replace an existing checkpoint at OUT (never the input itself).
    no_verify: load an llmkit checkpoint without checking it against its manifest.
    """
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.interop.load import load_model
    from llmkit.models import RNNSeq2Seq
    from llmkit.outputs import building, claim
    from llmkit.quant import describe
    from llmkit.quant import quantize as quantize_model
    from llmkit.runs import resolve_checkpoint

    source = resolve_checkpoint(checkpoint, averaged=False)
    output = claim(out, "checkpoint", inputs=[checkpoint, source], overwrite=overwrite)
    method = to if to in ("int8", "int4", "fp8") else to.upper()  # a GGUF type or mixture, as llmkit names them
    if method != to and group_size is not None:
        raise LLMKitError(f"--group-size is for int8, int4 and fp8; {to} has blocks of its own")
    if imatrix is not None and method == to:
        raise LLMKitError(f"--imatrix weighs llama.cpp's block types and mixtures, not {to}")
    importance = None
    if imatrix is not None:
        importance = _importance(source, imatrix, imatrix_chunks, no_verify)
    if method != to:  # a GGUF type or mixture: each layer quantized as it is read (never the whole float model)
        loaded = load_model(source, quantized=False, verify=not no_verify, quantize=method, importance=importance)
        before = "float"
    else:
        loaded = load_model(source, quantized=False, verify=not no_verify)
        if isinstance(loaded.model, RNNSeq2Seq):
            raise LLMKitError("the RNN encoder-decoder has no linear layers to quantize")
        before = describe(loaded.model)
        quantize_model(loaded.model, method, group_size, include_head)
    _print_notes(loaded.notes)
    source_dir = Path(source) if Path(source).is_dir() else None
    with building(output) as tmp:
        save_llmkit(
            loaded.model,
            tmp,
            tokenizer=loaded.tokenizer,
            tokenizer_dir=source_dir if loaded.source == "hf" else None,
            source_tokenizer=loaded.source_tokenizer,
            hf_model_type=loaded.hf_model_type,
            hf_config=loaded.hf_config,
            generation_config=loaded.generation_config,
        )
    print(f"{checkpoint} ({before}) -> {out} ({describe(loaded.model)})")
    return 0


def imatrix(
    checkpoint: str,
    text: str,
    out: str,
    *,
    chunks: int = IMATRIX_CHUNKS,
    context: int = IMATRIX_CONTEXT,
    overwrite: bool = False,
    no_verify: bool = False,
) -> int:
    """Compute an importance matrix: how large each input of each linear layer is on calibration text (the mean
    square over its tokens), written in llama.cpp's imatrix format, for `llmkit quantize --imatrix FILE` and
    `llama-quantize --imatrix FILE` alike.

    checkpoint: a Hugging Face directory, a .gguf file (dequantized), an llmkit checkpoint or a run folder.
    text: 'shakespeare', a text file or folder, or a .jsonl file (its "text" fields).
    out: the .gguf file to write (built beside it and renamed into place when complete).
    chunks: the most chunks of --context tokens the text is cut into (each run as one sequence).
    context: tokens a chunk (a BOS first where the tokenizer adds one).
    overwrite: replace an existing file at OUT.
    no_verify: load an llmkit checkpoint without checking it against its manifest.
    """
    from llmkit.outputs import building, claim
    from llmkit.runs import resolve_checkpoint

    source = resolve_checkpoint(checkpoint, averaged=False)
    output = claim(out, "file", inputs=[checkpoint, source], overwrite=overwrite)
    matrix = _importance(source, text, chunks, no_verify, context)
    with building(output) as tmp:
        matrix.save(tmp)
    print(f"{checkpoint} on {text}: {len(matrix.sums)} layers, {matrix.chunks} chunks of {context} tokens -> {out}")
    return 0


def _importance(
    source: str | Path,
    path: str,
    chunks: int,
    no_verify: bool,
    context: int = IMATRIX_CONTEXT,
) -> ImportanceMatrix:
    """An importance matrix from `path`: read, where it is an imatrix file, else computed by running the float model
    of `source` over the calibration text `path` names (at most `chunks` chunks of `context` tokens)."""
    import gc

    from llmkit.data.corpus import load_corpus
    from llmkit.interop.imatrix import collect, is_imatrix_file, load_imatrix, text_chunks
    from llmkit.interop.load import load_model

    if is_imatrix_file(path):
        return load_imatrix(path)
    if chunks < 1:
        raise LLMKitError(f"--imatrix-chunks must be at least 1, not {chunks}")
    text = "\n\n".join(d.text for d in load_corpus(path))
    loaded = load_model(source, quantized=False, verify=not no_verify)
    if loaded.tokenizer is None:
        raise LLMKitError(f"{source} has no tokenizer to cut the calibration text with")
    tok = loaded.tokenizer
    ids = tok.encode(text, add_bos=False)
    pieces = text_chunks(ids, context, tok.bos_id if tok.add_bos else None, chunks)
    print(f"importance matrix: {len(pieces)} chunks of {context} tokens of {path}", file=sys.stderr)
    matrix = collect(loaded.model, pieces, dataset=str(path), context=context)
    del loaded
    gc.collect()
    return matrix


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
