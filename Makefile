# The README's two set-up commands: `make serve` and `make test`.
# Both create .venv, install the package with the local CPU torch build, then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL ?= sd
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

INSTALLED := $(VENV)/.installed

$(INSTALLED): pyproject.toml clients/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	# the client distribution first: the server depends on it for the wire format
	$(VENV)/bin/python -m pip install -q -e ./clients -e ".[test]"
	touch $@

.PHONY: install serve test lint bench
install: $(INSTALLED)

serve: $(INSTALLED)
	$(VENV)/bin/vae-service serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: lint
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint Dockerfile

bench: $(INSTALLED)
	$(VENV)/bin/python bench/bench_spine.py
