#!/usr/bin/env bash
# The decoding job of issue #7, run by scripts/gpu_job.sh decode (teacher joined in /tmp/stage).
# 1. the fast decoder's CUDA graph against its eager twin and generate() (tests/test_gpu_decode.py);
# 2. untrained students of the real teacher (speed does not depend on the weights), bf16;
# 3. linearize bench: the students' fast path over the whole sweep, and the teacher's paths at the
#    same context reached by prefill (plain generate() at ~90 ms/step cannot make 32k tokens here).
set -uo pipefail
OUT=${OUT:-/tmp/out}
T=/tmp/stage/teacher.gguf
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_decode.py tests/test_gpu_kernels.py 2>&1 | tee "$OUT/decode_tests.txt" | tail -5
for kind in ${KINDS:-lolcats supra}; do
  [ -d /tmp/ckpt/$kind ] || python3 -m linearize convert --teacher $T --kind $kind --out /tmp/ckpt/$kind --dtype bfloat16 2>&1 | tail -2
done
bench() { timeout ${BENCH_TIMEOUT:-200} python3 -m linearize bench "$@" --dtype bfloat16 2>&1 | grep -v "it/s]"; }
for kind in ${KINDS:-lolcats supra}; do
  bench /tmp/ckpt/$kind --teacher none --paths fast ${COMPILE:+--compile} --batch-sizes ${BATCHES:-1 16 256 1024} \
    --new-tokens ${LENGTHS:-1024 4096 32768} --prompt-len 128 --out "$OUT/bench_${kind}_fast.json" --plots "$OUT/plots_$kind" \
    | tee "$OUT/bench_${kind}_fast.md" | tail -20
done
# the decode step compiled (torch.compile fuses the step's ~2,500 small kernels; compiling costs minutes)
bench /tmp/ckpt/lolcats --teacher none --paths fast --compile --batch-sizes ${BATCHES_COMPILE:-1 256} \
  --new-tokens ${LENGTHS_COMPILE:-1024} --prompt-len 128 --out "$OUT/bench_lolcats_compiled.json" | tail -6
for ctx in ${CONTEXTS:-1024 4096}; do
  bench $T --teacher none --paths generate --batch-sizes ${BATCHES:-1 16 256 1024} --new-tokens 64 \
    --prompt-len $ctx --out "$OUT/bench_teacher_generate_$ctx.json" | tee "$OUT/bench_teacher_generate_$ctx.md" | tail -8
  bench $T --teacher none --paths static fast --batch-sizes ${BATCHES:-1 16 256 1024} \
    --new-tokens 256 --prompt-len $ctx --out "$OUT/bench_teacher_static_$ctx.json" | tee "$OUT/bench_teacher_static_$ctx.md" | tail -12
done
if [ -n "${MAXBATCH:-}" ]; then  # the largest batch that fits at 4k generated tokens (opt-in: long)
  bench /tmp/ckpt/lolcats --teacher none --paths fast --prefill-batch 1024 --batch-sizes 2048 4096 8192 16384 --new-tokens 4096 \
    --prompt-len 128 --out "$OUT/maxbatch_student.json" | tail -6
  bench $T --teacher none --paths static --batch-sizes 256 512 768 1024 --new-tokens 4096 --prompt-len 128 \
    --out "$OUT/maxbatch_teacher.json" | tail -6
fi
