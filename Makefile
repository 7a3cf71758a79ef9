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
	# Build the C++ CPU kernels once (cached by torch); says why not where they cannot be.
	$(PY) -c "from kernels import cpu; print('CPU kernels:', cpu.load() or 'built')"
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
