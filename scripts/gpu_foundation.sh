#!/usr/bin/env bash
# The whole GPU job of the foundation issue, for the device tool:
#   carry .whl (fla, fla-core, einops, pytest wheels); figures land in $OUT.
# 1. the CPU test suite's model/ops tests on this machine's transformers (compatibility),
# 2. the GPU tests (fla path == PyTorch path),
# 3. the kernel / mixer benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_ops.py tests/test_model.py tests/test_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout 420 python3 -m linearize.bench.mixers --out "$OUT/mixers.json" 2>&1 | tee "$OUT/mixers.md"
