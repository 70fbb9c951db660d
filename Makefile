# The README's two set-up commands: `make serve` and `make test`. Both create .venv and install
# torch and the package into it; `make serve` only what serving needs, `make test` the test tools
# on top. torch is TORCH_SPEC from pip's own index: what that index serves for this machine (PyPI's
# Linux wheels of torch are CUDA builds of several GB); TORCH_INDEX picks another build, e.g.
# https://download.pytorch.org/whl/cpu (CPU only) or https://download.pytorch.org/whl/cu128.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
MODEL ?= sd
HOST ?= 127.0.0.1
PORT ?= 8000
# 0: no gRPC. Serve's gRPC proxy listens on every interface whatever HOST says: on a shared host,
# turn it on with a token (VAE_SERVICE_AUTH_TOKEN) or behind a firewall
GRPC_PORT ?= 0
PYTEST_ARGS ?=
# pytest-xdist workers for the unit suite (tests/conftest.py splits torch's threads among them);
# each test file runs on one worker, so its module fixtures (engines, saved models) are built once
UNIT_WORKERS ?= 2
UNIT_SUITE = $(VENV)/bin/python -m pytest tests/unit -n $(UNIT_WORKERS) --dist loadfile $(PYTEST_ARGS)

SERVING := $(VENV)/.installed-serving
INSTALLED := $(VENV)/.installed

# the venv and torch; then the client distribution with the server (it depends on the client for the wire format)
define install_into_venv
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/python -m pip install -e ./clients -e $(1)
	@$(VENV)/bin/python -c "import torch; print('Installed torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU only)')"
	@echo "$(VENV) now takes $$(du -sh $(VENV) | cut -f1) on disk"
endef

$(SERVING): pyproject.toml clients/pyproject.toml
	@echo "Installing into $(VENV): $(TORCH_SPEC), then vae-service with Ray Serve, Ray Data and diffusers (pip lists each package as it goes; a few minutes on a fresh machine)"
	$(call install_into_venv,.)
	touch $@

# one pip pass for the service and the test tools (a second pass would check every package again)
$(INSTALLED): pyproject.toml clients/pyproject.toml
	@echo "Installing into $(VENV): $(TORCH_SPEC), vae-service with Ray Serve, Ray Data and diffusers, and the test tools (pytest, xdist, hypothesis, ruff, hadolint, ...; a few minutes on a fresh machine)"
	$(call install_into_venv,".[test]")
	touch $(SERVING) $@

.PHONY: install serve test test-unit lint bench
install: $(INSTALLED)

serve: $(SERVING)
	$(VENV)/bin/vae-service serve --model $(MODEL) --host $(HOST) --port $(PORT) --grpc-port $(GRPC_PORT)

# each step says what it runs and its cost on a 2-core CPU before it runs, and how long it took after
TIMED = tests/timed.sh

# the unit suite in parallel workers, then the Ray suites (one shared local cluster) in order
test: lint
	@$(TIMED) "unit suite" "7 minutes" $(UNIT_SUITE)
	@$(TIMED) "Ray suites" "25 minutes" $(VENV)/bin/python -m pytest tests --ignore=tests/unit $(PYTEST_ARGS)

test-unit: $(INSTALLED)
	@$(TIMED) "unit suite" "7 minutes" $(UNIT_SUITE)

lint: $(INSTALLED)
	@$(TIMED) "ruff check" "1 s" $(VENV)/bin/ruff check .
	@$(TIMED) "ruff format" "1 s" $(VENV)/bin/ruff format --check .
	@$(TIMED) "hadolint" "1 s" $(VENV)/bin/hadolint Dockerfile

bench: $(INSTALLED)
	$(VENV)/bin/python bench/bench_spine.py
