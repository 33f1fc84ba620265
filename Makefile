# omnikv: `make demo` runs the two-stage pipeline demo, `make test` runs lint + the whole suite.
# Both build .venv from nothing. torch==2.13.0 is installed first so that no CUDA build is pulled.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.omnikv-base
DEV_STAMP := $(VENV)/.omnikv-dev
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: demo test lint unit bench clean system-deps

$(BASE_STAMP): pyproject.toml
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || (apt-get update && apt-get install -y python3-venv)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	touch $@

# Debian packages the engine tests need (Mooncake loads libibverbs even for tcp).
system-deps:
	@if ! ldconfig -p | grep -q libibverbs.so.1; then \
	  if command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 iproute2 util-linux; \
	  else echo "warning: cannot install libibverbs1; Mooncake tests will be skipped" >&2; fi; \
	fi

$(DEV_STAMP): $(BASE_STAMP) | system-deps
	$(PIP) install -e '.[dev,mooncake]'
	touch $@

demo: $(BASE_STAMP)
	$(VENV)/bin/omnikv demo

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

# Installs happen first (they need the registries); the suite then runs in a loopback-only netns.
test: lint
	.ci/loopback-only $(PY) -m pytest -q -p no:cacheprovider tests $(PYTEST_ARGS)

bench: $(BASE_STAMP)
	$(VENV)/bin/omnikv bench all

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache
