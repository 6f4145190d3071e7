"""Real-size models on the CPU: llmkit against llama.cpp on the same GGUF files, at published shapes.

    bash bench/build_llama_server.sh       # once: llama.cpp's tools (llama-bench, llama-batched-bench, llama-quantize)
    .venv/bin/python bench/size_bench.py [--shapes qwen2.5-1.5b,llama-3.2-3b] [--types Q4_K_M,Q4_0,Q8_0] [--rounds 2]
        [--writer llama.cpp|llmkit|both] [--gguf runs/size_bench/llama-3.1-8b/llmkit.Q4_K_M.gguf]

Each shape is a random-weight Hugging Face checkpoint (LlamaForCausalLM in bf16, weights N(0, 0.02) like a trained
model's spread, norms 1, SmolLM2's tokenizer: speed and memory do not depend on the values), made once under
runs/size_bench/ and converted by llama.cpp's own `convert_hf_to_gguf.py` and `llama-quantize` (from the sources
bench/build_llama_server.sh fetched, in their own virtual environment: runs/llama.cpp/venv), so both sides read
the same file; `--writer llmkit` (or `both`) measures files written by `llmkit convert --to gguf --quant` instead
(or as well). Shapes: Qwen2.5-1.5B's (hidden 1536, 28 layers, 12/2 heads, FFN 8960; 1.46B parameters with the
49,152-token vocabulary), Llama-3.2-3B's (3072, 28, 24/8, 8192; 3.12B) and Llama-3.1-8B's (4096, 32, 32/8, 14336).

Per file and round (rounds interleave the two sides, so a slow minute falls on both):
- llama.cpp: `llama-bench -t THREADS -p 512 -n 128` (prompt 512 tokens; 128 generated tokens after an empty prompt;
  its peak RSS) and `llama-batched-bench -npp 32 -ntg 128 -npl 8` (8 sequences decoding together: its S_TG t/s).
- llmkit, each in a child process (its peak RSS is the child's): load time (cold: the file's pages dropped from the
  page cache first with posix_fadvise; warm: loaded again), peak RSS after loading and after decoding, decode
  tokens/s of 128 greedy tokens after a 32-token prompt (the decoding steps alone), 8 rows at once, and the prefill
  of 512 tokens (time to the first token).
- The machine's limits in the same run: memory read bandwidth and the bf16 matmul peak (llmkit.machine.perf). Bytes a
  token: the weights one decoding step reads (every tensor but the token embedding's table, of which it reads one
  row), the fraction of the bandwidth that takes at the measured rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import ROOT, measure_limits, report

HERE = Path(__file__).resolve().parent
OUT = ROOT / "runs/size_bench"
LLAMA = ROOT / "runs/llama.cpp"
THREADS = os.cpu_count() or 1

# published shapes (config.json of each model) with SmolLM2's vocabulary
SHAPES = {
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}
VOCAB = 49152


# ---- the files


def hf_checkpoint(shape: str) -> Path:
    """A random-weight LlamaForCausalLM of `shape` in bf16, sharded by layers (made once)."""
    import torch
    from safetensors.torch import save_file

    out = OUT / shape / "hf"
    if (out / "config.json").is_file():
        return out
    s = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer_files()
    for f in tokenizer.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("special_tokens"):
            (out / f.name).write_bytes(f.read_bytes())
    C, F, L, H, KH = s["hidden"], s["ffn"], s["layers"], s["heads"], s["kv_heads"]
    D = C // H
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C, "intermediate_size": F,
        "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KH, "head_dim": D,
        "vocab_size": VOCAB, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1,
        "eos_token_id": 2,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)

    def normal(*size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    index: dict[str, str] = {}
    per = max(1, L // 8)
    starts = range(0, L, per)
    for k in range(len(starts) + 1):  # each shard written as it is made: an 8B checkpoint is 16 GB
        shard: dict[str, torch.Tensor] = {}
        if k == 0:
            shard = {"model.embed_tokens.weight": normal(VOCAB, C), "lm_head.weight": normal(VOCAB, C),
                     "model.norm.weight": ones(C)}  # fmt: skip
        for i in range(starts[k - 1], min(L, starts[k - 1] + per)) if k else ():
            p = f"model.layers.{i}."
            shard |= {
                p + "self_attn.q_proj.weight": normal(H * D, C), p + "self_attn.k_proj.weight": normal(KH * D, C),
                p + "self_attn.v_proj.weight": normal(KH * D, C), p + "self_attn.o_proj.weight": normal(C, H * D),
                p + "mlp.gate_proj.weight": normal(F, C), p + "mlp.up_proj.weight": normal(F, C),
                p + "mlp.down_proj.weight": normal(C, F), p + "input_layernorm.weight": ones(C),
                p + "post_attention_layernorm.weight": ones(C),
            }  # fmt: skip
        name = f"model-{k + 1:05d}-of-{len(starts) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index |= {key: name for key in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    return out


def _tokenizer_files() -> Path:
    """SmolLM2's tokenizer as Hugging Face files (llmkit convert writes them beside the weights)."""
    from common import smollm2_gguf

    out = OUT / "smollm2-hf"
    if not (out / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-m", "llmkit", "convert", str(smollm2_gguf()), str(out), "--to", "hf"],
                       check=True, cwd=ROOT)  # fmt: skip
    return out


def llama_cpp_gguf(shape: str, kind: str) -> Path:
    """The checkpoint of `shape` as a GGUF file of `kind`, by llama.cpp's converter and llama-quantize (made once)."""
    out = OUT / shape / f"{shape}.{kind}.gguf"
    if out.is_file():
        return out
    f16 = OUT / shape / f"{shape}.BF16.gguf"
    if not f16.is_file():
        converter = next(LLAMA.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
        python = LLAMA / "venv/bin/python"
        subprocess.run([str(python), str(converter), str(hf_checkpoint(shape)), "--outfile", str(f16), "--outtype",
                        "bf16"], check=True)  # fmt: skip
    subprocess.run([str(LLAMA / "build/bin/llama-quantize"), str(f16), str(out), kind], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return out


def llmkit_gguf(shape: str, kind: str) -> Path:
    """The checkpoint of `shape` as a GGUF file of `kind`, by llmkit's own writer and quantizer (`llmkit convert
    --to gguf --quant`, made once): quantize_bench.py checks its tensors are llama-quantize's, byte for byte."""
    out = OUT / shape / f"llmkit.{kind}.gguf"
    if not out.is_file():
        subprocess.run([sys.executable, "-m", "llmkit", "convert", str(hf_checkpoint(shape)), str(out), "--to", "gguf",
                        "--quant", kind.lower()], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    return out


# ---- llama.cpp


# runs a command and writes its peak RSS (KiB, the largest waited-for child's) as stderr's last line
PEAK = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
)


def llama_bench(path: Path) -> dict[str, float]:
    """llama-bench's pp512 and tg128 tokens/s on `path`, and its peak RSS (GiB: it maps the file, so the pages it
    touches count, as llmkit's do)."""
    cmd = [str(LLAMA / "build/bin/llama-bench"), "-m", str(path), "-t", str(THREADS), "-p", "512", "-n", "128",
           "-r", "2", "-o", "json"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", PEAK, *cmd], check=True, capture_output=True, text=True)
    rows = json.loads(done.stdout)
    peak = int(done.stderr.strip().splitlines()[-1]) / 1024**2
    return {("pp512" if r["n_prompt"] else "tg128"): float(r["avg_ts"]) for r in rows} | {"rss_peak_gib": peak}


def llama_batched(path: Path, batch: int = 8) -> float:
    """llama-batched-bench's decoding tokens/s for `batch` sequences (prompt 32, 128 new tokens each)."""
    out = subprocess.run([str(LLAMA / "build/bin/llama-batched-bench"), "-m", str(path), "-t", str(THREADS),
                          "-npp", "32", "-ntg", "128", "-npl", str(batch), "-c", "4096"],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    # table rows: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2] == str(batch) and re.fullmatch(r"[\d.]+", cells[7]):
            return float(cells[7])
    raise RuntimeError(f"no batch-{batch} row in llama-batched-bench's output:\n{out}")


# ---- llmkit, in a child process


def child(path: Path, cold: bool) -> dict[str, Any]:
    """Run `--child` on `path` in a fresh process and return its measurements."""
    cmd = [sys.executable, str(Path(__file__)), "--child", str(path)] + (["--cold"] if cold else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_llmkit(path: Path, cold: bool) -> dict[str, Any]:
    import resource

    import torch

    from llmkit.generate import generate, stream
    from llmkit.interop.load import load_model
    from llmkit.quant import weight_bytes
    from llmkit.quant.block_linear import HeldBlocks

    if cold:  # the file's pages out of the page cache
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    torch.manual_seed(0)
    start = time.perf_counter()
    loaded = load_model(path)
    load_s = time.perf_counter() - start
    model = loaded.model.eval()
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    vocab = model.cfg.vocab_size
    prompt = torch.randint(100, vocab, (1, 32))

    def decode(x: torch.Tensor, new: int) -> float:  # generated tokens/s over the decoding steps alone
        first, steps = None, 0
        for _ in stream(model, x, max_new_tokens=new):
            first = first or time.perf_counter()
            steps += 1
        return x.shape[0] * (steps - 1) / (time.perf_counter() - first)

    with torch.inference_mode():
        decode(prompt, 8)  # warm-up: the first touch of every weight page, the kernels' first calls
        tg = decode(prompt, 128)
        b8 = decode(torch.randint(100, vocab, (8, 32)), 64)
        long = torch.randint(100, vocab, (1, 512))
        generate(model, long[:, :64], max_new_tokens=1)
        start = time.perf_counter()
        generate(model, long, max_new_tokens=1)
        pp = 512 / (time.perf_counter() - start)
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # (before anything below allocates)
    read = weight_bytes(model)
    if model.head is not None:  # an untied table, of which a step reads one row (a block table's own bytes: its
        embed = model.embed  # `weight` would dequantize the whole of it)
        table = embed.blocks if isinstance(embed, HeldBlocks) else embed.weight
        read -= table.numel() * table.element_size()
    return {
        "load_s": load_s, "rss_load_gib": rss_load, "tg128": tg, "batch8": b8, "pp512": pp, "bytes_per_token": read,
        "rss_peak_gib": rss_peak, "notes": loaded.notes,
    }  # fmt: skip


# ---- the run


def medians(rounds: list[dict[str, Any]], side: str, keys: tuple[str, ...]) -> dict[str, float]:
    return {k: statistics.median(r[side][k] for r in rounds) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-1.5b,llama-3.2-3b")
    ap.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--writer",
        choices=("llama.cpp", "llmkit", "both"),
        default="llama.cpp",
        help="whose converter and quantizer write the files: llama.cpp's, llmkit's, or both (a row each)",
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        action="append",
        default=[],
        help="also a GGUF file made elsewhere (e.g. llmkit's own Q4_K_M of the 8B shape); repeatable",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(measure_llmkit(args.child, args.cold)))
        return
    pairs = [(s, k) for s in args.shapes.split(",") if s for k in args.types.split(",")]
    files: dict[tuple[str, str], Path] = {}
    for shape, kind in pairs:
        if args.writer != "llmkit":
            files[(shape, kind)] = llama_cpp_gguf(shape, kind)
        if args.writer != "llama.cpp":
            files[(shape, f"{kind} (llmkit's file)")] = llmkit_gguf(shape, kind)
    for extra in args.gguf:
        if not extra.is_file():
            ap.error(f"--gguf {extra}: no such file")
        files[(extra.parent.name, extra.name)] = extra
    limits = measure_limits(("bf16",))
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in files}
    for r in range(args.rounds):
        for key, path in files.items():
            ours = child(path, cold=r == 0)
            warm = child(path, cold=False)["load_s"] if r == 0 else ours["load_s"]
            theirs = llama_bench(path) | {"batch8": llama_batched(path)}
            runs[key].append({"llmkit": ours, "llmkit_warm_load_s": warm, "llama": theirs})
            print(
                f"round {r + 1} {key}: llmkit {ours['tg128']:.1f} / llama.cpp {theirs['tg128']:.1f} tok/s",
                file=sys.stderr,
            )
    limits_after = measure_limits(())
    summary = {"limits": limits.as_dict(), "memory_read_after_gbs": limits_after.memory_read / 1e9, "files": {}}
    for (shape, kind), rounds in runs.items():
        first = rounds[0]
        summary["files"][f"{shape} {kind}"] = {
            "file_bytes": files[(shape, kind)].stat().st_size, "bytes_per_token": first["llmkit"]["bytes_per_token"],
            "llmkit": medians(rounds, "llmkit", ("tg128", "batch8", "pp512", "rss_peak_gib", "load_s"))
            | {"cold_load_s": first["llmkit"]["load_s"], "warm_load_s": first["llmkit_warm_load_s"]},
            "llama": medians(rounds, "llama", ("tg128", "batch8", "pp512", "rss_peak_gib")),
            "notes": first["llmkit"]["notes"], "rounds": rounds,
        }  # fmt: skip

    def table() -> None:
        bw = min(limits.memory_read, limits_after.memory_read)
        print(
            f"memory read {limits.memory_read / 1e9:.1f} / {limits_after.memory_read / 1e9:.1f} GB/s (start / end), "
            f"bf16 matmul {limits.matmul_flops['bf16'] / 1e9:.0f} GFLOP/s, {THREADS} threads"
        )
        print(
            "| file | decode b1 llmkit / llama.cpp | bandwidth | prefill 512 | batch-8 | peak RSS llmkit / llama.cpp "
            "(file) | load |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, f in summary["files"].items():
            o, t = f["llmkit"], f["llama"]
            frac = f["bytes_per_token"] * o["tg128"] / bw
            rates = [f"{o[k]:.1f} / {t[k]:.1f} ({o[k] / t[k]:.2f}x)" for k in ("tg128", "pp512", "batch8")]
            ratio = o["rss_peak_gib"] / t["rss_peak_gib"]
            rss = f"{o['rss_peak_gib']:.2f} / {t['rss_peak_gib']:.2f} GiB ({ratio:.2f}x; {f['file_bytes'] / 2**30:.2f})"
            load = f"{o['cold_load_s']:.1f} s cold, {o['warm_load_s']:.1f} warm"
            print(f"| {name} | {rates[0]} | {100 * frac:.0f}% | {rates[1]} | {rates[2]} | {rss} | {load} |")

    report(summary, args.json, table)


if __name__ == "__main__":
    main()
