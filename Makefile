# make run   set up .venv if missing, then run the built-in scenario suite (CPU, or CUDA when present)
# make test  set up .venv if missing, then run the tests
# make lint  ruff check and ruff format --check (configured in pyproject.toml)
# TORCH picks the torch requirement installed first; GPU machines: make TORCH='torch>=2.4' run
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: run test lint bench setup clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	rm -rf kvchaos.egg-info  # else pytest, run here, reads it as the installed distribution
	touch $@

run: setup
	$(BIN)/kvchaos run $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/kvchaos bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
