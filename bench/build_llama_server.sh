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
cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
cmake --build build --target llama-server llama-quantize llama-bench llama-batched-bench -j "$(nproc)"
echo "built $dir/build/bin/llama-server: $("$dir/build/bin/llama-server" --version 2>&1 | head -1)"
