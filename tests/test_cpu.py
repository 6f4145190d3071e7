"""The CPU's features, read once into a value (llmkit.machine.cpu)."""

from __future__ import annotations

from llmkit.machine.cpu import CpuFeatures, cpu_features, read_flags

XEON = (
    "processor\t: 0\nflags\t\t: fpu avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16\n"
)


def test_flags_are_read_from_the_first_processor():
    flags = read_flags(XEON + "processor\t: 1\nflags\t\t: fpu\n")
    assert "amx_bf16" in flags and "flags" not in flags and ":" not in flags
    assert read_flags("processor\t: 0\n") == frozenset()


def test_what_each_machine_kind_has():
    xeon = CpuFeatures(read_flags(XEON), True)
    assert xeon.avx2 and xeon.avx512 and xeon.avx512_vnni and xeon.avx512_bf16 and xeon.amx
    assert xeon.describe() == "AVX2, AVX-512, AVX512-VNNI, AVX512-BF16, AMX"
    epyc = CpuFeatures(frozenset({"avx2", "fma", "f16c"}))
    assert epyc.avx2 and not (epyc.avx512 or epyc.avx512_vnni or epyc.avx512_bf16 or epyc.amx)
    assert not CpuFeatures(frozenset({"avx2"})).avx2  # without FMA and F16C the kernels cannot build
    assert CpuFeatures().describe() == "no vector extensions llmkit uses"


def test_the_process_reads_them_once():
    assert cpu_features() is cpu_features()
