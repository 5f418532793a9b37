#!/usr/bin/env bash
# Ferry a named teacher's GGUF (linearize.teacher.NAMED_TEACHERS, e.g. gemma-3-270m: 253 MB) to the GPU
# machine, whose calls carry at most 64 MiB each with the repo (~6 MB): split it here into parts of
# 50 MiB, one ignored folder each, and join them there with the sha256 checked.
#   here (after make teachers, or PYTHON=... for another environment):
#     bash dev/gpu_teacher.sh split gemma-3-270m     -> .gpu/t1 .. .gpu/tN (gemma-3-270m: N = 5)
#     PREFIX=q bash dev/gpu_teacher.sh split qwen2.5-coder-0.5b -> .gpu/q1 .. .gpu/q10 (several teachers staged at once)
#   there, one call per part (carry .gpu/tK, any order; the calls may also start jobs):
#     bash dev/gpu_teacher.sh take                   -> "K of N parts"; the call that brings the
#                                                           last one writes /tmp/stage/NAME.gguf
# /tmp/stage (STAGE=DIR: elsewhere) survives only while the machine stays warm. Then give
# --teacher /tmp/stage/NAME.gguf: the GPU machine dequantises it once, under $LINEARIZE_HOME.
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:?verb: split NAME or take} in
  split)
    name=${2:?which named teacher}
    gguf=$(PYTHONPATH=src ${PYTHON:-.venv/bin/python} -c \
      "import sys; from linearize.teacher import named_gguf_path; print(named_gguf_path(sys.argv[1]))" "$name")
    sha=$(sha256sum "$gguf" | cut -d' ' -f1)
    pre=.gpu/${PREFIX:-t}
    rm -rf "$pre"[0-9]*
    tmp=$(mktemp -d)
    split -b 50M -d -a 2 "$gguf" "$tmp/$name.gguf.part"
    parts=("$tmp"/*)
    k=0
    for part in "${parts[@]}"; do
      k=$((k + 1))
      mkdir -p "$pre$k"
      mv "$part" "$pre$k/"
      echo "$name ${#parts[@]} $sha" > "$pre$k/manifest"
    done
    rmdir "$tmp"
    du -sh "$pre"[0-9]*
    echo "$name: ${#parts[@]} parts; carry $pre""1 .. $pre${#parts[@]}, one per call, each running: bash dev/gpu_teacher.sh take" ;;
  take)
    root=${STAGE:-/tmp/stage}; mkdir -p "$root"
    carried=0
    for folder in .gpu/*[0-9]; do  # every carried part (of any teacher), kept apart by teacher
      [ -f "$folder/manifest" ] || continue
      read -r name n sha < "$folder/manifest"
      mkdir -p "$root/parts-$name" && cp "$folder"/*.gguf.part* "$root/parts-$name/" \
        && cp "$folder/manifest" "$root/parts-$name/manifest" && carried=1
    done
    [ $carried = 1 ] || { echo "no teacher part carried (carry .gpu/tK)"; exit 1; }
    for stage in "$root"/parts-*; do
      [ -f "$stage/manifest" ] || continue
      read -r name n sha < "$stage/manifest"
      have=$(find "$stage" -name "$name.gguf.part*" | wc -l)
      if [ "$have" -lt "$n" ]; then echo "$have of $n parts of $name here"; continue; fi
      cat "$stage/$name.gguf.part"* > "$root/$name.gguf.tmp"  # the glob sorts part00, part01, ...
      [ "$(sha256sum "$root/$name.gguf.tmp" | cut -d' ' -f1)" = "$sha" ] \
        || { echo "$name: sha256 mismatch after joining"; rm -f "$root/$name.gguf.tmp"; exit 1; }
      mv "$root/$name.gguf.tmp" "$root/$name.gguf" && rm -rf "$stage"
      echo "joined $root/$name.gguf ($n parts, sha256 checked)"
    done ;;
  *) echo "unknown verb $1 (split NAME, take)"; exit 2 ;;
esac
