#!/usr/bin/env bash
# Issue #22's kernel part on one GPU: the LoLCATs hybrid's whole-sequence Triton kernels (tests, their
# time alone, launches per layer), the prefill sweep against the teacher and the LoLCATs stages'
# training rows. In a lease: `gpu_session.sh start hybrid "bash dev/gpu_hybrid.sh [PART...]"`;
# alone: `T=<teacher> bash dev/gpu_hybrid.sh [PART...]`. Parts (default: all, in this order):
#   tests     CUDA tests of the kernels against float64 (values, gradients, GQA, lengths off the
#             chunks, shorter than the window, one token, padding, soft-capping) and the mixer's dispatch
#   kernels   the hybrid alone at SmolLM2's shape: fused kernels, kernels with PyTorch features, the
#             PyTorch chunked form, the teacher's SDPA (forward, forward + backward)
#   launches  kernels per decoder layer of a 1k prefill: student before (torch) and after, teacher
#   prefill   the prefill sweep, student (kernels) vs teacher (sdpa, flash_attention_2 if installed) in
#             one run, then the student's PyTorch form at 1k and 8k (before)
#   train     bench.train at 8x1024: teacher full fine-tune, LoLCATs stage 1 and stage 2
#   graphs    the CUDA tests of the LoLCATs stages as CUDA graphs, then bench.train at 8x1024 eager and graphed
#             in one run (teacher, stage 1, stage 2; --cuda-graph both): ratios divide by the teacher's faster row
#   prelude   the backward's RoPE + Hedgehog prelude as Triton kernels (chunk_triton.FUSED_PRELUDE) against
#             PyTorch: the CUDA tests, the kernels alone at 8x1024 and 1x8192, and bench.train's graphed rows
#             (teacher, stage 1, stage 2) with the switch on, then off
#   ceiling   the teacher's prefill kernels at 1k, 8k and 32k (batch 1): attention's share of the GPU time bounds
#             what any attention replacement can gain there (Amdahl)
#   sweep     hybrid_bench.py --kernels --sweep at 8x1024 and 1x8192: each kernel's time, then warps and rows
#             of the kernels and the prelude varied one at a time, then bench.train's graphed rows (teacher, stage
#             1, stage 2) with the fastest values, then with the defaults, in one run
#   lora      bench.train's graphed teacher and stage-2 rows with peft's LoRA forward and a cast per projection, then
#             with the fused adapters and one cast (the defaults), with stage 1, in one call
#   prefill-sweep  the prefill's output-pass tiles (hybrid_bench.py --sweep-prefill), then the prefill rows
#             (1k and 8k, batch 1 and 32) with the fastest tiles set in the process, then with the defaults
#   step      the fused decode step alone (dev/step_bench.py: warps x value parts, STEP_ARGS; STEP_MODULES=FILE adds
#             an earlier version of the module beside it), then decode batch 1-256 from 1k prompts beside the teacher
#   sinks     attention sinks in the fused decode step: CUDA tests, compiled decode from 1k prompts without and with
#             them (untrained students), each beside the teacher
#   sinks-prefill  attention sinks in the prefill's forward kernels: CUDA tests, prefill rows without (beside the
#             teacher) and with them
#   profile   where a training step's time goes (bench.profile train at 8x1024: kernels, host phases) for the
#             teacher and both LoLCATs stages, and a 1k prefill's kernels, student and teacher
#   delta-prefill  issue #53: the delta student's prefill, part by part (dev/delta_prefill.py), beside the teacher
#   window    issue #53: the window-softmax layers' fast forms: CUDA tests (the one-launch prefill kernel, flash
#             blocks, the Triton ring step), the ring step alone on bf16 and float8 rings (dev/window_step_bench.py,
#             WINDOW_BENCH_ARGS, WINDOW_BENCH8_ARGS; WINDOW_STEP_SWEEP=0 skips them), the prefill forms alone
#             (dev/window_prefill_bench.py: the kernel's tiles swept at 1 x 32k, WINDOW_PREFILL_ARGS;
#             WINDOW_PREFILL_SWEEP=0 skips them), then
#             length-speed's rows (LENGTH_NEW 512) of untrained students of T (WINDOW_SPECS, default: wide = 14
#             layers over 1,280, lolcats_wide's shape; tiers = 4 of them over 4,288, float8, 4 sinks: lolcats_tiers',
#             the default's), each beside the teacher
#   decode-default  issue #54: the default's shape (untrained, tiers above) decoding as it runs by default at batch
#             1/64/256 from 1k prompts + 512 new beside the teacher's fastest path, then the kernels of its batch-1 step
#   prefill-reach  issue #53: the default's shape (untrained, tiers above) prefilling 1 x 32k beside the teacher's
#             SDPA, as it runs (past the reach the kernel makes the sinks' queries), with them made in PyTorch first
#             (WINDOW_PREFILL_SINK_ROPE off) and without sinks (--softmax-window-sinks 0), each with the teacher in its
#             run; REACH_RUNS repeats the three (default 2: a 32k prefill varies by a few ms run to run)
#   decode-ceiling  issue #44: the kernels of one decode step at batch 1 from 1k prompts (bench.profile decode,
#             the default fast path without its graph), teacher and student: the teacher's attention share bounds
#             what any replacement of it can gain at batch 1 (Amdahl), as `ceiling` does for the prefill
#   gates     issue #46: the kernels with gates (a fading linear state): their CUDA tests against float64, then for a
#             student converted with --feature-rope off --decay gated ($C-nopegated) the prefill (1x32k, 32x1k; the
#             kernels, then the PyTorch chunked form as before) beside the teacher, then bench.train at 8x1024 eager and
#             graphed: teacher, LoLCATs' stages and the gated student's (lolcats-long-stage1/2)
# An untrained student, convert's default LoLCATs one (the hybrid `linearize lolcats` trains in every layer it does not
# keep as window softmax; the default's window layers: the window job's `wide` row): speed does not depend on the
# weights. Rows land in $S (/tmp/runs/hybrid).
set -uo pipefail
T=${T:-/tmp/stage/teacher.gguf}; S=${S:-/tmp/runs/hybrid}; C=${C:-/tmp/ckpt/lolcats}; mkdir -p "$S"
quiet() { grep -v -E "Warning|warn\(|it/s\]|s/it\]"; }
# the default's shape (lolcats_tiers' layers in its third training, 4 far over 4,288, float8) with S sinks, as CK
tiers() { local ck=$1 sinks=$2; [ -d "$ck" ] || python3 -m linearize convert --teacher "$T" --config lolcats_mix \
  --keep-softmax 1,2,7,8,10,11,12,14,15,17,18,19,20,23 --softmax-window 1280,1:4288,2:4288,18:4288,20:4288 \
  --softmax-window-dtype float8 --softmax-window-sinks "$sinks" --out "$ck" --dtype bfloat16 2>&1 | tail -1; }
student() { [ -d "$C" ] || python3 -m linearize convert --teacher "$T" --kind lolcats --out "$C" --dtype bfloat16 2>&1 | tail -1; }
for part in ${@:-tests kernels launches prefill train}; do
  echo "=== $part $(date +%T)"
  case $part in
    tests)
      timeout ${TESTS_S:-900} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_hybrid.py 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | head -40 ;;
    kernels)
      timeout 300 python3 dev/hybrid_bench.py --shapes 1x1024 8x1024 1x8192 32x1024 1x32768 \
        --out "$S/hybrid_bench.json" 2>&1 | quiet ;;
    launches)
      student
      for backend in torch auto; do
        timeout 120 python3 -m linearize.bench.profile prefill "$C" --batch 1 --prompt-len 1024 --backend $backend \
          --top 12 --out "$S/profile_prefill_$backend.json" 2>&1 | quiet | tail -18
      done
      timeout 120 python3 -m linearize.bench.profile prefill "$T" --batch 1 --prompt-len 1024 --top 12 \
        --out "$S/profile_prefill_teacher.json" 2>&1 | quiet | tail -18 ;;
    prefill)
      student
      timeout 540 python3 -m linearize bench "$C" --teacher "$T" --dtype bfloat16 \
        --prefill 1x1024 32x1024 256x1024 1x8192 32x8192 1x32768 32x32768 --out "$S/prefill.json" 2>&1 | quiet | tail -24
      timeout 120 python3 -m linearize bench "$C" --teacher none --dtype bfloat16 --prefill 1x1024 1x8192 \
        --prefill-paths torch --out "$S/prefill_torch.json" 2>&1 | quiet | tail -5 ;;
    train)
      timeout 300 python3 -m linearize.bench.train --teacher "$T" --models teacher lolcats-stage1 lolcats-stage2 \
        --shapes 8x1024 --steps 10 --out "$S/train.json" 2>&1 | quiet | tail -6 ;;
    graphs)
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_lolcats_graphs.py 2>&1 | tail -15
      timeout 400 python3 -m linearize.bench.train --teacher "$T" --models teacher lolcats-stage1 lolcats-stage2 \
        --shapes 8x1024 --steps 20 --cuda-graph both --out "$S/train_graphed.json" 2>&1 | quiet | tail -8 ;;
    prelude)
      timeout ${TESTS_S:-900} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_hybrid.py 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | head -40
      timeout 300 python3 dev/hybrid_bench.py --shapes 8x1024 1x8192 --skip "torch chunked" \
        --out "$S/prelude_bench.json" 2>&1 | quiet
      for fused in True False; do
        timeout 300 python3 -c "import sys; from linearize.ops.hybrid import chunk_triton as k; k.FUSED_PRELUDE = $fused
from linearize.bench.train import main; sys.exit(main(sys.argv[1:]))" --teacher "$T" --shapes 8x1024 --steps 20 \
          --models teacher lolcats-stage1 lolcats-stage2 --cuda-graph on --out "$S/train_prelude_$fused.json" 2>&1 | quiet | tail -5
      done ;;
    ceiling)
      for n in 1024 8192 32768; do
        timeout 120 python3 -m linearize.bench.profile prefill "$T" --batch 1 --prompt-len $n --top 6 \
          --out "$S/ceiling_teacher_$n.json" 2>&1 | quiet | tail -9
      done ;;
    sweep)
      timeout 500 python3 dev/hybrid_bench.py --shapes 8x1024 1x8192 --skip "torch chunked" --kernels --sweep \
        --out "$S/hybrid_sweep.json" 2>&1 | quiet | grep -v "^sweep" | tail -45
      # bench.train's graphed rows with the sweep's knobs ("tuned"), then the defaults, in one run
      for tag in tuned defaults; do
        record=$S/hybrid_sweep.json; [ $tag = tuned ] || record=none
        timeout 300 python3 dev/with_knobs.py "$record" best linearize.bench.train --teacher "$T" --shapes 8x1024 \
          --steps 20 --models teacher lolcats-stage1 lolcats-stage2 --cuda-graph on --out "$S/train_$tag.json" 2>&1 \
          | quiet | tail -5
      done ;;
    lora)  # stage 2 before and after its LoRA fused the adapter's up-projection, scaling and add into one GEMM
      # and the converted layers cast their input once under autocast: bench.train's graphed rows in one call
      timeout 300 python3 -c "import sys; from linearize.recipes import lora; from linearize.mixers import base
lora.fuse_lora_products = lambda model: 0; base.autocast_input = lambda x: x; print('before: peft LoRA, a cast per product')
from linearize.bench.train import main; sys.exit(main(sys.argv[1:]))" --teacher "$T" --shapes 8x1024 --steps 20 \
        --models teacher lolcats-stage2 --cuda-graph on --out "$S/train_lora_before.json" 2>&1 | quiet | tail -4
      timeout 300 python3 -m linearize.bench.train --teacher "$T" --shapes 8x1024 --steps 20 --cuda-graph on \
        --models teacher lolcats-stage1 lolcats-stage2 --out "$S/train_lora_after.json" 2>&1 | quiet | tail -5 ;;
    prefill-sweep)  # the prefill's output-pass tiles: every pair of PREFILL_QUERY_ROWS x PREFILL_WARPS (forward
      # kernels without gradients), then the prefill rows with the fastest pair set in the process, then the defaults
      student
      timeout 400 python3 dev/hybrid_bench.py --shapes 1x1024 32x1024 1x8192 32x8192 --skip "torch chunked" \
        "kernels (fused), PyTorch prelude" "kernels (features given)" --sweep-prefill \
        --out "$S/prefill_sweep.json" 2>&1 | quiet | grep -v "^prefill sweep" | tail -12
      for tag in tuned defaults; do
        record=$S/prefill_sweep.json; [ $tag = tuned ] || record=none
        timeout 300 python3 dev/with_knobs.py "$record" best_prefill linearize.cli bench "$C" --teacher "$T" \
          --dtype bfloat16 --prefill 1x1024 32x1024 1x8192 32x8192 --prefill-teacher-paths sdpa \
          --out "$S/prefill_$tag.json" 2>&1 | quiet | grep -E "knobs|kernels|sdpa" | tail -9
      done ;;
    step)  # the fused decode step's CUDA tests, then the step alone (dev/step_bench.py: the default student's layout,
      # warps x value parts by STEP_ARGS; STEP_MODULES: other versions of ops/hybrid/step_triton.py
      # beside it), then the default student's decode on the default fast path at batch 1, 64 and 256 from 1k prompts
      # + STEP_NEW new (512) beside the teacher's fastest paths, then the kernels of a batch-256 step (PROFILE=0: not)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_length.py \
        -k "fused_hybrid_step or fused or gate" 2>&1 | tail -3
      timeout 420 python3 dev/step_bench.py ${STEP_ARGS:---warps 0 --splits 0} ${STEP_MODULES:+--module $STEP_MODULES} \
        --out "$S/step_bench.json" 2>&1 | quiet
      student
      timeout 420 python3 -m linearize bench "$C" --teacher "$T" --dtype bfloat16 --paths fast --teacher-paths static fast \
        --batch-sizes 1 64 256 --new-tokens ${STEP_NEW:-512} --prompt-len 1024 --out "$S/decode_step.json" 2>&1 | quiet \
        | grep -E "^\| (student|teacher)|Error|error:"
      [ "${PROFILE:-1}" = 1 ] && timeout 200 python3 -m linearize.bench.profile decode "$C" --batch 256 --prompt-len 1024 \
        --tokens 32 --top 20 --out "$S/profile_decode_256.json" 2>&1 | quiet | tail -24 ;;
    sinks)  # attention sinks (a cache of the first 4 tokens) in the fused decode step: its CUDA tests, then compiled
      # decode of untrained students without and with the sinks (1k prompts, batch 1, 64 and 256), each beside the teacher
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py -k sinks 2>&1 | tail -3
      student
      [ -d "$C-sinks" ] || python3 -m linearize convert --teacher "$T" --kind lolcats --sparse-cache 4 \
        --sparse-priority first --out "$C-sinks" --dtype bfloat16 2>&1 | tail -1
      for ck in "$C" "$C-sinks"; do
        timeout 420 python3 -m linearize bench "$ck" --teacher "$T" --dtype bfloat16 --paths fast --compile \
          --teacher-paths static --batch-sizes 1 64 256 --new-tokens 256 --prompt-len 1024 \
          --out "$S/decode_$(basename "$ck").json" 2>&1 | quiet | grep -E "^\| (student|teacher)|Error|error:"
      done ;;
    length-speed)  # issue #46: the fused step's CUDA test with the length options, then decode (the default fast path,
      # 1k prompts, batch 1/64/256) and prefill (1x32k, 32x1k) of untrained students with the length options
      # (LENGTH_SPECS: name=flags ... with ':' for spaces and '%' for a colon, e.g. wide=--keep-softmax:3,8:--softmax-window:2048), each beside the teacher's fastest path; LENGTH_NEW new tokens
      # (default 256); LENGTH_PREFILL: the names whose prefill runs (default: all); LENGTH_TESTS=0: no CUDA test
      [ "${LENGTH_TESTS:-1}" = 1 ] && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_length.py 2>&1 | tail -3
      for pair in ${LENGTH_SPECS:-plain=--config:lolcats_plain default=}; do
        name=${pair%%=*}; flags=$(echo "${pair#*=}" | tr ':' ' ' | tr '%' ':')  # % for a colon inside a value
        ck=$C-$name; [ -d "$ck" ] || python3 -m linearize convert --teacher "$T" --kind lolcats $flags --out "$ck" \
          --dtype bfloat16 2>&1 | tail -1
        timeout 420 python3 -m linearize bench "$ck" --teacher "$T" --dtype bfloat16 --paths fast --teacher-paths static fast \
          --batch-sizes 1 64 256 --new-tokens ${LENGTH_NEW:-256} --prompt-len 1024 --out "$S/decode_length_$name.json" 2>&1 \
          | quiet | grep -E "^\| (student|teacher)|Error|error:"
        [[ " ${LENGTH_PREFILL:-$name} " == *" $name "* ]] && timeout 300 python3 -m linearize bench "$ck" --teacher "$T" --dtype bfloat16 --prefill 1x32768 32x1024 \
          --out "$S/prefill_length_$name.json" 2>&1 | quiet | grep -E "^\| (student|teacher)|Error|error:"
      done ;;
    window)  # issue #53: see the header
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_window.py tests/gpu/test_gpu_window_step.py \
        > $S/window_tests.log 2>&1  # the whole log comes back; here the failures' names, their first errors, the count
      grep -E "^FAILED|^E  |passed|failed" $S/window_tests.log | head -40
      [ "${WINDOW_STEP_SWEEP:-1}" = 1 ] && timeout 300 python3 dev/window_step_bench.py ${WINDOW_BENCH_ARGS:---blocks 32 64 128 \
--warps 2 4 8 --programs 0 1} --out "$S/window_step_bench.json" 2>&1 | grep -v -E "^\s*$|Warning|warn" | tail -40
      [ "${WINDOW_STEP_SWEEP:-1}" = 1 ] && timeout 300 python3 dev/window_step_bench.py --float8 ${WINDOW_BENCH8_ARGS:---blocks 64 128 \
--warps 4} --out "$S/window_step_bench_float8.json" 2>&1 | grep -v -E "^\s*$|Warning|warn" | tail -20
      [ "${WINDOW_PREFILL_SWEEP:-1}" = 1 ] && timeout 300 python3 dev/window_prefill_bench.py ${WINDOW_PREFILL_ARGS:---shapes \
1x32768 --windows 1280 --bm 64 128 --bn 64 128 --warps 4 8 --stages 2 3} --out "$S/window_prefill_sweep.json" 2>&1 \
        | grep -v -E "^\s*$|Warning|warn" | tail -45
      [ "${WINDOW_PREFILL_SWEEP:-1}" = 1 ] && timeout 200 python3 dev/window_prefill_bench.py \
        --out "$S/window_prefill_bench.json" 2>&1 | grep -E "^\|" | tail -20
      kept=1,2,7,8,10,11,12,14,15,17,18,19,20,23  # the default's layers in its third training (1, 2, 18, 20 far)
      LENGTH_TESTS=0 LENGTH_NEW=${LENGTH_NEW:-512} LENGTH_SPECS="${WINDOW_SPECS:-wide=--config:lolcats_mix:--keep-softmax:$kept\
:--softmax-window:1280 tiers=--config:lolcats_mix:--keep-softmax:$kept:--softmax-window:1280,1%4288,2%4288,18%4288,20%4288\
:--softmax-window-dtype:float8:--softmax-window-sinks:4}" bash "$0" length-speed ;;
    decode-default)  # issue #54: see the header
      tiers "$C-tiers" 4
      timeout 400 python3 -m linearize bench "$C-tiers" --teacher "$T" --dtype bfloat16 --paths fast \
        --teacher-paths static fast --batch-sizes 1 64 256 --new-tokens 512 --prompt-len 1024 \
        --out "$S/decode_default.json" 2>&1 | quiet | grep -E "^\| (student|teacher)|rror"
      timeout 200 python3 -m linearize.bench.profile decode "$C-tiers" --batch 1 --prompt-len 1024 --tokens 32 \
        --top 45 --out "$S/profile_decode_default_1.json" 2>&1 | quiet | tail -50 ;;
    prefill-reach)  # issue #53: see the header
      for n in 4 0; do tiers "$C-reach$n" $n; done
      for r in $(seq ${REACH_RUNS:-2}); do
        for run in "kernel 4 none" "torch 4 {\"linearize.mixers.window.WINDOW_PREFILL_SINK_ROPE\":false}" "nosinks 0 none"; do
          set -- $run; echo "--- $1 (run $r)"
          timeout 200 python3 dev/with_knobs.py "$3" - linearize.cli bench "$C-reach$2" --teacher "$T" --dtype bfloat16 \
            --prefill 1x32768 --prefill-teacher-paths sdpa --out "$S/prefill_reach_$1_$r.json" 2>&1 | quiet \
            | grep -E "^\| (student|teacher)|rror"
        done
      done ;;
    delta-prefill)  # issue #53: where the delta student's prefill goes (dev/delta_prefill.py: parts swapped out, the
      # parts alone, the kernels) at DELTA_SHAPES (default 1x32768 32x1024), beside the teacher, on an untrained student
      ck=$C-delta; [ -d "$ck" ] || python3 -m linearize convert --teacher "$T" --kind delta --feature-rope off --out "$ck" \
        --dtype bfloat16 2>&1 | tail -1
      timeout 540 python3 dev/delta_prefill.py "$ck" --teacher "$T" --shapes ${DELTA_SHAPES:-1x32768 32x1024} \
        --out "$S/delta_prefill.json" 2>&1 | quiet | grep -v -E "^\s*$|Warning|warn" ;;
    decode-ceiling)
      student
      for m in "$T" "$C"; do
        timeout 200 python3 -m linearize.bench.profile decode "$m" --batch 1 --prompt-len 1024 --tokens 32 --top 40 \
          --out "$S/ceiling_decode_$(basename "$m" | cut -d. -f1).json" 2>&1 | quiet | tail -14
      done ;;
    gates)  # issue #46: the whole-sequence kernels with gates (the length-robust student: features before RoPE,
      # data-dependent gates): CUDA tests, prefill beside the teacher (kernels and, before, the PyTorch form), training
      # (GATE_TESTS=0: the timings alone; the tests' whole log in $S/gates_tests.log)
      [ "${GATE_TESTS:-1}" = 1 ] && { timeout ${TESTS_S:-900} python3 -m pytest -v -p no:cacheprovider \
        tests/gpu/test_gpu_hybrid.py -k gated > $S/gates_tests.log 2>&1
        grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" $S/gates_tests.log | head -40; }
      [ "${GATE_TIMES:-1}" = 1 ] || continue
      ck=$C-nopegated; [ -d "$ck" ] || python3 -m linearize convert --teacher "$T" --kind lolcats --feature-rope off \
        --decay gated --out "$ck" --dtype bfloat16 2>&1 | tail -1
      timeout 480 python3 -m linearize bench "$ck" --teacher "$T" --dtype bfloat16 --prefill 1x32768 32x1024 \
        --prefill-paths kernels torch --out "$S/prefill_gates.json" 2>&1 | quiet | grep -E "^\| |Error|error:"
      timeout 600 python3 -m linearize.bench.train --teacher "$T" --shapes 8x1024 --steps 20 --cuda-graph both \
        --models teacher lolcats-stage1 lolcats-stage2 lolcats-long-stage1 lolcats-long-stage2 \
        --out "$S/train_gates.json" 2>&1 | quiet | tail -12 ;;
    sinks-prefill)  # attention sinks in the prefill's forward kernels: their CUDA tests, then the prefill rows of
      # untrained students with and without the sinks (with the teacher beside the plain one)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_hybrid.py -k sinks 2>&1 | tail -3
      student
      [ -d "$C-sinks" ] || python3 -m linearize convert --teacher "$T" --kind lolcats --sparse-cache 4 \
        --sparse-priority first --out "$C-sinks" --dtype bfloat16 2>&1 | tail -1
      timeout 150 python3 -m linearize bench "$C" --teacher "$T" --dtype bfloat16 --prefill 1x1024 32x1024 1x8192 \
        32x8192 --prefill-teacher-paths sdpa --out "$S/prefill_plain.json" 2>&1 | quiet | grep -E "kernels|sdpa|rror"
      timeout 120 python3 -m linearize bench "$C-sinks" --teacher none --dtype bfloat16 --prefill 1x1024 32x1024 \
        1x8192 32x8192 --out "$S/prefill_sinks.json" 2>&1 | quiet | grep -E "kernels|torch|rror" ;;
    profile)
      student
      for m in teacher lolcats-stage1 lolcats-stage2; do
        timeout 240 python3 -m linearize.bench.profile train --model $m --teacher "$T" --shape 8x1024 --top 25 \
          --out "$S/profile_train_$m.json" 2>&1 | quiet | tail -40
      done
      for m in "$C" "$T"; do
        timeout 120 python3 -m linearize.bench.profile prefill "$m" --batch 1 --prompt-len 1024 --top 20 \
          --out "$S/profile_prefill_$(basename $m).json" 2>&1 | quiet | tail -28
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
