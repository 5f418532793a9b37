#!/usr/bin/env bash
# The training runs of issues #3-#6 on one GPU, each a job for `gpu_session.sh start NAME bash
# dev/gpu_quality.sh NAME` (several run side by side; their tokens/s are then shared-GPU figures,
# the clean ones come from linearize.bench.train). After training, each run's final checkpoint goes
# through lm-eval (once gpu_session.sh eval-setup has run) at LIMIT documents per task (LIMIT=all: all).
# At most SLOTS (default 3) jobs hold the GPU at once; the others wait for a slot. On 2026-11-22,
# six side by side on one H100 (80 GB) ran out of memory (~14 GB per training, ~28 GB per lm-eval).
set -uo pipefail
T=${T:-/tmp/stage/teacher.gguf}; RUNS=${RUNS:-/tmp/runs}; LIMIT=${LIMIT:-300}
lin() { python3 -m linearize "$@"; }
quiet() { grep --line-buffered -v -E "it/s\]|s/it\]"; }
evaluate() {  # evaluate CHECKPOINT NAME
  [ -e "$1" ] || { echo "no checkpoint $1"; return 1; }
  local n=0; until [ -e /tmp/evalsite/.ready ]; do sleep 10; n=$((n + 10)); [ $n -ge 1500 ] && return 1; done
  local limit=(--limit "$LIMIT"); [ "$LIMIT" = all ] && limit=()  # LIMIT=all: every document of every task
  PYTHONPATH=/tmp/evalsite:$PYTHONPATH lin eval "$1" --tasks all "${limit[@]}" --batch-size ${EVAL_BATCH:-32} \
    ${EVAL_FLAGS:-} --name "$2" --out $RUNS/eval/$2.json 2>&1 | quiet | tail -20
}
recall() {  # recall CHECKPOINT NAME: the recall grid to 8k and the loss by position
  lin eval "$1" --tasks recall --by-position --limit ${RECALL_LIMIT:-4} --batch-size 16 --name "$2" \
    --out $RUNS/eval/recall-$2.json 2>&1 | quiet | tail -14
}
gpu_slot() {  # hold one of SLOTS GPU slots (of the GPUs in CUDA_VISIBLE_DEVICES) until this script exits
  while true; do
    for i in $(seq 1 ${SLOTS:-3}); do
      exec {fd}>/tmp/gpu-slot.${CUDA_VISIBLE_DEVICES:-all}.$i
      flock -n $fd && { echo "holding GPU slot $i"; return 0; }
      exec {fd}>&-
    done
    sleep 5
  done
}
length_eval() {  # length_eval CHECKPOINT NAME: issue #46's rows of one model
  local o=$RUNS/length/$2 rows=" ${LENGTH_ROWS:-books sotu 32k passkey} "  # LENGTH_ROWS: a subset (the sparse rows always)
  [[ $rows == *" books "* ]] && lin eval "$1" --by-position --name $2 --out $o-books.json 2>&1 | quiet | tail -3  # + ppl on 1,024-token blocks
  [[ $rows == *" sotu "* ]] && lin eval "$1" --by-position --no-perplexity --source corpus:sotu --max-blocks ${SOTU_BLOCKS:-24} --name $2 \
    --out $o-sotu.json 2>&1 | quiet | tail -2
  [ "$2" = teacher ] || [[ $rows != *" 32k "* ]] || lin eval "$1" --by-position --no-perplexity ${POSLEN:---position-len 32768} --name $2 \
    --out $o-books32k.json 2>&1 | quiet | tail -2
  [[ $rows == *" passkey "* ]] && lin eval "$1" --tasks passkey --lengths ${PASSKEY_LENGTHS:-1k,2k,4k,8k} --limit ${RECALL_LIMIT:-4} --batch-size 16 \
    --name $2 --out $o-recall.json 2>&1 | quiet | tail -3
  for c in ${SPARSE_PASSKEY:-}; do  # e.g. "256:novelty:window[:W]": passkey with the training-free sparse cache (W: its
                                  # --sparse-linear; with W, also the books by position under it: its perplexity cost)
    IFS=: read S P A W <<< "$c"
    local tag=s$S-$P-$A${W:+-w$W} flags=(--sparse-cache $S --sparse-priority $P --sparse-anchor $A ${W:+--sparse-linear $W})
    lin eval "$1" --tasks passkey --lengths ${PASSKEY_LENGTHS:-1k,2k,4k,8k} --limit ${RECALL_LIMIT:-4} --batch-size 16 \
      "${flags[@]}" --name $2-$tag --out $o-recall-$tag.json 2>&1 | quiet | tail -2
    [ -n "$W" ] && lin eval "$1" --by-position "${flags[@]}" --name $2-$tag --out $o-books-$tag.json 2>&1 | quiet | tail -3
  done
  [ "${TASKS:-0}" = 1 ] && evaluate "$1" length-$2
  return 0
}
waitfor() { local n=0; until [ -e "$1" ]; do sleep 5; n=$((n + 5)); [ $n -ge ${2:-1500} ] && { echo "gave up waiting for $1"; return 1; }; done; return 0; }
seed_table() {  # seed_table NAME: one of issue #45's tables (seed-tables), all rows at STEPS x 8 x 1024 tokens under
               # LOSSES, the closest pair of each loss again at seed SEED2; run again: nothing trains, the page is
               # rewritten with the rows' zero-shot records (eval.json beside each run)
  local name=$1 seed=(--second-seed ${SEED2:-1}) losses=${LOSSES:-lm,kl+lm} args
  case $name in
    seed-supra) args=(supra-table3) ;;
    seed-xatl3) args=(xatl-table3 --arch retnet ${LIT_ARGS:-}) ;;  # e.g. LIT_ARGS="--lit-threshold 0.02"
    seed-mamba) args=(xatl-table2 --arch striped_mamba --rows ${XATL2_ROWS:-scratch,E+FFN}) ;;
    # RetNet's tokens to match at the same budget, beside StripedMamba's: one seed, RETNET_LOSSES (lm)
    seed-retnet) args=(xatl-table2 --arch retnet --rows ${XATL2_ROWS:-scratch,E+FFN}); seed=(); losses=${RETNET_LOSSES:-lm} ;;
    *) echo "unknown seed table $name"; return 2 ;;
  esac
  lin orderings "${args[@]}" --teacher $T --budget gpu --losses $losses --steps ${STEPS:-250} \
    --eval-steps ${EVAL_STEPS:-25} --align-steps ${ALIGN:-0} "${seed[@]}" ${SEED_ARGS:-} --out $RUNS/$name
}
seed_tend() {  # while the seed tables train: drop each finished row's checkpoints (~3 GB each; only a resume reads
               # them), and (TASKS=1) score its final checkpoint on the zero-shot tasks into eval.json beside it
  local dirs=("$@") done=0 ready=0 row waited=0
  while true; do
    [ -e $RUNS/seed-tables.done ] && done=1 && waited=$((waited + 10))
    [ -e /tmp/evalsite/.ready ] && ready=1
    local left=0
    for row in $(find "${dirs[@]}" -name results.json -printf '%h\n' 2>/dev/null | sort); do
      rm -rf "$row"/train/checkpoint-* "$row"/align/checkpoint-* "$row"/new-weights/checkpoint-*
      [ "${TASKS:-1}" = 1 ] && [ ! -e "$row/eval.json" ] && [ -e "$row/final" ] || continue
      [ $ready = 1 ] || { left=1; continue; }
      local limit=(--limit "$LIMIT"); [ "$LIMIT" = all ] && limit=()
      PYTHONPATH=/tmp/evalsite:$PYTHONPATH lin eval "$row/final" --tasks ${TASK_SET:-zeroshot} "${limit[@]}" \
        --no-perplexity --batch-size ${EVAL_BATCH:-32} --name "${row#$RUNS/}" --out "$row/eval.json" 2>&1 | quiet | tail -2
    done
    if [ $done = 1 ] && { [ $left = 0 ] || [ $waited -gt 600 ]; }; then  # lm-eval: 10 min more to get ready
      [ $left = 1 ] && echo "seed-tables: lm-eval never became ready (gpu_session.sh eval-setup): no zero-shot scores"
      return 0
    fi
    sleep 10
  done
}
mkdir -p $RUNS/eval
# OVERLAY=1: the newer pure-Python packages of gpu_session.sh overlay go first (Gemma's GGUF tokenizer needs
# transformers >= 5.23; the machine has 5.17)
[ "${OVERLAY:-0}" = 1 ] && { waitfor /tmp/overlay/transformers 1500 || exit 1; export PYTHONPATH=/tmp/overlay:$PYTHONPATH; }
case ${1:-} in  # (dial-tasks takes its slot once its row's training is done; seed-tables' parts take one each)
  dial-tasks|seed-tables) ;;
  *) gpu_slot ;;
esac
case ${1:?job} in
  teacher-eval) evaluate $T teacher ;;
  lolcats)  # the default student at its gpu budget (10M tokens per stage: 2 x 4096 x 1220 steps each), then lm-eval
    lin lolcats --teacher $T --budget gpu --out $RUNS/lolcats 2>&1 | quiet
    evaluate $RUNS/lolcats/final lolcats
    # the checkpoint lives only on this machine: draw its attention maps here (PNGs come back with wait)
    lin report $RUNS/eval/lolcats.json --runs $RUNS/lolcats --attention-maps --out $RUNS/lolcats-report/page.md 2>&1 | tail -2 ;;
  supra|t2r)  # the same 20M tokens (8 x 1024 x 2440 steps)
    lin supra --teacher $T --budget gpu --variant $1 --out $RUNS/$1 2>&1 | quiet
    evaluate $RUNS/$1/final $1 ;;
  memory)  # LoLCATs stage 1 peak memory: all layers jointly vs blocks of 5 and 1 layers
    for k in joint 5 1; do
      extra=(); [ "$k" = joint ] || extra=(--layers-per-block $k)
      lin lolcats --config lolcats_plain --teacher $T --rows stage1-only --stage1-steps 5 --eval-steps 1000 \
        --train-blocks 64 "${extra[@]}" --out $RUNS/memory-$k 2>&1 | quiet | tail -4
    done ;;
  ablate-hedgehog|ablate-t2r)  # LoLCATs Table 5 rows at equal tokens (1.2M per stage)
    lin lolcats --config lolcats_plain --teacher $T --feature-map ${1#ablate-} --rows lolcats,swap-finetune,stage1-only,no-window \
      --stage1-steps 150 --stage2-steps 150 --eval-steps 50 --out $RUNS/$1 2>&1 | quiet | grep -v "^\s*$" ;;
  xatl-*)  # RetNet from SmolLM2 at equal tokens (5M: 8 x 1024 x 610 steps)
    case $1 in
      xatl-scratch) args=(--transfer scratch) ;;
      xatl-effn) args=(--transfer embeddings,ffn) ;;
      xatl-effn-wo) args=(--transfer embeddings,ffn,wo) ;;
      xatl-hybrid) args=(--transfer embeddings,ffn,wo,attention --hybrid xatl) ;;
    esac
    lin xatl --teacher $T --budget gpu --arch retnet "${args[@]}" --steps ${XATL_STEPS:-610} --eval-steps 61 ${XATL_ARGS:-} \
      --out $RUNS/$1 2>&1 | quiet
    case $1 in xatl-effn-wo|xatl-hybrid) evaluate $RUNS/$1/final $1 ;; esac ;;
  recall-teacher)  # the teacher's recall grid to its 8k context and its loss by position
    PYTHONPATH=/tmp/evalsite:$PYTHONPATH lin eval $T --tasks recall --by-position --limit ${RECALL_LIMIT:-4} \
      --batch-size 16 --name teacher --out $RUNS/eval/recall-teacher.json 2>&1 | quiet | tail -30 ;;
  lolcats-recall)  # a LoLCATs student (STEPS per stage), then its recall grid with sparse caches of S tokens
    lin lolcats --config lolcats_plain --teacher $T --stage1-steps ${STEPS:-600} --stage2-steps ${STEPS:-600} \
      --out $RUNS/lolcats-recall 2>&1 | quiet | tail -12
    evaluate $RUNS/lolcats-recall/final lolcats-recall
    for S in 0 ${SPARSE:-16 64 256}; do
      ck=$RUNS/lolcats-recall/final
      if [ "$S" != 0 ]; then
        ck=$RUNS/lolcats-recall-s$S
        python3 -c "import sys, linearize; m, t = linearize.load(sys.argv[1]); linearize.respec(m, sparse_cache=int(sys.argv[3])); \
m.save_pretrained(sys.argv[2]); t.save_pretrained(sys.argv[2])" $RUNS/lolcats-recall/final $ck $S
      fi
      lin eval $ck --tasks recall --by-position --limit ${RECALL_LIMIT:-4} --batch-size 16 --name lolcats-s$S \
        --out $RUNS/eval/recall-lolcats-s$S.json 2>&1 | quiet | tail -14
    done ;;
  gemma-teacher)  # Gemma 3 270M's own scores (staged by dev/gpu_teacher.sh)
    G=/tmp/stage/gemma-3-270m.gguf; waitfor $G 1500 || exit 1
    EVAL_BATCH=${EVAL_BATCH:-8} evaluate $G gemma-teacher ;;
  gemma)  # a LoLCATs student of Gemma 3 270M (STEPS per stage; the SmolLM2 recipe runs 1220), its scores,
          # then (RECALL=0: not) the recall grid of the student and of the teacher
    G=/tmp/stage/gemma-3-270m.gguf; waitfor $G 1500 || exit 1
    lin lolcats --config lolcats_plain --teacher $G --stage1-steps ${STEPS:-600} --stage2-steps ${STEPS:-600} \
      --out $RUNS/gemma-lolcats 2>&1 | quiet | tail -12
    EVAL_BATCH=${EVAL_BATCH:-8} evaluate $RUNS/gemma-lolcats/final gemma-lolcats
    [ "${RECALL:-1}" = 1 ] && { recall $RUNS/gemma-lolcats/final gemma-lolcats; recall $G gemma-teacher; } ;;
  recall-supra)  # a SUPRA student (STEPS, default 1220: 10M tokens), its zero-shot scores and recall grid
    lin supra --teacher $T --budget gpu --steps ${STEPS:-1220} --out $RUNS/recall-supra 2>&1 | quiet | tail -8
    evaluate $RUNS/recall-supra/final recall-supra
    recall $RUNS/recall-supra/final supra ;;
  recall-xatl)  # the XATL hybrid (RetNet, softmax at two layers; 610 steps: 5M tokens), its scores and recall grid
    lin xatl --teacher $T --budget gpu --arch retnet --transfer embeddings,ffn,wo,attention --hybrid xatl \
      --steps ${XATL_STEPS:-610} --eval-steps 61 --out $RUNS/recall-xatl 2>&1 | quiet | tail -8
    evaluate $RUNS/recall-xatl/final recall-xatl
    recall $RUNS/recall-xatl/final xatl-hybrid ;;
  distill-supra)  # SUPRA learning from the teacher (issue #20): ALIGN alignment steps, then STEPS of kl+lm
    lin supra --teacher $T --budget gpu --align-steps ${ALIGN:-300} --align-lr 1e-3 --loss ${LOSS:-kl+lm} \
      --steps ${STEPS:-1220} ${SUPRA_ARGS:-} --out $RUNS/distill-supra 2>&1 | quiet | tail -10
    evaluate $RUNS/distill-supra/final distill-supra
    recall $RUNS/distill-supra/final distill-supra ;;
  distill-xatl)  # the XATL hybrid learning from the teacher, same schedule; NAME (default distill-xatl) names the
                 # run, XATL_ARGS adds flags (e.g. --transfer embeddings,ffn,wo,qkv,attention, --data A,B)
    n=${NAME:-distill-xatl}
    lin xatl --teacher $T --budget gpu --arch retnet --transfer embeddings,ffn,wo,attention --hybrid xatl \
      --align-steps ${ALIGN:-300} --align-lr 1e-3 --loss ${LOSS:-kl+lm} --steps ${XATL_STEPS:-610} \
      --eval-steps ${EVAL_STEPS:-61} ${XATL_ARGS:-} --out $RUNS/$n 2>&1 | quiet | tail -10
    evaluate $RUNS/$n/final $n
    recall $RUNS/$n/final $n-hybrid ;;
  generate)  # text sampled from the teacher (issue #20's data-free distillation): GEN_TOKENS new tokens, stored as
              # generated:smollm2; then e.g. XATL_ARGS="--data gutenberg,generated:smollm2" ... distill-xatl
    lin data generate --teacher $T --tokens ${GEN_TOKENS:-10000000} --batch-size ${GEN_BATCH:-256} --name smollm2 \
      --quiet 2>&1 | quiet | tail -4
    # packed for the way back (gpu_session.sh take), so that later leases carry it instead of sampling again
    XZ_OPT="-6 -T0" tar -C /tmp/linhome -cJf /tmp/results/generated-smollm2.tar.xz generated/smollm2 \
      && ls -la /tmp/results/generated-smollm2.tar.xz ;;
  distill-xatl-scratch)  # the same hybrid from scratch (no weights transferred), same schedule: the transfer's margin
    lin xatl --teacher $T --budget gpu --arch retnet --transfer scratch --hybrid xatl \
      --align-steps ${ALIGN:-300} --align-lr 1e-3 --loss ${LOSS:-kl+lm} --steps ${XATL_STEPS:-610} --eval-steps 61 \
      --out $RUNS/distill-xatl-scratch 2>&1 | quiet | tail -10 ;;
  lolcats-kl)  # LoLCATs with stage 2 on KL to the teacher (STEPS per stage), against the paper's LM loss at equal tokens
    lin lolcats --config lolcats_plain --teacher $T --stage1-steps ${STEPS:-300} --stage2-steps ${STEPS:-300} --loss ${LOSS:-kl} \
      --out $RUNS/lolcats-kl 2>&1 | quiet | tail -12
    evaluate $RUNS/lolcats-kl/final lolcats-kl ;;
  seed-tables)  # issue #45 on one GPU (of CUDA_VISIBLE_DEVICES), ~15-16 min on an H100: SUPRA Table 3, XATL Table 3
                # (RetNet) and XATL Table 2's scratch vs E+FFN for StripedMamba, then RetNet (lm only: tokens to match
                # side by side), each row STEPS (250) x 8 x 1024 = 2,048,000 tokens under lm and kl+lm, the closest
                # pair of each loss again at seed SEED2 (1; not RetNet's). The tables are parts (seed-supra, seed-xatl3, seed-mamba,
                # seed-retnet), SLOTS (3) of them on the GPU at once, logs in $RUNS/seed-*.log; meanwhile finished
                # rows lose their checkpoints and get their zero-shot scores (TASKS=0: none; TASK_SET, default
                # zeroshot: the suite less MMLU's 5-shot, LIMIT docs per task); then every page again, with them.
                # SEED_PARTS picks parts, SEED_ARGS adds flags (a CPU dry run: RUNS=/tmp/x T=<tiny teacher> STEPS=4
                # EVAL_STEPS=2 TASKS=0 SEED_ARGS="--budget cpu --device cpu --block-len 32 --eval-blocks 4 --data ...").
                # Pages: $RUNS/seed-*/orderings.md, $RUNS/seed-tables/tokens-to-match.md
    parts=(${SEED_PARTS:-seed-supra seed-xatl3 seed-mamba seed-retnet})
    rm -f $RUNS/seed-tables.done; declare -A pid
    for p in "${parts[@]}"; do bash "$0" $p > $RUNS/$p.log 2>&1 & pid[$p]=$!; done
    seed_tend $(printf "$RUNS/%s " "${parts[@]}") > $RUNS/seed-tend.log 2>&1 & tend=$!
    rc=0; ok=(); for p in "${parts[@]}"; do if wait ${pid[$p]}; then ok+=($p); else rc=1; echo "$p failed"; fi; done
    touch $RUNS/seed-tables.done; wait $tend; tail -3 $RUNS/seed-tend.log
    # the pages again, now with the zero-shot scores (only of parts that finished: nothing trains here, outside a slot)
    for p in "${ok[@]}"; do seed_table $p 2>&1 | quiet | tail -2; done
    mkdir -p $RUNS/seed-tables
    match=(); for p in seed-mamba seed-retnet; do [ -e $RUNS/$p/orderings.json ] && match+=($RUNS/$p/orderings.json); done
    [ ${#match[@]} -gt 0 ] && python3 -m linearize.recipes.orderings match "${match[@]}" --out $RUNS/seed-tables
    for p in "${parts[@]}"; do echo "== $p: $RUNS/$p/orderings.md"
      [[ " ${ok[*]} " == *" $p "* ]] || tail -12 $RUNS/$p.log  # a failed part: its log's end
      grep -E "^\| .*\*\*|^- |^Closest|^The paper's ordering under" $RUNS/$p/orderings.md 2>/dev/null; done
    cat $RUNS/seed-tables/tokens-to-match.md 2>/dev/null
    exit $rc ;;
  seed-supra|seed-xatl3|seed-mamba|seed-retnet)  # one part of seed-tables (it holds a GPU slot)
    seed_table $1 2>&1 | quiet ;;
  orderings-*)  # a paper's table under lm and kl+lm (issue #20): orderings-supra-table3, orderings-xatl-table2 ...
    lin orderings ${1#orderings-} --teacher $T --budget gpu --losses ${LOSSES:-lm,kl+lm} --steps ${STEPS:-610} \
      --eval-steps ${EVAL_STEPS:-61} --align-steps ${ALIGN:-0} --out $RUNS/${1} 2>&1 | quiet | tail -16
    cp $RUNS/${1}/orderings.md $RUNS/${1}/orderings.json $RUNS/${1}/curves.png $OUT/ 2>/dev/null ;;
  dial)  # issue #21's dial: memory against recall for LoLCATs, + sparse caches (SPARSE sizes, SPARSE_PRIORITIES rules), auto-K (by attention MSE; autor2 by
         # the recall score) and hand-placed K, the gated delta rule, Hedgehog linear attention without the window
         # (nowindow), LoLCATs trained on 4,096-token blocks (long4k; long8k: 8,192),
         # LoLCATs trained with a novelty cache of 64 (trained64n; long4k64n on 4,096-token blocks), with a cache of 64
         # on the window's scale (trained64w), with the first 4 tokens kept as attention sinks (sinks4; sinks4w: window anchor)
         # (DIAL_ROWS picks rows by name; DIAL_ARGS adds training flags; DIAL_EVAL adds eval flags, e.g. --by-position), the teacher
    for v in "lolcats:" "auto1:--keep-softmax auto:1" "auto2:--keep-softmax auto:2" "auto4:--keep-softmax auto:4" \
             "autor2:--keep-softmax auto:2 --auto-softmax-score recall" "hand2:--keep-softmax 2,15" "delta:--kind delta" \
             "nowindow:--kind linear" "long4k:--block-len 4096 --batch-size 2" "long8k:--block-len 8192 --batch-size 1" "trained64n:--sparse-cache 64 --sparse-priority novelty" \
             "long4k64n:--block-len 4096 --batch-size 2 --sparse-cache 64 --sparse-priority novelty" \
             "trained64w:--sparse-cache 64 --sparse-anchor window" "sinks4:--sparse-cache 4 --sparse-priority first" \
             "sinks4w:--sparse-cache 4 --sparse-priority first --sparse-anchor window"; do
      [ -n "${DIAL_ROWS:-}" ] && [[ ",$DIAL_ROWS," != *",${v%%:*},"* ]] && continue
      name=${v%%:*}; flags=${v#*:}
      lin lolcats --config lolcats_plain --teacher $T --stage1-steps ${STEPS:-600} --stage2-steps ${STEPS:-600} $flags ${DIAL_ARGS:-} \
        --out $RUNS/dial-$name 2>&1 | quiet | tail -6
      lin eval $RUNS/dial-$name/final --tasks recall --limit ${RECALL_LIMIT:-4} --batch-size 16 --name $name ${DIAL_EVAL:-} \
        --out $RUNS/dial/$name.json 2>&1 | quiet | tail -4
    done
    # several dial jobs may share the rows: DIAL_TAIL=0 skips the tail below, DIAL_WAIT names the rows it waits for
    [ "${DIAL_TAIL:-1}" = 1 ] || exit 0
    for n in ${DIAL_WAIT:-}; do waitfor $RUNS/dial/$n.json 1500 || exit 1; done
    # each S under each of SPARSE_PRIORITIES and SPARSE_ANCHORS (recall and joint, the defaults: rows lolcats-sS;
    # others add their names: lolcats-s64-novelty, lolcats-s64-window, lolcats-s64-novelty-window), on the row
    # SPARSE_FROM's student (default lolcats; e.g. long4k: rows long4k-s256-window ...); TEACHER_ROW=0 skips the teacher
    src=${SPARSE_FROM:-lolcats}
    for S in ${SPARSE:-16 64 256}; do
      for P in ${SPARSE_PRIORITIES:-recall}; do
        for A in ${SPARSE_ANCHORS:-joint}; do
          name=$src-s$S; [ "$P" = recall ] || name=$name-$P; [ "$A" = joint ] || name=$name-$A
          lin eval $RUNS/dial-$src/final --tasks recall --limit ${RECALL_LIMIT:-4} --batch-size 16 --sparse-cache $S \
            --sparse-priority $P --sparse-anchor $A --name $name --out $RUNS/dial/$name.json 2>&1 | quiet | tail -4
        done
      done
    done
    [ "${TEACHER_ROW:-1}" = 0 ] || lin eval $T --tasks recall --limit ${RECALL_LIMIT:-4} --batch-size 16 --name teacher \
      --out $RUNS/dial/teacher.json 2>&1 | quiet | tail -4
    lin report $RUNS/dial --out $RUNS/dial/README.md --title "Memory against recall" && cp -r $RUNS/dial $OUT/ ;;
  length)  # issue #46: LoLCATs students that hold past their training length, STEPS per stage, rows LENGTH_ROWS
           # (space-separated names below; supra*: SUPRA, its decays capped by --decay-horizon); each row: held-out
           # books and corpus:sotu by position (8k blocks), the
           # books to 32k (POSLEN flags), passkey to 8k (no sparse cache; SPARSE_PASSKEY="S:priority:anchor ...": with
           # those caches too), then (TASKS=1) the zero-shot tasks
    declare -A ROW=([base]="" [span]="--decay span" [learned]="--decay learned" [gated]="--decay gated"
      [nope]="--feature-rope off" [nopespan]="--feature-rope off --decay span" [nopegated]="--feature-rope off --decay gated"
      [nopelearned]="--feature-rope off --decay learned" [separate]="--norm separate"
      [nopeseparate]="--feature-rope off --norm separate"
      [gated4k]="--decay gated --block-len 4096 --batch-size 2" [nopegated4k]="--feature-rope off --decay gated --block-len 4096 --batch-size 2"
      [nopespan4k]="--feature-rope off --decay span --block-len 4096 --batch-size 2" [sinks4]="--sparse-cache 4 --sparse-priority first"
      [supra]="" [supra1k]="--decay-horizon 1024" [supra256]="--decay-horizon 256")
    mkdir -p $RUNS/length
    for name in ${LENGTH_ROWS:?rows}; do
      [ -n "${ROW[$name]+x}" ] || { echo "unknown length row $name"; continue; }
      ck=$RUNS/len-$name/final
      if [[ $name == supra* ]]; then  # SUPRA rows: SUPRA_STEPS steps (default 1220: 10M tokens)
        lin supra --teacher $T --budget gpu --steps ${SUPRA_STEPS:-1220} ${ROW[$name]} --out $RUNS/len-$name 2>&1 \
          | quiet | tail -6
      else
        lin lolcats --config lolcats_plain --teacher $T --stage1-steps ${STEPS:-300} --stage2-steps ${STEPS:-300} ${ROW[$name]} \
          --out $RUNS/len-$name 2>&1 | quiet | tail -9
      fi
      length_eval $ck $name
    done ;;
  length-recipe)  # issue #46: a packaged recipe (RECIPE, default lolcats_long) at its own budget (RECIPE_ARGS adds flags,
                  # e.g. --stage1-steps 300) on the SmolLM2 teacher, or (TEACHER=gemma) on Gemma 3 270M staged by
                  # dev/gpu_teacher.sh, whose own rows (to its 32k context) come first unless TEACHER_ROWS=0 (they are
                  # in gpu-runs/length.jsonl); the rows are named NAME
    tea=$T; name=${NAME:-recipe}; mkdir -p $RUNS/length
    if [ "${TEACHER:-}" = gemma ]; then
      tea=/tmp/stage/gemma-3-270m.gguf; waitfor $tea 1500 || exit 1
      [ "${TEACHER_ROWS:-1}" = 0 ] || length_eval $tea gemma-teacher
    fi
    lin lolcats --config ${RECIPE:-lolcats_long} --teacher $tea ${RECIPE_ARGS:-} --out $RUNS/len-$name 2>&1 | quiet | tail -9
    length_eval $RUNS/len-$name/final $name ;;
  recall-probe)  # issue #46: where the length recipe's student (NAME, trained here with RECIPE_ARGS unless its run is
                 # there) loses the pass key: dev/recall_probe.py with VARIANTS (";"-separated)
    name=${NAME:-long1220}; ck=$RUNS/len-$name/final; mkdir -p $RUNS/length
    [ -e $ck ] || lin lolcats --config ${RECIPE:-lolcats_long} --teacher $T ${RECIPE_ARGS:-} --out $RUNS/len-$name 2>&1 \
      | quiet | tail -9
    python3 dev/recall_probe.py $ck --lengths ${PASSKEY_LENGTHS:-2k,4k,8k} --limit ${RECALL_LIMIT:-4} \
      --variants "${VARIANTS:-none;S=256;exact;S=256,lin=0}" --out $RUNS/length/probe-$name.json \
      2> $RUNS/length/probe-$name.err ;;  # (progress bars apart: they share lines with the rows)
  domains)  # issue #53: a LoLCATs recipe (RECIPE, default lolcats_tiers, the default student; RECIPE_ARGS, e.g. --data ...) trained as NAME, then
            # its student beside the teacher on every held-out domain (whole, by position to 8k, KL, greedy agreement),
            # the copy task and passkey; then the domains alone on 32k blocks (DOMAIN_32K=0 skips); TASKS=1: zero-shot.
            # FROM=OTHER: no training, OTHER's student scored as NAME (with EVAL_FLAGS, e.g. --sparse-cache 256);
            # DOMAINS_EVAL=0: not the domains, copy and passkey (e.g. FROM=x DOMAINS_EVAL=0 DOMAIN_32K=0 TASKS=1 on
            # another GPU: the zero-shot tasks beside the domains' scoring)
            # TEACHER=NAME: the named teacher staged by dev/gpu_teacher.sh (gemma-3-270m: with OVERLAY=1;
            # qwen2.5-coder-0.5b) instead of SmolLM2; DOMAIN_TASKS (default copy,passkey; empty: none) beside the domains
    name=${NAME:-recipe}; ck=$RUNS/dom-${FROM:-$name}/final; mkdir -p $RUNS/domains
    tea=$T; [ -n "${TEACHER:-}" ] && { tea=/tmp/stage/$TEACHER.gguf; waitfor $tea 1500 || exit 1; }
    [ -n "${FROM:-}" ] && { waitfor $RUNS/dom-$FROM/results.json 3000 || exit 1; }  # written once final/ is saved
    [ -e $ck ] || lin lolcats --config ${RECIPE:-lolcats_tiers} --teacher $tea ${RECIPE_ARGS:-} --out $RUNS/dom-$name 2>&1 \
      | quiet | tail -9
    dtasks=${DOMAIN_TASKS-copy,passkey}  # DOMAIN_TASKS= (empty): the domains alone (e.g. a named teacher's whole-file rows)
    [ "${DOMAINS_EVAL:-1}" = 0 ] || lin eval $ck --domains all --teacher $tea ${dtasks:+--tasks $dtasks --lengths 2k,4k,8k} \
      --limit ${RECALL_LIMIT:-5} --batch-size 16 --no-perplexity ${EVAL_FLAGS:-} --name $name \
      --out $RUNS/domains/$name.json 2>&1 | quiet | tail -12
    [ "${DOMAIN_32K:-1}" = 0 ] || lin eval $ck --domains all --position-len 32k --domain-blocks 4 --no-perplexity \
      ${EVAL_FLAGS:-} --name $name --out $RUNS/domains/$name-32k.json 2>&1 | quiet | tail -5
    if [ "${TASKS:-0}" = 1 ]; then evaluate $ck domains-$name; fi ;;
  length-teacher)  # the teacher's rows of the length table (its 8k context)
    mkdir -p $RUNS/length; length_eval $T teacher ;;
  dial-tasks)  # zero-shot tasks of a dial row's student: DIAL_CK (e.g. long4k), eval flags EVAL_FLAGS (e.g. the sparse
              # cache's), the name NAME
    waitfor $RUNS/dial/${DIAL_CK:?}.json 2400 || exit 1  # its recall row: written after its training
    gpu_slot
    evaluate $RUNS/dial-$DIAL_CK/final ${NAME:?} ;;
  *) echo "unknown job $1"; exit 2 ;;
esac
