#!/usr/bin/env bash
# Here: fetch the pure-Python wheels the GPU machine lacks (it reaches no registry) into .whl/,
# which every GPU call carries and unpacks onto PYTHONPATH. Keep .whl/ out of git
# (echo /.whl/ >> .git/info/exclude; likewise /.gpu/).
#   bash dev/gpu_wheels.sh overlay: instead, newer pure-Python packages than the GPU machine's own into .gpu/o
#   (transformers >= 5.23 builds Gemma's GGUF tokenizer right; the machine has 5.17), carried by
#   gpu_session.sh overlay in a call of their own (~14 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = overlay ]; then
  rm -rf .gpu/o && python3 -m pip download -q --no-deps -d .gpu/o transformers==5.24.0 huggingface-hub==1.33.0
  ls .gpu/o; exit 0
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 gguf==0.19.0 pytest pluggy iniconfig
ls .whl
