#!/usr/bin/env bash
# The speed figures of issues #7, #4 and #5 on one GPU, as parts run one after another (nothing else
# on the GPU): `gpu_session.sh start speed bash dev/gpu_speed.sh PART...`. Untrained students:
# speed does not depend on the weights. Rows land in /tmp/runs/speed/*.json.
set -uo pipefail
T=${T:-/tmp/stage/teacher.gguf}; S=/tmp/runs/speed; mkdir -p $S
lin() { python3 -m linearize "$@"; }
bench() { local t=$1; shift; timeout $t python3 -m linearize bench "$@" --dtype bfloat16 2>&1 | grep -v -E "it/s\]|s/it\]"; }
student() { [ -d /tmp/ckpt/$1 ] || lin convert --teacher $T --kind $1 --out /tmp/ckpt/$1 --dtype bfloat16 2>&1 | tail -1; }
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    tests)  # CUDA graph vs eager vs generate(), our Triton kernels vs their PyTorch twins (fla's own: test_gpu.py)
      timeout 300 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_kernels.py \
        "tests/gpu/test_gpu.py::test_retnet_trains_through_fla_under_autocast" 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
    fast)  # the linearized students' fast path over batch sizes and generated lengths
      student lolcats; student supra
      bench 150 /tmp/ckpt/lolcats --teacher none --paths fast --batch-sizes 1 256 1024 --new-tokens 1024 4096 \
        --prompt-len 128 --out $S/fast_lolcats.json --plots $S/plots | tail -10
      bench 60 /tmp/ckpt/supra --teacher none --paths fast --batch-sizes 1 256 --new-tokens 1024 \
        --prompt-len 128 --out $S/fast_supra.json | tail -6 ;;
    teacher)  # the teacher at a 4k context: plain generate(), static cache + compile, our static-KV fast path
      bench 90 $T --teacher none --paths generate --batch-sizes 1 256 --new-tokens 64 --prompt-len 4096 \
        --out $S/teacher_generate_4k.json | tail -4
      bench 180 $T --teacher none --paths static fast --batch-sizes 1 256 --new-tokens 256 --prompt-len 4096 \
        --out $S/teacher_static_4k.json | tail -6 ;;
    compiled)  # the student's decode step through torch.compile (the lever for the batch-1 target), with
      # q/k/v and gate/up fused (the default) and apart, and the fused step's kernels
      student lolcats
      bench 240 /tmp/ckpt/lolcats --teacher none --paths fast --compile --batch-sizes 1 256 --new-tokens 1024 \
        --prompt-len 128 --out $S/fast_lolcats_compiled.json | tail -5
      bench 150 /tmp/ckpt/lolcats --teacher none --paths fast --compile --unfused --batch-sizes 1 --new-tokens 1024 \
        --prompt-len 128 --out $S/fast_lolcats_compiled_unfused.json | tail -3
      timeout 150 python3 -m linearize.bench.profile decode /tmp/ckpt/lolcats --batch 1 --compile --top 12 \
        --out $S/profile_decode_compiled.json 2>&1 | grep -v Warning | tail -15 ;;
    long)  # memory growth of the student from 1k to 32k generated tokens (compiled step: half the time)
      student lolcats
      bench 280 /tmp/ckpt/lolcats --teacher none --paths fast --compile --batch-sizes 1 64 --new-tokens 1024 32768 \
        --prompt-len 128 --out $S/long_lolcats.json | tail -6 ;;
    maxbatch)  # the largest batch at a 4k context. The teacher's static cache is allocated for the whole
      # length up front (4096-token prompt + 32 new); the student's state is constant in length
      # (the `long` part shows it), so 256 new tokens after a 128-token prompt hold what 4k would.
      student lolcats
      # Defaults bracket an H100 80GB (on an H200 of 2026-11-22: teacher 180 MB, student 9.0 MB per sequence).
      # TEACHER_BATCHES=none: the student only (the teacher's rows do not change with this code).
      [ "${TEACHER_BATCHES:-}" = none ] || bench 240 $T --teacher none --paths static \
        --batch-sizes ${TEACHER_BATCHES:-416 448 480 512} --new-tokens 32 --prompt-len 4096 --out $S/maxbatch_teacher.json | tail -6
      bench 300 /tmp/ckpt/lolcats --teacher none --paths fast --prefill-batch 1024 \
        --batch-sizes ${STUDENT_BATCHES:-8192 9216 10240 12288} \
        --new-tokens 256 --prompt-len 128 --out $S/maxbatch_student.json | tail -5 ;;
    train)  # training tokens/s: teacher vs SUPRA/T2R/RetNet/StripedMamba (issues #4 and #5 targets)
      timeout 400 python3 -m linearize.bench.train --teacher $T --shapes 16x1024 8x2048 2x8192 --steps 6 \
        --out $S/train.json 2>&1 | tail -25 ;;
    train-compiled)  # the same with each model's forward compiled (host overhead is part of the students' step)
      timeout 500 python3 -m linearize.bench.train --teacher $T --models teacher supra retnet --shapes 16x1024 2x8192 \
        --steps 6 --compile --out $S/train_compiled.json 2>&1 | grep -v Warning | tail -10 ;;
    train-distill)  # the distillation step (KL + next-token to a frozen teacher run each step), eager and graphed,
      # beside the teacher's next-token fine-tune (issue #20: distillation at a one-GPU budget)
      for g in "" --cuda-graph; do
        timeout 280 python3 -m linearize.bench.train --teacher $T --models teacher ${DISTILL_MODELS:-supra retnet} \
          --shapes 8x1024 --steps 10 --loss kl+lm $g --out $S/train_distill${g:+-graph}.json 2>&1 | grep -v Warning | tail -6
      done ;;
    train-graph)  # the same with each step's forward and backward replayed as CUDA graphs (linearize.graphed),
      # beside the eager teacher: the students' eager steps are host-bound (docs/RESULTS.md, training speed)
      # (fla compiles for every model on a fresh machine: 240 s ran out after two of the four models)
      timeout ${GRAPH_TEST_TIMEOUT:-540} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu.py -k "graphed or cuda_graphs" 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error"
      timeout 500 python3 -m linearize.bench.train --teacher $T --models ${GRAPH_MODELS:-teacher supra retnet striped_mamba} \
        --shapes 16x1024 8x2048 2x8192 --steps 6 --cuda-graph --out $S/train_graph.json 2>&1 | grep -v Warning | tail -16 ;;
    mamba|scan)  # the Mamba kernels equal to PyTorch on CUDA, the scan's constants and per-kernel times
      # (dev/scan_bench.py; SCAN_ARGS, default --sweep), then StripedMamba's training speed beside the teacher's. Eager:
      # graphed steps pass a mask, which keeps the PyTorch convolution. Speed does not depend on the
      # weights, so T may be a shape-only teacher (shape:NAME, or dev/shape_teacher.py).
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py -k "scan or conv" 2>&1 | tail -3
      timeout 400 python3 dev/scan_bench.py --kernels ${SCAN_ARGS:---sweep} 2>&1 | tee $S/scan_bench.txt
      timeout 300 python3 -m linearize.bench.train --teacher $T --models teacher striped_mamba \
        --shapes 16x1024 8x2048 2x8192 --steps 6 --out $S/train_mamba.json 2>&1 | tail -8 ;;
    profile)  # where the training step and the decode step spend their time (kernels by device time;
      # PROFILE_SHAPE=16x1024 for the training shape of the #4 target; PROFILE_MODELS, PROFILE_DECODE=0,
      # PROFILE_ARGS="--python 30" for the Python hot spots, PROFILE_LINES for the log tail)
      for m in ${PROFILE_MODELS:-teacher supra retnet striped_mamba}; do
        timeout ${PROFILE_TIMEOUT:-120} python3 -m linearize.bench.profile train --teacher $T --model $m --shape ${PROFILE_SHAPE:-2x8192} --top 14 ${PROFILE_ARGS:-} \
          --out $S/profile_train_${m}_${PROFILE_SHAPE:-2x8192}.json 2>&1 | grep -v Warning | tail -${PROFILE_LINES:-45}
      done
      [ "${PROFILE_DECODE:-1}" = 0 ] && continue
      student lolcats
      timeout 150 python3 -m linearize.bench.profile decode /tmp/ckpt/lolcats --batch 1 --compile --top 25 \
        --out $S/profile_decode_compiled.json 2>&1 | grep -v Warning | tail -28 ;;
    fp32)  # the fla-vs-PyTorch agreement in fp32 with full-precision Triton dots (issue #2). Four tries
      # (200, 200, 500, 300 s, all lengths) printed nothing: fla autotunes each kernel per length and
      # IEEE fp32 dots compile slowly. One length by default; run it as its own background job
      # beside other work (gpu_session.sh start fp32 "bash dev/gpu_speed.sh fp32").
      TRITON_F32_DEFAULT=ieee timeout ${FP32_TIMEOUT:-1500} python3 -m linearize.bench.mixers --skip-timing \
        --dtypes float32 --lengths ${FP32_LENGTHS:-1024} --out $S/agreement_ieee.json 2>&1 | grep -v Warning | tail -30 ;;
    *) echo "unknown part $part" ;;
  esac
done
