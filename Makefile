# stagectl — developer entry points. Every install uses constraints-cpu.txt so `torch` resolves to
# the local CPU build (a loose requirement would pull the multi-GB CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
INTEROP_VENV ?= .venv-interop
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
CONSTRAINTS := constraints-cpu.txt

.PHONY: install install-dev vllm-env interop-env chromium train lint typecheck test test-fast test-unit test-integration test-vllm test-interop test-gpu test-browser bench clean

# Every editable install of stagectl (here and in scripts/setup_vllm_env.sh) writes stagectl.egg-info in the
# checkout, so each runs under a lock on pyproject.toml (flock): the environments then build side by side.
LOCKED := flock pyproject.toml

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(LOCKED) sh -c 'test -x $(PY) || $(PYTHON) -m venv $(VENV)'
	$(LOCKED) $(PIP) install -q -c $(CONSTRAINTS) -e .
	touch $@

# One pip call for a fresh development environment (the base install is part of it).
$(VENV)/.installed-dev: pyproject.toml $(CONSTRAINTS)
	$(LOCKED) sh -c 'test -x $(PY) || $(PYTHON) -m venv $(VENV)'
	$(LOCKED) $(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The vLLM CPU build lives in its own virtual environment (its own torch/torchvision pair and transformers);
# its editable install of stagectl takes the same lock (`make test` builds the environments side by side).
$(VLLM_VENV)/.installed: scripts/setup_vllm_env.sh
	bash scripts/setup_vllm_env.sh $(VLLM_VENV)
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# ms-swift (pinned) in its own virtual environment: the tests/interop tier runs swift's client and response
# models there, in subprocesses, against stagectl's server and client.
$(INTEROP_VENV)/.installed: scripts/setup_interop_env.sh
	bash scripts/setup_interop_env.sh $(INTEROP_VENV)
	touch $@

interop-env: $(INTEROP_VENV)/.installed

# Headless Chromium for the tests/browser tier (the report pages rendered in a real browser): Debian's package,
# installed when missing and apt-get can run (root); otherwise the tier skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null \
				|| echo "chromium: apt-get install failed; tests/browser will skip"; \
		else echo "chromium: not installed and apt-get not usable here; tests/browser will skip"; fi; }

# The main job: Stage-2 AB training of the tiny Qwen2.5-VL on synthetic shapes (CPU, a few minutes).
train: install
	$(VENV)/bin/stagectl train-ab examples/tiny/train_ab.yaml

lint: install-dev
	$(VENV)/bin/ruff check stagectl tests bench
	$(VENV)/bin/ruff format --check stagectl tests bench

typecheck: install-dev
	$(VENV)/bin/mypy

test-unit: install-dev
	$(VENV)/bin/pytest tests/unit -q

# The inner loop, under 3 minutes on 2 quiet cores: the unit tier plus the in-process server and weight-sync
# tests (real app on loopback, no training subprocess); property tests at the `ci` example count
# (STAGECTL_FUZZ_PROFILE=full for each property's own count). pyproject's addopts list the slowest 25.
FAST_TESTS := tests/unit \
	tests/integration/test_rollout_fake_server.py \
	tests/integration/test_stage_b_server.py \
	tests/integration/test_weight_stream.py \
	tests/integration/test_weight_sync_collective.py \
	tests/integration/test_weight_sync_delta.py

test-fast: install-dev
	$(VENV)/bin/pytest $(FAST_TESTS) -q -m "not slow"

test-integration: install-dev
	$(VENV)/bin/pytest tests/integration -q

test-vllm: install-dev vllm-env
	STAGECTL_REQUIRE_VLLM=1 $(VENV)/bin/pytest tests/vllm -q

test-interop: install-dev interop-env
	STAGECTL_REQUIRE_INTEROP=1 STAGECTL_INTEROP_VENV=$(INTEROP_VENV) $(VENV)/bin/pytest tests/interop -q

test-gpu: install-dev
	$(VENV)/bin/pytest tests/gpu -q

test-browser: install-dev chromium
	$(VENV)/bin/pytest tests/browser -q

# Every tier that can run here: lint, types, then unit, integration (incl. faults), vllm (its own venv,
# .venv-vllm), interop (ms-swift in .venv-interop), gpu (skips without CUDA) and browser (the report pages in
# headless Chromium, which `chromium` installs; skips without it). Test files are spread over
# PYTEST_WORKERS processes (pytest-xdist; --dist loadfile keeps each file, and its module-scoped runs, on
# one worker); the longest tiers are listed first so the short unit files fill the tail.
# The prerequisites run side by side (a fresh clone spends ~6 minutes on them one after another: pip
# unpacking three environments and a cold mypy; ~3 minutes side by side).
PYTEST_WORKERS ?= 2
test:
	$(MAKE) --no-print-directory -j4 lint typecheck vllm-env interop-env chromium
	STAGECTL_REQUIRE_VLLM=1 STAGECTL_REQUIRE_INTEROP=1 STAGECTL_INTEROP_VENV=$(INTEROP_VENV) \
		$(VENV)/bin/pytest tests/vllm tests/faults tests/integration tests/interop tests/unit tests/gpu tests/browser -q \
		-n $(PYTEST_WORKERS) --dist loadfile

bench: install-dev
	$(PY) -m bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(INTEROP_VENV) .pytest_cache .mypy_cache .ruff_cache runs
