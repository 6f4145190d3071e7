"""GGUF block types held as stored (llmkit.quant.blocks, BlockLinear, cpu_blocks.cpp) against the `gguf` package:

- the PyTorch dequantization of every type equals the package's reference dequantization bit for bit;
- every C++ kernel (AVX2, and AVX512-VNNI where the CPU has it) computes, at 1, 2, 7 and 16 rows, the product of
  the reference-dequantized weights with x rounded to int8 per group (32 inputs, 256 for the K-quants; F16 and BF16
  take x as it is) within the fp32 summation's bound, and gives every row the bits it gets alone;
- many rows (a prompt): the integer panels (AVX512-VNNI) compute the same product within the same bound, a row's
  and a column's bits the same whatever rows and columns are computed with them; the dequantized panels equal
  torch's product of the dequantized weights;
- quantizing to the 32-weight types (and rounding to F16 and BF16) gives the package's own bytes;
- a BlockLinear layer saves, loads, casts and multiplies like nn.Linear.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks

from llmkit.errors import InputError
from llmkit.machine.cpu import cpu_features
from llmkit.quant import KernelChoice, kernel_choice_set, native
from llmkit.quant.block_linear import BlockLinear
from llmkit.quant.blocks import FLOAT_TYPES, TYPES, dequantize, quantize_blocks

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
ALL = sorted(TYPES)
needs_native = pytest.mark.skipif(not native.available(), reason="llmkit's C++ kernels do not run here")


def _raw(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(kind, rows, cols, seed))


def _reference(kind: str, raw: torch.Tensor, cols: int) -> torch.Tensor:
    data = raw.numpy().view(np.float16) if kind == "F16" else raw.numpy()  # (the package takes F16 as values)
    return torch.from_numpy(gguf.quants.dequantize(data, Q[kind]).astype(np.float32)).reshape(-1, cols)


def _width(kind: str) -> int:
    """A row width with a tail: 2 groups of 8 blocks and 2 blocks more, or 3 super-blocks."""
    return 576 if TYPES[kind].weights == 32 else 768


@pytest.mark.parametrize("kind", ALL)
def test_dequantization_equals_the_gguf_package(kind):
    cols = _width(kind)
    raw = _raw(kind, 5, cols)
    assert torch.equal(dequantize(raw, kind, cols), _reference(kind, raw, cols))


def _rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded as the kernels round it: int8 codes round(x / d) per `group` inputs, d = max |x| / 127."""
    g = x.reshape(x.shape[0], -1, group)
    d = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(g * inv).clamp(-127, 127) * d).reshape(x.shape)


def _kernels() -> list[str]:
    ext = native.module()
    return ["avx2"] + (["auto"] if ext is not None and ext.cpu_has_avx512_vnni() else [])


@needs_native
@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_kernels_multiply_the_blocks_exactly_and_row_by_row(kind, rows):
    cols, t = _width(kind), TYPES[kind]
    raw = _raw(kind, 37, cols, seed=rows)
    w = _reference(kind, raw, cols).double()
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    xr = (x if kind in FLOAT_TYPES else _rounded(x, 256 if t.weights == 256 else 32)).double()  # floats: x as is
    want = xr @ w.T
    bound = cols / 8 * 2.0**-24 * (xr.abs() @ w.abs().T)  # fp32 sums of at most cols / 8 terms, each within u
    ext = native.module()
    for kernel in _kernels():
        with native.integer_kernel_set(kernel):
            y = ext.block_linear(x, raw, t.ggml, 1000)
            assert ((y.double() - want).abs() <= bound + 1e-30).all(), (kernel, (y.double() - want).abs().max())
            for m in range(rows):
                alone = ext.block_linear(x[m : m + 1].contiguous(), raw, t.ggml, 1000)
                assert torch.equal(alone[0], y[m]), (kernel, m)


@needs_native
@pytest.mark.parametrize("kind", ALL)
def test_a_column_s_bits_do_not_depend_on_the_columns_computed_with_it(kind):
    """Kernels take several columns at a time (Q4_K four, one to a register lane; the last group of a range padded):
    any run of columns, starting anywhere, gives each column the bits it has in the whole product."""
    cols, t = _width(kind), TYPES[kind]
    held = _raw(kind, 37, cols, seed=3)
    ext = native.module()
    for rows in (1, 5):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        for kernel in _kernels():
            with native.integer_kernel_set(kernel):
                whole = ext.block_linear(x, held, t.ggml, 1000)
                for a, b in [(0, 1), (1, 6), (2, 5), (3, 37), (33, 37), (36, 37)]:
                    part = ext.block_linear(x, held[a:b].contiguous(), t.ggml, 1000)
                    assert torch.equal(part, whole[:, a:b]), (kernel, rows, a, b)


needs_vnni = pytest.mark.skipif(
    not native.available() or not native.module().cpu_has_avx512_vnni(), reason="the integer panels need AVX512-VNNI"
)
QUANTIZED = [kind for kind in ALL if kind not in FLOAT_TYPES]


@needs_vnni
@pytest.mark.parametrize("kind", QUANTIZED)
def test_integer_panels_multiply_the_blocks_exactly_and_row_by_row(kind):
    """A prompt's product on VNNI: each panel of 32 columns unpacked once, then every row in integers. 45 columns (a
    panel and a part of one), 40 rows (tiles of 4 and a tail): within the fp32 sums' bound of the product of the
    reference-dequantized weights and x rounded per group; a row alone, any run of rows and any run of columns give
    the bits they have in the whole product."""
    cols, t = _width(kind), TYPES[kind]
    raw = _raw(kind, 45, cols, seed=5)
    w = _reference(kind, raw, cols).double()
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(5))
    xr = _rounded(x, 256 if t.weights == 256 else 32).double()
    want = xr @ w.T
    bound = cols / 8 * 2.0**-24 * (xr.abs() @ w.abs().T)
    ext = native.module()
    y = ext.block_linear(x, raw, t.ggml, 32, False, True)
    assert ((y.double() - want).abs() <= bound + 1e-30).all(), (y.double() - want).abs().max()
    for m in (0, 3, 39):
        assert torch.equal(ext.block_linear(x[m : m + 1].contiguous(), raw, t.ggml, 1, False, True)[0], y[m]), m
    assert torch.equal(ext.block_linear(x[3:38].contiguous(), raw, t.ggml, 32, False, True), y[3:38])
    for a, b in [(0, 1), (1, 33), (31, 45), (44, 45)]:
        assert torch.equal(ext.block_linear(x, raw[a:b].contiguous(), t.ggml, 32, False, True), y[:, a:b]), (a, b)


@needs_native
def test_the_prefill_dtype_picks_the_many_row_product():
    """ "int8" multiplies a block layer's many rows in integer panels where the integer kernel is VNNI (else as
    "auto" would), "fp32" in fp32 panels; "auto" takes the integer panels on a CPU with VNNI and without AMX."""
    cols, t = _width("Q4_K"), TYPES["Q4_K"]
    raw = _raw("Q4_K", 40, cols)
    layer = BlockLinear(cols, 40, bias=False, block="Q4_K")
    layer.blocks.copy_(raw)
    layer.prepare()
    x = torch.randn(64, cols)
    ext = native.module()
    int8, fp32 = KernelChoice("int8"), KernelChoice("fp32")
    with kernel_choice_set(layer, int8):
        integer = ext.cpu_has_avx512_vnni()
        assert torch.equal(layer(x), ext.block_linear(x, raw, t.ggml, 32, int8.bf16_panels, integer))
    with kernel_choice_set(layer, fp32):
        assert not fp32.integer_panels
        assert torch.equal(layer(x), ext.block_linear(x, raw, t.ggml, fp32.integer_rows + 1, False, False))
    features = cpu_features()
    assert KernelChoice("auto").integer_panels == (features.avx512_vnni and not features.amx)
    with pytest.raises(InputError, match="not one of"):
        KernelChoice("int4")


@needs_native
@pytest.mark.parametrize("kind", list(TYPES))
def test_many_rows_multiply_the_dequantized_panels(kind):
    """A prompt's product: the weights dequantized in panels, fp32 or rounded to bf16 in registers (nearest even, as
    torch rounds), then torch's product: the same bits as torch's product of the dequantized weights."""
    cols, t = _width(kind), TYPES[kind]
    raw = _raw(kind, 40, cols)
    w = _reference(kind, raw, cols)
    x = torch.randn(64, cols)
    ext = native.module()
    fp32 = ext.block_linear(x, raw, t.ggml, 32, False)
    torch.testing.assert_close(fp32, x @ w.T, rtol=1e-5, atol=1e-5 * float((x @ w.T).abs().max()))
    bf16 = ext.block_linear(x, raw, t.ggml, 32, True)
    ours = ext.block_dequantize(raw, t.ggml, cols)
    assert torch.equal(bf16, (x.bfloat16() @ ours.bfloat16().T).float())
    want = (x.bfloat16() @ w.bfloat16().T).float()
    torch.testing.assert_close(bf16, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_quantizing_gives_the_gguf_package_s_bytes(kind):
    w = np.random.default_rng(1).normal(0, 0.02, (9, 576)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block
    w[1, 32:64] = 0.01  # a block of equal values
    w[2, :4] = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 65504.0, 1e-8]  # halves to even (bf16), fp16's largest, a subnormal
    ours = quantize_blocks(torch.from_numpy(w), kind)
    assert np.array_equal(ours.numpy(), gguf.quants.quantize(w, Q[kind]).view(np.uint8))


def test_quantizing_to_an_unknown_type_is_a_clear_error():
    with pytest.raises(InputError, match="unknown block type 'Q7_K'; llmkit holds Q4_0, "):
        quantize_blocks(torch.randn(4, 256), "Q7_K")


def test_a_width_that_is_not_whole_blocks_is_refused():
    with pytest.raises(InputError, match="blocks of 256"):
        BlockLinear(300, 4, block="Q4_K")
    with pytest.raises(InputError, match="unknown block type"):
        BlockLinear(256, 4, block="Q7_K")


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_a_block_layer_saves_loads_and_multiplies_like_a_linear_one(kind):
    cols = _width(kind)
    layer = BlockLinear(cols, 6, bias=True, block=kind)
    layer.blocks.copy_(_raw(kind, 6, cols))
    layer.bias.data.normal_()
    copy = BlockLinear(cols, 6, bias=True, block=kind)
    copy.load_state_dict(layer.state_dict())
    assert set(layer.state_dict()) == {"blocks", "bias"}
    x = torch.randn(3, cols)
    w = dequantize(layer.blocks, kind, cols)
    want = F.linear(x, w, layer.bias).detach()
    if copy.resolved == "avx2":  # the C++ kernels round x to int8 per group
        rounded = F.linear(_rounded(x, 256 if TYPES[kind].weights == 256 else 32), w, layer.bias).detach()
        torch.testing.assert_close(copy(x), rounded, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    exact = BlockLinear(cols, 6, bias=True, block=kind, kernel="dequant")
    exact.load_state_dict(layer.state_dict())
    assert torch.equal(exact(x), want)
    assert exact.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16
    x.requires_grad_(True)  # QLoRA: a gradient flows through the frozen blocks
    copy(x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, w.sum(0).expand_as(x))
    assert copy.blocks.grad is None


@pytest.mark.parametrize("method", ["Q8_0", "Q4_0"])
def test_a_model_quantized_to_a_block_type_saves_and_loads_with_the_same_logits(tmp_path, method):
    """quantize(model, "Q8_0") swaps the linear layers for BlockLinear ones (llama.cpp's rules); an llmkit checkpoint
    keeps their blocks in the file's layout and loads back into the same model, grouped again where the kernels run."""
    from llmkit import build_model, get_preset
    from llmkit.interop.checkpoint import load_llmkit, save_llmkit
    from llmkit.quant import describe, quantize

    torch.manual_seed(0)
    model = quantize(build_model(get_preset("llama2-7b-tiny")).eval(), method, include_head=True)
    assert all(isinstance(m, BlockLinear) for n, m in model.named_modules() if n.endswith(("wq", "w2", "head")))
    assert f"{method}:" in describe(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(tokens)
    path = save_llmkit(model, tmp_path / "ckpt")
    loaded = load_llmkit(path).model.eval()
    layer = loaded.blocks[0].attn.wq
    assert torch.equal(layer.state_dict()["blocks"], model.blocks[0].attn.wq.state_dict()["blocks"])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), want)
