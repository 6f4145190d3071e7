"""The server's settings (ServeOptions: HTTP, keys, time limits) and the engine's (EngineConfig), and the engine's
counters (llmkit.serve.engine)."""

from __future__ import annotations

from dataclasses import dataclass

from llmkit.errors import InputError


@dataclass(frozen=True)
class EngineConfig:
    """kv_memory: bytes for the paged cache (all layers); block_size: token slots per block; max_batch: sequences
    running at once; step_tokens: tokens computed per step (decoding rows plus prompt chunks); max_queue: requests
    waiting before new ones are refused; prefix_caching: reuse cached blocks of shared prompt prefixes;
    batch_invariant: every token through the C++ step as a row of its own (prompt tokens too, in integer panels
    where the weights are GGUF blocks and the CPU has AVX512-VNNI), so that a request's tokens and log-probabilities
    do not depend on what else runs, and equal `generate`'s; on a GPU, the kernel runner with batch-invariant
    products, norms and attention (llmkit.kernels.invariant); None (the default): wherever the model runs on the C++
    step (never on a GPU), True: required (an error where it cannot run), False: off (prompts through PyTorch, a
    little faster);
    draft_tokens: with k > 0, each decoding sequence drafts up to k tokens a step with the model's MTP module and the
    target verifies them (serve/speculation.py; 0: no speculation); draft_head_bits 4 / 8: the drafts read an int4
    / int8 copy of the output head and of the module's block (None: the model's own; a quantized head is always
    its own). The copies make drafts cheaper (SmolLM2: 0.6 against 1.6 ms a row), never change the output;
    ngram: with draft_tokens, draft from each sequence's own text (prompt lookup, serve/ngram.py) instead of the MTP
    module: any model, no second one;
    host_cache: bytes of host memory for cached prefix blocks the pool evicts (0: none); cache_dir: a directory
    where they go next, and where the cached blocks are written at shutdown for the next start (None: no disk
    tier); disk_cache: bytes the directory's blocks may take (serve/tiers.py);
    max_adapters: with n > 0, requests may choose a LoRA adapter (serve/adapters.py), n of them resident at most;
    their decoding rows keep the C++ step (its low-rank products per row), the base model's rows run as they would;
    kv_dtype: "int8" or "fp8" keeps the cache's keys and values as one-byte codes with a scale per token and kv head
    (serve/paged.py; grouped-query models; fp8 where the GPU's paged-attention kernel reads it): about 3.8x the
    sequences of an fp32 cache in the same kv_memory, at a small cost in quality (docs/serving.md gives it); None:
    the model's dtype;
    log_steps: a file to which each step appends a JSON line: its rows, seconds, the bytes of weights and cache it
    read and its FLOPs, and their fractions of the machine's limits when measured (serve/telemetry.py)."""

    kv_memory: int = 1 << 30
    block_size: int = 16
    max_batch: int = 32
    step_tokens: int = 512
    max_queue: int = 256
    prefix_caching: bool = True
    batch_invariant: bool | None = None
    draft_tokens: int = 0
    draft_head_bits: int | None = 4
    ngram: bool = False
    host_cache: int = 0
    cache_dir: str | None = None
    disk_cache: int = 16 << 30
    max_adapters: int = 0
    kv_dtype: str | None = None
    log_steps: str | None = None

    @property
    def tiered(self) -> bool:
        return self.host_cache > 0 or self.cache_dir is not None

    def __post_init__(self) -> None:
        for name in ("kv_memory", "block_size", "max_batch", "step_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise InputError(f"{name}={getattr(self, name)} must be >= 1")
        if self.draft_tokens < 0:
            raise InputError(f"draft_tokens={self.draft_tokens} must be >= 0")
        if self.draft_head_bits not in (None, 4, 8):
            raise InputError(f"draft_head_bits={self.draft_head_bits!r} must be 4, 8 or None")
        if self.max_adapters < 0:
            raise InputError(f"max_adapters={self.max_adapters} must be >= 0")
        if self.max_adapters and self.draft_tokens:
            raise InputError("served adapters run without speculation")
        if self.host_cache < 0 or self.disk_cache < 0:
            raise InputError("host_cache and disk_cache are byte counts >= 0")
        if self.tiered and not self.prefix_caching:
            raise InputError("prefix-cache tiers (host_cache, cache_dir) need prefix caching on")
        if self.kv_dtype not in (None, "int8", "fp8"):
            raise InputError(f"kv_dtype={self.kv_dtype!r} must be 'int8', 'fp8' or None (the model's dtype)")
        if self.kv_dtype is not None and self.draft_tokens and not self.ngram:
            raise InputError(
                f"an {self.kv_dtype} KV cache is not shared with an MTP module or a draft model: use --ngram drafts"
            )
        if self.ngram and not self.draft_tokens:
            raise InputError("ngram drafting needs draft_tokens >= 1 (how many drafts a sequence may get a step)")


@dataclass
class EngineStats:
    """Counters since start (what /metrics reports)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0
    failed: int = 0  # sequences ended because their logits were not finite or their sampling failed


@dataclass(frozen=True)
class ServeOptions:
    """model_name: the name clients ask for; api_key: required as a Bearer token when given (for everything but
    /health); metrics_key: a second key that opens /metrics only (for a scraper); request_timeout: seconds a
    request may take before it is ended; max_body_size: bytes of request body at most; body_timeout /
    header_timeout: seconds a client has to send its body / its request line and headers; shutdown_timeout:
    seconds in-flight requests get to finish after SIGTERM or SIGINT before they are ended; reasoning_parser: how
    a chat reply's thinking block is returned apart, as `reasoning_content` ("auto": where the chat template has
    <think> blocks; "think": always; "none": never, the block stays in `content`); stored_responses /
    stored_characters: how many Responses-API responses are kept in memory for `previous_response_id`, and how many
    characters of conversation they may hold together (the least recently used go first); ui: the web page at `/`
    (serve/webpage.py)."""

    model_name: str
    api_key: str | None = None
    metrics_key: str | None = None
    request_timeout: float = 600.0
    max_body_size: int = 8 << 20
    body_timeout: float = 30.0
    header_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    stored_responses: int = 1024
    stored_characters: int = 64 << 20
    reasoning_parser: str = "auto"
    ui: bool = True

    def __post_init__(self) -> None:
        if self.reasoning_parser not in ("auto", "think", "none"):
            raise InputError(f"reasoning_parser={self.reasoning_parser!r} must be 'auto', 'think' or 'none'")
        for name in ("request_timeout", "body_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name}={getattr(self, name)} must be a positive number of seconds")
        if not self.shutdown_timeout >= 0:
            raise InputError(f"shutdown_timeout={self.shutdown_timeout} must be >= 0 seconds")
        if self.max_body_size < 1024:
            raise InputError(f"max_body_size={self.max_body_size} must be at least 1 KiB")
        if self.stored_responses < 0 or self.stored_characters < 0:
            raise InputError("stored_responses and stored_characters must be >= 0")
