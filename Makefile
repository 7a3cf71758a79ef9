VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint format bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel; an unpinned torch would pull the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,bench]'
	# The triton a CUDA torch 2.11 install brings, beside the current one: the kernel variant
	# test compiles for sm_90 with both (tests/kernels/test_kernel_variants.py).
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-3.6.0 triton==3.6.0
	# Prometheus and promtool (Debian) for tests/deploy; those tests say why they skip without.
	command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; }; } || \
		echo "prometheus not installed: tests/deploy will be skipped"
	# Build the C++ CPU kernels for every instruction set the machine runs (the tests run each),
	# once (cached by torch); says why not where they cannot be.
	$(PY) -c "from kernels import cpu; print('CPU kernels:', {i: cpu.build(i) or 'built' for i in cpu.isas()} or cpu.load())"
	touch $@

install: $(STAMP)

serve: install
	$(VENV)/bin/kvserve fetch $(MODEL)
	$(VENV)/bin/kvserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q -rs tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# NVIDIA's kvpress for bench/kvpress_peer.py, in an environment of its own: it needs
# transformers below 5.3, the main one has a newer one.
KVPRESS_VENV := .venv-kvpress

.PHONY: kvpress
$(KVPRESS_VENV)/.installed:
	python3.11 -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q --upgrade pip
	# The CPU wheel first; an unpinned torch would pull the CUDA build.
	$(KVPRESS_VENV)/bin/pip install -q torch==2.13.0
	$(KVPRESS_VENV)/bin/pip install -q kvpress==0.5.5 transformers==5.2.0 gguf==0.19.0
	touch $@

kvpress: $(KVPRESS_VENV)/.installed
