# Two entry points (see README): `make run` (the main job) and `make test`.
# Both create .venv on first use: CPU torch 2.13.0 from the local wheel first, so pip never
# pulls a CUDA build, then stemlm with its dev extras at the versions in constraints.txt.
# `make test-latest` checks the newest releases of every dependency in a separate .venv-latest.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stemlm-installed
LATEST := .venv-latest

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

.PHONY: install run demo demo-real test test-slow test-latest bench bench-check gpu-check
install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/stemlm train

# A model that knows the country facts and a row swap that changes one answer (~2-3 min on 2 cores).
demo: $(STAMP)
	$(VENV)/bin/stemlm demo

# The same edit on a real pretrained model: SmolLM2-135M with calibrated STEM rows (a few minutes; converted once).
demo-real: $(STAMP)
	$(VENV)/bin/stemlm demo --model smollm2

# The suite runs in TEST_WORKERS processes (pytest-xdist): on the 2-core CI machine 2 workers take ~4 min
# where one process takes ~7 (most tests are short and single-threaded). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# The newest releases (torch stays at the local CPU wheel): a new upstream release shows up here
# before it reaches constraints.txt.
test-latest:
	rm -rf $(LATEST)
	python3 -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q torch==2.13.0
	echo "torch==2.13.0" > $(LATEST)/torch-only.txt
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(LATEST)/torch-only.txt -e ".[dev]"
	$(LATEST)/bin/python -m pip list | grep -i -E "^(transformers|tokenizers|safetensors|numpy) "
	$(LATEST)/bin/python -m pytest -n $(TEST_WORKERS)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

# Re-measure the README's CPU figures at HEAD: each benchmark 3 times, interleaved, against the committed JSON
# (CHECK_ARGS="--only P7,serve" for a selection); writes benchmarks/results/check.json and check.md.
bench-check: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) benchmarks/check.py $(CHECK_ARGS)

# Every GPU figure of issue 27 side by side (docs/gpu.md): run on the GPU machine from this source
# tree, with no install (only torch, numpy, safetensors, tokenizers and pyyaml need importing).
# GPU_ARGS=--dry-run runs it on the CPU at tiny shapes.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/gpu_suite.py $(GPU_ARGS)
