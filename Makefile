# stagectl — developer entry points. Every install uses constraints-cpu.txt so `torch` resolves to
# the local CPU build (a loose requirement would pull the multi-GB CUDA wheels).
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
CONSTRAINTS := constraints-cpu.txt

.PHONY: install install-dev vllm-env train lint typecheck test test-unit test-integration test-vllm test-gpu bench clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The vLLM CPU build lives in its own virtual environment (its own torch/torchvision pair and transformers).
$(VLLM_VENV)/.installed: scripts/setup_vllm_env.sh
	bash scripts/setup_vllm_env.sh $(VLLM_VENV)
	touch $@

vllm-env: $(VLLM_VENV)/.installed

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

test-integration: install-dev
	$(VENV)/bin/pytest tests/integration -q

test-vllm: install-dev vllm-env
	STAGECTL_REQUIRE_VLLM=1 $(VENV)/bin/pytest tests/vllm -q

test-gpu: install-dev
	$(VENV)/bin/pytest tests/gpu -q

# Every tier that can run here: lint, types, then unit, integration (incl. faults), vllm (its own venv,
# .venv-vllm) and gpu (skips without CUDA).
test: lint typecheck vllm-env
	STAGECTL_REQUIRE_VLLM=1 $(VENV)/bin/pytest tests -q

bench: install-dev
	$(PY) -m bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache runs
