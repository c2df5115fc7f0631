# exl — two commands: `make demo` (quantize and chat with the demo model) and `make test`.
PY ?= python3
PIP := $(PY) -m pip --disable-pip-version-check
# The CPU build of PyTorch (a plain `torch` requirement would pull the multi-GB CUDA build).
TORCH ?= torch==2.13.0

.PHONY: install install-dev demo test test-all cuda-check bench

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e .

install-dev:
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"

demo: install
	$(PY) -m exl.demo

cuda-check:
	$(PY) -m cuda_ext.compile_check

test: install-dev
	@if [ -f cuda_ext/compile_check.py ]; then $(PY) -m cuda_ext.compile_check; fi
	$(PY) -m pytest

test-all: install-dev
	$(PY) -m pytest -m "not gpu"
