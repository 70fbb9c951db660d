# The README's two set-up commands: `make serve` and `make test`.
# Both create .venv, install the package with the local CPU torch build, then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL ?= sd
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# pytest-xdist workers for the unit suite (tests/conftest.py splits torch's threads among them)
UNIT_WORKERS ?= 2

INSTALLED := $(VENV)/.installed

$(INSTALLED): pyproject.toml clients/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	# the client distribution first: the server depends on it for the wire format
	$(VENV)/bin/python -m pip install -q -e ./clients -e ".[test]"
	touch $@

.PHONY: install serve test test-unit lint bench
install: $(INSTALLED)

serve: $(INSTALLED)
	$(VENV)/bin/vae-service serve --model $(MODEL) --host $(HOST) --port $(PORT)

# the unit suite in parallel workers, then the Ray suites (one shared local cluster) in order
test: lint
	$(VENV)/bin/python -m pytest tests/unit -n $(UNIT_WORKERS) $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest tests --ignore=tests/unit $(PYTEST_ARGS)

test-unit: $(INSTALLED)
	$(VENV)/bin/python -m pytest tests/unit -n $(UNIT_WORKERS) $(PYTEST_ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint Dockerfile

bench: $(INSTALLED)
	$(VENV)/bin/python bench/bench_spine.py
