"""llmkit's own CPU kernels (cpu_kernel.cpp: int4 and int8 products for AVX2 CPUs, the method of llama.cpp, and
cpu_vnni.cpp: the same products on AVX512-VNNI, chosen at run time where the CPU has it (set_integer_kernel);
cpu_decode.cpp and cpu_moe.cpp: decoder blocks' decode step in one call, dense or mixture-of-experts, which
llmkit.quant.native_step drives; cpu_attention.cpp: a prompt's causal attention on AVX512-BF16 units, which
the layers llmkit.quant quantizes attend with in a prefill), compiled with
torch.utils.cpp_extension on first use and cached by torch (under ~/.cache/torch_extensions, or
$TORCH_EXTENSIONS_DIR).

`module()` is None where they cannot run: a CPU without AVX2 and FMA, no C++ compiler, or LLMKIT_NATIVE=0 in the
environment; the callers then use torch's kernels or dequantize. A failed build is reported once, as a warning.

Builds are serialised by an OS file lock of our own (`build_lock`), which the system releases when its holder
dies: torch's own lock is a plain file, and one left by a build that was interrupted (Ctrl-C, a killed job) made
every later command wait for it forever, without a word.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch

from llmkit.errors import InputError
from llmkit.machine.cpu import CpuFeatures, cpu_features

HERE = Path(__file__).parent
SOURCES = [
    HERE / f
    for f in (
        "cpu_kernel.cpp",
        "cpu_vnni.cpp",
        "cpu_blocks.cpp",
        "cpu_kquants.cpp",
        "cpu_decode.cpp",
        "cpu_moe.cpp",
        "cpu_attention.cpp",
    )
]
HEADERS = [
    HERE / f
    for f in (
        "cpu_kernel.h",
        "cpu_step.h",
        "cpu_blocks.h",
        "cpu_blocks_kernels.inc",
        "cpu_blocks_wide.inc",
        "cpu_blocks_panels.inc",
    )
]


CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def build_name() -> str:
    """The extension's name, with a digest of everything its build depends on: every source and header (torch's
    cache rebuilds an extension when a listed source changes, not a header), the flags, and the Python and torch it
    is built for (torch's own check counts the include paths, so two environments of the same sources, sharing
    torch's cache, each rebuilt the one folder in turn, minutes a switch: each gets a build of its own)."""
    h = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)))
    h.update(repr((CFLAGS, LDFLAGS, sys.version, sys.prefix, torch.__version__, torch.__file__)).encode())
    return f"llmkit_quant_cpu_{h.hexdigest()[:12]}"


@functools.cache
def module() -> Any | None:
    """The compiled kernels, or None (see the module docstring)."""
    if os.environ.get("LLMKIT_NATIVE", "1") == "0" or not cpu_features().avx2:
        return None
    try:
        from torch.utils.cpp_extension import load

        announce_build(build_name())
        with build_lock(build_name()):
            ext = load(
                name=build_name(),
                sources=[str(s) for s in SOURCES],
                extra_cflags=list(CFLAGS),  # (copies: torch appends its own flags to the lists it is given)
                extra_ldflags=list(LDFLAGS),
                verbose=False,
            )
        ext.select_vnni(_environment("LLMKIT_INTEGER_KERNEL", INTEGER_KERNELS) == "auto")
        return ext
    except InputError:
        raise
    except Exception as e:  # no compiler, no ninja, headers missing: the portable kernels still work
        warnings.warn(
            f"llmkit's AVX2 kernels could not be built ({type(e).__name__}: {e}); using torch's", stacklevel=2
        )
        return None


def _build_directory(name: str) -> Path | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # where load() builds and caches `name`
    except ImportError:  # another torch: nothing to say is better than a wrong guess
        return None
    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold the build of `name` for this process (every llmkit process takes this lock before torch's). While it is
    held, a torch lock file in the build directory is one a process left that died while building: once no process
    works in the directory any more (its ninja and compilers outlive it), it is removed, so that torch builds (or
    loads) instead of waiting for it forever."""
    directory = _build_directory(name)
    try:
        import fcntl
    except ImportError:  # not a POSIX system: torch's lock alone
        fcntl = None  # type: ignore[assignment]
    if directory is None or fcntl is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "llmkit.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for a live build; released by the OS if its holder dies
        stale = directory / "lock"
        if stale.exists():
            wait_for_builders(directory)
            print(f"llmkit: removing a lock left by an interrupted build ({stale})", file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        yield


def builders(directory: Path) -> list[int]:
    """The live processes (but this one) working in `directory`, by /proc (Linux): a build's ninja and compiler
    processes run there, and go on after the process that started them is killed. Empty where /proc is not."""
    where, found = os.path.realpath(directory), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) != os.getpid() and os.readlink(entry / "cwd") == where:
                found.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or not ours to look at
            continue
    return found


def wait_for_builders(directory: Path, poll: float = 1.0) -> None:
    """Wait until no process works in `directory` (`builders`), saying so once on stderr."""
    said = False
    while pids := builders(directory):
        if not said:
            print(
                f"llmkit: waiting for a build an interrupted process left running in {directory} (pids "
                f"{', '.join(map(str, pids))})",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(poll)


def announce_build(name: str) -> bool:
    """Say on stderr that the kernels are being compiled, when they are not in torch's cache yet (the first command
    after an install or an upgrade: about a minute on 2 cores, which would otherwise pass without a word).
    Returns whether a build is due."""
    directory = _build_directory(name)
    if directory is None or (directory / f"{name}.so").is_file():
        return False
    print(
        f"llmkit: compiling the native CPU kernels (first use after install, about a minute; cached in {directory})",
        file=sys.stderr,
        flush=True,
    )
    return True


def available() -> bool:
    return module() is not None


# The AVX2 products round x to int8 and multiply in integers below a number of rows, and from it on dequantize W in
# panels (cpu_kernel.cpp): in fp32 from INTEGER_ROWS + 1 rows on, in bf16 from BF16_ROWS on (see KernelChoice).
# A row's result is the same for any number of rows up to KernelChoice.integer_rows.
INTEGER_ROWS = 95
# below BF16_ROWS integer products were faster (Zen 5, int4 576 x 1536: 102 vs 151 us at 16 rows; 236 vs 209 at 32)
BF16_ROWS = 32

PrefillDtype = Literal["auto", "int8", "bf16", "fp32"]
PREFILL_DTYPES: tuple[PrefillDtype, ...] = ("auto", "int8", "bf16", "fp32")
INTEGER_KERNELS = ("auto", "avx2")


def _environment(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name` ("auto" when unset), one of `choices` or an InputError naming it."""
    value = os.environ.get(name, "auto")
    if value not in choices:
        raise InputError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class KernelChoice:
    """How the C++ kernels multiply many rows (a prompt's prefill) of a quantized layer on this CPU: a value each
    quantized layer holds (QuantizedLinear.kernel_choice, given by llmkit.quant.apply.set_kernel_choice), made once per
    process by default (default_choice) from the environment variable LLMKIT_PREFILL_DTYPE and the CPU's features.

    `prefill`: "int8", GGUF block weights in integer panels from BF16_ROWS rows on (x rounded to int8 per group as
    decoding rows are, each panel of 32 columns unpacked once for every row, vpdpbusd: twice vdpbf16ps's products an
    instruction; cpu_blocks_panels.inc) where the integer kernel is AVX512-VNNI, the other weights as "auto" has
    them; "bf16", the dequantized panels from BF16_ROWS rows on (x and W rounded to bf16, fp32 sums, the result
    rounded to bf16; oneDNN runs it on the CPU's bf16 units: ~4x fp32's rate on a Zen 5 EPYC, ~6x with a Xeon's
    AMX); "fp32" from INTEGER_ROWS + 1 rows on (exact up to fp32 rounding); or "auto" (the default): "int8" on a CPU
    with AVX512-VNNI and no AMX, "bf16" on one that multiplies bf16 natively (AMX's tiles beat VNNI's integers),
    "fp32" elsewhere, where bf16 is emulated and slower. Fewer rows (decoding) always multiply in integers."""

    prefill: PrefillDtype = "auto"
    cpu: CpuFeatures = field(default_factory=cpu_features)

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_DTYPES:
            raise InputError(f"prefill dtype {self.prefill!r} is not one of {', '.join(PREFILL_DTYPES)}")

    @functools.cached_property
    def bf16_panels(self) -> bool:
        """Whether many-row products of dequantized panels multiply in bf16."""
        return self.prefill == "bf16" or (self.prefill in ("auto", "int8") and self.cpu.bf16_native)

    @functools.cached_property
    def integer_panels(self) -> bool:
        """Whether many-row products of GGUF block weights may multiply in integer panels (the extension takes them
        where its integer kernel is AVX512-VNNI)."""
        return self.prefill == "int8" or (self.prefill == "auto" and self.cpu.avx512_vnni and not self.cpu.amx)

    @functools.cached_property
    def integer_rows(self) -> int:
        """The most rows a product computes in integers (a row's bits are the same with any number of rows up to
        it)."""
        return BF16_ROWS - 1 if self.bf16_panels else INTEGER_ROWS

    def attention_applies(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether causal_attention takes these queries and values: tensors in CPU memory, a CPU with AVX512-BF16 and
        the extension built, fp32 or bf16, one head dim (a multiple of 16 up to 256) for q, k and v; fp32 ones only
        while many-row products multiply in bf16, whose precision they share."""
        if q.device.type != "cpu" or v.device.type != "cpu":  # a GPU model quantized by llmkit.quant attends with SDPA
            return False
        if q.dtype not in (torch.float32, torch.bfloat16) or v.dtype != q.dtype or not self.cpu.avx512_bf16:
            return False
        D = q.shape[-1]
        if v.shape[-1] != D or D % 16 or D > 256 or (q.dtype == torch.float32 and not self.bf16_panels):
            return False
        return module() is not None


@functools.cache
def default_choice() -> KernelChoice:
    """The process's KernelChoice: LLMKIT_PREFILL_DTYPE ("auto" when unset) on this CPU, read once."""
    return KernelChoice(cast(PrefillDtype, _environment("LLMKIT_PREFILL_DTYPE", PREFILL_DTYPES)), cpu_features())


class PrefillAttention:
    """A quantized model's attention kernel for prompts (llmkit.layers.attention.core.PrefillKernel):
    causal_attention where its KernelChoice takes the queries, else None (torch's attention then runs)."""

    def __init__(self, choice: KernelChoice) -> None:
        self.choice = choice

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float
    ) -> torch.Tensor | None:
        return causal_attention(q, k, v, offset, scale) if self.choice.attention_applies(q, v) else None


def set_integer_kernel(name: str) -> None:
    """Which kernel computes the integer products (fewer than integer_rows + 1 rows: decoding, serving steps,
    speculation's verifying steps): "auto" (the default), AVX512-VNNI where the CPU has it (cpu_vnni.cpp: 16 output
    columns at once, 2.5x the AVX2 kernel's rate at 16 rows on a Zen 5 core), else AVX2; "avx2", the AVX2 kernel
    everywhere. The two give the same integer sums and differ in the last bits of the float ones; each gives a row the
    same bits whatever rows it is computed with. The choice is the extension's own (its dispatch, one per process);
    LLMKIT_INTEGER_KERNEL sets it when the extension loads."""
    if name not in INTEGER_KERNELS:
        raise InputError(f"integer kernel {name!r} is not one of {', '.join(INTEGER_KERNELS)}")
    ext = module()
    if ext is not None:
        ext.select_vnni(name == "auto")


@contextlib.contextmanager
def integer_kernel_set(name: str) -> Iterator[None]:
    """set_integer_kernel(name) inside the `with` block only."""
    ext = module()
    before = ext is None or ext.vnni_selected()
    set_integer_kernel(name)
    try:
        yield
    finally:
        if ext is not None:
            ext.select_vnni(before)


def integer_kernel() -> str | None:
    """The kernel integer products run on: "avx512-vnni", "avx2", or None without the extension."""
    ext = module()
    if ext is None:
        return None
    return "avx512-vnni" if ext.vnni_selected() else "avx2"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """Causal attention of T queries at positions offset .. offset + T - 1 over the keys up to each one's position,
    on the CPU's bf16 dot-product units (cpu_attention.cpp: flash attention's blocked online softmax; q, k, v and the
    softmax weights rounded to bf16, sums and softmax in fp32; a query's result is the same whichever chunk of the
    prompt it comes in). q (H, T, D), k and v (K, S >= offset + T, D), H a multiple of K -> (H, T, D) of q's
    dtype. Only where KernelChoice.attention_applies."""
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return module().causal_attention(q, k, v, offset, scale)  # type: ignore[union-attr]


# Registered as torch operators too (opaque to torch.compile, which then compiles everything around them instead of
# breaking its graph at every layer), with shape-only implementations for tracing. Eager calls go straight to the
# extension: the operator's Python dispatch costs ~50 us a call, more than a small layer's product. The operators
# take the KernelChoice as the numbers the extension reads: the first row count dequantized (`panel_rows`, one more
# than KernelChoice.integer_rows), whether panels multiply in bf16, and whether block panels may be integer ones.


@torch.library.custom_op("llmkit::int4_linear", mutates_args=())
def _int4_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, panel_rows: int, bf16: bool
) -> torch.Tensor:
    return module().int4_linear(x.contiguous(), qweight, scales, zeros, panel_rows, bf16)  # type: ignore[union-attr]


@_int4_op.register_fake
def _(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, panel_rows: int, bf16: bool
) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.custom_op("llmkit::int8_linear", mutates_args=())
def _int8_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, panel_rows: int, bf16: bool) -> torch.Tensor:
    return module().int8_linear(x.contiguous(), qweight, scales, panel_rows, bf16)  # type: ignore[union-attr]


@_int8_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, panel_rows: int, bf16: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, choice: KernelChoice
) -> torch.Tensor:
    """x (M, K) fp32 @ int4 W^T -> (M, N) (dequantized from choice.integer_rows + 1 rows on)."""
    rows, bf16 = choice.integer_rows + 1, choice.bf16_panels
    if torch.compiler.is_compiling():
        return _int4_op(x, qweight, scales, zeros, rows, bf16)
    return module().int4_linear(x.contiguous(), qweight, scales, zeros, rows, bf16)  # type: ignore[union-attr]


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, choice: KernelChoice) -> torch.Tensor:
    """x (M, K) fp32 @ int8 W^T -> (M, N) (dequantized from choice.integer_rows + 1 rows on)."""
    rows, bf16 = choice.integer_rows + 1, choice.bf16_panels
    if torch.compiler.is_compiling():
        return _int8_op(x, qweight, scales, rows, bf16)
    return module().int8_linear(x.contiguous(), qweight, scales, rows, bf16)  # type: ignore[union-attr]


@torch.library.custom_op("llmkit::block_linear", mutates_args=())
def _block_op(
    x: torch.Tensor, blocks: torch.Tensor, kind: int, panel_rows: int, bf16: bool, integer: bool
) -> torch.Tensor:
    return module().block_linear(x.contiguous(), blocks, kind, panel_rows, bf16, integer)  # type: ignore[union-attr]


@_block_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, kind: int, panel_rows: int, bf16: bool, integer: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def block_linear(x: torch.Tensor, blocks: torch.Tensor, kind: int, choice: KernelChoice) -> torch.Tensor:
    """x (M, K) fp32 @ W^T for W held as GGUF blocks of ggml type `kind` (llmkit.quant.blocks) -> (M, N)
    (from choice.integer_rows + 1 rows on in integer or dequantized panels: KernelChoice)."""
    rows, bf16, integer = choice.integer_rows + 1, choice.bf16_panels, choice.integer_panels
    if torch.compiler.is_compiling():
        return _block_op(x, blocks, kind, rows, bf16, integer)
    return module().block_linear(x.contiguous(), blocks, kind, rows, bf16, integer)  # type: ignore[union-attr]
