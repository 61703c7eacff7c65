#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA: the kernel, CUDA-graph and engine tests
# on the GPU (kernels compiled, not interpreted), then bench/bench_gpu.py.
# Logs go to $OUT (default /tmp/shardline-gpu-check). Run from the repository root
# with shardline installed (pip install -e ".[gpu]").
set -u
OUT=${OUT:-/tmp/shardline-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider --timeout 120 \
    tests/engine/kernels 2>&1 | tee "$OUT/kernel_tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-330}" python3 bench/bench_gpu.py ${BENCH_ARGS:---eager} 2>&1 | tee "$OUT/bench_gpu.log" \
    | grep -v "Loading weights\|Writing model"
timeout "${EQUALITY_TIMEOUT:-60}" python3 -m pytest -q -p no:cacheprovider --timeout 50 -x \
    tests/engine/test_hf_equality.py -k "llama or qwen3" 2>&1 | tee "$OUT/hf_equality.log" | tail -8
