"""Run by tests/parallel/test_tensor_parallel.py under torchrun (gloo, 127.0.0.1): every case's model split across
the processes against the same model unsplit, in the same process. Rank 0 writes the results (JSON) to argv[1]."""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from llmkit import build_model, get_preset
from llmkit.generate import generate
from llmkit.parallel import parallelize, resident_bytes
from llmkit.quant import quantize

CASES = [
    ("gpt2-tiny", None),  # MHA with biases, learned positions, GELU MLP, tied head
    ("llama2-7b-tiny", None),  # MHA, SwiGLU, untied head
    ("llama2-70b-tiny", None),  # GQA with one key/value head: each rank computes it
    ("gemma-2b-tiny", None),  # MQA, tied
    ("gemma2-2b-tiny", None),  # GQA, soft-capped scores and logits, sliding windows
    ("gemma3-1b-tiny", None),  # GQA 8:2 (split 2 ways), own head dim
    ("qwen3-0.6b-tiny", None),  # GQA with q/k norms, tied
    ("llama2-7b-tiny", "int8"),
    ("llama2-7b-tiny", "int4"),
    ("llama2-7b-tiny", "int4/dequant"),  # int4 codes multiplied as floats: no activation codes
]


def model_of(name: str, quant: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = get_preset(name)
    if quant is not None and quant.startswith(
        "int4"
    ):  # groups of 32 inputs: halves of the hidden width in whole groups
        cfg = dataclasses.replace(cfg, ffn=dataclasses.replace(cfg.ffn, hidden_dim=128))
    model = build_model(cfg).eval()
    if quant is not None:
        method, _, kernel = quant.partition("/")
        quantize(model, method, include_head=True, kernel=kernel or "auto")  # type: ignore[arg-type]
    return model


def case(name: str, quant: str | None) -> dict:
    model = model_of(name, quant)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 12), generator=g)
    prompts = [tokens[0, :7].tolist(), tokens[1].tolist()]
    with torch.no_grad():
        ref = model(tokens)
    ref_greedy = generate(model, prompts, max_new_tokens=10).new_tokens
    ref_sampled = generate(model, prompts, max_new_tokens=10, temperature=1.0, seed=3).new_tokens
    whole = resident_bytes(model)
    parallelize(model)
    with torch.no_grad():
        out = model(tokens)
    greedy = generate(model, prompts, max_new_tokens=10).new_tokens
    sampled = generate(model, prompts, max_new_tokens=10, temperature=1.0, seed=3).new_tokens
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, sampled)
    return {
        "case": f"{name}/{quant or 'fp32'}",
        "max_diff": (out - ref).abs().max().item(),
        "scale": ref.abs().max().item(),
        "greedy_equal": greedy == ref_greedy,
        "sampled_equal": sampled == ref_sampled,
        "ranks_agree": all(r == sampled for r in ranks),
        "bytes_fraction": resident_bytes(model) / whole,
    }


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    results = [case(name, quant) for name, quant in CASES]
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
