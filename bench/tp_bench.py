"""What tensor parallelism costs on one machine: the same checkpoint decoded by one process (both cores) and split
across two (`torchrun --nproc_per_node 2`, one core each), in the same run.

On a 2-core machine splitting cannot make anything faster (the two ranks share the cores and the memory bus that
one process already uses); what this measures is the price: tokens/s of 2 ranks against 1, the bytes all-reduced
and gathered per decoded token (counted at the collectives), and each rank's load time, peak memory and resident
weights. The model: a LLaMA-style decoder (GQA, SwiGLU; 16 heads, 4 key/value heads) of random weights, saved once
as an llmkit checkpoint under runs/bench/tp-model.

    python bench/tp_bench.py [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import RUNS, measure_limits, peak_rss_gib, report

PROMPT, NEW = 256, 64


def checkpoint() -> Path:
    out = RUNS / "tp-model"
    if (out / "llmkit.json").is_file():
        return out
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    import llmkit
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.tokenizer import Tokenizer

    cfg = llmkit.get_preset("llama2-7b")
    cfg = dataclasses.replace(cfg, d_model=1024, n_layers=12, vocab_size=32000,
                              attention=dataclasses.replace(cfg.attention, n_heads=16, n_kv_heads=4),
                              ffn=dataclasses.replace(cfg.ffn, hidden_dim=2816))  # fmt: skip
    torch.manual_seed(0)
    backend = Backend(models.BPE())  # a byte-level BPE: the benchmark feeds token ids, a checkpoint needs one
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(["to be"], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                               initial_alphabet=alphabet))  # fmt: skip
    tok = Tokenizer(backend, bos_id=0, eos_id=1)
    save_llmkit(llmkit.build_model(cfg).eval(), out, tokenizer=tok)
    return out


def worker(path: Path, tp: int, out: Path) -> None:
    """One rank (or the one process): load (a rank: its slices only), prefill, decode; rank 0 writes what it
    measured."""
    import torch.distributed as dist

    from llmkit.cli.common import load_decoder
    from llmkit.generate import generate
    from llmkit.generate.step import DecodeStep
    from llmkit.parallel import launch, resident_bytes

    ranks = launch.start(tp, None)
    start = time.perf_counter()
    model, _ = load_decoder(str(path), None, split=ranks is not None)
    load_s = time.perf_counter() - start
    peak_load = peak_rss_gib()
    sent = {"all_reduce": 0, "all_gather": 0, "calls": 0}
    if ranks is not None:  # count what the model's collectives move
        reduce, gather = dist.all_reduce, dist.all_gather

        def counted_reduce(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            sent["all_reduce"] += t.numel() * t.element_size()
            sent["calls"] += 1
            return reduce(t, *a, **k)

        def counted_gather(parts: list[torch.Tensor], t: torch.Tensor, *a: Any, **k: Any) -> Any:
            sent["all_gather"] += t.numel() * t.element_size() * len(parts)
            sent["calls"] += 1
            return gather(parts, t, *a, **k)

        dist.all_reduce, dist.all_gather = counted_reduce, counted_gather  # type: ignore[assignment]
    prompt = torch.randint(0, model.cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(prompt)  # warm-up
        t0 = time.perf_counter()
        model(prompt)
        prefill_s = time.perf_counter() - t0
    steps = {"torch": DecodeStep(model)}
    if ranks is None:
        steps["C++"] = None  # generate's own choice: llmkit's C++ decode step, which a split model cannot use
    decode = {}
    for name, step in steps.items():
        generate(model, [prompt[0, :16].tolist()], max_new_tokens=4, step=step)  # warm-up
        before = dict(sent)
        t0 = time.perf_counter()
        generate(model, [prompt[0].tolist()], max_new_tokens=1, step=step, eos_id=None)  # the prompt alone
        first = time.perf_counter() - t0
        prompt_sent = {k: sent[k] - before[k] for k in sent}
        before = dict(sent)
        t0 = time.perf_counter()
        generate(model, [prompt[0].tolist()], max_new_tokens=NEW, step=step, eos_id=None)
        seconds = time.perf_counter() - t0 - first  # the NEW - 1 decoding steps after the first token
        per_token = {k: (sent[k] - before[k] - prompt_sent[k]) / (NEW - 1) for k in sent}
        decode[name] = {"tokens_per_s": (NEW - 1) / seconds, "per_token": per_token}
    result = {"tp": tp, "load_s": load_s, "peak_rss_after_load_gib": peak_load, "peak_rss_gib": peak_rss_gib(),
              "resident_weight_bytes": resident_bytes(model), "prefill_tokens_per_s": PROMPT / prefill_s,
              "decode": decode}  # fmt: skip
    results = [result]
    if ranks is not None:
        results = [None] * tp  # type: ignore[list-item]
        dist.all_gather_object(results, result)
    if ranks is None or ranks.rank == 0:
        out.write_text(json.dumps(results))
    launch.end(ranks, finished=True)


def run(tp: int, path: Path, out: Path) -> list[dict[str, Any]]:
    script = [str(Path(__file__).resolve()), "--worker", str(tp), str(path), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // tp)}
    if tp == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), *script]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _cpu() -> str:
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")]
    return names[0] if names else platform.processor()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _each(ranks: list[dict[str, Any]], key: str, unit: float, spec: str) -> str:
    return ", ".join(format(r[key] / unit, spec) for r in ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("TP", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[1]), int(args.worker[0]), Path(args.worker[2]))
        return
    path = checkpoint()
    limits = measure_limits(("fp32",))
    one = run(1, path, RUNS / "tp-1.json")[0]
    two = run(2, path, RUNS / "tp-2.json")
    cpu = _cpu()
    summary = {"cpu": cpu, "limits": limits.as_dict(), "weight_bytes_whole": one["resident_weight_bytes"],
               "one_process": one, "two_ranks": two}  # fmt: skip

    def table() -> None:
        print(f"tp_bench: {cpu}, {limits}; weights {one['resident_weight_bytes'] / 2**20:.0f} MiB fp32")
        print("| | 1 process (2 threads) | 2 ranks (1 thread each) |\n|---|---|---|")
        for name in ("C++", "torch"):
            if name in one["decode"]:
                a = one["decode"][name]["tokens_per_s"]
                b = two[0]["decode"]["torch"]["tokens_per_s"]
                print(f"| decode tok/s, batch 1, {name} step for 1 process | {a:.1f} | {b:.1f} ({b / a:.2f}x) |")
        a, b = one["prefill_tokens_per_s"], two[0]["prefill_tokens_per_s"]
        print(f"| prefill {PROMPT} tokens, tok/s | {a:.0f} | {b:.0f} ({b / a:.2f}x) |")
        per = two[0]["decode"]["torch"]["per_token"]
        print(
            f"| collectives / decoded token | - | {per['calls']:.0f} calls, {per['all_reduce'] / 1024:.1f} KiB "
            f"all-reduced, {per['all_gather'] / 1024:.1f} KiB gathered |"
        )
        print(
            f"| load s, checksums verified; a rank reads its slices only (per rank) | {one['load_s']:.2f} | "
            f"{_each(two, 'load_s', 1, '.2f')} |"
        )
        print(
            f"| peak RSS after load GiB (per rank) | {one['peak_rss_after_load_gib']:.2f} | "
            f"{_each(two, 'peak_rss_after_load_gib', 1, '.2f')} |"
        )
        print(
            f"| resident weights MiB (per rank) | {one['resident_weight_bytes'] / 2**20:.0f} | "
            f"{_each(two, 'resident_weight_bytes', 2**20, '.0f')} |"
        )

    report(summary, args.json, table)


if __name__ == "__main__":
    main()
