#!/usr/bin/env bash
# The decoding job of issue #7, run by scripts/gpu_job.sh decode (teacher joined in /tmp/stage).
# PART picks what runs (a device call lasts at most 10 minutes; default: "tests student"):
#   tests     the fast decoder's CUDA graph against its eager twin and generate(), and our Triton
#             kernels against their PyTorch twins (tests/test_gpu_decode.py, tests/test_gpu_kernels.py)
#   student   untrained LoLCATs and SUPRA students of the real teacher (speed does not depend on the
#             weights), bf16, fast path over batches 1-1024 and 1k/4k new tokens
#   long      the LoLCATs student at 32k new tokens (memory growth from 1k to 32k), batches 1 and 256
#   compiled  the same with the decode step compiled (torch.compile)
#   teacher   the teacher's plain generate(), static cache (compiled) and fast paths at the same
#             contexts, reached by prefill (plain generate() at ~90 ms/step cannot make 32k tokens)
#   maxbatch  the largest batch that fits at 4k new tokens, student vs teacher (long)
set -uo pipefail
OUT=${OUT:-/tmp/out}
T=/tmp/stage/teacher.gguf
bench() { timeout ${BENCH_TIMEOUT:-240} python3 -m linearize bench "$@" --dtype bfloat16 2>&1 | grep -v "it/s]"; }
students() {
  for kind in ${KINDS:-lolcats supra}; do
    [ -d /tmp/ckpt/$kind ] || python3 -m linearize convert --teacher $T --kind $kind --out /tmp/ckpt/$kind \
      --dtype bfloat16 2>&1 | tail -1
  done
}
for part in ${PART:-tests student}; do
  case $part in
    tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_decode.py \
             tests/test_gpu_kernels.py 2>&1 | tee "$OUT/decode_tests.txt" | tail -5 ;;
    student) students
      for kind in ${KINDS:-lolcats supra}; do
        plots=(); [ "$kind" = lolcats ] && plots=(--plots "$OUT/plots")  # at most 8 files come back
        bench /tmp/ckpt/$kind --teacher none --paths fast --batch-sizes ${BATCHES:-1 16 256 1024} \
          --new-tokens ${LENGTHS:-1024 4096} --prompt-len 128 --out "$OUT/bench_${kind}_fast.json" "${plots[@]}" | tail -12
      done ;;
    long) students
      bench /tmp/ckpt/lolcats --teacher none --paths fast --batch-sizes 1 256 --new-tokens 1024 32768 \
        --prompt-len 128 --out "$OUT/bench_lolcats_long.json" | tail -6 ;;
    compiled) students
      bench /tmp/ckpt/lolcats --teacher none --paths fast --compile --batch-sizes ${BATCHES_COMPILE:-1 256} \
        --new-tokens ${LENGTHS_COMPILE:-1024} --prompt-len 128 --out "$OUT/bench_lolcats_compiled.json" | tail -6 ;;
    teacher)
      for ctx in ${CONTEXTS:-1024 4096}; do
        bench $T --teacher none --paths generate --batch-sizes ${BATCHES:-1 16 256} --new-tokens 64 \
          --prompt-len $ctx --out "$OUT/bench_teacher_generate_$ctx.json" | tail -6
        bench $T --teacher none --paths static fast --batch-sizes ${BATCHES:-1 16 256} --new-tokens 256 \
          --prompt-len $ctx --out "$OUT/bench_teacher_static_$ctx.json" | tail -10
      done ;;
    maxbatch) students
      bench /tmp/ckpt/lolcats --teacher none --paths fast --prefill-batch 1024 \
        --batch-sizes 2048 4096 8192 16384 --new-tokens 4096 --prompt-len 128 --out "$OUT/maxbatch_student.json" | tail -6
      bench $T --teacher none --paths static --batch-sizes 256 512 768 1024 --new-tokens 4096 --prompt-len 128 \
        --out "$OUT/maxbatch_teacher.json" | tail -6 ;;
    *) echo "unknown part $part" ;;
  esac
done
