#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the yardstick of bench/serve_bench.py and bench/quant_bench.py) and llama-quantize
# (which makes the Q4_K_M file quant_bench.py --gguf reads) from the llama.cpp sources vendored in the PyPI sdist of
# llama-cpp-python: pip is the only way to fetch it here, and its wheel build leaves no server binary.
# llama-bench and llama-batched-bench are bench/size_bench.py's yardsticks.
# Usage: bash bench/build_llama_server.sh [DIR]   (default runs/llama.cpp; about 7 minutes on 2 cores)
set -euo pipefail
dir="$(realpath -m "${1:-runs/llama.cpp}")"
mkdir -p "$dir"
cd "$dir"
python3 -m pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d . -q
tar xzf llama_cpp_python-0.3.36.tar.gz
# On a CPU with AMX, a native build issues AMX tile instructions, which fault in this project's VMs
# (../shared/FACTS.md: ggml_backend_amx_mul_mat dies at ldtilecfg): there the CPU's other features are named instead.
cpu_flags=(-DGGML_NATIVE=ON)
if grep -q -w amx_tile /proc/cpuinfo; then
  cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${cpu_flags[@]}" \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
cmake --build build --target llama-server llama-quantize llama-bench llama-batched-bench -j "$(nproc)"
echo "built $dir/build/bin/llama-server: $("$dir/build/bin/llama-server" --version 2>&1 | head -1)"
