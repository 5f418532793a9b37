#!/usr/bin/env bash
# Here: fetch the pure-Python wheels the GPU machine lacks (it reaches no registry) into .whl/,
# which every GPU call carries and unpacks onto PYTHONPATH. Keep .whl/ out of git
# (echo /.whl/ >> .git/info/exclude; likewise /.gpu/).
#   bash dev/gpu_wheels.sh overlay: instead, newer pure-Python packages than the GPU machine's own into .gpu/o
#   (transformers >= 5.23 builds Gemma's GGUF tokenizer right; the machine has 5.17), carried by
#   gpu_session.sh overlay in a call of their own (~14 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
#   bash dev/gpu_wheels.sh tilelang: TileLang and what it needs that the GPU image lacks, for fla's gated backward on
#   Hopper (fla 0.6 refuses it under Triton 3.4-3.7.0 unless TileLang takes it; the image has Triton 3.6 and nvcc):
#   tilelang into .gpu/tl (50 MB), apache-tvm-ffi, torch-c-dlpack-ext and z3-solver into .gpu/tl2 (33 MB), one call
#   each (gpu_session.sh tilelang)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"; }
if [ "${1:-}" = tilelang ]; then
  rm -rf .gpu/tl .gpu/tl2
  get -d .gpu/tl tilelang==0.1.15
  get -d .gpu/tl2 "apache-tvm-ffi>=0.1.11,<0.1.13" torch-c-dlpack-ext==0.1.5 "z3-solver>=4.13.0,<4.15.5"
  ls -la .gpu/tl .gpu/tl2; exit 0
fi
if [ "${1:-}" = overlay ]; then
  rm -rf .gpu/o && python3 -m pip download -q --no-deps -d .gpu/o transformers==5.24.0 huggingface-hub==1.33.0
  ls .gpu/o; exit 0
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 gguf==0.19.0 pytest pluggy iniconfig
ls .whl
