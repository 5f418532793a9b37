#!/usr/bin/env bash
# Issue #23 on a machine with 2 GPUs (the device tool's nvidia-h200-x2), in three calls:
#   1. carry .gpu/a .whl .gpu/g:  bash dev/gpu_multi.sh setup     (wheels, teacher half, corpus)
#   2. carry .gpu/b:              bash dev/gpu_multi.sh join same  (teacher joined; same-batch runs)
#   3. (nothing):                 bash dev/gpu_multi.sh speed fsdp
# Parts (each prints its figures and writes JSON under $OUT):
#   same   LoLCATs, 60 + 60 steps, seed 0: 1 GPU at batch 8 against torchrun on 2 GPUs at batch 4
#          each (the same global batch): training losses step by step and the held-out perplexities
#   speed  tokens/s of LoLCATs stage 1 / stage 2 and SUPRA at batch 8 per GPU (STEPS=300 per stage): 1 GPU,
#          then 2 GPUs; whole-stage and steady (from logged step WARM=50 on) figures; SUPRA_ARGS="--cuda-graph off"
#          TAG=-eager: SUPRA's rows with those flags, recorded under that tag (SUPRA graphs its steps by default,
#          --cuda-graph auto; records made before that: untagged rows eager, -graphed ones with --cuda-graph)
#   fsdp-distill  SUPRA's distillation (align 20 steps, then kl+lm, FSDP_STEPS) under FSDP and under torchrun:
#          tokens/s, peak memory per GPU, the teacher's shards
#   probe  ms per SUPRA training step in variants (dev/ddp_probe.py): DDP's options, its hooks, a host sync
#   fsdp   LoLCATs stage 1 under accelerate's FSDP config (linearize.recipes.launch fsdp) and under torchrun
#          (data-parallel), batch 8 per GPU: tokens/s, perplexity, attention MSE, peak memory of each GPU
# .gpu/g holds the corpus as one archive: mkdir -p .gpu/g && cp .gpu/e/gutenberg.tar.xz .gpu/g/.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=/tmp/runs/multi; mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LINEARIZE_HOME=/tmp/linhome PYTHONPATH=/tmp/site:$PWD/src
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TQDM_DISABLE=1
T=/tmp/stage/teacher.gguf
quiet() { grep -v -E "it/s\]|s/it\]|Warning|warn\(|^\s*$"; }
lolcats() {  # lolcats NAME LAUNCHER... -- ARGS...
  local name=$1; shift
  local launcher=(); while [ "$1" != -- ]; do launcher+=("$1"); shift; done; shift
  timeout 300 "${launcher[@]}" -m linearize lolcats --teacher $T --budget gpu --eval-blocks 16 --seed 0 \
    --out $R/$name "$@" 2>&1 | quiet | tail -8
  local res; res=$(ls $R/$name/results.json $R/$name/*/results.json 2>/dev/null | head -1)
  [ -n "$res" ] && cp "$res" "$OUT/$name.json"
  res=$(ls $R/$name/metrics.jsonl $R/$name/*/metrics.jsonl 2>/dev/null | head -1)
  [ -n "$res" ] && cp "$res" "$OUT/$name.metrics.jsonl"
}
one=(env CUDA_VISIBLE_DEVICES=0 python3); two=(torchrun --standalone --nproc_per_node 2)
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    setup)
      mkdir -p /tmp/stage /tmp/linhome && cp .gpu/a/teacher.gguf.part1 /tmp/stage/ \
        && tar -C /tmp/linhome -xJf .gpu/g/gutenberg.tar.xz \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt" \
        && nvidia-smi topo -m | tee -a "$OUT/device.txt" ;;  # NVLink or PCIe: what the all-reduce runs over
    join)
      cat /tmp/stage/teacher.gguf.part1 .gpu/b/teacher.gguf.part2 > $T.tmp \
        && [ "$(sha256sum $T.tmp | cut -d' ' -f1)" = "$(cat .gpu/b/teacher.gguf.sha256)" ] && mv $T.tmp $T \
        && echo "teacher joined" ;;
    same)
      lolcats same-1gpu "${one[@]}" -- --batch-size 8 --stage1-steps 60 --stage2-steps 60 --eval-steps 30
      lolcats same-2gpu "${two[@]}" -- --batch-size 4 --stage1-steps 60 --stage2-steps 60 --eval-steps 30
      python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def losses(name):
    rows = [json.loads(l) for l in (out / f"{name}.metrics.jsonl").read_text().splitlines()]
    return {(r["stage"], r["step"]): r["loss"] for r in rows if "loss" in r}
a, b = losses("same-1gpu"), losses("same-2gpu")
common = sorted(set(a) & set(b))
rel = [abs(a[k] - b[k]) / abs(a[k]) for k in common]
pa = json.loads((out / "same-1gpu.json").read_text())["perplexity"]
pb = json.loads((out / "same-2gpu.json").read_text())["perplexity"]
rec = {"points": len(common), "max_rel_diff": max(rel), "mean_rel_diff": sum(rel) / len(rel),
       "losses": {f"{s}@{t}": [a[(s, t)], b[(s, t)]] for s, t in common}, "perplexity_1gpu": pa, "perplexity_2gpu": pb}
(out / "same.json").write_text(json.dumps(rec, indent=1))
print(f"same global batch: {len(common)} logged losses, max relative difference {max(rel):.2e}, "
      f"mean {rec['mean_rel_diff']:.2e}; ppl 1 GPU {pa}, 2 GPUs {pb}")
PY
      ;;
    speed)
      # STEPS steps per stage; tokens/s over the whole stage and "steady" (from the logged step
      # WARM on, from metrics.jsonl's elapsed_s: the first steps' compilation left out)
      # (speed-lolcats and speed-supra run each half, for calls of 10 minutes; speed then sums up)
      S=${STEPS:-300}
      [ -n "${NO_LOLCATS:-}" ] || {
      lolcats speed-lolcats-1gpu "${one[@]}" -- --batch-size 8 --stage1-steps $S --stage2-steps $S --eval-steps 1000
      lolcats speed-lolcats-2gpu "${two[@]}" -- --batch-size 8 --stage1-steps $S --stage2-steps $S --eval-steps 1000; }
      [ -n "${NO_SUPRA:-}" ] || {
      [ -e $R/supra-warm ] || timeout 200 "${one[@]}" -m linearize supra --teacher $T --budget gpu --batch-size 8 \
        --steps 20 --eval-steps 1000 --eval-blocks 4 --seed 0 --out $R/supra-warm 2>&1 | quiet | tail -2  # fla compiles once
      for n in 1 2; do
        launcher=("${one[@]}"); [ $n = 2 ] && launcher=("${two[@]}")
        timeout 300 "${launcher[@]}" -m linearize supra --teacher $T --budget gpu ${SUPRA_ARGS:-} \
          --batch-size 8 --steps $S --eval-steps 1000 --eval-blocks 16 --seed 0 --out $R/supra${TAG:-}-$n 2>&1 | quiet | tail -5
        cp $R/supra${TAG:-}-$n/results.json "$OUT/speed-supra${TAG:-}-${n}gpu.json" 2>/dev/null
        cp $R/supra${TAG:-}-$n/metrics.jsonl "$OUT/speed-supra${TAG:-}-${n}gpu.metrics.jsonl" 2>/dev/null
      done; }
      cp "$OUT"/speed-* /tmp/runs/multi/ 2>/dev/null; cp /tmp/runs/multi/speed-* "$OUT"/ 2>/dev/null  # both halves' records
      TAG=${TAG:-} WARM=${WARM:-50} python3 - "$OUT" <<'PY'
import json, os, sys, pathlib
out, warm = pathlib.Path(sys.argv[1]), int(os.environ["WARM"])
def steady(name, stage, tokens_per_step):
    rows = [json.loads(l) for l in (out / f"{name}.metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("stage") == stage and "loss" in r and r.get("elapsed_s") is not None]
    a = next(r for r in rows if r["step"] >= warm); b = rows[-1]
    return (b["step"] - a["step"]) * tokens_per_step / (b["elapsed_s"] - a["elapsed_s"])
rows = {}
tag = os.environ.get("TAG", "")
for label, stage, whole in (("lolcats stage1", "stage1[0]", ("stage1",)), ("lolcats stage2", "stage2", ("stage2",)),
                            ("supra" + tag, "uptrain", ("train",))):
    base = "speed-lolcats" if label.startswith("lolcats") else "speed-supra" + tag
    rec = {}
    if not (out / f"{base}-2gpu.json").exists():
        continue
    for n in (1, 2):
        d = json.loads((out / f"{base}-{n}gpu.json").read_text())
        for p in whole:
            d = d[p]
        try:
            st = steady(f"{base}-{n}gpu", stage, 8 * 1024 * n)
        except (StopIteration, FileNotFoundError, KeyError) as e:
            st = None
        rec[f"{n}gpu"] = {"whole": d["tokens_per_second"], "steady": st}
    rec["ratio_whole"] = rec["2gpu"]["whole"] / rec["1gpu"]["whole"]
    rec["ratio_steady"] = rec["2gpu"]["steady"] / rec["1gpu"]["steady"] if rec["1gpu"]["steady"] and rec["2gpu"]["steady"] else None
    rows[label] = rec
(out / f"speed{tag}.json").write_text(json.dumps(rows, indent=1))
for k, v in rows.items():
    print(k, json.dumps(v))
PY
      ;;
    fsdp)
      cfg=$(python3 -m linearize.recipes.launch fsdp)
      lolcats fsdp-stage1 accelerate launch --config_file "$cfg" --num_processes 2 -- \
        --rows stage1-only --batch-size 8 --stage1-steps ${FSDP_STEPS:-100} --eval-steps 1000
      lolcats ddp-stage1 "${two[@]}" -- --rows stage1-only --batch-size 8 --stage1-steps ${FSDP_STEPS:-100} --eval-steps 1000
      for r in fsdp ddp; do python3 -c "import json,sys; d=json.load(open('$OUT/$r-stage1.json')); s=d.get('stage1',{}); \
print('$r stage 1:', s.get('steps'), 'steps', round(s.get('tokens_per_second') or 0), 'tok/s, peak GiB per rank', \
[round(b/2**30, 2) for b in s.get('peak_gpu_bytes_per_rank') or []], 'ppl', d.get('perplexity'), 'mse', \
sum(d['layer_mse_after'].values())/len(d['layer_mse_after']))" 2>&1; done ;;
    fsdp-distill)  # SUPRA learning from the teacher (align, then kl+lm) under FSDP (the frozen teacher sharded
                   # too) and under torchrun: tokens/s, peak memory of each GPU, how many ways the teacher was split
      cfg=$(python3 -m linearize.recipes.launch fsdp)
      for r in fsdp ddp; do
        launcher=(accelerate launch --config_file "$cfg" --num_processes 2); [ $r = ddp ] && launcher=("${two[@]}")
        timeout 300 "${launcher[@]}" -m linearize supra --teacher $T --budget gpu --batch-size 8 --align-steps 20 \
          --loss kl+lm --steps ${FSDP_STEPS:-100} --eval-steps 1000 --eval-blocks 16 --seed 0 --out $R/distill-$r \
          > "$OUT/distill-$r.log" 2>&1  # the whole log comes back: a failure's traceback is in it
        quiet < "$OUT/distill-$r.log" | grep -E "Error|rror:" | sort -u | head -3; quiet < "$OUT/distill-$r.log" | tail -6
        cp $R/distill-$r/results.json "$OUT/distill-$r.json" 2>/dev/null
        python3 -c "import json; d=json.load(open('$OUT/distill-$r.json')); t=d['train']; print('$r distillation:', \
t['steps'], 'steps', round(t['tokens_per_second']), 'tok/s, peak GiB per rank', [round(b/2**30, 2) for b in \
t.get('peak_gpu_bytes_per_rank') or []], 'teacher sharded over', d.get('teacher_sharded_over'), 'graphs', d.get('cuda_graph'))" 2>&1
      done ;;
    probe)  # where a data-parallel SUPRA step loses time (dev/ddp_probe.py): one process, then two
      timeout 200 "${one[@]}" dev/ddp_probe.py $T 2>&1 | grep -v -i warn | tail -3 | tee "$OUT/probe-1gpu.txt"
      timeout 300 torchrun --standalone --nproc_per_node 2 dev/ddp_probe.py $T ${PROBE_ARGS:-} 2>&1 | grep -v -i warn \
        | tail -${PROBE_TAIL:-3} | tee "$OUT/probe-2gpu.txt" ;;
    *) echo "unknown part $part" ;;
  esac
done
