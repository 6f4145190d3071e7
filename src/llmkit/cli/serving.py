"""`llmkit serve`: an OpenAI-compatible HTTP server for a decoder-only checkpoint."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmkit.cli.common import DType, invariance, load_decoder
from llmkit.errors import LLMKitError


@dataclass(frozen=True)
class HTTPOptions:
    """The HTTP server.

    host: the address to bind (127.0.0.1: this machine only).
    port: the port to listen on.
    api_key: when given, clients must send it as "Authorization: Bearer KEY" (everywhere but /health).
    metrics_key: a second key that opens /metrics only (for a Prometheus scraper).
    model_name: the name clients ask for (default: the checkpoint's file or folder name).
    request_timeout: seconds a request may run before it is ended.
    max_body_size: the largest request body taken, e.g. 8MiB (larger: HTTP 413).
    body_timeout: seconds a client has to send its whole request body (slower: HTTP 408).
    header_timeout: seconds a client has to send its request line and headers (slower: the connection is closed).
    shutdown_timeout: on SIGTERM or Ctrl-C, seconds the requests in flight get to finish before they are ended
      (streams get an error event and [DONE]); a second signal ends them at once.
    reasoning_parser: a chat reply's <think> block returned apart as reasoning_content: auto (where the chat
      template has thinking blocks: Qwen3, DeepSeek-R1, ...), think (always), none (left in content).
    no_ui: do not serve the web page at / (a chat with the model and a live view of the engine).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    metrics_key: str | None = None
    model_name: str | None = None
    request_timeout: float = 600.0
    max_body_size: str = "8MiB"
    body_timeout: float = 30.0
    header_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    reasoning_parser: Literal["auto", "think", "none"] = "auto"
    no_ui: bool = False


@dataclass(frozen=True)
class EngineOptions:
    """The engine: its batch and its paged KV cache.

    max_batch: sequences decoded together at most.
    kv_memory: memory for the paged KV cache, e.g. 512MiB, 2GiB.
    block_size: token slots per cache block.
    step_tokens: tokens computed per step (decoding rows plus prompt chunks): bounds how long a long prompt
      holds up the sequences that are decoding.
    max_queue: requests waiting before new ones get HTTP 429.
    no_prefix_cache: do not reuse the cache blocks of shared prompt prefixes.
    batch_invariant: require the batch-invariant mode, the default wherever the C++ decode step runs (AVX2 CPU,
      fp32 or int4/int8 weights): every token through the C++ step as a row of its own, so that a request's tokens
      and log-probabilities do not depend on what else is running, and equal `llmkit generate`'s. On a GPU (not
      the default there) the GPU runner with batch-invariant Triton products, norms and attention (docs/gpu.md).
      An error where neither can run (a CPU with bf16 weights or latent attention; mixture-of-experts or quantized
      layers on a GPU), which serve through PyTorch without it.
    no_batch_invariant: prompts through PyTorch instead, as one batch (about 11% more output tokens a second on
      mixed prompts with AVX512-VNNI, much more without it; see BENCHMARKS.md); answers then depend on the load.
    prefix_cache_host: host memory for cached prompt blocks the cache evicts, e.g. 4GiB (0: none): a later prompt
      with the same prefix copies them back instead of computing them.
    prefix_cache_dir: a directory for cached prompt blocks: evicted ones past the host memory, and every cached
      block at shutdown, so that a restarted server finds them (keyed by the model, the cache's dtype and layout;
      damaged or foreign files are ignored). Not with --mtp or --draft.
    prefix_cache_disk: what the directory's blocks may take, e.g. 16GiB (the oldest go first).
    adapter: NAME=PATH, a LoRA adapter (a folder with PEFT's adapter_config.json and adapter_model.safetensors, as
      llmkit's LoRA runs save them) served beside the base model: a request whose `model` is NAME gets it
      (repeatable). Its rows keep the C++ decode step and the batch-invariant mode; not with speculation.
    max_adapters: adapters resident at most (default: as many as --adapter gives); with an API key, more are
      loaded at run time through POST /v1/load_lora_adapter, the least recently used idle one unloaded.
    kv_dtype: auto (the model's dtype), int8 or fp8: keys and values as one-byte codes with a scale per token and
      kv head, about 3.8x the sequences of fp32 (1.9x of bf16) in the same --kv-memory for a small loss
      (docs/serving.md measures it). Grouped-query models; int8 on the CPU (the C++ step reads the codes) and GPUs,
      fp8 on GPUs of compute capability 8.9 or later (Ada, Hopper); not with --mtp or --draft.
    log_steps: a file to which every step appends a JSON line (its decoding rows, prompt tokens and drafts, seconds,
      the bytes of weights and KV cache it read, its FLOPs, and their fractions of the memory bandwidth and matmul
      peak measured at start-up).
    """

    max_batch: int = 32
    kv_memory: str = "1GiB"
    block_size: int = 16
    step_tokens: int = 512
    max_queue: int = 256
    no_prefix_cache: bool = False
    batch_invariant: bool = False
    no_batch_invariant: bool = False
    prefix_cache_host: str = "0"
    prefix_cache_dir: str | None = None
    prefix_cache_disk: str = "16GiB"
    adapter: list[str] | None = None
    max_adapters: int = 0
    kv_dtype: Literal["auto", "int8", "fp8"] = "auto"
    log_steps: str | None = None


@dataclass(frozen=True)
class SpeculationOptions:
    """Speculative decoding (greedy output is the same as without; sampled output has the same distribution).

    mtp: draft with the model's own multi-token-prediction module (a checkpoint grafted by `llmkit graft-mtp`):
      each decoding sequence drafts up to --speculate tokens a step and the model checks all of them in the step's
      one pass. Fewer drafts as the batch grows (none where a step's rows already cost their arithmetic). Needs the
      C++ step.
    draft: draft with this smaller model (a checkpoint sharing the model's tokenizer, e.g. one made by `llmkit
      distill-draft`), loaded like the model; as --mtp otherwise.
    ngram: draft from each sequence's own text (prompt lookup: what followed the last few tokens where they
      occurred before, in the prompt or the output): any model, no second one; pays where answers copy their
      prompt (code edits, quotes, summaries). As --mtp otherwise.
    speculate: with --mtp, --draft or --ngram, the most tokens a sequence drafts per step.
    draft_head_bits: with --mtp, draft from an int4 (4) or int8 (8) copy of the output head and of the module's
      block (0: their own weights): cheaper drafts, the same output.
    """

    mtp: bool = False
    draft: str | None = None
    ngram: bool = False
    speculate: int = 3
    draft_head_bits: int = 4

    def draft_tokens(self) -> int:
        """EngineConfig.draft_tokens: the most drafts a step (0: no speculation); a clear error for a bad mix."""
        if self.mtp + (self.draft is not None) + self.ngram > 1:
            raise LLMKitError("--mtp, --draft and --ngram are three drafters: give one")
        drafting = self.mtp or self.draft is not None or self.ngram
        if (not drafting and self.speculate != 3) or (not self.mtp and self.draft_head_bits != 4):
            raise LLMKitError("--speculate applies with --mtp, --draft or --ngram, --draft-head-bits with --mtp")
        if not 1 <= self.speculate <= 16:
            raise LLMKitError(f"--speculate {self.speculate} is out of range: it must be 1 to 16")
        if self.draft_head_bits not in (0, 4, 8):
            raise LLMKitError(f"--draft-head-bits {self.draft_head_bits} is out of range: it must be 4, 8 or 0")
        return self.speculate if drafting else 0


def serve(
    checkpoint: str,
    *,
    dtype: DType | None = None,
    device: str | None = None,
    no_verify: bool = False,
    tensor_parallel: int = 1,
    http: HTTPOptions = HTTPOptions(),
    engine: EngineOptions = EngineOptions(),
    speculation: SpeculationOptions = SpeculationOptions(),
) -> int:
    """Serve a model over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics):
    a run folder, an llmkit checkpoint, a Hugging Face directory or a GGUF file. Requests are batched continuously
    over a paged KV cache that shares prompt prefixes.

    checkpoint: the model to serve.
    dtype: load the weights in this precision (default: the checkpoint's; a bf16 / fp16 checkpoint on the CPU
        keeps its weights at that width, read by llmkit's kernels, with fp32 activations).
    device: cpu, cuda, cuda:1, ... (default: where the checkpoint loads).
    no_verify: load an llmkit checkpoint without checking its files against the checksums saved with them.
    tensor_parallel: split the model across this many processes, started by torchrun --nproc_per_node N: each
      holds about 1/N of the weights and of the KV cache; rank 0 serves HTTP and schedules, every rank runs each
      step (see docs/parallelism.md). Not with --mtp, --draft, --ngram or --batch-invariant.
    """
    try:
        from llmkit.serve.adapters import parse_adapter
        from llmkit.serve.server import ServeOptions, Server, parse_size
    except ImportError as missing:  # fastapi / uvicorn / prometheus_client are the `serve` extra
        raise LLMKitError(f"serving needs {missing.name}: pip install 'llmkit[serve]'") from missing

    name = http.model_name or Path(checkpoint).name
    options = ServeOptions(name, api_key=http.api_key, metrics_key=http.metrics_key,
                           request_timeout=http.request_timeout, max_body_size=parse_size(http.max_body_size),
                           body_timeout=http.body_timeout, header_timeout=http.header_timeout,
                           shutdown_timeout=http.shutdown_timeout, reasoning_parser=http.reasoning_parser,
                           ui=not http.no_ui)  # fmt: skip
    drafts = speculation.draft_tokens()
    config = _engine_config(engine, speculation)
    adapters = [parse_adapter(a) for a in engine.adapter or []]
    if tensor_parallel > 1 and (drafts or engine.batch_invariant):
        raise LLMKitError("--tensor-parallel serves without --mtp, --draft, --ngram or --batch-invariant")
    from llmkit.parallel import launch

    ranks = launch.start(tensor_parallel, device)
    if ranks is not None:
        return _serve_split(ranks, checkpoint, dtype, no_verify, options, config, http.host, http.port)
    model, tok = load_decoder(checkpoint, dtype, device, verify=not no_verify)
    draft = speculation.draft
    drafter = load_decoder(draft, dtype, device, verify=not no_verify)[0] if draft is not None else None
    _log_to_stderr()
    server = Server(model, tok, options, config, http.host, http.port, drafter)
    for adapter_name, path in adapters:  # (before the engine's loop runs: nothing else touches it yet)
        assert server.engine.adapters is not None
        server.engine.adapters.register(adapter_name, path)
    _measure_limits(server.engine)  # (before the line that says it listens: no request runs beside it)
    _announce(server, name, model, drafts if speculation.mtp else 0, draft, drafts)
    server.run_foreground()
    return 0


def _engine_config(engine: EngineOptions, speculation: SpeculationOptions) -> Any:
    """The engine's settings from the command line's."""
    from llmkit.serve.engine import EngineConfig
    from llmkit.serve.server import parse_size

    return EngineConfig(
        parse_size(engine.kv_memory),
        engine.block_size,
        engine.max_batch,
        engine.step_tokens,
        engine.max_queue,
        not engine.no_prefix_cache,
        invariance(engine.batch_invariant, engine.no_batch_invariant),
        draft_tokens=speculation.draft_tokens(),
        draft_head_bits=speculation.draft_head_bits or None,
        ngram=speculation.ngram,
        host_cache=parse_size(engine.prefix_cache_host),
        cache_dir=engine.prefix_cache_dir,
        disk_cache=parse_size(engine.prefix_cache_disk),
        max_adapters=max(engine.max_adapters, len(engine.adapter or [])),
        kv_dtype=None if engine.kv_dtype == "auto" else engine.kv_dtype,
        log_steps=engine.log_steps,
    )


def _serve_split(
    ranks: Any,
    checkpoint: str,
    dtype: DType | None,
    no_verify: bool,
    options: Any,
    config: Any,
    host: str,
    port: int,
) -> int:
    """`serve --tensor-parallel N` on one of torchrun's N processes: every rank loads its part of the model;
    rank 0 serves, the others follow its steps (serve/lockstep.py)."""
    from llmkit.parallel import launch
    from llmkit.serve.lockstep import Lockstep, follow
    from llmkit.serve.server import Server

    finished = False
    try:
        model, tok = load_decoder(checkpoint, dtype, str(ranks.device), verify=not no_verify, split=True)
        lockstep = Lockstep.create()
        if ranks.rank != 0:
            follow(model, lockstep)
        else:
            _log_to_stderr()
            server = Server(model, tok, options, config, host, port, lockstep=lockstep)
            _announce(server, options.model_name, model, 0, None, 0, ranks.world)
            try:
                server.run_foreground()
            finally:
                lockstep.stop()
        finished = True
    finally:
        launch.end(ranks, finished)
    return 0


def _announce(server: Any, name: str, model: Any, mtp: int, draft: str | None, speculate: int, tp: int = 1) -> None:
    e = server.engine
    from llmkit.quant import describe, parameter_count

    split = f", split across {tp} processes (this one's part)" if tp > 1 else ""
    invariant = "batch-invariant" if e.runner.invariant else "answers depend on the load (not batch-invariant)"
    print(
        f"llmkit serve: {name} ({parameter_count(model) / 1e6:.1f}M parameters{split}, {describe(model)}, "
        f"computing in {str(e.dtype).removeprefix('torch.')} on {e.device}); "
        f"KV cache {e.pool.n_blocks} blocks x {e.pool.block_size} tokens = {e.cache.nbytes / 2**20:.0f} MiB"
        f"{f' of {e.cache.kv_dtype} keys and values' if e.cache.kv_dtype else ''}, "
        f"{e.capacity_sequences:.1f} sequences of the full {e.max_len}-token context, "
        f"{e.sequences_of(min(2048, e.max_len))} of {min(2048, e.max_len)} tokens; steps through "
        f"{e.runner.kind}; {invariant}; "
        + (f"drafting up to {speculate} tokens a step with its MTP module; " if mtp else "")
        + (f"drafting up to {speculate} tokens a step with {Path(draft).name}; " if draft is not None else "")
        + (f"drafting up to {speculate} tokens a step from each sequence's text; " if e.config.ngram else "")
        + _tiers(e)
        + (f"LoRA adapters {', '.join(e.adapters.known)} (at most {e.adapters.most} resident); " if e.adapters else "")
        + f"listening on {server.url}/v1"
        + (f" (the web page: {server.url}/)" if server.options.ui else ""),
        flush=True,
    )


def _measure_limits(engine: Any) -> None:
    """The machine's memory bandwidth and matmul peak, measured once (about a second) before the first request, for
    each step's fractions of them (/metrics, --log-steps); printed."""
    from llmkit.serve.telemetry import Limits

    try:
        engine.telemetry.limits = limits = Limits.measure(engine.device, engine.dtype)
    except RuntimeError as e:  # (a GPU whose memory the cache took: the server runs without the fractions)
        print(f"llmkit serve: the machine's limits were not measured ({e}); steps are counted without them")
        return
    print(f"llmkit serve: this machine: {limits}", flush=True)


def _tiers(engine: Any) -> str:
    """The prefix-cache tiers, for the start-up line."""
    store = engine.store
    if store is None:
        return ""
    parts = [f"{store.host_bytes / 2**20:.0f} MiB of host memory"] if store.host_bytes else []
    if store.dir is not None:
        parts.append(f"{store.dir} ({len(store.disk)} blocks found, at most {store.disk_bytes / 2**30:.1f} GiB)")
    return f"evicted prefix blocks kept in {' then '.join(parts)}; "


def _log_to_stderr() -> None:
    """The server's own messages (refused requests, shutdown) on stderr, one line each."""
    logger = logging.getLogger("llmkit.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("llmkit serve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
