# Quick start: `make demo` (a local swarm training a small model) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
# Installed only when the venv has no torch at all, so a GPU user's CUDA build is kept.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup test test-fast test-integration browser demo lint bench bench-links bench-links-quick bench-convergence bench-convergence-quick bench-bubbles bench-control-plane bench-overhead bench-timeline bench-time-to-target bench-time-to-target-quick gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# Tiers (README, "Tests"): unit (pure logic, seconds) and integration (real peers on loopback, minutes).
# The 25 slowest tests are listed at the end, so CI logs (.ci/run) show where the time goes.
test: setup
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m unit $(PYTEST_ARGS)

test-integration: setup
	$(BIN)/python -m pytest -q -m integration --durations=25 $(PYTEST_ARGS)

# The monitor's browser test needs a headless chromium on PATH (Debian/Ubuntu package; root or sudo).
# Tests never install anything: without it that test is skipped.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null \
	  || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }
	@echo "chromium: $$(command -v chromium || command -v chromium-browser)"

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

# Control-plane bytes per token by source, in the network lab (root): one message's wire cost
# (results/stream_cost.json), runs of 24 and 128 micro-batches (results/control_plane.json), then
# `python -m benchmarks.control_plane --render` for BENCHMARKS.md (section "Control plane").
bench-control-plane: setup
	$(BIN)/python -m benchmarks.stream_cost --concurrency 4
	$(BIN)/python -m benchmarks.stream_cost --concurrency 4 --channels off
	$(BIN)/python -m benchmarks.control_plane --variant after

# Where the cycles go: CPU per 1,000 tokens by process and thread, swarm vs 1F1B (loopback; py-spy optional).
bench-overhead: setup
	$(BIN)/python -m benchmarks.overhead --spy

# Where the idle time is: per-micro-batch timelines of the stage peers, swarm vs 1F1B (loopback).
bench-timeline: setup
	$(BIN)/python -m benchmarks.timeline --reps 2 --tag after

# Measured time to a target held-out loss, 1F1B vs the swarm, at 100 and 20 Mbit/s (root, like bench-links).
bench-time-to-target: setup
	$(BIN)/python -m benchmarks.time_to_target

bench-time-to-target-quick: setup
	$(BIN)/python -m benchmarks.time_to_target --quick

# Training quality: swarms on loopback vs one process (108 runs, hours on 2 cores; --quick: minutes).
bench-convergence: setup
	$(BIN)/python -m benchmarks.convergence

bench-convergence-quick: setup
	$(BIN)/python -m benchmarks.convergence --quick

# Pipeline bubbles with emulated compute per stage: GPipe, 1F1B, swarm sync and async (tens of minutes).
bench-bubbles: setup
	$(BIN)/python -m benchmarks.bubbles

# On a machine with a GPU (about 5 minutes; skips cleanly without CUDA).
gpu-check: setup
	$(BIN)/python -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) runs .pytest_cache
