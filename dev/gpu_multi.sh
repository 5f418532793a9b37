#!/usr/bin/env bash
# Issue #23 on a machine with 2 GPUs (the device tool's nvidia-h200-x2), in three calls:
#   1. carry .gpu/a .whl .gpu/g:  bash dev/gpu_multi.sh setup     (wheels, teacher half, corpus)
#   2. carry .gpu/b:              bash dev/gpu_multi.sh join same  (teacher joined; same-batch runs)
#   3. (nothing):                 bash dev/gpu_multi.sh speed fsdp
# Parts (each prints its figures and writes JSON under $OUT):
#   same   LoLCATs, 60 + 60 steps, seed 0: 1 GPU at batch 8 against torchrun on 2 GPUs at batch 4
#          each (the same global batch): training losses step by step and the held-out perplexities
#   speed  tokens/s of LoLCATs stage 1 / stage 2 and SUPRA at batch 8 per GPU: 1 GPU, then 2 GPUs
#   fsdp   LoLCATs stage 1 under accelerate's FSDP config (linearize.recipes.launch fsdp): loss and
#          peak memory of each GPU
# .gpu/g holds the corpus as one archive: tar -C .gpu/e -cJf .gpu/g/gutenberg.tar.xz gutenberg.
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
  cp $R/$name/results.json "$OUT/$name.json" 2>/dev/null; cp $R/$name/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
}
one=(env CUDA_VISIBLE_DEVICES=0 python3); two=(torchrun --standalone --nproc_per_node 2)
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    setup)
      mkdir -p /tmp/stage /tmp/linhome && cp .gpu/a/teacher.gguf.part1 /tmp/stage/ \
        && tar -C /tmp/linhome -xJf .gpu/g/gutenberg.tar.xz \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt" ;;
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
      lolcats speed-lolcats-1gpu "${one[@]}" -- --batch-size 8 --stage1-steps 60 --stage2-steps 60 --eval-steps 1000
      lolcats speed-lolcats-2gpu "${two[@]}" -- --batch-size 8 --stage1-steps 60 --stage2-steps 60 --eval-steps 1000
      for n in 1 2; do
        launcher=("${one[@]}"); [ $n = 2 ] && launcher=("${two[@]}")
        /usr/bin/time -f "supra-$n wall %e s" timeout 300 "${launcher[@]}" -m linearize supra --teacher $T --budget gpu \
          --batch-size 8 --steps 120 --eval-steps 1000 --eval-blocks 16 --seed 0 --out $R/supra-$n 2>&1 | quiet | tail -5
        cp $R/supra-$n/results.json "$OUT/speed-supra-${n}gpu.json" 2>/dev/null
      done
      python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def get(name, *path):
    d = json.loads((out / name).read_text())
    for p in path:
        d = d[p]
    return d
rows = {}
for stage in ("stage1", "stage2"):
    one, two = (get(f"speed-lolcats-{n}gpu.json", stage, "tokens_per_second") for n in (1, 2))
    rows[f"lolcats {stage}"] = [one, two, two / one]
def supra(n):
    d = json.loads((out / f"speed-supra-{n}gpu.json").read_text())
    return d.get("tokens_per_second") or d.get("train", {}).get("tokens_per_second")
try:
    rows["supra"] = [supra(1), supra(2), supra(2) / supra(1)]
except Exception as e:
    rows["supra"] = f"not read: {e}"
(out / "speed.json").write_text(json.dumps(rows, indent=1))
for k, v in rows.items():
    print(k, v if isinstance(v, str) else f"1 GPU {v[0]:,.0f} tok/s, 2 GPUs {v[1]:,.0f} tok/s, {v[2]:.2f}x")
PY
      ;;
    fsdp)
      cfg=$(python3 -m linearize.recipes.launch fsdp)
      lolcats fsdp-stage1 accelerate launch --config_file "$cfg" --num_processes 2 -- \
        --rows stage1-only --batch-size 4 --stage1-steps 30 --eval-steps 1000
      python3 -c "import json,sys; d=json.load(open('$OUT/fsdp-stage1.json')); s=d.get('stage1',{}); \
print('fsdp stage 1:', s.get('steps'), 'steps', s.get('tokens_per_second'), 'tok/s, peak GiB (rank 0)', \
(s.get('peak_gpu_bytes') or 0)/2**30, 'ppl', d.get('perplexity'))" 2>&1 ;;
    *) echo "unknown part $part" ;;
  esac
done
