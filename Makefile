# Two entry points (see README): `make run` (the main job) and `make test`.
# Both create .venv on first use: CPU torch 2.13.0 from the local wheel first, so pip never
# pulls a CUDA build, then stemlm with its dev extras.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stemlm-installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

.PHONY: install run test test-slow bench
install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/stemlm train

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done
