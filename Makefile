# The README's two commands: `make quickstart` and `make test`. Both create .venv first if missing.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup test test-fast quickstart bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.14.1 / torchvision 0.29.1 are pinned in pyproject (mosaicml-streaming needs torchvision).
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

# Everything, including the slow multi-process and SLURM tests (what CI runs).
test: setup
	$(BIN)/pytest -q $(PYTEST_ARGS)

# Local inner loop: skip multi-process and SLURM tests.
test-fast: setup
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

quickstart: setup
	$(BIN)/nlq-scale quickstart

bench: setup
	for b in benchmarks/*.py; do $(BIN)/python $$b; done

clean-venv:
	rm -rf $(VENV)
