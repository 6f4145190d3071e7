"""Run by tests/parallel/test_tensor_parallel.py under torchrun (gloo, 127.0.0.1): every case's model split across
the processes against the same model unsplit, in the same process. Rank 0 writes the results (JSON) to argv[1]."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from on_ranks import run

from llmkit import InputError, build_model, get_preset
from llmkit.generate import generate
from llmkit.layers.extras import Extras
from llmkit.parallel import parallelize, resident_bytes
from llmkit.parallel.costs import rank_costs
from llmkit.quant import quantize

CASES = [
    ("gpt2-tiny", None),  # MHA with biases, learned positions, GELU MLP, tied head
    ("llama2-7b-tiny", None),  # MHA, SwiGLU, untied head
    ("llama2-70b-tiny", None),  # GQA with one key/value head: each rank computes it
    ("gemma-2b-tiny", None),  # MQA, tied
    ("gemma2-2b-tiny", None),  # GQA, soft-capped scores and logits, sliding windows
    ("gemma3-1b-tiny", None),  # GQA 8:2 (split 2 ways), own head dim
    ("qwen3-0.6b-tiny", None),  # GQA with q/k norms, tied
    ("mixtral-8x7b-tiny", None),  # GQA 8:2, 8 experts top-2: 4 a rank
    ("qwen1.5-moe-a2.7b-tiny", None),  # experts plus a gated shared expert, split by hidden units
    ("deepseek-v2-lite-tiny", None),  # MLA without a query latent, dense first layer, shared experts
    ("deepseek-v3-tiny", None),  # MLA, grouped sigmoid routing with a score bias, MTP module
    ("deepseek-v3.2-tiny", None),  # sparse attention: the indexer whole on every rank
    ("llama2-7b-tiny", "int8"),
    ("llama2-7b-tiny", "int4"),
    ("llama2-7b-tiny", "int4/dequant"),  # int4 codes multiplied as floats: no activation codes
    ("mixtral-8x7b-tiny", "int8/dequant"),  # quantized expert stacks split by experts' rows
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


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss plus the mixtures' balance and z losses: what training differentiates."""
    extras = Extras()
    logits = model(tokens, extras=extras)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    return loss + extras.moe_loss(0.01, 0.001, loss) if extras.moe else loss


def whole_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of the parameters every rank holds whole (norms, routers, latent projections), then cleared."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def inspected(cfg) -> list[int]:
    """What `llmkit inspect --tp` says each rank holds in fp32, the MTP module's part included."""
    costs = rank_costs(cfg, dist.get_world_size(), "fp32")
    return [a + b for a, b in zip(costs.weight_bytes, costs.mtp_weight_bytes, strict=True)]


def case(name: str, quant: str | None) -> dict:
    model = model_of(name, quant)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 12), generator=g)
    prompts = [tokens[0, :7].tolist(), tokens[1].tolist()]
    with torch.no_grad():
        ref = model(tokens)
    if quant is None:
        loss_of(model, tokens).backward()
    ref_grads = whole_grads(model)
    ref_greedy = generate(model, prompts, max_new_tokens=10).new_tokens
    ref_sampled = generate(model, prompts, max_new_tokens=10, temperature=1.0, seed=3).new_tokens
    whole = resident_bytes(model)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    parallelize(model)
    with torch.no_grad():
        out = model(tokens)
    if quant is None:
        loss_of(model, tokens).backward()
    grads = {n: g for n, g in whole_grads(model).items() if g.shape == shapes.get(n)}  # the ones not split
    refused = None
    if model.cfg.attention.indexer is not None:  # sparse attention's indexer does not train split
        try:
            model.train()(tokens, extras=Extras(indexer="dense"))
        except InputError as e:
            refused = str(e)
        model.eval()
    grad_diff = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-12)).item()
                    for n, g in grads.items()) if grads else 0.0  # fmt: skip
    greedy = generate(model, prompts, max_new_tokens=10).new_tokens
    sampled = generate(model, prompts, max_new_tokens=10, temperature=1.0, seed=3).new_tokens
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, sampled)
    ranks_bytes = [None] * dist.get_world_size()
    dist.all_gather_object(ranks_bytes, resident_bytes(model))
    return {
        "case": f"{name}/{quant or 'fp32'}",
        "max_diff": (out - ref).abs().max().item(),
        "scale": ref.abs().max().item(),
        "greedy_equal": greedy == ref_greedy,
        "sampled_equal": sampled == ref_sampled,
        "ranks_agree": all(r == sampled for r in ranks),
        "bytes_fraction": resident_bytes(model) / whole,
        "whole_grads": len(grads),
        "indexer_training": refused,
        "inspected_bytes": inspected(model.cfg) if quant is None else [],
        "resident_bytes": ranks_bytes,
        "grad_diff": grad_diff,
    }


def main() -> None:
    run(lambda: [case(name, quant) for name, quant in CASES])


if __name__ == "__main__":
    main()
