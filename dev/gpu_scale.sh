#!/usr/bin/env bash
# Issue #55's rows at a named shape (random weights: speed and memory do not depend on them), parts run one
# after another with nothing else on the GPU: `gpu_session.sh start s8 "SHAPE=llama-3-8b bash dev/gpu_scale.sh"`.
#   train    linearize lolcats (the default config: the gpu budget's default student, since 2026-11-30
#            lolcats_tiers'; TRAIN_ARGS='--config lolcats_mix' for the rows measured before) for
#            S1 + S2 steps (80 + 60) on the books: each stage's set-up / steady split and peak memory
#            (results.json); its final checkpoint is the student the next parts time
#   decode   (CK: another student than the train part's, e.g. profile-decode's with KEEP_CK=1)
#            the student's default fast path beside the teacher's static and fast paths, 1k prompts + NEW (256)
#            new tokens, batch 1 / 64 / 256: ms a step and each student row's bandwidth floor (bench's floor_ms)
#   prefill  1 x 32k and 1 x 128k (PREFILL_SHAPES), student's kernels beside the teacher's SDPA and flash
#   ceiling  the teacher's prefill kernels at 32k (bench.profile prefill): attention's share bounds the prefill's gain
#   profile-decode  where a decode step goes (kernels, bench.profile decode) at batch DECODE_PROFILE_BATCHES (64 256),
#            1k prompts, for two untrained students converted from the shape (speed does not depend on training):
#            lolcats_mix's and the default's layout (lolcats_tiers with KEEP (every other layer, 15 of 32) softmax
#            layers over 1,280, LONG (4) of them over 4,288); first the fused hybrid step alone at the shape's heads
#            (dev/step_bench.py: warps, value parts, chunks) and a float8 ring of 4,292 holding 1,280 tokens with its
#            empty blocks skipped and read (dev/window_step_bench.py --filled --skip); KEEP_CK=1 keeps the students
#            for `CK=/tmp/ckpt/conv-SHAPE-tiers ... decode`
#   window-parts  the float8 ring step at batch 1 / 4 / 64 with its parts capped at 16 or not (STEP_MAX_PARTS), on
#            SmolLM2's heads and the shape's, rings of 1,284 and 4,292 slots, full and holding 1,280 tokens
#            (dev/window_step_bench.py --max-parts 0 16): whether the cap becomes the default
#   profile  where a graphed stage-1 and stage-2 step of the default student goes at 2 x 4,096 (bench.profile train)
#   profile-uptrain  where an eager step of SUPRA's and XATL's (RetNet) student goes at the shape's width on its first
#            UP_LAYERS (8) layers, 1 x 4,096 (bench.profile train): the FSDP rows' XATL ran at half SUPRA's MFU
#   maxbatch the largest batch at a 32k context: the teacher's static cache holds 32,768 + 32 tokens a sequence
#            (TEACHER_BATCHES: a 32k prefill of 30 takes ~2 min, three a size), its prompts prefilled 2,048 tokens
#            at a time (whole, 20 x 32k's activations ran out of memory); the student's state does not grow with
#            length, so 128-token prompts + 64 new hold what 32k would (STUDENT_BATCHES, prefilled 256 at a time;
#            1,536 states of 87 MiB ran out at 8B)
#   fsdp2    (two GPUs) SUPRA and XATL (RetNet) training every weight under accelerate's FSDP config, FSDP_STEPS (20)
#            of FSDP_BATCH (1) x 4,096 per GPU: steady tok/s, peak memory per GPU, model FLOPs utilisation
#            (6 x parameters x tok/s over 2 x 790 TFLOP/s)
#   fsdp2-profile  (two GPUs) the same runs for FSDP_STEPS (8), the steps after the set-up profiled (--profile-steps
#            ${PROFILE_STEPS:-3}): kernels by time, the collectives among them, the GPU's busy share, on rank 0
#   link     (NPROC GPUs, 2) NCCL's all-gather, reduce-scatter and all-reduce of 512 MiB shares: ms and bus GB/s
#            (dev/link_bw.py), and nvidia-smi's topology: what FSDP's collectives can move on this host
#   sync-sites  (two GPUs) the same FSDP runs for FSDP_STEPS (6) under dev/sync_sites.py: where the host waits for the
#            GPU each step, by Python call site, on rank 0
#   peak-phases  which phase of stage 1 (the default's, S1 (8) steps, with and without --gradient-checkpointing) sets
#            its peak memory: each training step, optimizer step, evaluation and what runs between (dev/peak_phases.py)
#   ddp2     (two GPUs) LoLCATs (the default config) under torchrun, S1 + S2 steps: each stage's steady tok/s, for the
#            ratio to the `train` part's one GPU
#   fsdp2-lolcats  (two GPUs) LoLCATs under FSDP with --gradient-checkpointing (what docs/scale.md plans for 70B:
#            the default recipe, its window layers chosen on the sharded student; LOLCATS_ARGS='--config lolcats_mix'
#            for the spec without them), S1 + S2 steps of 1 x 8,192 a GPU: each stage's steady tok/s and peak memory
#            a GPU, the choice's time; e.g. SHAPE='llama-3-70b,layers=8'
#   Checkpointing on one GPU: TRAIN_ARGS=--gradient-checkpointing ... train (the time and memory it costs or saves)
# FSDP_NPROC (2): the processes of the FSDP parts (1: FSDP's code paths on one GPU).
# Rows land in $S (/tmp/runs/scale/SHAPE).
set -uo pipefail
SHAPE=${SHAPE:-llama-3-8b}; T=shape:$SHAPE; S=${S:-/tmp/runs/scale/$SHAPE}; R=/tmp/ckpt/scale-$SHAPE; mkdir -p "$S"
quiet() { grep -v -E "Warning|warn\(|it/s\]|s/it\]"; }
# fsdp_run RECIPE LOG STEPS WARMUP [FLAGS...]: one FSDP training on both GPUs, its run in $R-RECIPE
fsdp_run() {
  local recipe=$1 log=$2 steps=$3 warmup=$4; shift 4
  rm -rf "$R-$recipe"
  timeout ${FSDP_S:-480} accelerate launch --config_file "$(python3 -m linearize.recipes.launch fsdp)" --num_processes ${FSDP_NPROC:-2} \
    -m linearize $recipe --teacher "$T" --data gutenberg --steps $steps --block-len 4096 --batch-size ${FSDP_BATCH:-1} \
    --warmup-steps $warmup --eval-steps 100000 --eval-blocks 2 --keep-checkpoints 0 --out "$R-$recipe" "$@" > "$log" 2>&1
}
for part in ${@:-train decode prefill ceiling}; do
  echo "=== $SHAPE $part $(date +%T)"
  case $part in
    train)
      rm -rf "$R"
      timeout ${TRAIN_S:-900} python3 -m linearize lolcats --teacher "$T" --data gutenberg --stage1-steps ${S1:-80} \
        --stage2-steps ${S2:-60} --eval-steps 100000 --eval-blocks 2 --out "$R" ${TRAIN_ARGS:-} 2>&1 | quiet | tail -12
      python3 - "$R/results.json" "$S/train.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
keep = {k: r.get(k) for k in ("stage1", "stage2", "train")}
json.dump(keep, open(sys.argv[2], "w"), indent=1)
for stage in ("stage1", "stage2"):
    s = r.get(stage) or {}
    print(stage, "steady tok/s", (s.get("steady") or {}).get("tokens_per_second"), "set-up s",
          (s.get("setup") or {}).get("seconds"), "seconds", s.get("seconds"), "peak GB",
          {k: round(v / 1e9, 1) for k, v in s.items() if "peak" in k and isinstance(v, (int, float))})
EOF
      ;;
    decode)
      timeout ${DECODE_S:-540} python3 -m linearize bench "${CK:-$R/final}" --teacher "$T" --dtype bfloat16 --paths fast \
        --teacher-paths ${TEACHER_PATHS:-fast static} --batch-sizes ${BATCHES:-1 64 256} --new-tokens ${NEW:-256} \
        --prompt-len 1024 --out "$S/decode.json" 2>&1 | quiet | tee "$S/decode.log" | grep -E "^\| (student|teacher)|Error|error:" ;;
    prefill)
      timeout ${PREFILL_S:-420} python3 -m linearize bench "$R/final" --teacher "$T" --dtype bfloat16 \
        --prefill ${PREFILL_SHAPES:-1x32768 1x131072} --prefill-warmup 1 --prefill-repeats 3 --out "$S/prefill.json" \
        2>&1 | quiet | tee "$S/prefill.log" | grep -E "^\| (student|teacher)|Error|error:" ;;
    ceiling)
      timeout 200 python3 -m linearize.bench.profile prefill "$T" --batch 1 --prompt-len 32768 --top 8 \
        --out "$S/ceiling_teacher_32768.json" 2>&1 | quiet | tail -11 ;;
    profile-decode)
      n=$(python3 -c "from linearize.shapes import shape_config; print(shape_config('$SHAPE').num_hidden_layers)" 2>/dev/null || echo 32)
      keep=${KEEP:-$(python3 -c "print(','.join(str(i) for i in range(0, $n, 2)[:15]))")}
      long=${LONG:-$(python3 -c "k='$keep'.split(','); print(','.join(f'{i}:4288' for i in k[1::4][:4]))")}
      python3 dev/step_bench.py --shape ${STEP_SHAPE:-$SHAPE} --batches 1 64 256 --warps 0 8 --splits 0 2 --chunks 0 64 \
        --out "$S/step_bench.json" 2>&1 | quiet | grep -E "^\||rror"
      python3 dev/window_step_bench.py --shape ${STEP_SHAPE:-$SHAPE} --float8 --window 4292 --filled 1280 --skip 0 1 \
        --batches 64 256 --layers 15 --out "$S/window_step_filled.json" 2>&1 | quiet | grep -E "^\| held|rror"
      for spec in mix tiers; do
        ck=/tmp/ckpt/conv-$SHAPE-$spec; rm -rf "$ck"
        if [ $spec = mix ]; then args="--config lolcats_mix"
        else args="--config lolcats_tiers --keep-softmax $keep --softmax-window 1280,$long"; fi
        timeout 300 python3 -m linearize convert --teacher "$T" $args --out "$ck" 2>&1 | quiet | tail -2
        for b in ${DECODE_PROFILE_BATCHES:-64 256}; do
          timeout 300 python3 -m linearize.bench.profile decode "$ck" --batch $b --prompt-len 1024 --tokens 16 \
            --top ${TOP:-14} --out "$S/profile_decode_${spec}_$b.json" 2>&1 | quiet | grep -A17 "^decode:" | cut -c1-160
        done
        [ -n "${KEEP_CK:-}" ] || rm -rf "$ck"
      done ;;
    window-parts)
      for heads in smollm2-135m ${STEP_SHAPE:-$SHAPE}; do
        for ring in "1284" "4292" "4292 --filled 1280"; do
          python3 dev/window_step_bench.py --shape $heads --float8 --window $ring --batches 1 4 64 --max-parts 0 16 \
            --layers 15 --out "$S/window_parts_${heads}_${ring// /_}.json" 2>&1 | quiet | grep -E "^\| held|rror" \
            | sed "s/^/$heads $ring /"
        done
      done ;;
    profile)
      for m in lolcats-long-stage1 lolcats-long-stage2; do
        timeout 300 python3 -m linearize.bench.profile train --teacher "$T" --model $m --shape 2x4096 --cuda-graph \
          --top ${TOP:-40} --out "$S/profile_train_$m.json" 2>&1 | quiet | tail -22
      done ;;
    profile-uptrain)
      for m in supra retnet; do
        timeout 300 python3 -m linearize.bench.profile train --teacher "shape:$SHAPE,layers=${UP_LAYERS:-8}" --model $m \
          --shape 1x4096 --top ${TOP:-30} --out "$S/profile_uptrain_$m.json" 2>&1 | quiet | tail -34
      done ;;
    maxbatch)
      timeout 600 python3 -m linearize bench "$T" --teacher none --dtype bfloat16 --paths static \
        --batch-sizes ${TEACHER_BATCHES:-28 30} --new-tokens 32 --prompt-len 32768 --prefill-chunk 2048 \
        --out "$S/maxbatch_teacher.json" \
        2>&1 | quiet | tee "$S/maxbatch_teacher.log" | grep -E "^\| teacher|Error|error:"
      timeout 420 python3 -m linearize bench "$R/final" --teacher none --dtype bfloat16 --paths fast --prefill-batch 256 \
        --batch-sizes ${STUDENT_BATCHES:-1024 1152 1280 1344 1408 1472} --new-tokens 64 --prompt-len 128 \
        --out "$S/maxbatch_student.json" 2>&1 | quiet | tee "$S/maxbatch_student.log" | grep -E "^\| student|Error|error:" ;;
    fsdp2)
      for recipe in ${FSDP_RECIPES:-supra xatl}; do
        fsdp_run $recipe "$S/fsdp2-$recipe.log" ${FSDP_STEPS:-20} 5
        quiet < "$S/fsdp2-$recipe.log" | grep -E "Error|rror:" | sort -u | head -3
        python3 - "$R-$recipe/results.json" "$S/fsdp2-$recipe.json" $recipe <<'EOF'
import glob, json, math, os, struct, sys
r = json.load(open(sys.argv[1])); t = r["train"]
params = 0  # every weight trains: the saved student's tensors, from the safetensors headers
for f in glob.glob(os.path.join(os.path.dirname(sys.argv[1]), "final", "*.safetensors")):
    with open(f, "rb") as fh:
        head = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    params += sum(math.prod(v["shape"]) for k, v in head.items() if k != "__metadata__")
rate = (t.get("steady") or {}).get("tokens_per_second")
rec = {"train": t, "parameters": params,
       "mfu": 6 * params * rate / (2 * 790e12) if params and rate else None}
json.dump(rec, open(sys.argv[2], "w"), indent=1)
print(sys.argv[3], "FSDP x2:", t["steps"], "steps, steady tok/s", rate, "set-up s", (t.get("setup") or {}).get("seconds"),
      "peak GiB per GPU", [round(b / 2**30, 1) for b in t.get("peak_gpu_bytes_per_rank") or []], "allocator retries",
      t.get("alloc_retries_per_rank"), "MFU", rec["mfu"])
EOF
        rm -rf "$R-$recipe"  # 16 GB a run: the disk (128 GB on x2) holds few
      done ;;
    fsdp2-profile)
      for recipe in ${FSDP_RECIPES:-supra xatl}; do
        fsdp_run $recipe "$S/fsdp2-profile-$recipe.log" ${FSDP_STEPS:-8} 2 --profile-steps ${PROFILE_STEPS:-3}
        quiet < "$S/fsdp2-profile-$recipe.log" | grep -E "^profile of|^\| nccl|^GPU busy|Error|rror:" | head -12
        cp "$R-$recipe/train/profile.json" "$S/fsdp2-profile-$recipe.json" 2>/dev/null
        python3 -c "import json; t=json.load(open('$R-$recipe/results.json'))['train']; print('$recipe peak GiB a GPU', \
[round(b / 2**30, 1) for b in t.get('peak_gpu_bytes_per_rank') or []], 'allocator retries', t.get('alloc_retries_per_rank'))"
        rm -rf "$R-$recipe"
      done ;;
    link)
      timeout 120 torchrun --standalone --nproc_per_node ${NPROC:-2} dev/link_bw.py 2>&1 | grep -E "^\{|rror" | tee "$S/link.json" \
        | python3 -c "import json, sys; r = json.loads(sys.stdin.readline()); print(r.pop('topology')); print(r)" ;;
    sync-sites)
      for recipe in ${FSDP_RECIPES:-supra xatl}; do
        rm -rf "$R-$recipe"
        timeout ${FSDP_S:-480} accelerate launch --config_file "$(python3 -m linearize.recipes.launch fsdp)" --num_processes ${FSDP_NPROC:-2} \
          dev/sync_sites.py --after 2 $recipe --teacher "$T" --data gutenberg --steps ${FSDP_STEPS:-6} --block-len 4096 \
          --batch-size 1 --warmup-steps 2 --eval-steps 100000 --eval-blocks 2 --keep-checkpoints 0 --out "$R-$recipe" \
          > "$S/sync-sites-$recipe.log" 2>&1
        quiet < "$S/sync-sites-$recipe.log" | grep -E -A40 "^sync sites, rank 0" | head -60
        quiet < "$S/sync-sites-$recipe.log" | grep -E "Error|rror:" | sort -u | head -3
        rm -rf "$R-$recipe"
      done ;;
    peak-phases)
      # stage 1 of the default, with and without --gradient-checkpointing: which phase sets its peak
      for args in "" "--gradient-checkpointing"; do
        rm -rf "$R-peak"
        timeout ${PEAK_S:-200} python3 dev/peak_phases.py lolcats --teacher "$T" --data gutenberg --rows stage1-only \
          --stage1-steps ${S1:-8} --eval-steps 100000 --eval-blocks 2 --keep-checkpoints 0 --out "$R-peak" $args 2>&1 \
          | quiet | grep -E "^peak phases|Error|rror:" | head -3
      done
      rm -rf "$R-peak" ;;
    ddp2)
      rm -rf "$R-ddp2"
      timeout ${TRAIN_S:-900} torchrun --standalone --nproc_per_node 2 -m linearize lolcats --teacher "$T" --data gutenberg \
        --stage1-steps ${S1:-80} --stage2-steps ${S2:-60} --eval-steps 100000 --eval-blocks 2 --keep-checkpoints 0 \
        --out "$R-ddp2" > "$S/ddp2.log" 2>&1
      quiet < "$S/ddp2.log" | grep -v "copy/s\]" | grep -E -B2 -A8 "Error|rror:" | head -40
      python3 -c "import json; r=json.load(open('$R-ddp2/results.json')); json.dump({k: r.get(k) for k in ('stage1', 'stage2')}, \
open('$S/ddp2.json', 'w'), indent=1); [print(s, 'x2 steady tok/s', (r[s].get('steady') or {}).get('tokens_per_second'), \
'peak', r[s].get('peak_gpu_bytes_per_rank')) for s in ('stage1', 'stage2')]" ;;
    fsdp2-lolcats)
      rm -rf "$R-lolcats"
      timeout ${FSDP_S:-600} accelerate launch --config_file "$(python3 -m linearize.recipes.launch fsdp)" --num_processes ${FSDP_NPROC:-2} \
        -m linearize lolcats --teacher "$T" ${LOLCATS_ARGS:-} --block-len 8192 --batch-size 1 --data gutenberg \
        --stage1-steps ${S1:-40} --stage2-steps ${S2:-30} --gradient-checkpointing \
        --eval-steps 100000 --eval-blocks 2 --keep-checkpoints 0 --out "$R-lolcats" > "$S/fsdp2-lolcats.log" 2>&1
      quiet < "$S/fsdp2-lolcats.log" | grep -E "stage[12]:|wall time|softmax kept|Error|rror:" | head -8
      cp "$R-lolcats/results.json" "$S/fsdp2-lolcats.json" 2>/dev/null
      rm -rf "$R-lolcats" ;;
    *) echo "unknown part $part" ;;
  esac
done
