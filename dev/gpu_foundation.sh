#!/usr/bin/env bash
# The whole GPU job of the foundation issue, for the device tool:
#   carry .whl (fla, fla-core, einops, pytest wheels); figures land in $OUT.
# 1. the kernel / mixer benchmark, with the fla-vs-PyTorch agreement table (rows print as measured),
# 2. the GPU tests and a few model tests on this machine's transformers.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
timeout ${BENCH_TIMEOUT:-400} python3 -m linearize.bench.mixers --out "$OUT/mixers.json" "$@" 2>&1 | tee "$OUT/mixers.md"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu.py -k "${GPU_TESTS:-}" \
  "tests/models/test_model.py::test_greedy_generate_equals_argmax_of_parallel_forwards" \
  "tests/models/test_model.py::test_generate_with_explicit_linearize_cache" \
  "tests/models/test_model.py::test_save_load_roundtrip_gives_identical_logits" 2>&1 | tee "$OUT/tests.txt" | tail -15
