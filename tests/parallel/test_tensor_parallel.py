"""Tensor parallelism: every decoder family (dense MHA/GQA/MQA, latent attention, sparse attention, mixtures of
experts) split across 2 processes (torchrun, gloo on 127.0.0.1) computes the logits of the same model in one
process, generates the same tokens (greedy and seeded sampling), gives the parameters every rank holds whole the
same gradients, and holds about half the weights on each rank; the checks that refuse a split say which sizes would
work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

from llmkit import InputError, build_model, get_preset
from llmkit.parallel import check, split_sizes
from llmkit.quant import quantize

WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("tp") / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(WORKER), str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.read_text())}


FLOAT = ["gpt2-tiny", "llama2-7b-tiny", "llama2-70b-tiny", "gemma-2b-tiny", "gemma2-2b-tiny", "gemma3-1b-tiny",
         "qwen3-0.6b-tiny", "mixtral-8x7b-tiny", "qwen1.5-moe-a2.7b-tiny", "deepseek-v2-lite-tiny", "deepseek-v3-tiny",
         "deepseek-v3.2-tiny"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [f"{n}/fp32" for n in FLOAT] + ["llama2-7b-tiny/int4/dequant", "mixtral-8x7b-tiny/int8/dequant"]
)
def test_split_model_computes_the_same_logits_and_tokens(results, case):
    r = results[case]
    assert r["max_diff"] <= 1e-5 * max(1.0, r["scale"])  # fp32 sums in another order, nothing else
    assert r["greedy_equal"] and r["sampled_equal"] and r["ranks_agree"]
    assert r["bytes_fraction"] <= 0.6  # the replicated norms, biases and learned positions on top of half


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{n}/fp32" for n in FLOAT])
def test_split_model_gives_whole_parameters_the_same_gradients(results, case):
    # norms, q/k norms, routers, MLA's latent projections, a key/value head shared by ranks: every rank holds them
    # whole, each rank's part of the computation gives one term of their gradient, and the sum must be the same
    r = results[case]
    assert r["inspected_bytes"] == r["resident_bytes"]  # `inspect --tp`'s count is each rank's measured bytes
    assert r["whole_grads"] >= 5
    assert r["grad_diff"] <= 1e-5  # relative to each gradient's largest entry


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama2-7b-tiny/int8", "llama2-7b-tiny/int4"])
def test_split_quantized_model_stays_close(results, case):
    # the integer kernels quantize each row of activations with a scale of its own, and a row-parallel layer's
    # rank sees half a row (its own heads or hidden units): codes differ in the last step, not the weights
    r = results[case]
    assert r["max_diff"] <= 2e-2 * r["scale"]
    assert r["greedy_equal"] and r["ranks_agree"]
    assert r["bytes_fraction"] <= 0.55


@pytest.mark.slow
def test_sparse_attention_indexer_training_is_refused_when_split(results):
    # its loss compares the indexer with the main attention summed over every head, and each rank has half of them
    assert "indexer does not train split across ranks" in results["deepseek-v3.2-tiny/fp32"]["indexer_training"]


def test_sizes_that_split_each_family():
    assert split_sizes(build_model(get_preset("llama2-7b-tiny")), most=8) == [1, 2, 4]  # 4 heads
    assert split_sizes(build_model(get_preset("llama2-70b-tiny")), most=8) == [1, 2, 4, 8]  # 8 heads, 1 kv head
    assert split_sizes(build_model(get_preset("gemma3-1b-tiny")), most=8) == [1, 2, 4, 8]  # kv 2: divides or multiple


def test_a_size_that_does_not_divide_says_which_would():
    with pytest.raises(InputError, match=r"3 ways: .*4 query heads.*sizes that would: 1, 2, 4"):
        check(build_model(get_preset("llama2-7b-tiny")), 3)


def test_quantized_groups_must_not_be_cut():
    model = quantize(build_model(get_preset("llama2-7b-tiny")), "int4")  # hidden 96: halves of 48 inputs
    with pytest.raises(InputError, match="groups of 32"):
        check(model, 2)


def test_mixtures_split_by_experts_and_latent_attention_by_heads():
    assert split_sizes(build_model(get_preset("mixtral-8x7b-tiny")), most=16) == [1, 2, 4, 8]  # 8 heads, 8 experts
    v3 = build_model(get_preset("deepseek-v3-tiny"))  # 4 heads, 16 experts, shared expert of 32 hidden units
    assert split_sizes(v3, most=16) == [1, 2, 4]
    with pytest.raises(InputError, match=r"3 ways: blocks.0.attn has 4 heads.*sizes that would: 1, 2, 4"):
        check(v3, 3)
    with pytest.raises(InputError, match=r"blocks.1.ffn has 16 experts.*sizes that would: 1, 2, 4, 8, 16$"):
        check(v3, 32, plan={"*.ffn": "ffn"})  # the feed-forwards alone: experts spread up to 16 ways


def _generate(checkpoint: Path, *flags: str, processes: int = 1) -> subprocess.CompletedProcess[str]:
    llmkit = ["-m", "llmkit", "generate", str(checkpoint), "--prompt", "to be", "--max-new-tokens", "12", *flags]
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1",
                "--master_port", str(free_port())]  # fmt: skip
    cmd = [sys.executable, *(launcher if processes > 1 else []), *llmkit]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import dataclasses

    import torch
    from helpers import tiny_tokenizer

    from llmkit.interop.checkpoint import save_llmkit

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-70b-tiny"), vocab_size=300)).eval()
    return save_llmkit(model, tmp_path_factory.mktemp("tp-cli") / "ckpt", tokenizer=tiny_tokenizer())


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--temperature", "0"), ("--seed", "5", "--samples", "2")])
def test_generate_with_tp_prints_what_one_process_prints(checkpoint, flags):
    one = _generate(checkpoint, *flags)
    two = _generate(checkpoint, *flags, "--tp", "2", processes=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and "to be" in one.stdout  # rank 1 prints nothing


@pytest.mark.slow
def test_generate_with_tp_refuses_a_wrong_launch(checkpoint):
    alone = _generate(checkpoint, "--tp", "2")
    assert alone.returncode == 2 and "start it with torchrun --nproc_per_node 2" in alone.stderr
    mismatched = _generate(checkpoint, "--tp", "3", processes=2)
    assert mismatched.returncode != 0 and "--tp 3 but torchrun started 2 processes" in mismatched.stderr
    unsplittable = _generate(checkpoint, "--tp", "2", "--beams", "2", processes=2)
    assert unsplittable.returncode != 0 and "--tp runs plain decoding" in unsplittable.stderr
