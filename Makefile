# Quick start: `make demo` (a local swarm training a small model) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
# Installed only when the venv has no torch at all, so a GPU user's CUDA build is kept.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup test test-fast demo lint bench bench-links bench-links-quick bench-convergence bench-convergence-quick clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: setup
	$(BIN)/swarm demo $(DEMO_ARGS)

lint: setup
	$(BIN)/ruff check swarm peer compression tests benchmarks examples
	$(BIN)/ruff format --check swarm peer compression tests benchmarks examples

bench: setup
	$(BIN)/python -m benchmarks.codecs

# The link benchmark needs root for network namespaces (it says so otherwise; --loopback runs without).
bench-links: setup
	$(BIN)/python -m benchmarks.links

bench-links-quick: setup
	$(BIN)/python -m benchmarks.links --quick

# Training quality: swarms on loopback vs one process (108 runs, hours on 2 cores; --quick: minutes).
bench-convergence: setup
	$(BIN)/python -m benchmarks.convergence

bench-convergence-quick: setup
	$(BIN)/python -m benchmarks.convergence --quick

clean:
	rm -rf $(VENV) runs .pytest_cache
