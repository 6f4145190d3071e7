"""Weight quantization: the formats round-trip within half a step, every kernel equals the dequantized reference
within its precision, every tiny preset quantizes and decodes with its cache exactly as its own uncached forward,
and a quantized checkpoint saves and loads to identical outputs."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llmkit import build_model, get_preset
from llmkit.config.presets import PRESETS
from llmkit.errors import InputError
from llmkit.generate import generate
from llmkit.interop.checkpoint import load_llmkit, save_llmkit
from llmkit.interop.weights import materialize_buffers
from llmkit.layers.moe import GroupedExperts
from llmkit.models import DecoderLM, EncoderDecoder
from llmkit.quant import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    KernelChoice,
    QuantizedExperts,
    apply_spec,
    describe,
    kernel_choice_set,
    native,
    parameter_count,
    quantize,
    weight_bytes,
)
from llmkit.quant.embedding import QuantizedEmbedding
from llmkit.quant.formats import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

TINY = [n for n in PRESETS if n.endswith("-tiny")]


def tiny(name: str) -> torch.nn.Module:
    cfg = get_preset(name)
    if cfg.moe is not None:  # route every token: capacity limits couple tokens across a batch
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=None))
    torch.manual_seed(0)
    return build_model(cfg).eval()


# ---- formats


@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_trip_is_within_half_a_step(group):
    w = torch.randn(48, 128) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different ranges
    q, s = quantize_int8(w, group)
    assert q.dtype == torch.int8 and s.shape == (48, 1 if group is None else 128 // group)
    err = (dequantize_int8(q, s) - w).abs().reshape(48, s.shape[1], -1)
    assert (err <= s[..., None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step(group):
    w = torch.randn(40, 256)
    packed, s, z = quantize_int4(w, group)
    assert packed.shape == (40, 128) and packed.dtype == torch.uint8
    err = (dequantize_int4(packed, s, z) - w).abs().reshape(40, 256 // group, -1)
    assert (err <= s[..., None] / 2 + 1e-6).all()
    # the ends of each group's range are represented exactly (up to rounding of the arithmetic)
    deq = dequantize_int4(packed, s, z).reshape(40, 256 // group, -1)
    g = w.reshape(40, 256 // group, -1)
    torch.testing.assert_close(deq.amin(-1), g.amin(-1))


@pytest.mark.parametrize("group", [None, 32])
def test_fp8_round_trip_is_each_weight_rounded_to_the_nearest_e4m3_number(group):
    """Each group's largest magnitude maps to 448; every weight is the nearest E4M3 number times its scale (within
    half a step: 2^-4 of its magnitude for normal numbers), and the codes are float8_e4m3fn's bytes."""
    w = torch.randn(48, 128) * torch.logspace(-2, 1, 48)[:, None]
    q, s = quantize_fp8(w, group)
    assert q.dtype == torch.uint8 and s.shape == (48, 1 if group is None else 128 // group)
    deq = dequantize_fp8(q, s).reshape(48, s.shape[1], -1)
    g = w.reshape(48, s.shape[1], -1)
    assert torch.equal(deq.abs().amax(-1), 448 * s)  # the largest magnitude is 448 times the scale
    err = (deq - g).abs()
    assert (err <= g.abs() / 16 + s[..., None] * 2**-10).all()  # half a step (normal) or of a subnormal step
    assert torch.equal(
        q.view(torch.float8_e4m3fn).float(),
        (w.reshape(48, s.shape[1], -1) / s[..., None]).reshape(48, 128).to(torch.float8_e4m3fn).float(),
    )


def test_fp8_layers_keep_their_codes_when_the_model_is_cast():
    """The codes are uint8 bytes: model.to(torch.bfloat16) casts the bias and the compute dtype, not them."""
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32, bias=True))
    codes = layer.qweight.clone()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.qweight, codes) and layer.scales.dtype == torch.float32
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize(torch.bfloat16), layer.bias))
    with pytest.raises(InputError, match="fp8 layers run"):
        Fp8Linear(64, 32, kernel="avx2")


def test_int4_packing_is_invertible_and_low_nibble_first():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert pack_int4(torch.tensor([[3, 12]])).item() == 3 | (12 << 4)


# ---- kernels against the dequantized reference


@pytest.mark.parametrize(
    ("cls", "kernel", "tol"),
    [
        (Int8Linear, "dequant", 0.0),
        (Int8Linear, "int8-wo", 1e-5),  # torch's weight-only kernel: same products, another summation order
        (Int4Linear, "dequant", 0.0),
        (Int4Linear, "int4-wo", 1e-5),
        (Int8Linear, "int8-dyn", 0.05),  # activations rounded to 7 bits per call: ~1-2% of the output's range
        (Int8Linear, "avx2", 0.02),  # activations rounded to int8 per block of 32: ~0.5% of the range
        (Int4Linear, "avx2", 0.03),  # the same, ~1% of the range
    ],
)
def test_every_kernel_equals_the_dequantized_reference(cls, kernel, tol):
    if kernel == "avx2" and not native.available():
        pytest.skip("llmkit's AVX2 kernels are not built on this machine")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    layer = cls.from_linear(linear, kernel=kernel)
    x = torch.randn(3, 5, 256)
    reference = F.linear(x, layer.dequantize(), linear.bias)
    out = layer(x)
    assert out.shape == reference.shape
    scale = reference.abs().max()
    assert (out - reference).abs().max() <= tol * scale + 1e-6


def test_the_built_kernels_keep_their_weight_prefetches():
    """The decode kernels ask for weight rows ahead of use (cpu_kernel.cpp, prefetch_row). GCC 12 once deleted the
    int4 ones without a word (a function made only of prefetches looked free of effects), which cost ~1.3x at batch 1;
    the disassembly must hold the int4 row's three streams and the int8 row's two, and the block kernels' requests into
    L2 (prefetcht1: the 32-weight GGUF types)."""
    import shutil
    import subprocess

    if not native.available():
        pytest.skip("llmkit's AVX2 kernels are not built on this machine")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    path = native.module().__file__
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True, check=True)
    assert listing.stdout.count("prefetcht0") >= 5
    assert listing.stdout.count("prefetcht1") >= 1


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize(("rows", "width", "outputs"), [(96, 256, 96), (100, 64, (1 << 16) + 40)])
def test_avx2_many_rows_dequantize_in_panels_and_are_exact(cls, rows, width, outputs):
    """With the fp32 prefill, from 96 rows on the AVX2 products dequantize W (in panels of 2^22 weights: the second
    case spans two) and multiply in fp32, so they equal the dequantized reference up to fp32 summation order."""
    if not native.available():
        pytest.skip("llmkit's AVX2 kernels are not built on this machine")
    torch.manual_seed(0)
    layer = cls.from_linear(torch.nn.Linear(width, outputs, bias=False), kernel="avx2")
    x = torch.randn(rows, width)
    reference = x @ layer.dequantize().t()
    with kernel_choice_set(layer, KernelChoice("fp32")):
        out = layer(x)
        few = layer(x[:95])  # below the threshold: activations rounded to int8, ~1% of the range
    assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert (few - reference[:95]).abs().max() > 1e-4 * reference.abs().max()


def test_weight_reads_back_the_dequantized_matrix_in_the_compute_dtype():
    layer = Int4Linear.from_linear(torch.nn.Linear(64, 32))
    assert layer.weight.dtype == torch.float32
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and layer.scales.dtype == torch.float32
    assert layer.qweight.dtype == torch.uint8


# ---- models


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("name", TINY)
def test_every_tiny_preset_quantizes_and_its_cache_matches_its_uncached_forward(name, method):
    model = tiny(name)
    float_bytes = weight_bytes(model)
    n_params = parameter_count(model)
    quantize(model, method, group_size=16 if method == "int4" else None)
    left = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "head"]
    assert not left, f"every linear layer but the head is quantized, not {left}"
    if model.cfg.moe is not None:
        assert any(isinstance(m, QuantizedExperts) for m in model.modules())
    assert weight_bytes(model) < float_bytes and parameter_count(model) == n_params
    torch.manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6))
    if isinstance(model, EncoderDecoder):
        with torch.no_grad():
            assert torch.isfinite(model(tokens, tokens)).all()
        return
    assert isinstance(model, DecoderLM)
    out = generate(model, tokens, max_new_tokens=5).tokens
    seq = tokens
    with torch.no_grad():
        for _ in range(5):  # greedy by recomputing the whole sequence each step, no cache
            seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize(
    ("name", "method", "group", "head"),
    [
        ("llama2-7b-tiny", "int8", None, True),
        ("gpt2-tiny", "int4", 32, True),
        ("mixtral-8x7b-tiny", "int4", 16, False),
        ("llama2-70b-tiny", "fp8", 32, True),
        ("mixtral-8x7b-tiny", "fp8", None, False),
    ],
)
def test_quantize_save_load_gives_identical_outputs(tmp_path, name, method, group, head):
    model = quantize(tiny(name), method, group_size=group, include_head=head)
    save_llmkit(model, tmp_path / "q")
    loaded = load_llmkit(tmp_path / "q").model.eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded(tokens))
    assert describe(loaded) == describe(model)
    with torch.no_grad():  # and in bf16 when asked
        bf16 = load_llmkit(tmp_path / "q", dtype=torch.bfloat16).model.eval()
        assert bf16(tokens).dtype == torch.bfloat16


def test_a_tied_head_is_quantized_from_the_embedding():
    model = tiny("gpt2-tiny")
    assert model.cfg.tie_embeddings and model.head is None
    reference = copy.deepcopy(model)
    quantize(model, "int8", include_head=True)
    assert isinstance(model.head, Int8Linear)
    assert torch.equal(model.embed.weight, reference.embed.weight), "the embedding lookup stays in float"
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 7))
    with torch.no_grad():
        a, b = model(tokens), reference(tokens)
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_an_embedding_read_from_the_quantized_head_saves_and_loads_without_a_float_table(tmp_path, method):
    """QuantSpec.embedding_from_head (a GGUF file's tied table): the embedding's rows are the head's dequantized
    rows, its table is not held twice, and a checkpoint saves the codes once and loads the same structure."""
    model = tiny("llama2-7b-tiny")
    model.head = None  # tie it
    model.cfg = dataclasses.replace(model.cfg, tie_embeddings=True)
    quantize(model, method, include_head=True)
    spec = dataclasses.replace(model.quantization, embedding_from_head=True)
    state = {k: v for k, v in model.state_dict().items() if k != "embed.weight"}
    rebuilt = apply_spec(build_model(model.cfg, device="meta"), spec)
    rebuilt.load_state_dict(state, assign=True)
    materialize_buffers(rebuilt, torch.device("cpu"))  # as a loader does
    rebuilt.to(torch.float32).eval()
    assert isinstance(rebuilt.embed, QuantizedEmbedding) and "embed.weight" not in rebuilt.state_dict()
    assert weight_bytes(rebuilt) < weight_bytes(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 7))
    table = rebuilt.head.dequantize()
    assert torch.equal(rebuilt.embed(tokens), table[tokens])
    assert torch.equal(rebuilt.embed.weight, table) and rebuilt.device.type == "cpu"
    assert rebuilt.dtype == torch.float32
    save_llmkit(rebuilt, tmp_path / "q")
    loaded = load_llmkit(tmp_path / "q").model.eval()
    assert isinstance(loaded.embed, QuantizedEmbedding) and loaded.embed.source is loaded.head
    with torch.no_grad():
        assert torch.equal(loaded(tokens), rebuilt(tokens))
        assert loaded.to(torch.bfloat16).embed(tokens).dtype == torch.bfloat16
    with pytest.raises(InputError, match="needs include_head"):
        dataclasses.replace(spec, include_head=False)
    with pytest.raises(InputError, match="needs a tied model"):
        apply_spec(tiny("llama2-7b-tiny"), spec)


def test_bad_requests_are_clear_errors():
    model = tiny("llama2-7b-tiny")
    with pytest.raises(InputError, match="does not divide"):
        quantize(copy.deepcopy(model), "int4", group_size=128)  # widths are 64
    with pytest.raises(InputError, match="even"):
        quantize(copy.deepcopy(model), "int4", group_size=3)
    with pytest.raises(InputError, match="method"):
        quantize(copy.deepcopy(model), "int3")  # type: ignore[arg-type]
    quantize(model, "int8")
    with pytest.raises(InputError, match="already quantized"):
        quantize(model, "int4")
    with pytest.raises(InputError, match="kernel"):
        Int8Linear(8, 8, kernel="fast")  # type: ignore[arg-type]


def test_the_quantize_command_writes_a_checkpoint_every_command_loads(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    from helpers import tiny_tokenizer

    from llmkit.cli import main

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320))
    save_llmkit(model, tmp_path / "float", tokenizer=tiny_tokenizer())
    assert main(["quantize", str(tmp_path / "float"), str(tmp_path / "q4"), "--to", "int4", "--group-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "int4 g32: 14 layers" in out, out  # 2 blocks x (q, k, v, o, gate, up, down); the head stays float
    loaded = load_llmkit(tmp_path / "q4").model
    assert isinstance(loaded.blocks[0].attn.wq, Int4Linear)
    argv = ["generate", str(tmp_path / "q4"), "--prompt", "to be", "--max-new-tokens", "6", "--temperature", "0"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("to be") and "int4 g32" in captured.err
    assert main(["quantize", str(tmp_path / "q4"), str(tmp_path / "again"), "--to", "int8"]) != 0
    assert "already quantized" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "q4"), "--json"]) == 0  # inspect reads checkpoints, bytes as loaded
    report = __import__("json").loads(capsys.readouterr().out)
    assert report["quantization"]["method"] == "int4" and report["weight_bytes_loaded"] == weight_bytes(loaded)
    assert main(["quantize", str(tmp_path / "float"), str(tmp_path / "fp8"), "--to", "fp8"]) == 0
    assert "fp8: 14 layers" in capsys.readouterr().out
    assert isinstance(load_llmkit(tmp_path / "fp8").model.blocks[1].attn.wo, Fp8Linear)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_experts_read_only_their_own_rows_of_the_stacks(method, monkeypatch):
    """Each expert that received rows multiplies them by its own rows of the stacked codes: the whole stacks are never
    dequantized, and the output is the float experts' on the dequantized weights (within the kernel's rounding of the
    activations; exact up to fp32 when x needs a gradient, which takes those rows dequantized, and passes it)."""
    torch.manual_seed(0)
    q = QuantizedExperts.from_experts(GroupedExperts(8, 64, 32, "swiglu", "silu"), method, 32)
    ref = GroupedExperts(8, 64, 32, "swiglu", "silu")
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(ref, name).copy_(getattr(q, name))
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 2, 4])
    x = torch.randn(int(counts.sum()), 64)
    with torch.no_grad():
        expected = ref._one_by_one(x, counts)

    def refuse(self):
        raise AssertionError("a whole expert stack was dequantized")

    for name in ("w1", "w2", "w3"):
        monkeypatch.setattr(QuantizedExperts, name, property(refuse))
    with torch.no_grad():
        fast = q(x, counts)
    assert (fast - expected).abs().max() <= 0.02 * expected.abs().max()
    xg = x.clone().requires_grad_(True)
    exact = q(xg, counts)
    torch.testing.assert_close(exact, expected, atol=1e-5, rtol=1e-5)
    exact.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    q.kernel = "dequant"  # asked for (quantize(..., kernel="dequant")): the dequantized rows, without a gradient too
    with torch.no_grad():
        torch.testing.assert_close(q(x, counts), expected, atol=1e-5, rtol=1e-5)


def test_quantize_with_the_dequant_kernel_makes_exact_experts():
    model = build_model(get_preset("mixtral-8x7b-tiny"))
    quantize(model, "int8", kernel="dequant")
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    assert experts and all(m.kernel == "dequant" for m in experts)
    with pytest.raises(InputError, match="auto"):
        QuantizedExperts(GroupedExperts(2, 8, 4, "swiglu", "silu"), "int8", None, None, kernel="avx2")


def test_the_native_extension_is_rebuilt_when_a_header_changes(tmp_path, monkeypatch):
    """torch's extension cache watches the listed sources only: the build name carries a digest of the headers too."""
    from llmkit.quant import native

    header = tmp_path / "h.h"
    header.write_text("// one\n")
    monkeypatch.setattr(native, "HEADERS", [header])
    before = native.build_name()
    assert before == native.build_name() and before.startswith("llmkit_quant_cpu_")
    header.write_text("// two\n")
    assert native.build_name() != before


def test_two_environments_of_the_same_sources_get_builds_of_their_own(monkeypatch):
    """Two virtual environments sharing torch's extension cache rebuilt the one folder in turn (torch's own check
    counts their include paths): the name carries the Python and torch it is built for, and the flags."""
    from llmkit.quant import native

    before = native.build_name()
    for name, value in (("prefix", "/elsewhere/.venv"), ("version", "3.12.1 (other)")):
        with monkeypatch.context() as m:
            m.setattr(sys, name, value)
            assert native.build_name() != before, name
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "2.99.0")
        assert native.build_name() != before
    with monkeypatch.context() as m:
        m.setattr(native, "CFLAGS", (*native.CFLAGS, "-DOTHER"))
        assert native.build_name() != before
    native.module()  # (loading does not change the name: torch's load appends to the flag lists it is given)
    assert native.build_name() == before


def test_a_stale_lock_waits_for_the_build_its_killed_process_left_running(tmp_path, capsys):
    """A killed build's ninja kept compiling while the next process removed the lock and started a second build in
    the same folder: while a process works in the build folder, the lock stays and the next build waits."""
    import threading

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=tmp_path, stdin=subprocess.PIPE
    )
    try:
        assert child.pid in native.builders(tmp_path)  # a ninja left running, for this test
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (native.wait_for_builders(tmp_path, poll=0.05), done.set()))
        waiter.start()
        assert not done.wait(0.5)  # (a bound on how long the test looks, not a race: it waits until the child ends)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(60)
    waiter.join(60)
    assert done.is_set() and "waiting for a build an interrupted process left running" in capsys.readouterr().err
    assert native.builders(tmp_path) == []


def test_the_first_build_of_the_kernels_is_announced(tmp_path, monkeypatch, capsys):
    """`llmkit generate` once sat ~45 s without a word while the kernels compiled: a build that is due is said on
    stderr, and a cached one is not."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native.announce_build("llmkit_test_ext") is True
    assert "compiling the native CPU kernels" in capsys.readouterr().err
    (tmp_path / "llmkit_test_ext" / "llmkit_test_ext.so").write_bytes(b"")  # what a finished build leaves
    assert native.announce_build("llmkit_test_ext") is False
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(not native.available(), reason="needs llmkit's AVX2 kernels")
def test_a_lock_left_by_an_interrupted_build_does_not_hang_the_next_command():
    """An interrupted first build (Ctrl-C, a killed job) left torch's lock file behind, and every later command
    waited for it forever. With the kernels built, such a file is found stale and the next process loads them."""
    name = native.build_name()
    directory = native._build_directory(name)
    assert directory is not None
    (directory / "lock").write_text("")  # what a killed build leaves
    code = "from llmkit.quant import native; assert native.module() is not None"
    # the timeout bounds a hung run only (loading takes seconds); before the fix the child waited forever
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    # the child removed it (and said so), unless another process loading the kernels meanwhile (a pytest-xdist
    # worker, another command sharing torch's extension cache) took the build lock and removed it first
    assert not (directory / "lock").exists(), done.stderr
